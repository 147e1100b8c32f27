"""What a builtin replica is started with, read back by the engine's own parser."""

from __future__ import annotations

from infercloud.cli import build_parser
from infercloud.gateway.config import BuiltinReplica, ModelDeployment, ReplicaSpec
from infercloud.gateway.replicas import Replica
from infercloud.launch.base import engine_argv


def test_a_builtin_replica_schedules_by_the_gateways_classes() -> None:
    """The gateway sends a builtin replica each request's class as `priority` (its `Replica`
    takes priority without a config flag), and starts the replica with flags that the engine's
    parser reads as priority scheduling (its default is FCFS, which would ignore the field)."""
    spec = BuiltinReplica(kv_cache_bytes="64MiB", threads=1, args=["--max-num-seqs", "8"])
    deployment = ModelDeployment(name="m", replicas=[ReplicaSpec(builtin=spec)])
    args = build_parser().parse_args(["engine", *engine_argv(deployment, spec)])
    assert build_parser().parse_args(["engine"]).scheduling_policy == "fcfs"
    assert args.scheduling_policy == "priority"
    assert (args.served_model_name, args.kv_cache_bytes) == ("m", 64 << 20)
    assert (args.threads, args.max_num_seqs) == (1, 8)
    assert Replica("m/0", "http://127.0.0.1:1", "m", builtin=True).takes_priority
    assert not Replica("m/1", "http://127.0.0.1:2", "m", builtin=False).takes_priority
