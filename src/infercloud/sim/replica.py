"""One simulated replica: the real engine scheduler, block pool, prefix cache and second tier,
stepped in simulated time, each step lasting what the performance model says.

The loop is the engine's: schedule, (run the model), update. Here "run the model" is an event
`perf.step_s(shape)` later; the sampled token of each request is the next token of its scripted
answer (multi-turn workloads resend answers, so they must be the tokens a later prompt holds)
or a filler id. Requests run with `ignore_eos` and `max_tokens` = their output length, so they
finish exactly where the workload says. The second tier's copies cost their bytes over the
host link, and its transfer-cost model is fed the simulated step and copy times, so the real
load-or-recompute decision runs on simulated measurements.

A run of pure decode steps is one event (`_Run`): priced at once, applied when something reads
the replica (`sync`, before every routing decision) and at its end, and cut after the step in
flight when a request joins, so that every token, block and report figure is the one stepping
one event at a time gives.

Invariants: at most one step (or run) is in flight; a step's updates apply at its end time, in
the order the scheduler returned the chunks; a run's steps apply in order, none twice.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from infercloud.cache.block_pool import BlockPool
from infercloud.cache.eviction import make_policy
from infercloud.cache.host_tier import HostTier
from infercloud.cache.kv_cache_manager import KVCacheManager, SecondTier
from infercloud.cache.prefix_cache import CacheEvent, PrefixCache
from infercloud.cache.transfer_cost import TransferCostModel
from infercloud.engine.request import Request
from infercloud.engine.request_meter import StepCostWeights
from infercloud.engine.sampling_params import SamplingParams
from infercloud.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from infercloud.engine.step_meter import StepMeter
from infercloud.engine.step_shape import StepShape
from infercloud.sim.events import FINISH, STEP, Event, EventLoop
from infercloud.sim.perf_model import PerfModel
from infercloud.sim.workload import FIRST_TOKEN_ID

TokenCallback = Callable[[Request, Sequence[float], bool], None]
"""(the request, times s, finished): tokens a request produced, one per time, in order;
`finished`: the last of them ended it."""


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


@dataclass(slots=True, eq=False)
class _Run:
    """A run of decode steps in flight: `steps` steps of the batch `running`, step j ending at
    `ends_s[j]`; the first `applied` are applied to the scheduler and their tokens delivered.
    A request that joins during the run cuts it after the step in flight (`SimReplica.add`)."""

    running: list[Request]
    starts: list[int]
    durations_s: np.ndarray
    ends_s: list[float]
    held: list[tuple[Request, float]]
    table_blocks: list[int]
    start_s: float
    event: Event
    steps: int
    applied: int = 0


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
        decode_runs: bool = True,
    ) -> None:
        """`decode_runs`: a run of pure decode steps (`Scheduler.decode_run_length`) is one
        event, cut short when a request joins; False: every step is an event."""
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
                make_policy(
                    eviction, depth_cost_per_block=perf.model.depth_cost_per_block(block_size)
                ),
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
        self.decode_runs = decode_runs
        self.num_decode_runs = 0
        self._run: _Run | None = None
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
        if self._run is not None:
            self._cut_run()
        if not self._busy:
            self._busy = True
            self.loop.at(self.loop.now_s, self._step, STEP)

    def _step(self) -> None:
        if self.decode_runs:
            steps = self.scheduler.decode_run_length(MAX_RUN_STEPS)
            if steps >= 2:
                self._start_run(steps)
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
            c.request.request_id: self._next_tokens(c.request, 1)[0]
            for c in output.chunks
            if c.samples
        }
        self.busy_s += duration_s
        self.num_steps += 1
        self.loop.after(duration_s, lambda: self._complete(output, sampled), FINISH)

    def _next_tokens(self, request: Request, steps: int) -> list[int]:
        """The request's next `steps` tokens: its given answer's (a multi-turn session's
        reply, which the next turn's prompt repeats), then filler."""
        answer = self._live[request.request_id].answer
        if answer is None:
            return [FIRST_TOKEN_ID] * steps
        k = request.num_output_tokens
        given = answer[k : k + steps]
        return given + [FIRST_TOKEN_ID] * (steps - len(given))

    # -- runs of decode steps -------------------------------------------------------------------

    def _start_run(self, steps: int) -> None:
        """Take `steps` decode steps as one event: each step priced (in one numpy pass), its
        tokens delivered at its own end time, as stepping one event at a time would."""
        now = self.loop.now_s
        running = list(self.scheduler.running)
        starts = [r.num_computed_tokens for r in running]
        durations = self.perf.decode_run_s(starts, steps)
        # the same additions, in the same order, as stepping one event at a time
        ends = np.cumsum(np.concatenate(([now], durations)))[1:].tolist()
        event = self.loop.at(ends[-1], self._finish_run, FINISH)
        held = self.meter.held(running, exact=True)
        tables = [len(self.kv_cache.block_table(r.request_id)) for r in running]
        self._run = _Run(running, starts, durations, ends, held, tables, now, event, steps)

    def sync(self) -> None:
        """Apply the steps of the run in flight that have ended by now (the cache and the KV
        events then say what they would say stepping one by one), all but its last step: that
        one (where requests may finish) is the run's end event's, after the meter's charge."""
        run = self._run
        if run is not None:
            done = bisect_right(run.ends_s, self.loop.now_s, run.applied, run.steps - 1)
            if done > run.applied:
                self._apply(run, done)

    @property
    def in_run(self) -> bool:
        return self._run is not None

    def run_may_extend(self, block_hashes: set[int]) -> bool:
        """Whether the run in flight may have stored blocks (not applied yet) that continue
        one of `block_hashes` (a prompt's block hashes, with its salt's root hash): a request of
        the run whose last cached block is among them. Only then can `sync` change what a
        router reading this replica's cache for that prompt sees."""
        run = self._run
        if run is None or run.applied >= run.steps - 1:
            return False
        tail = self.kv_cache.cached_tail_hash
        return any(tail(r.request_id, r.cache_salt) in block_hashes for r in run.running)

    def _cut_run(self) -> None:
        """A request joined: the run stops after the step in flight (stepping one by one, the
        next step would schedule it)."""
        run = self._run
        assert run is not None
        self.sync()
        keep = run.applied + 1
        if keep < run.steps:
            run.steps = keep
            run.event.cancel()
            run.event = self.loop.at(run.ends_s[keep - 1], self._finish_run, FINISH)

    def _apply(self, run: _Run, upto: int) -> None:
        steps = upto - run.applied
        tokens = {r.request_id: self._next_tokens(r, steps) for r in run.running}
        updates = self.scheduler.advance_decode_run(steps, tokens, self.loop.now_s)
        ends = run.ends_s[run.applied : upto]
        if len(ends) > 1:  # every request's tokens but the last, before anybody finishes
            before_last = ends[:-1]
            for update in updates:
                self.on_token(update.request, before_last, False)
        last = ends[-1:]
        for update in updates:
            if update.finished:
                self._live.pop(update.request.request_id, None)
            self.on_token(update.request, last, update.finished)
        run.applied = upto

    def _finish_run(self) -> None:
        run = self._run
        assert run is not None
        self._run = None
        durations = run.durations_s[: run.steps]
        # charged before the last tokens: a request that finishes reports its meter then
        self.meter.charge_decode_run(run.running, run.starts, durations, run.held, run.table_blocks)
        self._apply(run, run.steps)
        second = self.kv_cache.second_tier
        if second is not None:
            n, first_pairs = len(run.running), sum(run.starts) + len(run.running)
            for j, duration_s in enumerate(durations.tolist()):
                second.cost.observe_step(n, first_pairs + n * j, duration_s)
        self.meter.advance(run.steps - 1)
        self.busy_s += run.ends_s[run.steps - 1] - run.start_s
        self.num_steps += run.steps
        self.num_decode_runs += 1
        self._step()

    def _complete(self, output: SchedulerOutput, sampled: dict[str, int]) -> None:
        now = self.loop.now_s
        for update in self.scheduler.update_from_output(output, sampled, now):
            rid = update.request.request_id
            if update.finished:
                self._live.pop(rid, None)
            self.on_token(update.request, (now,), update.finished)
        self._step()
