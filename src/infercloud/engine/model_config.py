"""The architecture of a Llama-family checkpoint, read from its Hugging Face `config.json`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = frozenset({"LlamaForCausalLM", "MistralForCausalLM"})


class UnsupportedModelError(ValueError):
    """The folder holds a model this engine cannot run."""


@dataclass(frozen=True, slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of keys plus values for one token in all layers, per element byte."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @classmethod
    def from_folder(cls, folder: Path) -> ModelConfig:
        path = folder / "config.json"
        if not path.is_file():
            raise UnsupportedModelError(f"{folder} has no config.json")
        raw: dict[str, Any] = json.loads(path.read_text())
        generation_path = folder / "generation_config.json"
        generation: dict[str, Any] = (
            json.loads(generation_path.read_text()) if generation_path.is_file() else {}
        )
        return cls.from_dict(raw, generation)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], generation: dict[str, Any]) -> ModelConfig:
        architectures = raw.get("architectures") or []
        if not SUPPORTED_ARCHITECTURES.intersection(architectures):
            raise UnsupportedModelError(
                f"architectures {architectures} not supported; expected one of "
                f"{sorted(SUPPORTED_ARCHITECTURES)}"
            )
        if raw.get("sliding_window"):
            raise UnsupportedModelError("sliding-window attention is not supported")
        if raw.get("attention_bias") or raw.get("mlp_bias"):
            raise UnsupportedModelError("attention or MLP biases are not supported")
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise UnsupportedModelError(f"rope scaling {rope_type!r} is not supported")
        rope_theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
        num_heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        head_dim = int(raw.get("head_dim") or hidden // num_heads)
        eos = generation.get("eos_token_id", raw.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            eos_token_ids=eos_ids,
            bos_token_id=raw.get("bos_token_id"),
        )
