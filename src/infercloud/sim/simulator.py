"""A simulation: a workload through admission, the router and a fleet of simulated replicas.

The path is the real platform's, policy for policy: an arrival takes an admission ticket
(`gateway.admission.AdmissionQueue`, when the fleet config has an `admission` section: shed when
the queue is full, expired past its deadline), is routed by the gateway's `ReplicaSet` (the
configured policy, with the KV index fed by the replicas' own prefix-cache events, without the
polling delay), and runs on a `SimReplica` (the engine's scheduler and caches). TTFT and E2EL are
counted from the arrival, as a client of the gateway would see them. The report is
`serving_report`'s, plus the fleet's cost: every replica is paid for the whole run, busy or not,
at its pool's price x tensor-parallel devices.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import operator
import time
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from infercloud.cache.prefix_cache import CacheEvent, salt_hash
from infercloud.engine.request import Request
from infercloud.engine.request_meter import StepCostWeights
from infercloud.engine.scheduler import SchedulerConfig
from infercloud.gateway.admission import CLASSES, AdmissionQueue, Ticket
from infercloud.gateway.replicas import Replica
from infercloud.ledger.cost import RequestUsage
from infercloud.router.kv_index import prompt_block_hashes
from infercloud.router.replica_set import ReplicaSet, ReplicaState, Route
from infercloud.serving_report import RequestTiming, serving_report
from infercloud.sim.events import ARRIVAL, EventLoop
from infercloud.sim.fleet import Fleet
from infercloud.sim.hardware import HardwareCatalog
from infercloud.sim.model_specs import ModelSpec, model_spec
from infercloud.sim.perf_model import PerfModel
from infercloud.sim.replica import SimReplica
from infercloud.sim.workload import SimRequest, TokenSource
from infercloud.units import parse_bytes


@contextlib.contextmanager
def reference_counting_only() -> Iterator[None]:
    """Run with Python's cycle collector off, restored after.

    A simulation keeps millions of long-lived objects (tree nodes, requests, timings) and makes
    almost no cyclic garbage (`test_a_simulation_leaves_no_cyclic_garbage`): what it drops is
    freed by reference counts, and the collector's passes over the live heap cost a quarter of
    the run's time on the Azure trace without freeing anything. The switch is process-wide:
    simulations run side by side in threads would turn it back on for each other."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@dataclass(slots=True)
class _Flight:
    request: SimRequest
    ticket: Ticket | None = None
    route: Route | None = None
    prompt_ids: list[int] = field(default_factory=list)
    first_token_s: float | None = None
    last_token_s: float | None = None
    itls_s: array[float] = field(default_factory=lambda: array("d"))
    """Inter-token gaps, s (8 bytes each: a long run keeps millions)."""


@dataclass(slots=True)
class _Pooled:
    replica: SimReplica
    hardware: str
    usd_per_hour: float | None
    kv_cache_bytes: int


