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

from collections.abc import Callable
from dataclasses import dataclass

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
    ) -> None:
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

    def _next_token(self, request: Request) -> int:
        answer = self._live[request.request_id].answer
        k = request.num_output_tokens
        return answer[k] if answer is not None and k < len(answer) else FIRST_TOKEN_ID

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
