"""The cost ledger: every dollar of replica time in a period, charged to the requests of that
period in five terms kept apart.

A replica costs `usd_per_hour` while it is up (`ReplicaSpan`), whether or not it computes. Part of
that price is its KV cache memory (`kv_usd_per_hour`), the rest its compute. For a period, each
replica's cost is split:

- compute dollars go to the requests it served by their measured step time (the engine's
  `RequestMeter`): time spent computing tokens for the first time is **new compute**, time spent
  computing context again (preempted, or evicted from the prefix cache) is **non-reusable
  context**;
- KV memory dollars go to the requests by the KV bytes x seconds they held: **cache occupancy**;
- what is left, the replica's time and memory nobody used, is **queueing and idle loss**,
  apportioned to the requests that replica served in the period by their direct cost (the
  traffic it was kept for); a replica that served nobody in the period has its idle loss spread
  over its model's requests on the other replicas;
- time spent on attempts that failed (a replica that errored or hung before the first token)
  is taken out of that idle loss and charged to the failed request as **network and failure**;
  a request that failed outright has all its cost moved there too.

Replicas that meter nothing (upstream servers) have their whole compute cost split by tokens
computed, as new compute; their idle time cannot be told apart from their busy time.

Invariants (tested with hypothesis):
- every term of every request is >= 0;
- sum over requests of all terms + `unallocated_usd` == `fleet_cost_usd` (replica-hours x price
  in the period), and `unallocated_usd` is 0 unless a model had replicas up and no request;
- a request counted twice (the same `request_id`) counts once;
- a request belongs to the period that contains its `created_at_s`; a replica's time to the
  period by overlap.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

TERMS = (
    "new_compute_usd",
    "non_reusable_context_usd",
    "cache_occupancy_usd",
    "queueing_idle_usd",
    "network_failure_usd",
)
"""The five terms, in the order of docs/DESIGN's cost formula."""


def kv_usd_per_hour(
    usd_per_hour: float, kv_cache_bytes: int, memory_usd_per_gib_hour: float
) -> float:
    """The part of a replica's price that is its KV pool's memory (at most all of it)."""
    return min(usd_per_hour, kv_cache_bytes / 2**30 * memory_usd_per_gib_hour)


@dataclass(frozen=True, slots=True)
class ReplicaSpan:
    """A replica up (and paid for) from `start_s` to `end_s`."""

    replica: str
    model: str
    hardware: str
    usd_per_hour: float
    kv_usd_per_hour: float
    """The part of `usd_per_hour` that is its KV cache memory (0 when unknown)."""
    kv_cache_bytes: int
    start_s: float
    end_s: float

    def overlap_s(self, since_s: float, until_s: float) -> float:
        return max(0.0, min(self.end_s, until_s) - max(self.start_s, since_s))


@dataclass(frozen=True, slots=True)
class RequestUsage:
    """What the ledger reads of one usage record."""

    request_id: str
    tenant: str
    model: str | None
    replica: str | None
    created_at_s: float
    outcome: str
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    compute_s: float | None = None
    """Measured step time spent on new tokens (None: the replica meters nothing)."""
    recompute_s: float | None = None
    kv_byte_s: float | None = None
    failed_attempts: tuple[tuple[str, float], ...] = ()
    """(replica, seconds) of each attempt that failed before this request's last one."""
    task_id: str | None = None
    config: str | None = None
    status: int = 200
    error: str | None = None
    e2e_s: float = 0.0
    attempts: int = 1

    @property
    def new_tokens(self) -> int:
        return max(0, self.prompt_tokens - self.cached_tokens) + self.completion_tokens


@dataclass(slots=True)
class RequestCost:
    usage: RequestUsage
    hardware: str | None = None
    new_compute_usd: float = 0.0
    non_reusable_context_usd: float = 0.0
    cache_occupancy_usd: float = 0.0
    queueing_idle_usd: float = 0.0
    network_failure_usd: float = 0.0

    @property
    def direct_usd(self) -> float:
        return self.new_compute_usd + self.non_reusable_context_usd + self.cache_occupancy_usd

    @property
    def total_usd(self) -> float:
        return sum(self.terms().values())

    def terms(self) -> dict[str, float]:
        return {t: getattr(self, t) for t in TERMS}


@dataclass(frozen=True, slots=True)
class ReplicaCost:
    replica: str
    model: str
    hardware: str
    up_s: float
    cost_usd: float
    metered_busy_s: float
    idle_usd: float
    """Its time and KV memory nobody used (before failed attempts took their part)."""
    failure_usd: float
    num_requests: int


@dataclass(slots=True)
class Ledger:
    since_s: float
    until_s: float
    requests: list[RequestCost]
    replicas: list[ReplicaCost]
    fleet_cost_usd: float
    unallocated_usd: float
    """Idle cost of models that served no request in the period."""
    by_request: dict[str, RequestCost] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.by_request = {r.usage.request_id: r for r in self.requests}

    def terms(self, rows: Iterable[RequestCost] | None = None) -> dict[str, float]:
        out = dict.fromkeys(TERMS, 0.0)
        for row in self.requests if rows is None else rows:
            for t in TERMS:
                out[t] += getattr(row, t)
        return out


