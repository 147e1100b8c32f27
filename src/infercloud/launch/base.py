"""What every launcher gives the gateway: a started replica and a handle on its process.

A launcher's `start(deployment, index, spec)` returns a `Replica` whose `process` is a
`ReplicaProcess`: `exit_status()` is None while the engine lives (and a description once it is
gone), `stop()` ends it (SIGTERM: the engine finishes its in-flight requests, then SIGKILL after
the timeout). The gateway drains a replica (no new requests, wait for its own) before it calls
`stop`, and replaces one whose `exit_status()` is not None.
"""

from __future__ import annotations

from typing import Protocol

from infercloud.gateway.config import BuiltinReplica, ModelDeployment
from infercloud.gateway.replicas import Replica, ReplicaProcess

__all__ = ["Launcher", "ReplicaProcess", "engine_argv"]


class Launcher(Protocol):
    name: str

    def start(self, deployment: ModelDeployment, index: int, spec: BuiltinReplica) -> Replica: ...

    def close(self) -> None: ...


def engine_argv(deployment: ModelDeployment, spec: BuiltinReplica) -> list[str]:
    """`infercloud engine` flags for a builtin replica (host, port and log are the launcher's).
    Priority scheduling, so that the gateway's classes reach the engine's scheduler."""
    argv = ["--model", spec.model, "--served-model-name", deployment.name]
    argv += ["--dtype", spec.dtype, "--kv-cache-bytes", str(spec.kv_cache_bytes)]
    argv += ["--scheduling-policy", "priority", "--log-level", "warning"]
    if spec.threads is not None:
        argv += ["--threads", str(spec.threads)]
    return [*argv, *spec.args]
