"""A Llama-family decoder in torch whose attention reads and writes the paged KV cache.

RMSNorm, rotary position embeddings (the "rotate half" layout of Hugging Face checkpoints),
grouped-query attention and a SwiGLU MLP. Q, K and V projections are fused into one matmul, and
so are the MLP's gate and up projections; `load_weights` does the fusing from a checkpoint's
separate tensors.

The forward pass takes a flat batch of tokens from many requests (no padding) with their
positions; only the rows named by `logits_rows` go through the vocabulary projection.

With `use_fused_ops()` (CPU, once `cpu_kernels.load_kernels()` succeeded) the element-wise
parts run as our fused operators: the residual add with the next RMSNorm, rotary embedding in
place, SiLU(gate) * up; each rounds as the plain-torch code below does. With `use_stack()` as
well (every linear layer a `KernelLinear`), a step whose attention all goes through our kernels
runs the whole layer loop as one C++ call (`csrc/decoder_stack.cpp`), the same operators in the
same order.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from infercloud.engine.attention import AttentionMetadata, paged_attention
from infercloud.engine.model_config import ModelConfig
from infercloud.engine.packed_linear import KernelGateUpSilu, KernelLinear


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In float32 as the reference implementation does, then back to the model dtype.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.theta = theta
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", torch.empty(max_positions, head_dim // 2), persistent=False)
        self.register_buffer("sin", torch.empty(max_positions, head_dim // 2), persistent=False)
        self.reset_tables()

    def reset_tables(self) -> None:
        """(Re)compute the float32 cos/sin tables on the buffers' device."""
        device = self.cos.device
        if device.type == "meta":
            return
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device)
        inv_freq = 1.0 / (self.theta ** (exponents / self.head_dim))
        steps = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        angles = torch.outer(steps, inv_freq)
        self.cos = angles.cos()
        self.sin = angles.sin()

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x32 = x.float()
    half = x.shape[-1] // 2
    x1, x2 = x32[..., :half], x32[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim**-0.5
        self.fused = False
        """Rotary embedding through `torch.ops.infercloud.rotary_embedding_` (in place)."""
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        num_tokens = x.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.fused:
            torch.ops.infercloud.rotary_embedding_(q, k, positions, rotary.cos, rotary.sin)
        else:
            q, k = rotary(positions, q, k)
        out = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)
        return self.o_proj(out)  # type: ignore[no-any-return]


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.fused = False
        """SiLU(gate) * up through `torch.ops.infercloud.silu_and_mul`."""
        self.gate_up_proj: nn.Module = nn.Linear(
            config.hidden_size, 2 * config.intermediate_size, bias=False
        )
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def fuse_gate_up_silu(self) -> bool:
        """Where the gate and up projections are a bfloat16 `KernelLinear`, replace them by one
        `KernelGateUpSilu` (SiLU in the GEMM's epilogue, the same bits); False elsewhere."""
        proj = self.gate_up_proj
        if not KernelGateUpSilu.fits(proj):
            return False
        self.gate_up_proj = KernelGateUpSilu(proj)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.gate_up_proj, KernelGateUpSilu):
            return self.down_proj(self.gate_up_proj(x))  # type: ignore[no-any-return]
        if self.fused:
            activated = torch.ops.infercloud.silu_and_mul(self.gate_up_proj(x))
            return self.down_proj(activated)  # type: ignore[no-any-return]
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)  # type: ignore[no-any-return]


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta
        )
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        """With tied embeddings its weight is the embedding table's (`_assign` ties them)."""
        self.fused = False
        self.stack: Any = None
        """The layers as one C++ object (`use_stack`), over `stack_caches`."""
        self.stack_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._no_rows = torch.empty(0, dtype=torch.int32)

    def projection_weights(self, num_layers: int) -> list[torch.Tensor]:
        """The plain weights of the first `num_layers` layers' projections (qkv, o, gate_up,
        down of each), in the order a step runs them."""
        weights = []
        for layer in list(self.layers)[:num_layers]:
            assert isinstance(layer, DecoderLayer)
            attn, mlp = layer.self_attn, layer.mlp
            for projection in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                assert isinstance(projection, nn.Linear), "weights already packed"
                weights.append(projection.weight.detach())
        return weights

    def use_stack(
        self,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        tiled_kv: bool = False,
        attention_tiles: bool = False,
    ) -> None:
        """Run the decoder layers as one `torch.classes.infercloud.DecoderStack` call in steps
        over `kv_caches` whose attention all goes through our kernels (the caller has called
        `use_fused_ops()` after packing every projection as a `KernelLinear`, which fuses gate,
        up and SiLU into a `KernelGateUpSilu`); `tiled_kv`: the caches are in the tiled layout
        of `csrc/kv_layout.h`; `attention_tiles`: both attention kernels on the AMX tile unit
        (with `tiled_kv`)."""
        if not self.fused:
            raise ValueError("use_stack needs use_fused_ops first")
        layers = [layer for layer in self.layers if isinstance(layer, DecoderLayer)]
        kernels: list[list[KernelLinear | KernelGateUpSilu]] = []
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv, o, gate_up, down = attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj
            if not (
                isinstance(qkv, KernelLinear)
                and isinstance(o, KernelLinear)
                and isinstance(gate_up, KernelGateUpSilu)
                and isinstance(down, KernelLinear)
            ):
                raise ValueError(
                    "use_stack needs every projection to be a KernelLinear, gate and up fused "
                    "with SiLU (KernelGateUpSilu)"
                )
            kernels.append([qkv, o, gate_up, down])
        tiles = {k.use_tiles for row in kernels for k in row}
        if len(tiles) != 1:
            raise ValueError("use_stack needs the same use_tiles in every projection")
        c = self.config
        stack = torch.classes.infercloud.DecoderStack(
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
            c.hidden_size,
            c.intermediate_size,
            c.rms_norm_eps,
            c.head_dim**-0.5,
            tiles.pop(),
            tiled_kv,
            attention_tiles,
        )
        for layer, row, (k_cache, v_cache) in zip(layers, kernels, kv_caches, strict=True):
            packed = [k.packed_weight for k in row]
            stack.add_layer(
                layer.input_layernorm.weight.detach(),
                packed[0],
                packed[1],
                layer.post_attention_layernorm.weight.detach(),
                packed[2],
                packed[3],
                k_cache,
                v_cache,
            )
        self.stack, self.stack_caches = stack, kv_caches

    def gate_up_silu_fused(self) -> bool:
        """Whether every MLP runs gate, up and SiLU as one `KernelGateUpSilu` (which the
        decoder stack needs)."""
        return all(
            isinstance(layer, DecoderLayer) and isinstance(layer.mlp.gate_up_proj, KernelGateUpSilu)
            for layer in self.layers
        )

    def use_fused_ops(self) -> None:
        """Run the element-wise parts through `torch.ops.infercloud.*` (loaded by the caller);
        where the projections are already bfloat16 `KernelLinear`s, SiLU goes into the gate and
        up projections' GEMM (`MLP.fuse_gate_up_silu`)."""
        self.fused = True
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            layer.self_attn.fused = True
            layer.mlp.fused = True
            layer.mlp.fuse_gate_up_silu()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        logits_rows: torch.Tensor,
    ) -> torch.Tensor:
        """Returns logits `[len(logits_rows), vocab_size]` in the model's dtype (the sampler
        widens them to float32 where it needs more than an argmax)."""
        hidden = self.embed_tokens(input_ids)
        if self.fused:
            if not self._layers_stacked(hidden, positions, kv_caches, meta):
                hidden = self._layers_fused(hidden, positions, kv_caches, meta)
            last = self.norm(hidden.index_select(0, logits_rows))
            return self.lm_head(last)  # type: ignore[no-any-return]
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            assert isinstance(layer, DecoderLayer)
            attn_out = layer.self_attn(
                layer.input_layernorm(hidden), positions, self.rotary, k_cache, v_cache, meta
            )
            hidden = hidden + attn_out
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        last = self.norm(hidden.index_select(0, logits_rows))
        return self.lm_head(last)  # type: ignore[no-any-return]

    def _layers_stacked(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> bool:
        """Run the layers through the C++ stack (updating `hidden` in place) if this step can:
        decodes in rows 0.., prefill chunks after them, all through our kernels."""
        if self.stack is None or kv_caches is not self.stack_caches:
            return False
        if meta.decodes or meta.prefills:
            return False
        decode, prefill = meta.paged_decode, meta.paged_prefill
        num_decode = decode.num_seqs if decode is not None else 0
        num_prefill = prefill.num_rows if prefill is not None else 0
        if prefill is not None and prefill.row_start != num_decode:
            return False
        if num_decode + num_prefill != hidden.shape[0]:
            return False
        none = self._no_rows
        self.stack.forward(
            hidden,
            positions,
            self.rotary.cos,
            self.rotary.sin,
            meta.write_rows,
            num_decode,
            decode.block_tables if decode is not None else none,
            decode.context_lens if decode is not None else none,
            prefill.block_tables if prefill is not None else none,
            prefill.starts if prefill is not None else none,
            prefill.lens if prefill is not None else none,
        )
        return True

    def _layers_fused(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The decoder layers with each residual add fused into the RMSNorm after it: the
        same sums (`hidden` is updated in place, rounded as `hidden + delta` would be)."""
        ops = torch.ops.infercloud
        delta: torch.Tensor | None = None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            assert isinstance(layer, DecoderLayer)
            norm = layer.input_layernorm
            if delta is None:
                x = ops.rms_norm(hidden, norm.weight, norm.eps)
            else:
                x = ops.add_rms_norm(hidden, delta, norm.weight, norm.eps)
            delta = layer.self_attn(x, positions, self.rotary, k_cache, v_cache, meta)
            norm = layer.post_attention_layernorm
            x = ops.add_rms_norm(hidden, delta, norm.weight, norm.eps)
            delta = layer.mlp(x)
        if delta is not None:
            hidden.add_(delta)
        return hidden

    def load_weights(self, folder: Path) -> None:
        """Load Hugging Face safetensors (one file or an index of shards), fusing projections."""
        from safetensors.torch import load_file

        index = folder / "model.safetensors.index.json"
        if index.is_file():
            shard_names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            files = [folder / name for name in shard_names]
        else:
            files = [folder / "model.safetensors"]
        if not all(f.is_file() for f in files):
            raise FileNotFoundError(f"no safetensors weights in {folder}")
        tensors: dict[str, torch.Tensor] = {}
        for f in files:
            tensors.update(load_file(str(f)))
        self._assign(tensors)

    @torch.no_grad()
    def _assign(self, tensors: dict[str, torch.Tensor]) -> None:
        def take(name: str) -> torch.Tensor:
            if name not in tensors:
                raise KeyError(f"checkpoint lacks tensor {name}")
            return tensors[name]

        self.embed_tokens.weight.copy_(take("model.embed_tokens.weight"))
        self.norm.weight.copy_(take("model.norm.weight"))
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        else:
            self.lm_head.weight.copy_(take("lm_head.weight"))
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, DecoderLayer)
            p = f"model.layers.{i}."
            layer.input_layernorm.weight.copy_(take(p + "input_layernorm.weight"))
            layer.post_attention_layernorm.weight.copy_(take(p + "post_attention_layernorm.weight"))
            attn = p + "self_attn."
            qkv = [take(attn + f"{n}_proj.weight") for n in ("q", "k", "v")]
            layer.self_attn.qkv_proj.weight.copy_(torch.cat(qkv, dim=0))
            layer.self_attn.o_proj.weight.copy_(take(attn + "o_proj.weight"))
            mlp = p + "mlp."
            gate_up = [take(mlp + "gate_proj.weight"), take(mlp + "up_proj.weight")]
            gate_up_proj = layer.mlp.gate_up_proj
            assert isinstance(gate_up_proj, nn.Linear), "weights load before packing"
            gate_up_proj.weight.copy_(torch.cat(gate_up, dim=0))
            layer.mlp.down_proj.weight.copy_(take(mlp + "down_proj.weight"))
