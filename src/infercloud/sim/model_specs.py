"""The model catalog: a Llama-family decoder's shapes, and the work they imply per token.

From the shapes alone: parameter counts (embedding, the per-layer matrices, the LM head), the
matrix-multiply FLOPs of one token (2 per weight it meets), the attention FLOPs per (query, key)
pair, and the KV bytes one token leaves in the cache. Entries come from `sim/data/models.yaml`;
`ModelSpec.from_config` turns the builtin engine's `ModelConfig` into the same thing.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING

import yaml

if TYPE_CHECKING:
    from infercloud.engine.model_config import ModelConfig


@dataclass(frozen=True, slots=True)
class ModelSpec:
    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    max_model_len: int
    source: str = ""

    @property
    def layer_params(self) -> int:
        """Weights one token meets in one layer: q, k, v, o projections and the SwiGLU MLP."""
        h, d = self.hidden_size, self.head_dim
        attention = h * d * (2 * self.num_heads + 2 * self.num_kv_heads)
        return attention + 3 * h * self.intermediate_size + 2 * h

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        head = 0 if self.tie_word_embeddings else self.embedding_params
        return self.embedding_params + self.num_layers * self.layer_params + self.hidden_size + head

    @property
    def weights_read_per_step(self) -> int:
        """Parameters read from memory by one step: all layers and the LM head (the embedding
        table is only indexed)."""
        return self.num_layers * self.layer_params + self.embedding_params

    def linear_flops_per_token(self) -> float:
        return 2.0 * self.num_layers * self.layer_params

    def lm_head_flops_per_row(self) -> float:
        return 2.0 * self.hidden_size * self.vocab_size

    def attention_flops_per_pair(self) -> float:
        """q.k and the weighted sum of v, per layer and head: 2 x 2 x head_dim each."""
        return 4.0 * self.num_layers * self.num_heads * self.head_dim

    def depth_cost_per_block(self, block_size: int) -> float:
        """How much more it costs to recompute a KV block for each block of context before it,
        as a share of the block's own linear layers: a block at depth d (in blocks, 1 = first)
        costs about 1 + d x this (its tokens attend to about d x `block_size` keys each).
        SmolLM2-135M with blocks of 16 tokens: 0.0052; Llama-3-70B with blocks of 512: 0.0097."""
        return block_size * self.attention_flops_per_pair() / self.linear_flops_per_token()

    def kv_elements_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @classmethod
    def from_config(cls, name: str, config: ModelConfig, max_model_len: int) -> ModelSpec:
        return cls(
            name=name,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_layers,
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            vocab_size=config.vocab_size,
            tie_word_embeddings=config.tie_word_embeddings,
            max_model_len=max_model_len,
            source="the model folder's config.json",
        )


def load_model_catalog() -> dict[str, ModelSpec]:
    text = resources.files("infercloud.sim").joinpath("data/models.yaml").read_text()
    raw = yaml.safe_load(text)["models"]
    return {name: ModelSpec(name=name, **fields) for name, fields in raw.items()}


def model_spec(name: str) -> ModelSpec:
    catalog = load_model_catalog()
    key = name.lower()
    if key not in catalog:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(sorted(catalog))}")
    return catalog[key]
