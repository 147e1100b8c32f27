"""The simulator: its event order, determinism, and the real policies it drives."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path

import pytest

from infercloud.sim.events import ARRIVAL, FINISH, STEP, EventLoop
from infercloud.sim.fleet import Admission, Fleet, Pool, SchedulerSettings
from infercloud.sim.simulator import Simulation
from infercloud.sim.workload import (
    Segment,
    SimRequest,
    TokenSource,
    load_trace,
    multi_turn_sessions,
    poisson,
    shared_prefix_groups,
    time_scale,
)

TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "traces"


def test_events_run_in_time_priority_and_scheduling_order() -> None:
    loop = EventLoop()
    seen: list[str] = []
    loop.at(2.0, lambda: seen.append("late"))
    loop.at(1.0, lambda: seen.append("step"), STEP)
    loop.at(1.0, lambda: seen.append("finish"), FINISH)
    loop.at(1.0, lambda: seen.append("arrival-a"), ARRIVAL)
    loop.at(1.0, lambda: seen.append("arrival-b"), ARRIVAL)
    cancelled = loop.at(1.5, lambda: seen.append("cancelled"))
    cancelled.cancel()
    loop.run()
    assert seen == ["finish", "arrival-a", "arrival-b", "step", "late"]
    assert loop.now_s == 2.0
    with pytest.raises(ValueError, match="cannot schedule"):
        loop.at(1.0, lambda: None)


def _fleet(**kw: object) -> Fleet:
    base: dict[str, object] = {
        "model": "llama-3-8b",
        "pools": [Pool(hardware="h100-sxm", replicas=2)],
    }
    base.update(kw)
    return Fleet.model_validate(base)


def _strip(report: dict[str, object]) -> dict[str, object]:
    return {k: v for k, v in report.items() if k != "sim_wall_s"}


def test_same_seed_same_result_other_seed_other_result() -> None:
    def run(seed: int) -> dict[str, object]:
        reqs = poisson(20.0, 200, (64, 2048), (16, 256), seed=seed, cv=2.0)
        return _strip(Simulation(_fleet(routing={"policy": "power_of_two"}), reqs).run())

    a, b, c = run(1), run(1), run(2)
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    assert a["mean_ttft_ms"] != c["mean_ttft_ms"]
    assert a["completed"] == 200 and a["failed"] == 0


def test_every_token_is_produced_and_counted() -> None:
    reqs = poisson(50.0, 300, (16, 4000), (1, 300), seed=3)
    report = Simulation(_fleet(), reqs).run()
    assert report["completed"] == 300
    assert report["total_output_tokens"] == sum(r.output_len for r in reqs)
    assert report["total_input_tokens"] == sum(r.prompt_len for r in reqs)
    assert report["request_throughput"] > 0 and report["cost_usd"] > 0
    assert sum(r["routed"] for r in report["replicas"]) == 300


def test_decode_is_bandwidth_bound_prefill_compute_bound_on_the_roofline() -> None:
    """TPOT at batch 1 is near the weights' read time; TTFT of a long prompt near its FLOPs."""
    one = [SimRequest("r", 0.0, (Segment("p", 4096),), 64)]
    report = Simulation(_fleet(pools=[Pool(hardware="h100-sxm")]), one).run()
    weights_s = 8.03e9 * 2 / 3.35e12
    assert weights_s * 1e3 < report["mean_tpot_ms"] < 3 * weights_s * 1e3
    flops_s = 2 * 8.03e9 * 4096 / 989e12
    assert flops_s * 1e3 < report["mean_ttft_ms"] < 4 * flops_s * 1e3


def test_kv_aware_routing_finds_cached_prefixes_round_robin_misses() -> None:
    """Twelve tenants' 4k-token system prompts over four replicas whose pools hold about three
    each: the real kv_aware policy, fed by the simulated engines' KV events, keeps each tenant
    on the replica that holds its prefix."""
    reqs = shared_prefix_groups(8.0, 600, 12, 4096, (32, 128), (16, 64), seed=5)
    pools = [Pool(hardware="h100-sxm", replicas=4, kv_cache_bytes="2GiB")]
    rates = {}
    for policy in ("round_robin", "kv_aware"):
        fleet = _fleet(pools=pools, routing={"policy": policy})
        rates[policy] = Simulation(fleet, reqs).run()["prefix_cache_hit_rate"]
    assert rates["kv_aware"] > 1.5 * rates["round_robin"]


