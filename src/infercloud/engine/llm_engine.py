"""The engine: one shared copy of the weights serving many requests, one step at a time.

`step()` reads as one sentence: schedule, run the model, postprocess (append tokens, detokenize,
check stops, report deltas). Everything here runs on one thread; `AsyncEngine` puts it behind
asyncio, `LLM` behind a blocking list-in, list-out call.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from infercloud.cache.block_pool import BlockPool
from infercloud.cache.eviction import make_policy
from infercloud.cache.host_tier import HostTier
from infercloud.cache.kv_cache_manager import KVCacheManager, SecondTier
from infercloud.cache.prefix_cache import CacheEvent, PrefixCache
from infercloud.cache.transfer_cost import TransferCostModel, attention_pairs
from infercloud.engine.config import EngineConfig
from infercloud.engine.cpu_kernels import load_error, load_kernels
from infercloud.engine.detokenizer import IncrementalDetokenizer
from infercloud.engine.host_kv_store import HostKVStore, host_slots_for_bytes
from infercloud.engine.linear_choice import LinearTimes
from infercloud.engine.model_config import ModelConfig
from infercloud.engine.model_runner import (
    ModelRunner,
    kv_block_bytes,
    num_kv_blocks_for_bytes,
    resolve_dtype,
)
from infercloud.engine.outputs import RequestOutput
from infercloud.engine.packed_linear import has_kernel_gemm
from infercloud.engine.request import Request, RequestStatus
from infercloud.engine.request_meter import StepCostWeights
from infercloud.engine.sampler import TokenLogprobs
from infercloud.engine.sampling_params import SamplingParams
from infercloud.engine.scheduler import ScheduledChunk, Scheduler
from infercloud.engine.step_meter import StepMeter
from infercloud.engine.step_shape import StepShape
from infercloud.models.registry import resolve_model
from infercloud.sim.model_specs import ModelSpec

KV_EVENTS_KEPT = 10_000


def _use_decode_kernel(choice: str, device: str) -> bool:
    """Resolve `EngineConfig.decode_attention` for `device` (building the kernel if needed)."""
    if choice not in ("auto", "kernel", "torch"):
        raise ValueError(f"decode_attention must be auto, kernel or torch, got {choice!r}")
    if choice == "torch":
        return False
    on_cpu = torch.device(device).type == "cpu"
    if choice == "kernel":
        if not on_cpu:
            raise ValueError(f"decode_attention='kernel' runs on the CPU only, not on {device}")
        if not load_kernels():
            raise RuntimeError(f"the CPU decode attention kernel is unavailable: {load_error()}")
        return True
    return on_cpu and load_kernels()


def _use_cpu_kernel(
    what: str,
    choice: str,
    choices: tuple[str, str, str],
    device: str,
    dtype: torch.dtype,
    runs: Callable[[torch.dtype], bool],
    needs: str,
    unfit: str | None = None,
) -> bool:
    """Resolve a choice among ("auto", "kernel", <the other path>) for one of our CPU kernels
    (`EngineConfig.linear_kernel`, `prefill_attention`), building them if needed. `runs(dtype)`:
    whether the built kernel takes `dtype` on this CPU (asked once the kernels are loaded);
    `needs`: what it needs, for the refusal of "kernel". `unfit`: why the model's shapes rule the
    kernel out, if they do ("auto" then takes the other path; "kernel" is refused)."""
    if choice not in choices:
        raise ValueError(f"{what} must be one of {', '.join(choices)}, got {choice!r}")
    if choice not in ("auto", "kernel"):
        return False
    if unfit is not None:
        if choice == "kernel":
            raise RuntimeError(f"{what}='kernel' {unfit}")
        return False
    usable = torch.device(device).type == "cpu" and load_kernels() and runs(dtype)
    if choice == "kernel" and not usable:
        raise RuntimeError(f"{what}='kernel' is unavailable here: {load_error() or needs}")
    return usable


def _prefill_kernel_runs(dtype: torch.dtype) -> bool:
    """bfloat16 needs AVX512-BF16 (vdpbf16ps), float32 a vector path (AVX2 or AVX-512); the
    float32 GEMM's availability says the latter."""
    if dtype == torch.bfloat16:
        return bool(torch.ops.infercloud.has_linear_bf16())
    return dtype == torch.float32 and bool(torch.ops.infercloud.has_linear_f32())


