"""Continuous batching under a per-step token budget, with chunked prefill and preemption.

The algorithm, stated once: there are no prefill and decode phases. Each step, every running
request's computed tokens catch up with its tokens by as much as the step's token budget allows
(at most `long_prefill_token_threshold` per request, so one long prompt cannot take the whole step
from the decodes); then waiting requests join while budget, sequence slots and KV blocks remain.
A request that needs a block when none is free takes one from the running request of lowest
standing (the last to arrive under FCFS, the worst priority under PRIORITY), which is preempted:
its blocks are freed and it goes back to the waiting queue to be recomputed later. When a request
has computed all its tokens, the step samples its next token.

With a prefix cache, a waiting request that has computed nothing starts from the longest cached
prefix of its tokens (same salt), on the device or loaded back from the second tier: those
tokens count as computed at once, and only the rest is scheduled. After each step the full
blocks a request has computed are offered to the cache. While a request waits (new, or
preempted), the prefix it will look up is demand the cache can see before it is scheduled
(`KVCacheManager.note_waiting`): a policy that reads it keeps those blocks first. The CACHE
scheduling policy also admits by the cache: of the first few waiting requests, the one with
the longest cached prefix goes first (SGLang's longest-prefix-match order), none overtaken more
than `MAX_OVERTAKES` times.

Pure policy: no torch, no clock reads; the caller passes `now_s`.

Invariants:
- a request is in exactly one of `waiting`, `running`, or neither (finished); exactly the
  waiting ones hold a demand on the prefix cache (with a policy that reads it);
- a running request holds blocks for every token scheduled so far; a waiting one holds none;
- the tokens scheduled in one step never exceed `max_num_batched_tokens`, and the running batch
  never exceeds `max_num_seqs`.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from infercloud.cache.eviction import RequestShape
from infercloud.cache.kv_cache_manager import NO_HIT, KVCacheManager, PrefixHit
from infercloud.engine.request import Request, RequestStatus
from infercloud.engine.request_queue import SchedulingPolicy, make_queue

PREFIX_WINDOW = 16
"""CACHE policy: how many requests from the head of the queue compete on their cached prefix."""
MAX_OVERTAKES = 16
"""CACHE policy: a waiting request is overtaken at most this many times."""


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    long_prefill_token_threshold: int = 256
    policy: SchedulingPolicy = "fcfs"

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")
        if self.long_prefill_token_threshold < 1:
            raise ValueError("long_prefill_token_threshold must be positive")


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """Compute tokens `start .. start + num_tokens - 1` of `request` this step."""

    request: Request
    start: int
    num_tokens: int

    @property
    def samples(self) -> bool:
        """True when this chunk brings the request level with its tokens: sample after it."""
        return self.start + self.num_tokens == self.request.num_tokens


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    preempted_request_ids: list[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass(frozen=True, slots=True)
class FinishedUpdate:
    """The result of one sampled token for one request."""

    request: Request
    new_token_id: int
    finished: bool


class Scheduler:
    """Decides each step which tokens of which requests to compute."""

    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager, eos_token_ids: set[int]):
        self.config = config
        self.kv_cache = kv_cache
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting = make_queue(config.policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._overtaken: defaultdict[str, int] = defaultdict(int)
        """Under the CACHE policy, how often each waiting request was overtaken."""
        self._front_order = 0
        self._back_order = 0
        self.prefix_cache_queries_tokens = 0
        """Tokens looked up in the prefix cache (prompt or recomputed context at admission)."""
        self.prefix_cache_hits_tokens = 0
        """Of those, tokens found on the device."""
        self.host_cache_queries_tokens = 0
        """Tokens looked up in the second tier: those the device did not have."""
        self.host_cache_hits_tokens = 0
        """Of those, tokens loaded back from the second tier instead of recomputed."""

    # -- queue management --------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.add(request)
        self._note_waiting(request, front=False)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish a request from outside (abort, stop string); None if it is not here."""
        if not status.finished:
            raise ValueError(f"{status} is not a finished status")
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
            self.kv_cache.drop_waiting(request_id)
            self._overtaken.pop(request_id, None)
        # its blocks in the prefix cache take the class of its outcome (`eviction.feature_class`)
        shape = RequestShape(request.num_prompt_tokens, request.num_output_tokens)
        self.kv_cache.free(request_id, shape)
        request.status = status
        return request

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- one step -----------------------------------------------------------------------------

    def schedule(self, now_s: float) -> SchedulerOutput:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        scheduled: dict[str, ScheduledChunk] = {}
        preempted: list[str] = []

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(
                request.num_tokens - request.num_computed_tokens,
                budget,
                cfg.long_prefill_token_threshold,
            )
            if num_new <= 0:
                index += 1
                continue
            target = request.num_computed_tokens + num_new
            while not self.kv_cache.allocate_slots(request.request_id, target, now_s):
                victim = self._pick_victim()
                self._preempt(victim)
                preempted.append(victim.request_id)
                undone = scheduled.pop(victim.request_id, None)
                if undone is not None:
                    budget += undone.num_tokens
                if victim is request:
                    break
                index = self.running.index(request)
            else:
                scheduled[request.request_id] = ScheduledChunk(
                    request, request.num_computed_tokens, num_new
                )
                budget -= num_new
                index += 1
                continue
            # the request itself was preempted; the next one now sits at `index`

        if not preempted:
            while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
                request, hit, ahead = self._next_waiting()
                bs = self.kv_cache.block_size
                num_cached = hit.num_blocks * bs
                start = max(request.num_computed_tokens, num_cached)
                num_new = min(request.num_tokens - start, budget, cfg.long_prefill_token_threshold)
                target = start + num_new
                if not self.kv_cache.allocate_slots(request.request_id, target, now_s, hit):
                    break
                if ahead:
                    self.waiting.remove(request)
                    for passed in ahead:
                        self._overtaken[passed.request_id] += 1
                else:
                    self.waiting.pop()
                self._overtaken.pop(request.request_id, None)
                self.kv_cache.drop_waiting(request.request_id)
                if request.num_computed_tokens == 0:
                    device_tokens = len(hit.device) * bs
                    self.prefix_cache_queries_tokens += request.num_tokens
                    self.prefix_cache_hits_tokens += device_tokens
                    if self.kv_cache.second_tier is not None:
                        self.host_cache_queries_tokens += request.num_tokens - device_tokens
                        self.host_cache_hits_tokens += len(hit.host) * bs
                    if request.num_cached_tokens is None:
                        request.num_cached_tokens = num_cached
                        self._note_evicted_prefix(request, hit)
                request.num_computed_tokens = start
                request.status = RequestStatus.RUNNING
                if request.first_scheduled_time_s is None:
                    request.first_scheduled_time_s = now_s
                self.running.append(request)
                scheduled[request.request_id] = ScheduledChunk(
                    request, request.num_computed_tokens, num_new
                )
                budget -= num_new

        return SchedulerOutput(list(scheduled.values()), preempted)

    def _next_waiting(self) -> tuple[Request, PrefixHit, list[Request]]:
        """The waiting request to admit next, its cached prefix, and the requests it would
        overtake. FCFS and PRIORITY: the queue's head, overtaking nobody. CACHE (SGLang's
        longest-prefix-match order, bounded): of the first `PREFIX_WINDOW` waiting, the one
        with the most cached blocks (the earliest on ties), unless a request ahead of it has
        been overtaken `MAX_OVERTAKES` times already (then the earliest such one): a prompt
        that shares nothing is delayed, never starved."""
        if self.config.policy != "cache":
            head = self.waiting.peek()
            return head, self._match(head), []
        window = self.waiting.first(PREFIX_WINDOW)
        best_at, best_hit = 0, NO_HIT
        for at, request in enumerate(window):
            if self._overtaken.get(request.request_id, 0) >= MAX_OVERTAKES:
                return request, self._match(request), window[:at]
            hit = self._match(request)
            if at == 0 or hit.num_blocks > best_hit.num_blocks:
                best_at, best_hit = at, hit
        return window[best_at], best_hit, window[:best_at]

    def _match(self, request: Request) -> PrefixHit:
        """The cached prefix a waiting request would start from (none if it has computed
        tokens already)."""
        if request.num_computed_tokens:
            return NO_HIT
        return self.kv_cache.match(request.cache_salt, request.all_token_ids())

    def _note_evicted_prefix(self, request: Request, hit: PrefixHit) -> None:
        """Mark the prompt tokens past the hit that the cache once held: computing them again
        is recompute in the request's meter."""
        cache = self.kv_cache.prefix_cache
        if cache is None:
            return
        tokens = request.prompt_token_ids
        evicted = cache.num_evicted_after(request.cache_salt, tokens, hit.device, len(tokens) - 1)
        if evicted:
            request.meter.evicted_prefix_tokens = len(hit.device) * cache.block_size + evicted

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time_s))
        return self.running[-1]

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache.free(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(request)
        self._note_waiting(request, front=True)

    def _note_waiting(self, request: Request, front: bool) -> None:
        """Its prompt (and, after a preemption, what it generated) is demand the prefix cache
        can see before the request is scheduled: the blocks it will match count as wanted,
        by its place in the queue (`_queue_order`)."""
        if not self.kv_cache.tracks_demand:
            return  # LRU reads no demand: no token list to build per request
        order = self._queue_order(request, front)
        self.kv_cache.note_waiting(
            request.request_id, request.cache_salt, request.all_token_ids(), order
        )

    def _queue_order(self, request: Request, front: bool) -> float:
        """A number that sorts the waiting requests as the queue will schedule them: under
        FCFS a count up at the back and down at the front; under PRIORITY the queue's own key,
        (priority, arrival), as one number (2^32 s between priority levels)."""
        if self.config.policy == "priority":
            return request.priority * 2.0**32 + request.arrival_time_s
        if front:
            self._front_order -= 1
            return self._front_order
        self._back_order += 1
        return self._back_order

    def update_from_output(
        self, output: SchedulerOutput, sampled_token_ids: dict[str, int], now_s: float = 0.0
    ) -> list[FinishedUpdate]:
        """Advance computed tokens, cache full blocks, append sampled tokens, finish requests.

        `sampled_token_ids` has one entry per chunk whose `samples` is true.
        """
        updates: list[FinishedUpdate] = []
        for chunk in output.chunks:
            request = chunk.request
            if request.status != RequestStatus.RUNNING:
                continue  # finished from outside between schedule and update
            request.num_computed_tokens += chunk.num_tokens
            self.kv_cache.cache_blocks(
                request.request_id,
                request.cache_salt,
                request.token_ids_range,
                request.num_computed_tokens,
                now_s,
            )
            token_id = sampled_token_ids.get(request.request_id)
            if token_id is None:
                continue
            request.output_token_ids.append(token_id)
            status = self._check_stop(request, token_id)
            if status is not None:
                self.finish_request(request.request_id, status)
            updates.append(FinishedUpdate(request, token_id, status is not None))
        return updates

    # -- runs of decode steps (the simulator's fast path) ----------------------------------------

    def decode_run_length(self, max_steps: int) -> int:
        """How many decode steps the running batch can take back to back with nothing changing
        but its tokens: nobody waiting, every running request one token behind (decoding),
        none able to stop before the run's last step (no stop or EOS tokens to watch; each
        stops at its length, at the end of the run at the earliest), and blocks for all of it,
        free or evictable (no preemption). Then `advance_decode_run` takes those steps at
        once, exactly as `schedule` and `update_from_output` would one by one. 0 when the batch
        is not such a run."""
        if max_steps < 2 or self.waiting or not self.running:
            return 0
        if len(self.running) > self.config.max_num_batched_tokens:
            return 0
        steps = max_steps
        for r in self.running:
            if r.num_tokens - r.num_computed_tokens != 1:
                return 0
            p = r.sampling_params
            if p.stop_token_ids or (not p.ignore_eos and self.eos_token_ids):
                return 0
            left = r.max_total_tokens - r.num_tokens
            if p.max_tokens is not None:
                left = min(left, p.max_tokens - r.num_output_tokens)
            steps = min(steps, left)
            if steps < 2:
                return 0
        need = sum(
            self.kv_cache.num_new_blocks_needed(r.request_id, r.num_computed_tokens + steps)
            for r in self.running
        )
        return steps if need <= self.kv_cache.num_available_blocks else 0

    def advance_decode_run(
        self, steps: int, token_ids: dict[str, list[int]], now_s: float
    ) -> list[FinishedUpdate]:
        """Take `steps` decode steps of the running batch (at most what `decode_run_length`
        said): each request computes `steps` tokens and gets `token_ids[id]` (that many) as its
        output; full blocks are cached, and idle cached blocks evicted for room, once, at the
        end; a request whose last token ends it (its length) finishes, as in
        `update_from_output`. Returns each request advanced, with its last token."""
        updates: list[FinishedUpdate] = []
        for r in list(self.running):
            target = r.num_computed_tokens + steps
            if not self.kv_cache.allocate_slots(r.request_id, target, now_s):
                raise RuntimeError("advance_decode_run without the blocks decode_run_length saw")
            r.num_computed_tokens = target
            tokens = token_ids[r.request_id]
            r.output_token_ids.extend(tokens)
            self.kv_cache.cache_blocks(
                r.request_id, r.cache_salt, r.token_ids_range, r.num_computed_tokens, now_s
            )
            status = self._check_stop(r, tokens[-1])
            if status is not None:
                self.finish_request(r.request_id, status)
            updates.append(FinishedUpdate(r, tokens[-1], status is not None))
        return updates

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        num_output = request.num_output_tokens
        if num_output >= params.min_tokens:
            if not params.ignore_eos and token_id in self.eos_token_ids:
                request.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if params.max_tokens is not None and num_output >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= request.max_total_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