def test_multi_turn_sessions_reuse_their_own_history() -> None:
    reqs = multi_turn_sessions(0.5, 20, (3, 6), 512, (32, 96), (32, 128), 5.0, seed=1)
    tokens = TokenSource(128256)
    later = next(r for r in reqs if r.request_id.endswith("-t1"))
    first = next(r for r in reqs if r.request_id == later.request_id.replace("-t1", "-t0"))
    answer = tokens.answer(first)
    assert answer is not None
    assert tokens.prompt(later)[: first.prompt_len + len(answer)] == tokens.prompt(first) + answer
    report = Simulation(_fleet(routing={"policy": "session_affinity"}), reqs).run()
    assert report["prefix_cache_hit_rate"] > 0.5


def test_a_simulation_leaves_no_cyclic_garbage() -> None:
    """The simulator runs with the cycle collector off (`reference_counting_only`): what it
    drops must be freed by reference counts, or a long run would grow without bound."""
    reqs = multi_turn_sessions(2.0, 300, (2, 6), 512, (32, 256), (16, 128), 2.0, seed=3)
    admission = Admission(max_inflight_per_replica=8, max_queued=50, queue_timeout_s=30)
    pools = [Pool(hardware="l4", replicas=2, kv_cache_bytes="512MiB")]
    fleet = _fleet(pools=pools, admission=admission, routing={"policy": "kv_aware"})
    gc.collect()
    gc.disable()
    try:
        simulation = Simulation(fleet, reqs)
        report = simulation.run()
        cyclic_garbage = gc.collect()
    finally:
        gc.enable()
    assert report["completed"] > 0 and report["num_preemptions"] > 0
    assert cyclic_garbage < 100, f"{cyclic_garbage} objects in garbage cycles"


def test_admission_sheds_the_overflow_and_loses_nothing() -> None:
    reqs = [SimRequest(f"r{i}", 0.0, (Segment(f"p{i}", 1024),), 256) for i in range(100)]
    admission = Admission(max_inflight_per_replica=4, max_queued=10, queue_timeout_s=60)
    fleet = _fleet(pools=[Pool(hardware="l4")], admission=admission)
    report = Simulation(fleet, reqs).run()
    assert report["num_shed"] > 0
    assert report["completed"] + report["failed"] == 100
    assert report["failed"] == report["num_shed"] + report["num_expired"]


def test_a_small_pool_preempts_through_the_real_scheduler() -> None:
    reqs = [SimRequest(f"r{i}", 0.0, (Segment(f"p{i}", 512),), 512) for i in range(16)]
    pools = [Pool(hardware="a100-80gb", kv_cache_bytes="1GiB")]
    sched = SchedulerSettings(max_num_batched_tokens=2048, max_num_seqs=64)
    report = Simulation(_fleet(pools=pools, scheduler=sched), reqs).run()
    assert report["num_preemptions"] > 0
    assert report["completed"] == 16


def test_the_simulated_fleet_keeps_the_platforms_ledger() -> None:
    """The same meter and ledger as the real platform: the modelled steps are charged to their
    requests in full, the terms add up to the fleet's cost, and a pool too small for the load
    shows its preemptions as non-reusable context."""
    reqs = [SimRequest(f"r{i}", i * 0.05, (Segment(f"p{i}", 512),), 512) for i in range(16)]
    pools = [Pool(hardware="a100-80gb", kv_cache_bytes="1GiB")]
    sched = SchedulerSettings(max_num_batched_tokens=2048, max_num_seqs=64)
    report = Simulation(_fleet(pools=pools, scheduler=sched), reqs).run()
    ledger = report["ledger"]
    busy_s = sum(r["utilization"] for r in report["replicas"]) * report["duration"]
    assert ledger["metered_busy_s"] == pytest.approx(busy_s, rel=1e-9)
    assert ledger["fleet_cost_usd"] == pytest.approx(report["cost_usd"], rel=1e-9)
    terms = ledger["terms_usd"]
    assert sum(terms.values()) + ledger["unallocated_usd"] == pytest.approx(report["cost_usd"])
    assert report["num_preemptions"] > 0 and terms["non_reusable_context_usd"] > 0
    assert all(v >= 0 for v in terms.values()) and terms["new_compute_usd"] > 0
    roomy = Simulation(_fleet(pools=[Pool(hardware="a100-80gb")], scheduler=sched), reqs).run()
    assert roomy["num_preemptions"] == 0
    assert roomy["ledger"]["terms_usd"]["non_reusable_context_usd"] == 0