class RequestRejectedError(ValueError):
    """A request the engine cannot take; the message is meant for the client.

    `code` follows OpenAI's error codes where one fits (e.g. "context_length_exceeded").
    """

    def __init__(self, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.code = code
        self.param = param


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage: float
    num_preemptions: int
    num_blocks: int
    num_prompt_tokens_total: int
    num_generation_tokens_total: int
    prefix_cache_queries_tokens: int = 0
    prefix_cache_hits_tokens: int = 0
    prefix_cache_blocks: int = 0
    prefix_cache_evicted_blocks: int = 0
    kv_blocks_moved: int = 0
    """Idle cached blocks moved to another id to keep running requests' blocks packed."""
    host_cache_enabled: bool = False
    host_cache_queries_tokens: int = 0
    host_cache_hits_tokens: int = 0
    host_cache_blocks: int = 0
    host_cache_evicted_blocks: int = 0
    kv_blocks_saved_to_host: int = 0
    kv_blocks_loaded_from_host: int = 0
    host_copy_s_per_block: float = 0.0
    """Measured seconds to load one block back from the host tier."""
    recompute_s_per_first_block: float = 0.0
    """Estimated seconds to recompute a prompt's first block (deeper ones cost more)."""


@dataclass(slots=True)
class _Tracked:
    request: Request
    detokenizer: IncrementalDetokenizer
    pending_logprobs: list[TokenLogprobs]


class LLMEngine:
    def __init__(self, config: EngineConfig, clock: Callable[[], float] = time.monotonic) -> None:
        from transformers import AutoTokenizer

        self.config = config
        self.clock = clock
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.model_name, self.model_path = resolve_model(config.model)
        if config.served_model_name:
            self.model_name = config.served_model_name
        self.model_config = ModelConfig.from_folder(self.model_path)
        self.tokenizer: Any = AutoTokenizer.from_pretrained(str(self.model_path))
        self._decoder = self.tokenizer.backend_tokenizer
        limit = self.model_config.max_position_embeddings
        self.max_model_len = min(config.max_model_len or limit, limit)
        dtype = resolve_dtype(config.dtype, torch.device(config.device))
        num_blocks = num_kv_blocks_for_bytes(
            self.model_config, config.kv_cache_bytes, config.block_size, dtype
        )
        if num_blocks < 1:
            raise ValueError(f"kv_cache_bytes={config.kv_cache_bytes} holds no KV block")
        if config.decode_group_overhead_tokens < 0:
            raise ValueError("decode_group_overhead_tokens must be >= 0")
        self.decode_kernel = _use_decode_kernel(config.decode_attention, config.device)
        """Whether decodes attend through our CPU kernel (`EngineConfig.decode_attention`)."""
        on_cpu = torch.device(config.device).type == "cpu"
        self.fused_ops = config.fused_layer_ops and on_cpu and load_kernels()
        """Whether the layers' element-wise parts run as our fused CPU operators."""
        self.linear_kernel = _use_cpu_kernel(
            "linear_kernel",
            config.linear_kernel,
            ("auto", "kernel", "onednn"),
            config.device,
            dtype,
            has_kernel_gemm,
            "it needs bfloat16 on a CPU with AVX512-BF16, or float32 on one with AVX2 or AVX-512",
        )
        """Whether linear layers multiply through our GEMM (else oneDNN); with "auto" where ours
        can run, settled by timing both once the weights are loaded."""
        time_linear = self.linear_kernel and config.linear_kernel == "auto"
        head_dim = self.model_config.head_dim
        self.prefill_kernel = _use_cpu_kernel(
            "prefill_attention",
            config.prefill_attention,
            ("auto", "kernel", "torch"),
            config.device,
            dtype,
            _prefill_kernel_runs,
            "it needs bfloat16 on a CPU with AVX512-BF16, or float32 on one with AVX2 or AVX-512",
            unfit=None
            if head_dim % 32 == 0 and head_dim <= 256
            else f"takes head sizes 32, 64, ... 256, not {head_dim}",
        )
        """Whether prefill chunks attend through our CPU kernel (else through matmuls)."""
        if config.kv_layout not in ("auto", "plain"):
            raise ValueError(f"kv_layout must be auto or plain, got {config.kv_layout!r}")
        self.kv_tiled = (
            config.kv_layout == "auto"
            and dtype == torch.bfloat16
            and self.decode_kernel
            and self.prefill_kernel
            and config.block_size == 16
            and head_dim in (32, 64, 128)
            and bool(torch.ops.infercloud.has_tiled_decode())
        )
        """Whether the KV cache is in the tiled layout (`EngineConfig.kv_layout`)."""
        self.attention_tiles = (
            self.kv_tiled
            and config.attention_tiles
            and bool(torch.ops.infercloud.has_attention_tiles())
        )
        """Whether both attention kernels run on the AMX tile unit
        (`EngineConfig.attention_tiles`)."""
        self.block_pool = BlockPool(num_blocks)
        self.kv_events: deque[tuple[int, CacheEvent]] = deque(maxlen=KV_EVENTS_KEPT)
        """The latest prefix-cache changes with their sequence numbers (`kv_events_since`)."""
        self._kv_event_seq = 0
        self._kv_events_lock = threading.Lock()
        """Events are appended on the engine thread and read from the HTTP server's."""
        self.prefix_cache = (
            PrefixCache(
                self.block_pool,
                config.block_size,
                make_policy(
                    config.eviction_policy,
                    depth_cost_per_block=ModelSpec.from_config(
                        str(self.model_path), self.model_config, self.max_model_len
                    ).depth_cost_per_block(config.block_size),
                ),
                on_event=self._record_kv_event,
            )
            if config.enable_prefix_caching
            else None
        )
        self.kv_cache = KVCacheManager(self.block_pool, config.block_size, self.prefix_cache)
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        self.eos_token_ids = eos
        self.scheduler = Scheduler(config.scheduler, self.kv_cache, eos)
        self.runner = ModelRunner(
            self.model_path,
            self.model_config,
            num_blocks,
            config.block_size,
            dtype,
            torch.device(config.device),
            seed=config.seed,
            packed_linear=config.packed_linear,
            linear_kernel=None if time_linear else self.linear_kernel,
            prefill_kernel=self.prefill_kernel,
            decode_group_overhead_tokens=config.decode_group_overhead_tokens,
            decode_kernel=self.decode_kernel,
            fused_ops=self.fused_ops,
            stacked_layers=config.stacked_layers,
            kv_tiled=self.kv_tiled,
            attention_tiles=self.attention_tiles,
        )
        self.linear_kernel = self.runner.linear_kernel
        self.linear_times: LinearTimes | None = self.runner.linear_times
        """With "auto" where both can run: both paths timed on this model's weights."""
        self.stacked_layers = self.runner.stacked_layers
        """Whether the decoder layers run as one C++ call (`EngineConfig.stacked_layers`)."""
        self.second_tier = self._second_tier(config, num_blocks)
        self.kv_cache.second_tier = self.second_tier
        if config.pack_kv_blocks and self.runner.kv_cache.device.type == "cpu":
            self.kv_cache.use_block_copier(self.runner.copy_blocks)
        self._tracked: dict[str, _Tracked] = {}
        self.num_prompt_tokens_total = 0
        self.num_generation_tokens_total = 0
        self.last_step: StepShape | None = None
        """The shape of the latest step (None if it scheduled nothing), for calibration."""
        mc = self.model_config
        self.step_weights = StepCostWeights.for_model(
            mc.hidden_size, mc.intermediate_size, mc.num_kv_heads, mc.head_dim
        )
        self.kv_block_bytes = kv_block_bytes(mc, config.block_size, dtype)
        self.step_meter = StepMeter(self.kv_cache, self.kv_block_bytes, self.step_weights)

    def _second_tier(self, config: EngineConfig, num_blocks: int) -> SecondTier | None:
        if config.host_cache_bytes <= 0:
            return None
        if self.prefix_cache is None:
            raise ValueError("a host cache needs prefix caching on")
        if config.host_cache_load not in ("auto", "always"):
            raise ValueError(
                f"host_cache_load must be auto or always, got {config.host_cache_load!r}"
            )
        pool = self.runner.kv_cache
        num_slots = host_slots_for_bytes(pool, num_blocks, config.host_cache_bytes)
        if num_slots < 1:
            raise ValueError(f"host_cache_bytes={config.host_cache_bytes} holds no KV block")
        cost = TransferCostModel(config.block_size)
        path = Path(config.host_cache_path) if config.host_cache_path else None
        store = HostKVStore(pool, num_blocks, num_slots, cost, path)
        store.calibrate()
        return SecondTier(HostTier(num_slots), store, cost, config.host_cache_load == "always")

    def _record_kv_event(self, event: CacheEvent) -> None:
        with self._kv_events_lock:
            self._kv_event_seq += 1
            self.kv_events.append((self._kv_event_seq, event))

    def kv_events_since(self, seq: int) -> tuple[int, list[CacheEvent], bool]:
        """Events after sequence number `seq`, the latest number, and whether some events after
        `seq` are no longer kept (the consumer fell more than `KV_EVENTS_KEPT` behind and should
        drop its view of this engine's cache before applying these)."""
        with self._kv_events_lock:
            oldest_kept = self._kv_event_seq - len(self.kv_events)
            events = [e for n, e in self.kv_events if n > seq]
            return self._kv_event_seq, events, seq < oldest_kept

    # -- requests -------------------------------------------------------------------------------

    @property
    def max_tokens_in_pool(self) -> int:
        return self.block_pool.num_blocks * self.config.block_size

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Validate a request; returns its context limit (prompt + output) in tokens."""
        num_prompt = len(prompt_token_ids)
        if num_prompt == 0:
            raise RequestRejectedError("the prompt must contain at least one token", param="prompt")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise RequestRejectedError(f"prompt token ids must be in [0, {vocab})", param="prompt")
        limit = min(self.max_model_len, self.max_tokens_in_pool)
        if num_prompt >= limit:
            raise RequestRejectedError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt} tokens in the prompt, leaving no room for output.",
                code="context_length_exceeded",
                param="prompt",
            )
        if params.max_tokens is not None and num_prompt + params.max_tokens > limit:
            raise RequestRejectedError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt + params.max_tokens} tokens ({num_prompt} in the prompt, "
                f"{params.max_tokens} for the completion). Please reduce the prompt or max_tokens.",
                code="context_length_exceeded",
                param="max_tokens",
            )
        return limit

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        arrival_time_s: float | None = None,
        cache_salt: str = "",
    ) -> None:
        limit = self.check_request(prompt_token_ids, params)
        if request_id in self._tracked:
            raise RequestRejectedError(f"request id {request_id!r} is already in use")
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            arrival_time_s=self.clock() if arrival_time_s is None else arrival_time_s,
            priority=priority,
            max_total_tokens=limit,
            cache_salt=cache_salt,
        )
        detok = IncrementalDetokenizer.for_prompt(
            self._decoder, request.prompt_token_ids, params.stop, params.include_stop_str_in_output
        )
        self._tracked[request_id] = _Tracked(request, detok, [])
        self.scheduler.add_request(request)
        self.num_prompt_tokens_total += len(prompt_token_ids)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Finish a request now and free its blocks; None if it is not in the engine."""
        tracked = self._tracked.get(request_id)
        if tracked is None:
            return None
        self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        return self._finish_output(tracked, [])

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        return EngineStats(
            num_requests_running=self.scheduler.num_running,
            num_requests_waiting=self.scheduler.num_waiting,
            # As vLLM counts it: blocks held by requests; idle cached blocks count as free.
            kv_cache_usage=1.0 - self.kv_cache.num_available_blocks / self.block_pool.num_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            num_blocks=self.block_pool.num_blocks,
            num_prompt_tokens_total=self.num_prompt_tokens_total,
            num_generation_tokens_total=self.num_generation_tokens_total,
            prefix_cache_queries_tokens=self.scheduler.prefix_cache_queries_tokens,
            prefix_cache_hits_tokens=self.scheduler.prefix_cache_hits_tokens,
            prefix_cache_blocks=len(self.prefix_cache) if self.prefix_cache is not None else 0,
            prefix_cache_evicted_blocks=(
                self.prefix_cache.num_evicted_blocks if self.prefix_cache is not None else 0
            ),
            kv_blocks_moved=(
                self.prefix_cache.num_moved_blocks if self.prefix_cache is not None else 0
            ),
            **self._host_stats(),
        )

    def _host_stats(self) -> dict[str, Any]:
        second = self.second_tier
        if second is None:
            return {}
        return {
            "host_cache_enabled": True,
            "host_cache_queries_tokens": self.scheduler.host_cache_queries_tokens,
            "host_cache_hits_tokens": self.scheduler.host_cache_hits_tokens,
            "host_cache_blocks": len(second.tier),
            "host_cache_evicted_blocks": second.tier.num_evicted,
            "kv_blocks_saved_to_host": second.num_saved_blocks,
            "kv_blocks_loaded_from_host": second.num_loaded_blocks,
            "host_copy_s_per_block": second.cost.copy_s_per_block or 0.0,
            "recompute_s_per_first_block": second.cost.recompute_s(0) or 0.0,
        }

    # -- one step -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        loaded_before = self.second_tier.num_loaded_blocks if self.second_tier else 0
        self.last_step = None
        step_started_s = time.perf_counter()
        output = self.scheduler.schedule(self.clock())
        if output.is_empty:
            return []
        held = self.step_meter.held(self.scheduler.running)
        self.last_step = StepShape(
            tuple((c.start, c.num_tokens) for c in output.chunks),
            sum(1 for c in output.chunks if c.samples),
            (self.second_tier.num_loaded_blocks if self.second_tier else 0) - loaded_before,
        )
        suppressed = self._suppressed_tokens(output.chunks)
        started_s = time.perf_counter()
        result = self.runner.execute(output, self.kv_cache, suppressed)
        if self.second_tier is not None:
            pairs = sum(attention_pairs(c.start, c.num_tokens) for c in output.chunks)
            elapsed_s = time.perf_counter() - started_s
            self.second_tier.cost.observe_step(output.num_batched_tokens, pairs, elapsed_s)
        sampled = {
            chunk.request.request_id: token
            for chunk, token in zip(
                result.sampled_chunks, result.sampler_output.token_ids, strict=True
            )
        }
        logprobs = {
            chunk.request.request_id: lp
            for chunk, lp in zip(result.sampled_chunks, result.sampler_output.logprobs, strict=True)
        }
        updates = self.scheduler.update_from_output(output, sampled, self.clock())
        self.step_meter.charge(output.chunks, held, time.perf_counter() - step_started_s)
        outputs: list[RequestOutput] = []
        for update in updates:
            tracked = self._tracked[update.request.request_id]
            self.num_generation_tokens_total += 1
            lp = logprobs[update.request.request_id]
            if lp is not None:
                tracked.pending_logprobs.append(lp)
            finished = update.finished
            if tracked.detokenizer.add_token(update.new_token_id) and not finished:
                self.scheduler.finish_request(
                    update.request.request_id, RequestStatus.FINISHED_STOPPED
                )
                update.request.stop_reason = tracked.detokenizer.matched_stop
                finished = True
            if finished:
                outputs.append(self._finish_output(tracked, [update.new_token_id]))
            else:
                outputs.append(self._delta_output(tracked, [update.new_token_id]))
        return outputs

    def _suppressed_tokens(self, chunks: list[ScheduledChunk]) -> dict[str, tuple[int, ...]]:
        out: dict[str, tuple[int, ...]] = {}
        for chunk in chunks:
            request = chunk.request
            params = request.sampling_params
            if chunk.samples and request.num_output_tokens < params.min_tokens:
                ids = set(params.stop_token_ids)
                if not params.ignore_eos:
                    ids |= self.eos_token_ids
                out[request.request_id] = tuple(sorted(ids))
        return out

    def _delta_output(self, tracked: _Tracked, new_ids: list[int]) -> RequestOutput:
        request = tracked.request
        logprobs, tracked.pending_logprobs = tracked.pending_logprobs, []
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=new_ids,
            new_text=tracked.detokenizer.take_new_text(finished=False),
            new_logprobs=logprobs,
            finished=False,
            finish_reason=None,
            stop_reason=None,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            arrival_time_s=request.arrival_time_s,
            first_scheduled_time_s=request.first_scheduled_time_s,
            num_cached_tokens=request.num_cached_tokens or 0,
        )

    def _finish_output(self, tracked: _Tracked, new_ids: list[int]) -> RequestOutput:
        request = tracked.request
        self._tracked.pop(request.request_id, None)
        self.runner.forget(request.request_id)
        logprobs, tracked.pending_logprobs = tracked.pending_logprobs, []
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=new_ids,
            new_text=tracked.detokenizer.take_new_text(finished=True),
            new_logprobs=logprobs,
            finished=True,
            finish_reason=request.status.value,
            stop_reason=request.stop_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            arrival_time_s=request.arrival_time_s,
            first_scheduled_time_s=request.first_scheduled_time_s,
            num_cached_tokens=request.num_cached_tokens or 0,
            meter=request.meter,
        )
