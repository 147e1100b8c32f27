"""One simulated replica: the real engine scheduler, block pool, prefix cache and second tier,
stepped in simulated time, each step lasting what the performance model says.

The loop is the engine's: schedule, (run the model), update. Here "run the model" is an event
`perf.step_s(shape)` later; the sampled token of each request is the next token of its scripted
answer (multi-turn workloads resend answers, so they must be the tokens a later prompt holds)
or a filler id. Requests run with `ignore_eos` and `max_tokens` = their output length, so they
finish exactly where the workload says. The second tier's copies cost their bytes over the
host link, and its transfer-cost model is fed the simulated step and copy times, so the real
load-or-recompute decision runs on simulated measurements.

Invariants: at most one step is in flight; a step's updates apply at its end time, in the order
the scheduler returned the chunks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from infercloud.cache.block_pool import BlockPool
from infercloud.cache.eviction import make_policy
from infercloud.cache.host_tier import HostTier
from infercloud.cache.kv_cache_manager import KVCacheManager, SecondTier
from infercloud.cache.prefix_cache import CacheEvent, PrefixCache
from infercloud.cache.transfer_cost import TransferCostModel
from infercloud.engine.request import Request, RequestStatus
from infercloud.engine.request_meter import StepCostWeights
from infercloud.engine.sampling_params import SamplingParams
from infercloud.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from infercloud.engine.step_meter import StepMeter
from infercloud.engine.step_shape import StepShape
from infercloud.sim.events import FINISH, STEP, EventLoop
from infercloud.sim.perf_model import PerfModel
from infercloud.sim.workload import FIRST_TOKEN_ID

TokenCallback = Callable[[Request, float, bool], None]
"""(the request, time s, finished) for each token a request produces."""


class _NoCopy:
    """The second tier's block mover in simulation: the bytes are priced, not moved."""

    def save(self, device_blocks: list[int], host_slots: list[int]) -> None:
        pass

    def load(self, host_slots: list[int], device_blocks: list[int]) -> None:
        pass


@dataclass(slots=True)
class _Live:
    request: Request
    answer: list[int] | None


MAX_RUN_STEPS = 256
"""The most decode steps taken as one event."""
SHARE_REFRESH_STEPS = 16
"""Steps a request's KV share is reused while its table keeps its length (`StepMeter`)."""


