"""Charging one step to its requests' meters: the same code in the real engine (measured step
time) and the simulator (modelled step time).

Before a step runs, `held` reads what each running request holds of the KV pool (a block shared
by several requests split evenly among them; the prefix cache's own reference is not a holder);
once its time is known, `charge` splits that time between the step's chunks by their work and
charges each holder its bytes x the step's time (`request_meter`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

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
        """A request's count of the KV pool stays exact while the running set is the one it
        was counted with: sharing starts only when a request joins (takes cached blocks) and
        stops only when one leaves, and the blocks a table gains meanwhile are freshly
        allocated, held by that request alone (added at once). After the set changes, a count
        is reused for `refresh_steps` steps (1: recounted at once, as the engine does; the
        simulator, whose steps cost nothing, recounts less often), unless `held` is asked for
        exact counts."""
        self.kv_cache = kv_cache
        self.block_bytes = block_bytes
        self.weights = weights
        self.refresh_steps = max(1, refresh_steps)
        self._step = 0
        self._members: tuple[str, ...] = ()
        self._version = 0
        """Changes whenever the running set does."""
        self._shares: dict[str, tuple[int, int, int, float]] = {}
        """request id -> (table length, running-set version, step counted, bytes held)."""

    def held(self, running: Sequence[Request], exact: bool = False) -> list[tuple[Request, float]]:
        """KV bytes each of `running` holds now (`exact`: recount every count the running set
        has changed since, whatever its age)."""
        self._step += 1
        members = tuple(r.request_id for r in running)
        if members != self._members:
            self._members = members
            self._version += 1
        version, step = self._version, self._step
        shares: dict[str, tuple[int, int, int, float]] = {}
        out: list[tuple[Request, float]] = []
        for request in running:
            rid = request.request_id
            table = self.kv_cache.block_table(rid)
            known = self._shares.get(rid)
            if (
                known is None
                or len(table) < known[0]
                or (known[1] != version and (exact or step - known[2] >= self.refresh_steps))
            ):
                known = (len(table), version, step, self._count(table))
            elif len(table) > known[0]:
                grown = (len(table) - known[0]) * self.block_bytes
                known = (len(table), known[1], known[2], known[3] + grown)
            shares[rid] = known
            out.append((request, known[3]))
        self._shares = shares
        return out

    def advance(self, steps: int) -> None:
        """`steps` steps ran without their own reading of `held` (a run of decode steps read
        once at its start): counts read before them age by as many steps."""
        self._step += max(0, steps)

    def _count(self, table: Sequence[int]) -> float:
        """Bytes of `table` this request holds: each block split among the requests holding
        it. With a prefix cache a block held by two references or more is cached (sharing
        happens only through the tree, and the tree gives up only idle blocks), so the
        tree's reference is one of them."""
        refs = [self.kv_cache.block_pool.ref_count(b) for b in table]
        if self.kv_cache.prefix_cache is None:
            share = sum(1.0 / max(1, r) for r in refs)
        else:
            share = sum(1.0 if r <= 2 else 1.0 / (r - 1) for r in refs)
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

    def charge_decode_run(
        self,
        requests: Sequence[Request],
        starts: Sequence[int],
        steps_s: Any,
        held: Sequence[tuple[Request, float]],
        table_blocks: Sequence[int],
    ) -> None:
        """Charge a run of decode steps (step j computes token `start + j` of each request and
        lasts `steps_s[j]`, a numpy array) as `charge` would step by step: each step split by
        the same work weights; each holder its bytes x the run's time, plus the blocks its
        table gains during the run (`table_blocks`: its length when `held` was read), held
        alone from the step that allocates them, as `held` counts them."""
        # Step j's work of request i is 1 + a (start_i + j + 1): its share of the step is
        # affine in start_i, so each request's charge is (1 + a start_i) A + a B, with the two
        # sums over the steps below (no request x step array).
        steps = len(steps_s)
        step_s = np.asarray(steps_s, dtype=float)
        a = self.weights.attention_pair_tokens
        n = len(starts)
        j1 = np.arange(1, steps + 1)
        per_work = step_s / (n + a * (sum(starts) + n * j1))
        sum_a = float(per_work.sum())
        sum_b = float((j1 * per_work).sum())
        for request, start in zip(requests, starts, strict=True):
            request.meter.charge_chunk(start, steps, (1.0 + a * start) * sum_a + a * sum_b)
        # A table of T blocks gains one at the first step j with start + j + 1 > T x bs, and
        # another every bs steps after; each is held from that step to the run's end.
        bs = self.kv_cache.block_size
        tail_s = np.cumsum(step_s[::-1])[::-1].tolist()
        total_s = float(step_s.sum())
        byte_s = self.block_bytes
        for (request, held_bytes), start, table in zip(held, starts, table_blocks, strict=True):
            assert table * bs >= start, "a table holds the tokens computed before the run"
            grown_s = sum(tail_s[j] for j in range(max(0, table * bs - start), steps, bs))
            request.meter.kv_byte_s += held_bytes * total_s + grown_s * byte_s
