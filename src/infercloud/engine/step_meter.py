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
        self, kv_cache: KVCacheManager, block_bytes: int, weights: StepCostWeights
    ) -> None:
        self.kv_cache = kv_cache
        self.block_bytes = block_bytes
        self.weights = weights

    def held(self, running: Iterable[Request]) -> list[tuple[Request, float]]:
        """KV bytes each of `running` holds now."""
        pool = self.kv_cache.block_pool
        cache = self.kv_cache.prefix_cache
        out: list[tuple[Request, float]] = []
        for request in running:
            share = 0.0
            for block in self.kv_cache.block_table(request.request_id):
                holders = pool.ref_count(block)
                if cache is not None and cache.node_of(block) is not None:
                    holders -= 1
                share += 1.0 / max(1, holders)
            out.append((request, share * self.block_bytes))
        return out

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
