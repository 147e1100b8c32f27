"""Settings of one engine replica."""

from __future__ import annotations

from dataclasses import dataclass, field

from infercloud.engine.scheduler import SchedulerConfig

DEFAULT_KV_CACHE_BYTES = 1 << 30
DEFAULT_DECODE_GROUP_OVERHEAD_TOKENS = 1024


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str
    """A model name known to the registry, or a path to a Hugging Face folder."""
    dtype: str = "float32"
    kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES
    block_size: int = 16
    max_model_len: int | None = None
    """Context limit (prompt + output); defaults to the model's max_position_embeddings."""
    device: str = "cpu"
    num_threads: int | None = None
    """Threads for torch's CPU kernels (default: torch's, one per core)."""
    seed: int = 0
    served_model_name: str | None = None
    enable_prefix_caching: bool = True
    pack_kv_blocks: bool = True
    """With prefix caching on a CPU: give running requests the lowest block ids nobody uses,
    moving idle cached blocks out of the way (`PrefixCache.claim_lowest`), so that the blocks
    a step reads lie together instead of wherever eviction freed them."""
    eviction_policy: str = "lru"
    """Which idle cached blocks go first when the pool is full: "lru" or "value"."""
    host_cache_bytes: int = 0
    """Size of the second tier that evicted prefix blocks move to (0: none; needs caching on)."""
    host_cache_path: str | None = None
    """Back the second tier by a memory-mapped file at this path (disk) instead of memory."""
    host_cache_load: str = "auto"
    """"auto": load a host hit back when copying is measured to be cheaper than recomputing;
    "always": load every host hit."""
    packed_linear: bool = True
    """Pre-pack linear weights in oneDNN's layout when running on the CPU (`packed_linear`)."""
    linear_kernel: str = "auto"
    """How linear layers multiply on the CPU: "kernel": our GEMM (`csrc/linear_bf16.cpp` for
    bfloat16 weights on AVX512-BF16, `csrc/linear_f32.cpp` for float32 ones on AVX2 or AVX-512;
    fails at start where it cannot run); "onednn": oneDNN, packed as `packed_linear` says;
    "auto": where ours can run, both are timed at start on the model's shapes and the faster is
    kept (`engine/linear_choice.py`; ours won on AMD EPYCs, oneDNN's AMX kernel on an Intel
    Xeon), else oneDNN. With bfloat16 and no tile unit, "auto" also times ours on vdpbf16ps
    against ours on float32 multiply-adds and keeps the faster; "kernel" keeps vdpbf16ps."""
    decode_attention: str = "auto"
    """How decoding requests attend: "kernel": our C++ kernel reads each request's blocks in
    place at its own length (CPU only; `cpu_kernels.py` builds it; fails at start if it cannot);
    "torch": gathered into padded groups in plain torch (any device); "auto": the kernel on the
    CPU where it builds, else torch."""
    prefill_attention: str = "auto"
    """How prefill chunks attend: "kernel": our C++ kernel over the paged cache (bfloat16 on CPUs
    with AVX512-BF16, float32 on CPUs with AVX2 or AVX-512; fails at start where it cannot run);
    "torch": gathered, through matmuls; "auto": the kernel where it can run."""
    fused_layer_ops: bool = True
    """On the CPU, run each layer's element-wise parts (residual add + RMSNorm, rotary
    embedding, SiLU * up) as our fused C++ operators where they build (`cpu_kernels.py`)."""
    stacked_layers: bool = True
    """On the CPU, where the linear layers, the element-wise ops and both attentions all run on
    our kernels, run the decoder layers as one C++ call (`csrc/decoder_stack.cpp`: the same
    operators in the same order, the same results) instead of a Python loop of ~20 operator
    calls per layer."""
    kv_layout: str = "auto"
    """How a KV block holds its 16 tokens: "plain" ([tokens][head_dim], what every attention
    path reads); "auto": where both attention kernels run (bfloat16 on a CPU with AVX512-BF16,
    blocks of 16 tokens, head_dim 32, 64 or 128), the tiled layout of `csrc/kv_layout.h`,
    whose blocks are the operands vdpbf16ps takes (keys by dimension pair, values by token
    pair), else plain."""
    attention_tiles: bool = True
    """Where the KV cache is tiled and the CPU has the AMX tile unit (and Linux grants it), both
    attention kernels run their products on the tile unit (`csrc/paged_attention.cpp`,
    `csrc/prefill_attention.cpp`), whose B operands the tiled blocks and packed tiles already
    are; else on vdpbf16ps."""
    decode_group_overhead_tokens: int = DEFAULT_DECODE_GROUP_OVERHEAD_TOKENS
    """With torch decode attention, decoding requests attend in groups of similar context
    length; a group costs about this many tokens of padded attention in fixed work
    (`engine/decode_groups.py`; on this CPU a group is ~4.5 ms per step and a padded token
    ~4.3 us). Large: one group."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
