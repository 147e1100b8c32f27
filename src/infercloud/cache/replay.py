"""Replay a request trace through the real prefix cache and eviction policy, without a model.

The trace is Mooncake's format (one JSON object per line: `timestamp` in ms, `input_length`,
`output_length`, `hash_ids`, each id naming one 512-token block of the prompt; two requests that
share a leading run of ids share that prefix). Each hash id becomes one cache block (the cache's
`block_size` is 1 "token" = one trace block), so the tree, pool, reference counts and policies
are exactly the engine's.

Time follows the trace. A request arrives at its timestamp, takes the cached prefix it matches
(a hit per block), allocates the rest (evicting idle blocks by the policy), has its blocks
cached once its prefill would be done, and holds them all until it would finish:
  prefill_s = uncached prompt tokens / `prefill_tokens_per_s`,
  finish    = arrival + prefill_s + output_length x `decode_s_per_token`.
So blocks in use by running requests cannot be evicted, as in the engine. A request that does
not fit even after evicting every idle block runs uncached (counted in `requests_uncacheable`).

Reported hit rate counts tokens: a hit on a trace block counts its 512 tokens (the last block of
a prompt counts what remains of `input_length`).
"""

from __future__ import annotations

import heapq
import json
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from infercloud.cache.block_pool import BlockPool
from infercloud.cache.eviction import EvictionPolicy, RequestShape, make_policy
from infercloud.cache.kv_cache_manager import KVCacheManager
from infercloud.cache.prefix_cache import PrefixCache, chain_hash, salt_hash

TRACE_BLOCK_TOKENS = 512
DEPTH_COST_PER_BLOCK = 0.02
"""The recompute cost of a trace block grows by this for each block before it (of its own
cost: `ModelSpec.depth_cost_per_block`; Llama-3-70B's at 512 tokens is 0.0098). The trace does
not name its model; 0.02, the weight of the first reports' compute-saved figures, is kept so
that they compare. The value policy ranks by the same cost."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    salt: str = ""

    def hash_ids_range(self, start: int, end: int) -> tuple[int, ...]:
        """Trace blocks `start .. end - 1`: the replay's "tokens" (one per 512-token block)."""
        return self.hash_ids[start:end]

    def block_tokens(self, index: int) -> int:
        """Prompt tokens in trace block `index` (the last one may be partial)."""
        rest = self.input_length - index * TRACE_BLOCK_TOKENS
        return max(0, min(TRACE_BLOCK_TOKENS, rest))


def load_mooncake(path: Path, time_scale: float = 1.0) -> list[TraceRequest]:
    """Read a Mooncake trace; `time_scale` < 1 compresses time (more load)."""
    out: list[TraceRequest] = []
    with path.open() as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                out.append(
                    TraceRequest(
                        arrival_s=float(row["timestamp"]) / 1000.0 * time_scale,
                        input_length=int(row["input_length"]),
                        output_length=int(row["output_length"]),
                        hash_ids=tuple(int(h) for h in row["hash_ids"]),
                        salt=str(row.get("salt", "")),
                    )
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{number}: not a Mooncake trace row ({exc})") from exc
    out.sort(key=lambda r: r.arrival_s)
    return out


def unique_blocks(requests: Iterable[TraceRequest]) -> int:
    """Distinct prefix blocks in the trace (a hash id under a different prefix counts apart)."""
    return len({key for r in requests for key in _prefix_keys(r)})


def future_uses(requests: Iterable[TraceRequest]) -> dict[int, list[float]]:
    """For Belady: when each prefix block is needed (sorted arrival times)."""
    uses: dict[int, list[float]] = defaultdict(list)
    for r in requests:
        for key in _prefix_keys(r):
            uses[key].append(r.arrival_s)
    return dict(uses)


def _prefix_keys(request: TraceRequest) -> list[int]:
    parent = salt_hash(request.salt)
    keys = []
    for h in request.hash_ids:
        parent = chain_hash(parent, (h,))
        keys.append(parent)
    return keys


@dataclass(frozen=True, slots=True)
class ReplayReport:
    policy: str
    capacity_blocks: int
    requests: int
    hit_rate_tokens: float
    """Prompt tokens served from cache / prompt tokens."""
    hit_rate_blocks: float
    compute_saved: float
    """Share of prefill compute avoided, weighting each block by its recompute cost,
    1 + `DEPTH_COST_PER_BLOCK` x its depth."""
    requests_uncacheable: int
    evicted_blocks: int
    unique_blocks: int

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def replay(
    requests: list[TraceRequest],
    capacity_blocks: int,
    policy: str | EvictionPolicy,
    prefill_tokens_per_s: float = 20_000.0,
    decode_s_per_token: float = 0.02,
) -> ReplayReport:
    if capacity_blocks < 1:
        raise ValueError("capacity_blocks must be at least 1")
    if isinstance(policy, str):
        policy = make_policy(
            policy,
            future_uses(requests) if policy == "belady" else None,
            depth_cost_per_block=DEPTH_COST_PER_BLOCK,
        )
    pool = BlockPool(capacity_blocks)
    cache = PrefixCache(pool, 1, policy)
    kv = KVCacheManager(pool, 1, cache)

    # (time, kind, order, index): kind 0 = prefill done (caches the blocks), 1 = finish (frees
    # them); at equal times a request caches its blocks before anyone frees theirs.
    events: list[tuple[float, int, int, int]] = []
    order = 0
    query_tokens = hit_tokens = 0
    query_blocks = hit_blocks = 0
    cost_total = cost_saved = 0.0
    uncacheable = 0

    def run_events_until(t: float) -> None:
        while events and events[0][0] <= t:
            when, kind, _, index = heapq.heappop(events)
            rid = str(index)
            r = requests[index]
            if kind == 1:  # it finishes: its output length is known from now on
                kv.free(rid, RequestShape(r.input_length, r.output_length))
            else:
                kv.cache_blocks(rid, r.salt, r.hash_ids_range, len(r.hash_ids), when)

    for index, r in enumerate(requests):
        run_events_until(r.arrival_s)
        now = r.arrival_s
        n = len(r.hash_ids)
        rid = str(index)
        cached = kv.match(r.salt, (*r.hash_ids, -1))  # all n blocks may hit
        fits = kv.allocate_slots(rid, n, now, cached)
        hit = cached.num_blocks if fits else 0
        if not fits:
            uncacheable += 1
        hit_tok = sum(r.block_tokens(i) for i in range(hit))
        query_tokens += r.input_length
        hit_tokens += hit_tok
        query_blocks += n
        hit_blocks += hit
        weights = [1.0 + DEPTH_COST_PER_BLOCK * (i + 1) for i in range(n)]
        cost_total += sum(weights)
        cost_saved += sum(weights[:hit])
        prefill_s = (r.input_length - hit_tok) / prefill_tokens_per_s
        finish_s = now + prefill_s + r.output_length * decode_s_per_token
        if fits:
            heapq.heappush(events, (now + prefill_s, 0, order, index))
            heapq.heappush(events, (finish_s, 1, order, index))
            order += 1
    run_events_until(float("inf"))
    return ReplayReport(
        policy=policy.name,
        capacity_blocks=capacity_blocks,
        requests=len(requests),
        hit_rate_tokens=hit_tokens / query_tokens if query_tokens else 0.0,
        hit_rate_blocks=hit_blocks / query_blocks if query_blocks else 0.0,
        compute_saved=cost_saved / cost_total if cost_total else 0.0,
        requests_uncacheable=uncacheable,
        evicted_blocks=cache.num_evicted_blocks,
        unique_blocks=unique_blocks(requests),
    )
