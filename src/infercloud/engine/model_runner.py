"""Runs one scheduled step on the model: lay out the batch, run the forward pass, sample.

The runner owns the physical KV cache (one slot array of keys and one of values per layer,
sized from a byte budget) and the per-request random generators. It reads block tables from the
`KVCacheManager` but never changes them: which blocks a request holds is the scheduler's call.

Batch layout of one step: the single-token chunks first (they share one batched attention call),
then each multi-token chunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from infercloud.cache.kv_cache_manager import KVCacheManager
from infercloud.engine.attention import (
    AttentionMetadata,
    DecodeBatch,
    PagedDecodeBatch,
    PagedPrefillBatch,
    PrefillChunk,
)
from infercloud.engine.config import DEFAULT_DECODE_GROUP_OVERHEAD_TOKENS
from infercloud.engine.decode_groups import decode_groups
from infercloud.engine.host_allocator import keep_freed_memory
from infercloud.engine.linear_choice import LAYERS_TIMED, LinearTimes, time_linear_paths
from infercloud.engine.llama import LlamaModel
from infercloud.engine.model_config import ModelConfig
from infercloud.engine.packed_linear import can_pack, pack_linears
from infercloud.engine.sampler import SamplerOutput, SamplingRow, sample
from infercloud.engine.scheduler import ScheduledChunk, SchedulerOutput

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """A dtype by name; "auto" is bfloat16 where it runs natively (CUDA, or a CPU whose oneDNN
    packs bfloat16 weights: AVX-512 or AVX-NE-CONVERT) and float32 elsewhere. On an AVX2-only
    CPU bfloat16 is emulated: a decode-sized GEMM took 5.9 ms against 1.2 ms in float32."""
    if name == "auto":
        native = device.type == "cuda" or can_pack(device, torch.bfloat16)
        return torch.bfloat16 if native else torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


@dataclass(frozen=True, slots=True)
class StepResult:
    """Sampled tokens of the chunks that sample, in the order of `sampled_chunks`."""

    sampled_chunks: list[ScheduledChunk]
    sampler_output: SamplerOutput


def kv_block_bytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of keys and values one KV block holds, in all layers."""
    return block_size * config.kv_bytes_per_token * torch.empty((), dtype=dtype).element_size()


def num_kv_blocks_for_bytes(
    config: ModelConfig, kv_cache_bytes: int, block_size: int, dtype: torch.dtype
) -> int:
    return kv_cache_bytes // kv_block_bytes(config, block_size, dtype)