class SimReplica:
    def __init__(
        self,
        name: str,
        loop: EventLoop,
        perf: PerfModel,
        scheduler_config: SchedulerConfig,
        num_blocks: int,
        block_size: int,
        prefix_caching: bool,
        eviction: str,
        host_blocks: int,
        on_token: TokenCallback,
        on_kv_event: Callable[[str, CacheEvent], None] | None = None,
        step_weights: StepCostWeights | None = None,
        next_external_s: Callable[[], float] | None = None,
    ) -> None:
        """`next_external_s`: the earliest time something outside could hand this replica a
        request (the next arrival); until then a run of pure decode steps is taken as one
        event (`Scheduler.decode_run_length`). None: every step is an event."""
        if num_blocks < 1:
            raise ValueError(f"replica {name}: the KV pool holds no block (is the model too big?)")
        self.name = name
        self.loop = loop
        self.perf = perf
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.prefix_cache = (
            PrefixCache(
                self.pool,
                block_size,
                make_policy(eviction),
                on_event=(lambda e: on_kv_event(name, e)) if on_kv_event else None,
            )
            if prefix_caching
            else None
        )
        self.kv_cache = KVCacheManager(self.pool, block_size, self.prefix_cache)
        if host_blocks > 0 and self.prefix_cache is not None:
            cost = TransferCostModel(block_size)
            self.kv_cache.second_tier = SecondTier(HostTier(host_blocks), _NoCopy(), cost)
        self.scheduler = Scheduler(scheduler_config, self.kv_cache, set())
        self.meter = StepMeter(
            self.kv_cache,
            block_size * perf.kv_bytes_per_token,
            step_weights or StepCostWeights(0),
            refresh_steps=SHARE_REFRESH_STEPS,
        )
        """Each request's share of the modelled step time and KV held, as the engine meters."""
        self.on_token = on_token
        self.next_external_s = next_external_s
        self.num_decode_runs = 0
        self._live: dict[str, _Live] = {}
        self._busy = False
        self.busy_s = 0.0
        """Simulated seconds spent in steps (for utilisation)."""
        self.num_steps = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        output_len: int,
        salt: str,
        priority: int = 0,
        answer: list[int] | None = None,
    ) -> None:
        params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        request = Request(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            arrival_time_s=self.loop.now_s,
            priority=priority,
            max_total_tokens=len(prompt_token_ids) + output_len,
            cache_salt=salt,
        )
        self._live[request_id] = _Live(request, answer)
        self.scheduler.add_request(request)
        if not self._busy:
            self._busy = True
            self.loop.at(self.loop.now_s, self._step, STEP)

    def _step(self) -> None:
        if self.next_external_s is not None:
            steps = self.scheduler.decode_run_length(MAX_RUN_STEPS)
            if steps >= 2 and self._decode_run(steps):
                return
        second = self.kv_cache.second_tier
        loaded_before = second.num_loaded_blocks if second else 0
        output = self.scheduler.schedule(self.loop.now_s)
        if output.is_empty:
            self._busy = False
            return
        shape = StepShape(
            tuple((c.start, c.num_tokens) for c in output.chunks),
            sum(1 for c in output.chunks if c.samples),
            (second.num_loaded_blocks if second else 0) - loaded_before,
        )
        duration_s = self.perf.step_s(shape)
        self.meter.charge(output.chunks, self.meter.held(self.scheduler.running), duration_s)
        if second is not None:
            second.cost.observe_step(shape.num_tokens, shape.attention_pairs, duration_s)
            second.cost.observe_copy(1, self.perf.host_copy_s_per_block())
        sampled = {
            c.request.request_id: self._next_token(c.request) for c in output.chunks if c.samples
        }
        self.busy_s += duration_s
        self.num_steps += 1
        self.loop.after(duration_s, lambda: self._complete(output, sampled), FINISH)

    def _next_token(self, request: Request, ahead: int = 0) -> int:
        answer = self._live[request.request_id].answer
        k = request.num_output_tokens + ahead
        return answer[k] if answer is not None and k < len(answer) else FIRST_TOKEN_ID

    def _decode_run(self, max_steps: int) -> bool:
        """Up to `max_steps` decode steps as one event, as many as end before the next
        external event; False (nothing done) when fewer than 2 fit. Each step is priced, metered
        and its tokens delivered at its own end time, as in `_step`."""
        assert self.next_external_s is not None
        bound = self.next_external_s()
        now = self.loop.now_s
        running = list(self.scheduler.running)
        starts = [r.num_computed_tokens for r in running]
        # decode steps only grow longer: the first one's time bounds how many can fit
        first_s = self.perf.step_s(StepShape(tuple((s, 1) for s in starts), len(running)))
        if first_s <= 0 or now + 2 * first_s > bound:
            return False
        if math.isfinite(bound):
            max_steps = min(max_steps, int((bound - now) / first_s) + 1)
        durations = self.perf.decode_run_s(starts, max_steps)
        # the same additions, in the same order, as stepping one event at a time
        ends_all = np.cumsum(np.concatenate(([now], durations)))[1:]
        steps = int(np.searchsorted(ends_all, bound, side="right"))
        if steps < 2:
            return False
        durations = durations[:steps]
        ends = ends_all[:steps].tolist()
        t = ends[-1]
        self.meter.charge_decode_run(running, starts, durations, self.meter.held(running))
        second = self.kv_cache.second_tier
        if second is not None:
            n, first_pairs = len(running), sum(starts) + len(running)
            for j, duration_s in enumerate(durations.tolist()):
                second.cost.observe_step(n, first_pairs + n * j, duration_s)
        tokens = {r.request_id: [self._next_token(r, i) for i in range(steps)] for r in running}
        self.busy_s += t - now
        self.num_steps += steps
        self.num_decode_runs += 1
        self.loop.after(t - now, lambda: self._complete_run(steps, tokens, ends), FINISH)
        return True

    def _complete_run(self, steps: int, tokens: dict[str, list[int]], ends: list[float]) -> None:
        advanced = self.scheduler.advance_decode_run(steps, tokens, self.loop.now_s)
        for end in ends:
            for request in advanced:
                self.on_token(request, end, False)
        self._step()

    def _complete(self, output: SchedulerOutput, sampled: dict[str, int]) -> None:
        now = self.loop.now_s
        for update in self.scheduler.update_from_output(output, sampled, now):
            rid = update.request.request_id
            if update.finished:
                self._live.pop(rid, None)
            self.on_token(update.request, now, update.finished)
        self._step()

    def abort(self, request_id: str) -> None:
        self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        self._live.pop(request_id, None)