def build_ledger(
    usages: Iterable[RequestUsage],
    spans: Sequence[ReplicaSpan],
    since_s: float,
    until_s: float,
) -> Ledger:
    """The ledger of `[since_s, until_s)` (see the module docstring)."""
    seen: dict[str, RequestUsage] = {}
    for u in usages:
        if since_s <= u.created_at_s < until_s:
            seen.setdefault(u.request_id, u)
    rows = {rid: RequestCost(u) for rid, u in seen.items()}
    served: dict[str, list[RequestCost]] = defaultdict(list)
    for row in rows.values():
        if row.usage.replica is not None:
            served[row.usage.replica].append(row)
    claims: dict[str, list[tuple[RequestCost, float]]] = defaultdict(list)
    for row in rows.values():
        for replica, seconds in row.usage.failed_attempts:
            claims[replica].append((row, max(0.0, seconds)))

    fleet = 0.0
    replica_costs: list[ReplicaCost] = []
    orphan_idle: dict[str, float] = defaultdict(float)
    for name, parts in _group_spans(spans).items():
        up_s = sum(s.overlap_s(since_s, until_s) for s in parts)
        if up_s <= 0:
            continue
        cost = sum(s.overlap_s(since_s, until_s) * s.usd_per_hour for s in parts) / 3600
        kv_cost = (
            sum(
                s.overlap_s(since_s, until_s) * min(s.kv_usd_per_hour, s.usd_per_hour)
                for s in parts
                if s.kv_cache_bytes > 0
            )
            / 3600
        )
        kv_capacity_byte_s = sum(s.overlap_s(since_s, until_s) * s.kv_cache_bytes for s in parts)
        fleet += cost
        last = max(parts, key=lambda s: s.end_s)
        mine = served.get(name, [])
        for row in mine:
            row.hardware = last.hardware
        busy_s, idle = _charge_replica(mine, cost - kv_cost, up_s, kv_cost, kv_capacity_byte_s)
        failure = _charge_failures(claims.get(name, []), (cost - kv_cost) / up_s, idle)
        idle -= failure
        if mine:
            _apportion(mine, idle)
        else:
            orphan_idle[last.model] += idle
        replica_costs.append(
            ReplicaCost(
                name,
                last.model,
                last.hardware,
                up_s,
                cost,
                busy_s,
                idle + failure,
                failure,
                len(mine),
            )
        )

    unallocated = 0.0
    for model, idle in orphan_idle.items():
        same_model = [r for r in rows.values() if r.usage.model == model and r.hardware]
        if same_model:
            _apportion(same_model, idle)
        else:
            unallocated += idle
    for row in rows.values():
        if row.usage.outcome == "failed":
            total = row.total_usd
            for t in TERMS:
                setattr(row, t, 0.0)
            row.network_failure_usd = total
    return Ledger(since_s, until_s, list(rows.values()), replica_costs, fleet, unallocated)


def _group_spans(spans: Sequence[ReplicaSpan]) -> dict[str, list[ReplicaSpan]]:
    out: dict[str, list[ReplicaSpan]] = defaultdict(list)
    for s in spans:
        if s.end_s > s.start_s:
            out[s.replica].append(s)
    return out


def _charge_replica(
    rows: list[RequestCost],
    compute_usd: float,
    up_s: float,
    kv_usd: float,
    kv_capacity_byte_s: float,
) -> tuple[float, float]:
    """Charge the replica's compute and KV dollars to `rows`; returns (metered busy seconds,
    dollars left over: the idle loss)."""
    compute_usd = max(0.0, compute_usd)
    metered = [r for r in rows if r.usage.compute_s is not None]
    if rows and not metered:
        # nothing metered: the whole compute cost by tokens computed, no idle to tell apart
        tokens = [r.usage.new_tokens for r in rows]
        total = sum(tokens)
        for row, n in zip(rows, tokens, strict=True):
            row.new_compute_usd += compute_usd * (n / total if total else 1 / len(rows))
        return 0.0, kv_usd
    busy_s = sum((r.usage.compute_s or 0.0) + (r.usage.recompute_s or 0.0) for r in metered)
    per_s = compute_usd / up_s * min(1.0, up_s / busy_s if busy_s > 0 else 1.0)
    charged = 0.0
    for row in metered:
        new = max(0.0, row.usage.compute_s or 0.0) * per_s
        again = max(0.0, row.usage.recompute_s or 0.0) * per_s
        row.new_compute_usd += new
        row.non_reusable_context_usd += again
        charged += new + again
    held = sum(max(0.0, r.usage.kv_byte_s or 0.0) for r in metered)
    kv_charged = 0.0
    if kv_capacity_byte_s > 0 and held > 0:
        per_byte_s = kv_usd / kv_capacity_byte_s * min(1.0, kv_capacity_byte_s / held)
        for row in metered:
            occupancy = max(0.0, row.usage.kv_byte_s or 0.0) * per_byte_s
            row.cache_occupancy_usd += occupancy
            kv_charged += occupancy
    idle = max(0.0, compute_usd - charged) + max(0.0, kv_usd - kv_charged)
    return busy_s, idle


def _charge_failures(
    claims: list[tuple[RequestCost, float]], usd_per_s: float, idle_usd: float
) -> float:
    """Charge failed attempts' seconds at the replica's compute price, out of its idle dollars
    (scaled down when they claim more than there is); returns the dollars charged."""
    wanted = [seconds * usd_per_s for _, seconds in claims]
    total = sum(wanted)
    if total <= 0 or idle_usd <= 0:
        return 0.0
    scale = min(1.0, idle_usd / total)
    for (row, _), usd in zip(claims, wanted, strict=True):
        row.network_failure_usd += usd * scale
    return min(total, idle_usd)


def _apportion(rows: list[RequestCost], idle_usd: float) -> None:
    """Spread idle dollars over `rows` by their direct cost (evenly if they have none)."""
    if idle_usd <= 0 or not rows:
        return
    weights = [r.direct_usd for r in rows]
    total = sum(weights)
    for row, w in zip(rows, weights, strict=True):
        row.queueing_idle_usd += idle_usd * (w / total if total > 0 else 1 / len(rows))