class Simulation:
    def __init__(
        self,
        fleet: Fleet,
        requests: Sequence[SimRequest],
        catalog: HardwareCatalog | None = None,
        spec: ModelSpec | None = None,
        progress: bool = False,
        decode_runs: bool = True,
    ) -> None:
        """`decode_runs`: take runs of pure decode steps as one event each (the same steps,
        times and tokens; `SimReplica._start_run`), or every step as one."""
        self.fleet = fleet
        self.requests = list(requests)
        self.catalog = catalog or HardwareCatalog.load()
        self.spec = spec or model_spec(fleet.model)
        self.progress = progress
        self.decode_runs = decode_runs
        self.loop = EventLoop()
        self.tokens = TokenSource(self.spec.vocab_size)
        self.max_model_len = fleet.max_model_len or self.spec.max_model_len
        self._flights: dict[str, _Flight] = {}
        self._by_ticket: dict[Ticket, _Flight] = {}
        """Flights holding an admission ticket that has not started (or failed) yet."""
        self._timings: list[RequestTiming] = []
        self._usage: list[RequestUsage] = []
        """The ledger's view of every request, as the gateway would record it."""
        self._pooled: list[_Pooled] = []
        self._by_name: dict[str, SimReplica] = {}
        self._efficiency: dict[str, str] = {}
        self._bar: Any = None
        self._last_finish_s = 0.0
        self.num_refused = 0
        self.num_shed = 0
        self.num_expired = 0
        self._build()

    # -- the fleet -----------------------------------------------------------------------------

    def _build(self) -> None:
        f = self.fleet
        s = f.scheduler
        config = SchedulerConfig(
            max_num_batched_tokens=s.max_num_batched_tokens,
            max_num_seqs=s.max_num_seqs,
            long_prefill_token_threshold=s.long_prefill_token_threshold or s.max_num_batched_tokens,
            policy=s.policy,
        )
        states: list[ReplicaState] = []
        sp = self.spec
        weights = StepCostWeights.for_model(
            sp.hidden_size, sp.intermediate_size, sp.num_kv_heads, sp.head_dim
        )
        for pool in f.pools:
            acc = self.catalog[pool.hardware]
            perf = PerfModel(
                self.spec, acc, acc.efficiency, f.dtype_bytes, pool.tensor_parallel, f.block_size
            )
            self._efficiency[acc.name] = perf.efficiency.source
            block_bytes = f.block_size * perf.kv_bytes_per_token
            num_blocks = pool.kv_bytes(acc.memory_gb, perf.weight_bytes) // block_bytes
            host_blocks = parse_bytes(pool.host_cache_bytes) // block_bytes
            price = acc.price(pool.provider)
            for _ in range(pool.replicas):
                name = f"{acc.name}/{len(self._pooled)}"
                replica = SimReplica(
                    name,
                    self.loop,
                    perf,
                    config,
                    int(num_blocks),
                    f.block_size,
                    f.prefix_caching,
                    f.eviction,
                    int(host_blocks),
                    self._on_token,
                    self._on_kv_event,
                    weights,
                    self.decode_runs,
                )
                usd = price.usd_per_hour * pool.tensor_parallel if price else None
                self._pooled.append(
                    _Pooled(replica, acc.name, usd, int(num_blocks) * int(block_bytes))
                )
                self._by_name[name] = replica
                state = ReplicaState(
                    Replica(name, f"sim://{name}", f.model, builtin=True),
                    status="healthy",
                    block_size=f.block_size,
                )
                states.append(state)
        self.replica_set = ReplicaSet(f.model, states, f.routing)
        a = f.admission
        self.admission = (
            AdmissionQueue(a.max_inflight_per_replica * len(states), a.max_queued)
            if a is not None
            else None
        )

    def _on_kv_event(self, replica: str, event: CacheEvent) -> None:
        stored = event.kind == "stored"
        self.replica_set.index.record(replica, stored, event.block_hashes, event.medium == "host")

    # -- the request path ----------------------------------------------------------------------

    def _arrive(self, request: SimRequest) -> None:
        flight = _Flight(request)
        now = self.loop.now_s
        smallest_pool = min(p.replica.num_blocks for p in self._pooled) * self.fleet.block_size
        limit = min(self.max_model_len, smallest_pool)
        if request.prompt_len + request.output_len > limit:
            self.num_refused += 1
            self._fail(flight)
            return
        self._flights[request.request_id] = flight
        if self.admission is None:
            self._dispatch(flight)
            return
        self._expire(now)
        assert self.fleet.admission is not None
        flight.ticket = Ticket(
            request.tenant,
            request.priority,
            cost=float(request.prompt_len + request.output_len),
            arrival_s=now,
            deadline_s=now + self.fleet.admission.queue_timeout_s,
        )
        self._by_ticket[flight.ticket] = flight
        offer = self.admission.offer(flight.ticket, now)
        for ticket in offer.shed:
            self.num_shed += 1
            self._fail(self._flight_of(ticket))
        if offer.started:
            self._dispatch(self._flight_of(flight.ticket))

    def _flight_of(self, ticket: Ticket) -> _Flight:
        return self._by_ticket.pop(ticket)

    def _expire(self, now_s: float) -> None:
        assert self.admission is not None
        for ticket in self.admission.expire(now_s):
            self.num_expired += 1
            self._fail(self._flight_of(ticket))

    def _dispatch(self, flight: _Flight) -> None:
        r = flight.request
        flight.prompt_ids = self.tokens.prompt(r)
        # the router reads the replicas' caches as of now: apply the runs whose blocks so far
        # could be a prefix of this prompt (any other run's cannot change its answer)
        bs = self.fleet.block_size
        hashes = prompt_block_hashes(flight.prompt_ids, bs, r.tenant)
        in_runs = [p.replica for p in self._pooled if p.replica.in_run]
        if in_runs:
            names = {*hashes, salt_hash(r.tenant)}
            for replica in in_runs:
                if replica.run_may_extend(names):
                    replica.sync()
        route = self.replica_set.route(
            r.request_id, flight.prompt_ids, r.tenant, r.session, self.loop.now_s,
            block_hashes={bs: hashes},
        )  # fmt: skip
        flight.route = route
        priority = CLASSES.index(r.priority) if r.priority in CLASSES else 1
        self._by_name[route.state.name].add(
            r.request_id,
            flight.prompt_ids,
            r.output_len,
            r.tenant,
            priority,
            self.tokens.answer(r),
        )

    def _on_token(self, request: Request, times_s: Sequence[float], finished: bool) -> None:
        flight = self._flights[request.request_id]
        itls = flight.itls_s
        last_s = flight.last_token_s
        if last_s is None:
            last_s = flight.first_token_s = times_s[0]
            assert flight.route is not None
            ReplicaSet.first_token(flight.route)
        else:
            itls.append(times_s[0] - last_s)
        if len(times_s) > 1:
            itls.extend(map(operator.sub, times_s[1:], times_s[:-1]))
        now_s = flight.last_token_s = times_s[-1]
        if not finished:
            return
        assert flight.route is not None and flight.first_token_s is not None
        ReplicaSet.finish(flight.route)
        del self._flights[request.request_id]
        arrival = flight.request.arrival_s
        self._timings.append(
            RequestTiming(
                ok=True,
                ttft_s=flight.first_token_s - arrival,
                e2el_s=now_s - arrival,
                itls_s=flight.itls_s,
                prompt_tokens=request.num_prompt_tokens,
                output_tokens=request.num_output_tokens,
                cached_tokens=request.num_cached_tokens or 0,
            )
        )
        meter = request.meter
        self._usage.append(
            RequestUsage(
                request_id=request.request_id,
                tenant=flight.request.tenant,
                model=self.fleet.model,
                replica=flight.route.state.name,
                created_at_s=arrival,
                outcome="completed",
                prompt_tokens=request.num_prompt_tokens,
                cached_tokens=request.num_cached_tokens or 0,
                completion_tokens=request.num_output_tokens,
                compute_s=meter.compute_s,
                recompute_s=meter.recompute_s,
                kv_byte_s=meter.kv_byte_s,
                e2e_s=now_s - arrival,
            )
        )
        self._last_finish_s = now_s
        self._tick()
        if self.admission is not None and flight.ticket is not None:
            self._expire(now_s)
            for ticket in self.admission.release(flight.ticket):
                self._dispatch(self._flight_of(ticket))

    def _fail(self, flight: _Flight) -> None:
        self._flights.pop(flight.request.request_id, None)
        self._timings.append(RequestTiming(ok=False, prompt_tokens=flight.request.prompt_len))
        r = flight.request
        self._usage.append(
            RequestUsage(
                r.request_id, r.tenant, self.fleet.model, None, r.arrival_s, "refused",
                prompt_tokens=r.prompt_len, status=503,
            )
        )  # fmt: skip
        self._tick()

    def _tick(self) -> None:
        if self._bar is not None:
            self._bar.update(1)

    # -- running ---------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        from tqdm import tqdm

        started = time.perf_counter()
        self._last_finish_s = 0.0
        self._bar = (
            tqdm(total=len(self.requests), unit="req", desc="simulating", mininterval=0.5)
            if self.progress
            else None
        )
        for request in self.requests:
            self.loop.at(request.arrival_s, functools.partial(self._arrive, request), ARRIVAL)
        with reference_counting_only():
            self.loop.run()
        if self._bar is not None:
            self._bar.close()
        first = min((r.arrival_s for r in self.requests), default=0.0)
        duration_s = max(self._last_finish_s, self.loop.now_s) - first
        slo = self.fleet.slo
        report: dict[str, Any] = serving_report(self._timings, duration_s, slo.ttft_ms, slo.tpot_ms)
        report.update(self._costs(report, duration_s))
        report["ledger"] = self._ledger(first, first + duration_s)
        report["num_refused"] = self.num_refused
        report["num_shed"] = self.num_shed
        report["num_expired"] = self.num_expired
        report["num_preemptions"] = sum(p.replica.scheduler.num_preemptions for p in self._pooled)
        report["sim_decode_runs"] = sum(p.replica.num_decode_runs for p in self._pooled)
        report["replicas"] = [
            {
                "name": p.replica.name,
                "hardware": p.hardware,
                "num_blocks": p.replica.num_blocks,
                "steps": p.replica.num_steps,
                "utilization": p.replica.busy_s / duration_s if duration_s > 0 else 0.0,
                "routed": self.replica_set.state(p.replica.name).routed_total,  # type: ignore[union-attr]
            }
            for p in self._pooled
        ]
        report["efficiency"] = self._efficiency
        report["sim_events"] = self.loop.num_events
        report["sim_wall_s"] = time.perf_counter() - started
        return report

    def _ledger(self, since_s: float, until_s: float) -> dict[str, Any]:
        """The platform's cost ledger over the run: every replica paid from the first arrival
        to the end, each request charged its share of the modelled steps (`ledger.cost`)."""
        from infercloud.gateway.config import MEMORY_USD_PER_GIB_HOUR
        from infercloud.ledger.cost import ReplicaSpan, build_ledger, kv_usd_per_hour

        spans = []
        for p in self._pooled:
            usd = p.usd_per_hour or 0.0
            kv_usd = kv_usd_per_hour(usd, p.kv_cache_bytes, MEMORY_USD_PER_GIB_HOUR)
            spans.append(
                ReplicaSpan(
                    p.replica.name, self.fleet.model, p.hardware, usd, kv_usd,
                    p.kv_cache_bytes, since_s, until_s,
                )
            )  # fmt: skip
        ledger = build_ledger(self._usage, spans, since_s, until_s)
        terms = ledger.terms()
        tokens = sum(u.prompt_tokens + u.completion_tokens for u in self._usage if u.replica)
        total = sum(terms.values())
        return {
            "fleet_cost_usd": ledger.fleet_cost_usd,
            "terms_usd": terms,
            "unallocated_usd": ledger.unallocated_usd,
            "cost_per_mtok_usd": total / tokens * 1e6 if tokens else None,
            "metered_busy_s": sum(r.metered_busy_s for r in ledger.replicas),
        }

    def _costs(self, report: dict[str, Any], duration_s: float) -> dict[str, Any]:
        prices = [p.usd_per_hour for p in self._pooled]
        if any(p is None for p in prices):
            return {"cost_usd": None, "cost_per_million_tokens": None}
        usd = sum(p for p in prices if p is not None) * duration_s / 3600
        tokens = report["total_input_tokens"] + report["total_output_tokens"]
        output = report["total_output_tokens"]
        return {
            "cost_usd": usd,
            "cost_per_million_tokens": usd / tokens * 1e6 if tokens else None,
            "cost_per_million_output_tokens": usd / output * 1e6 if output else None,
        }