class ModelRunner:
    def __init__(
        self,
        model_dir: Path,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        seed: int = 0,
        packed_linear: bool = True,
        linear_kernel: bool | None = False,
        prefill_kernel: bool = False,
        decode_group_overhead_tokens: int = DEFAULT_DECODE_GROUP_OVERHEAD_TOKENS,
        decode_kernel: bool = False,
        fused_ops: bool = False,
        stacked_layers: bool = False,
        kv_tiled: bool = False,
        attention_tiles: bool = False,
    ) -> None:
        """`decode_kernel`: decodes attend through `torch.ops.infercloud.paged_decode_attention`,
        else in padded groups; `fused_ops`: the layers' element-wise parts through our fused
        operators; `prefill_kernel`: prefill chunks through
        `torch.ops.infercloud.paged_prefill_attention`, else gathered and through matmuls;
        `linear_kernel`: linear layers through our GEMM (bfloat16 or float32), else oneDNN's where
        `packed_linear`; None: whichever of the two is faster on this model's weights here
        (`linear_choice.py`); `stacked_layers`: the decoder layers as one C++ call where all
        four of the above are on (for any of these, the caller has loaded the kernels:
        `cpu_kernels.load_kernels()`). With `fused_ops`, greedy rows are also chosen by our
        argmax operator (`csrc/greedy_tokens.cpp`). `kv_tiled`: the KV cache is in the tiled
        layout of `csrc/kv_layout.h`, which only our two attention kernels read (the caller
        has checked that both are on and that the model's shapes fit); `attention_tiles`: with
        it, both attention kernels run on the AMX tile unit (the caller has checked that they
        can)."""
        if device.type == "cpu":
            keep_freed_memory()
        self.config = config
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        with torch.device("meta"):
            model = LlamaModel(config)
        model = model.to_empty(device=device)
        model.load_weights(model_dir)
        self.model = model.to(dtype=dtype).eval()
        # RoPE tables are float32 whatever the weights' dtype (to() above cast them).
        self.model.rotary.reset_tables()
        self.linear_times: LinearTimes | None = None
        """With `linear_kernel=None`: both paths timed on this model's weights."""
        if linear_kernel is None:
            self.linear_times = time_linear_paths(
                self.model.projection_weights(LAYERS_TIMED),
                packed_other=packed_linear and can_pack(device, dtype),
                # bfloat16 on the vector units: vdpbf16ps or float32 multiply-adds
                fma=dtype == torch.bfloat16 and not torch.ops.infercloud.has_linear_tiles(),
            )
            linear_kernel = self.linear_times.kernel_wins
        self.linear_kernel = linear_kernel
        """Whether the linear layers run on our GEMM."""
        self.linear_fma = bool(
            linear_kernel and self.linear_times is not None and self.linear_times.fma_wins
        )
        """Whether our bfloat16 GEMM multiplies on float32 multiply-adds (timed faster than
        vdpbf16ps); a switch of the process (`set_linear_bf16_fma`), set by each engine that
        runs our bfloat16 GEMM."""
        if linear_kernel and dtype == torch.bfloat16:
            torch.ops.infercloud.set_linear_bf16_fma(self.linear_fma)
        if linear_kernel:
            pack_linears(self.model, kernel=True)
        elif packed_linear and can_pack(device, dtype):
            pack_linears(self.model)
        self.fused_ops = fused_ops
        if fused_ops:
            self.model.use_fused_ops()
        self.num_blocks = num_blocks
        rows = config.num_kv_heads * num_blocks
        shape = (config.num_layers, 2, rows, block_size, config.head_dim)
        # Zeroed, not empty: padded gather slots are multiplied by a zero probability, and
        # uninitialized memory may hold NaN, which would survive that product.
        self.kv_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(shape[0])]
        self._kv_by_block = self.kv_cache.view(
            config.num_layers, 2, config.num_kv_heads, num_blocks, block_size, config.head_dim
        )
        """The pool with a dimension per block (3), for `copy_blocks`."""
        self.stacked_layers = (
            stacked_layers
            and dtype == torch.bfloat16
            and linear_kernel
            and fused_ops
            and decode_kernel
            and prefill_kernel
            and self.model.gate_up_silu_fused()  # intermediate sizes a multiple of 16
        )
        """Whether the decoder layers run as one C++ call (`csrc/decoder_stack.cpp`: bfloat16)."""
        self.kv_tiled = kv_tiled
        self.attention_tiles = attention_tiles and kv_tiled
        if kv_tiled and not (decode_kernel and prefill_kernel):
            raise ValueError("a tiled KV cache is read by the attention kernels only")
        if self.stacked_layers:
            self.model.use_stack(
                self.kv_caches, tiled_kv=kv_tiled, attention_tiles=self.attention_tiles
            )
        self.group = config.num_heads // config.num_kv_heads
        self.decode_group_overhead_tokens = decode_group_overhead_tokens
        self.decode_kernel = decode_kernel
        self.prefill_kernel = prefill_kernel
        self._generators: dict[str, torch.Generator] = {}
        self._default_generator = torch.Generator().manual_seed(seed)

    @torch.inference_mode()
    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy the keys and values of blocks `src[i]` to `dst[i]`, every layer (the blocks'
        layout inside, tiled or not, goes along as it is). No id may be in both lists."""
        pool = self._kv_by_block
        device = pool.device
        to = torch.tensor(dst, dtype=torch.long, device=device)
        pool.index_copy_(3, to, pool.index_select(3, torch.tensor(src, device=device)))

    def forget(self, request_id: str) -> None:
        """Drop per-request state (its generator) once the request is finished."""
        self._generators.pop(request_id, None)

    @torch.inference_mode()
    def execute(
        self,
        output: SchedulerOutput,
        kv_cache: KVCacheManager,
        suppressed: dict[str, tuple[int, ...]],
    ) -> StepResult:
        # decodes by context length, so that a group of similar lengths shares one padded batch
        decodes = sorted((c for c in output.chunks if c.num_tokens == 1), key=lambda c: c.start)
        prefills = [c for c in output.chunks if c.num_tokens > 1]
        ordered = decodes + prefills
        bs = self.block_size

        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        logits_rows: list[int] = []
        sampled: list[ScheduledChunk] = []
        for chunk in ordered:
            table = kv_cache.block_table(chunk.request.request_id)
            input_ids.extend(
                chunk.request.token_ids_range(chunk.start, chunk.start + chunk.num_tokens)
            )
            chunk_positions = range(chunk.start, chunk.start + chunk.num_tokens)
            positions.extend(chunk_positions)
            slot_mapping.extend(table[p // bs] * bs + p % bs for p in chunk_positions)
            if chunk.samples:
                logits_rows.append(len(input_ids) - 1)
                sampled.append(chunk)

        slots = torch.tensor(slot_mapping, dtype=torch.long)
        paged = self.decode_kernel and bool(decodes)
        meta = AttentionMetadata(
            write_rows=self._per_head(slots, self.num_blocks * bs).to(self.device),
            decodes=[] if paged else self._decode_batches(decodes, kv_cache),
            prefills=[]
            if self.prefill_kernel
            else self._prefill_chunks(prefills, kv_cache, row_start=len(decodes)),
            paged_decode=self._paged_decode(decodes, kv_cache) if paged else None,
            paged_prefill=self._paged_prefill(prefills, kv_cache, len(decodes))
            if self.prefill_kernel and prefills
            else None,
            tiled=self.kv_tiled,
            tile_unit=self.attention_tiles,
        )
        logits = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=self.device),
            torch.tensor(positions, dtype=torch.long, device=self.device),
            self.kv_caches,
            meta,
            torch.tensor(logits_rows, dtype=torch.long, device=self.device),
        )
        rows = [
            SamplingRow(
                c.request.sampling_params,
                self._generator(c.request.request_id, c.request.sampling_params.seed),
                suppressed.get(c.request.request_id, ()),
            )
            for c in sampled
        ]
        return StepResult(sampled, sample(logits.cpu(), rows, greedy_kernel=self.fused_ops))

    def _generator(self, request_id: str, seed: int | None) -> torch.Generator:
        if seed is None:
            return self._default_generator
        generator = self._generators.get(request_id)
        if generator is None:
            generator = torch.Generator().manual_seed(seed)
            self._generators[request_id] = generator
        return generator

    def _per_head(self, index: torch.Tensor, stride: int) -> torch.Tensor:
        """Rows of every KV head for `index`: head * stride + index, head major."""
        heads = torch.arange(self.config.num_kv_heads, dtype=torch.long).unsqueeze(1)
        return (heads * stride + index.unsqueeze(0)).reshape(-1)

    def _block_tables(
        self, chunks: list[ScheduledChunk], kv_cache: KVCacheManager, dtype: torch.dtype
    ) -> tuple[torch.Tensor, list[int]]:
        """Each decode's blocks covering its context, padded with block 0 to the longest, and
        the contexts (keys each query attends to, its own included)."""
        bs = self.block_size
        contexts = [c.start + 1 for c in chunks]
        max_blocks = -(-max(contexts) // bs)
        rows = []
        for c, n in zip(chunks, contexts, strict=True):
            table = kv_cache.block_table(c.request.request_id)[: -(-n // bs)]
            rows.append(table + [0] * (max_blocks - len(table)))
        return torch.tensor(rows, dtype=dtype), contexts

    def _paged_decode(
        self, chunks: list[ScheduledChunk], kv_cache: KVCacheManager
    ) -> PagedDecodeBatch:
        """Every decode in one call of the kernel, each at its own context length."""
        tables, contexts = self._block_tables(chunks, kv_cache, torch.int32)
        return PagedDecodeBatch(
            num_seqs=len(chunks),
            block_tables=tables,
            context_lens=torch.tensor(contexts, dtype=torch.int32),
        )

    def _decode_batches(
        self, chunks: list[ScheduledChunk], kv_cache: KVCacheManager
    ) -> list[DecodeBatch]:
        """The decodes (ascending context) in groups of similar length (`decode_groups`)."""
        bs = self.block_size
        num_blocks = [-(-(c.start + 1) // bs) for c in chunks]
        groups = decode_groups(num_blocks, self.decode_group_overhead_tokens / bs)
        return [self._decode_batch(chunks[g.start : g.stop], g.start, kv_cache) for g in groups]

    def _decode_batch(
        self, chunks: list[ScheduledChunk], row_start: int, kv_cache: KVCacheManager
    ) -> DecodeBatch:
        bs = self.block_size
        tables, contexts = self._block_tables(chunks, kv_cache, torch.long)
        max_blocks = tables.shape[1]
        offsets = torch.arange(max_blocks * bs)
        mask = offsets.unsqueeze(0) < torch.tensor(contexts).unsqueeze(1)
        return DecodeBatch(
            row_start=row_start,
            num_seqs=len(chunks),
            gather_rows=self._per_head(tables.reshape(-1), self.num_blocks).to(self.device),
            max_blocks=max_blocks,
            bias=_bias(mask.view(1, len(chunks), 1, max_blocks * bs), self.dtype).to(self.device),
        )

    def _paged_prefill(
        self, chunks: list[ScheduledChunk], kv_cache: KVCacheManager, row_start: int
    ) -> PagedPrefillBatch:
        """Every prefill chunk in one call of the kernel, over its request's blocks."""
        bs = self.block_size
        ends = [c.start + c.num_tokens for c in chunks]
        max_blocks = -(-max(ends) // bs)
        rows = []
        for c, end in zip(chunks, ends, strict=True):
            table = kv_cache.block_table(c.request.request_id)[: -(-end // bs)]
            rows.append(table + [0] * (max_blocks - len(table)))
        return PagedPrefillBatch(
            row_start=row_start,
            num_rows=sum(c.num_tokens for c in chunks),
            block_tables=torch.tensor(rows, dtype=torch.int32),
            starts=torch.tensor([c.start for c in chunks], dtype=torch.int32),
            lens=torch.tensor([c.num_tokens for c in chunks], dtype=torch.int32),
        )

    def _prefill_chunks(
        self, chunks: list[ScheduledChunk], kv_cache: KVCacheManager, row_start: int
    ) -> list[PrefillChunk]:
        bs = self.block_size
        out: list[PrefillChunk] = []
        for c in chunks:
            end = c.start + c.num_tokens
            num_blocks = -(-end // bs)
            table = torch.tensor(kv_cache.block_table(c.request.request_id)[:num_blocks])
            offsets = torch.arange(num_blocks * bs)
            query_positions = torch.arange(c.start, end)
            mask = offsets.unsqueeze(0) <= query_positions.unsqueeze(1)
            mask = mask.repeat_interleave(self.group, dim=0)
            out.append(
                PrefillChunk(
                    row_start=row_start,
                    num_query=c.num_tokens,
                    gather_rows=self._per_head(table, self.num_blocks).to(self.device),
                    bias=_bias(mask, self.dtype).to(self.device),
                )
            )
            row_start += c.num_tokens
        return out


def _bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Additive attention bias from a bool mask: 0 where allowed, -inf where not (exact in any
    floating dtype)."""
    return torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf"))
