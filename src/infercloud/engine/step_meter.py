"""Charging one step to its requests' meters: the same code in the real engine (measured step
time) and the simulator (modelled step time).

Before a step runs, `held` reads what each running request holds of the KV pool (a block shared
by several requests split evenly among them; the prefix cache's own reference is not a holder);
once its time is known, `charge` splits that time between the step's chunks by their work and
charges each holder its bytes x the step's time (`request_meter`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from infercloud.cache.kv_cache_manager import KVCacheManager
from infercloud.engine.request import Request
from infercloud.engine.request_meter import StepCostWeights, split_step
from infercloud.engine.scheduler import ScheduledChunk


class StepMeter:
    def __init__(
        self,
        kv_cache: KVCacheManager,
        block_bytes: int,
        weights: StepCostWeights,
        refresh_steps: int = 1,
    ) -> None:
        """`refresh_steps`: how many steps a request's share of the KV pool is reused while its
        block table keeps its length (1: recounted every step, as the engine does; the
        simulator, whose steps cost nothing, recounts less often: a request's share changes
        only when its table grows or others start or stop sharing its prefix)."""
        self.kv_cache = kv_cache
        self.block_bytes = block_bytes
        self.weights = weights
        self.refresh_steps = max(1, refresh_steps)
        self._step = 0
        self._shares: dict[str, tuple[int, int, float]] = {}
        """request id -> (table length, step counted, bytes held)."""

    def held(self, running: Iterable[Request]) -> list[tuple[Request, float]]:
        """KV bytes each of `running` holds now."""
        self._step += 1
        shares: dict[str, tuple[int, int, float]] = {}
        out: list[tuple[Request, float]] = []
        for request in running:
            rid = request.request_id
            table = self.kv_cache.block_table(rid)
            known = self._shares.get(rid)
            if (
                known is None
                or known[0] != len(table)
                or self._step - known[1] >= self.refresh_steps
            ):
                known = (len(table), self._step, self._count(table))
            shares[rid] = known
            out.append((request, known[2]))
        self._shares = shares
        return out

    def _count(self, table: Sequence[int]) -> float:
        pool = self.kv_cache.block_pool
        cache = self.kv_cache.prefix_cache
        share = 0.0
        for block in table:
            holders = pool.ref_count(block)
            if cache is not None and cache.node_of(block) is not None:
                holders -= 1
            share += 1.0 / max(1, holders)
        return share * self.block_bytes

    def charge(
        self,
        chunks: Sequence[ScheduledChunk],
        held: Sequence[tuple[Request, float]],
        step_s: float,
    ) -> None:
        shares = split_step([(c.start, c.num_tokens) for c in chunks], step_s, self.weights)
        for chunk, chunk_s in zip(chunks, shares, strict=True):
            chunk.request.meter.charge_chunk(chunk.start, chunk.num_tokens, chunk_s)
        for request, held_bytes in held:
            request.meter.kv_byte_s += held_bytes * step_s