@pytest.mark.parametrize(
    ("admission", "workload"),
    [
        (None, "groups"),
        (Admission(max_inflight_per_replica=3, max_queued=50), "groups"),
        (None, "sessions"),
    ],
)
def test_decode_runs_change_nothing_but_the_event_count(
    admission: Admission | None, workload: str
) -> None:
    """Runs of decode steps taken as one event give the very same report as stepping one by
    one: every token at the same time, the same cache, the same costs. Sessions send their next
    turn while the last one may still decode: a run's blocks must reach the router in time."""
    if workload == "groups":
        reqs = shared_prefix_groups(6.0, 200, 4, 1024, (16, 512), (8, 256), seed=3)
    else:
        reqs = multi_turn_sessions(2.0, 40, (3, 6), 512, (32, 96), (32, 256), 1.0, seed=4)
    pools = [Pool(hardware="l4", replicas=2, kv_cache_bytes="2GiB")]
    fleet = _fleet(pools=pools, admission=admission)
    one = Simulation(fleet, reqs, decode_runs=False).run()
    runs = Simulation(fleet, reqs, decode_runs=True).run()
    assert runs["sim_decode_runs"] > 0 and runs["sim_events"] < one["sim_events"]
    for key in ("mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_itl_ms", "output_throughput",
                "prefix_cache_hit_rate", "num_preemptions", "completed", "num_shed"):  # fmt: skip
        assert runs[key] == pytest.approx(one[key], rel=1e-9, abs=1e-12), key
    for term, usd in one["ledger"]["terms_usd"].items():
        assert runs["ledger"]["terms_usd"][term] == pytest.approx(usd, rel=0.02, abs=1e-9), term


def test_traces_load_with_shared_prefixes_and_time_scaling() -> None:
    mooncake = load_trace(TRACES / "mooncake_synthetic.jsonl", token_scale=1 / 16)
    assert len(mooncake) == 3993
    tokens = TokenSource(49152)
    a, b = mooncake[0], mooncake[1]
    shared = 0
    for x, y in zip(a.prompt, b.prompt, strict=False):
        if x != y:
            break
        shared += x.length
    assert tokens.prompt(a)[:shared] == tokens.prompt(b)[:shared]
    azure = load_trace(TRACES / "azure2023_code.csv")
    assert len(azure) == 8819 and azure[0].arrival_s == 0.0
    assert azure[-1].arrival_s > 3000
    faster = time_scale(azure, 4.0)
    assert faster[-1].arrival_s == pytest.approx(azure[-1].arrival_s / 4)


def test_simulate_cli_prints_the_report(tmp_path: Path) -> None:
    config = tmp_path / "fleet.yaml"
    config.write_text(
        "model: llama-3-8b\n"
        "pools: [{hardware: h100-sxm, provider: lambda, replicas: 2}]\n"
        "routing: {policy: kv_aware}\n"
        "slo: {ttft_ms: 500, tpot_ms: 50}\n"
    )
    trace = TRACES / "azure2023_conv.csv"
    cmd = [sys.executable, "-m", "infercloud", "simulate", "--config", str(config)]
    out = subprocess.run(
        [*cmd, "--trace", str(trace), "--limit", "300", "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    report = json.loads(out.stdout)
    assert report["completed"] == 300
    for key in ("mean_ttft_ms", "p99_tpot_ms", "median_itl_ms", "request_goodput"):
        assert key in report
    assert report["cost_per_million_tokens"] > 0
    bad = subprocess.run(
        [*cmd, "--trace", str(tmp_path / "missing.csv")], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "missing.csv" in bad.stderr
    config.write_text("model: no-such-model\npools: [{hardware: h100-sxm}]\n")
    bad = subprocess.run([*cmd, "--trace", str(trace)], capture_output=True, text=True)
    assert bad.returncode == 2 and "no-such-model" in bad.stderr
