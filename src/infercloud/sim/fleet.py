"""The fleet config (YAML) of a simulation: one model, pools of replicas per accelerator, and
the same scheduler, cache, routing, SLO and admission settings as the real platform.

    model: llama-3-8b              # a name in the model catalog (sim/data/models.yaml)
    dtype: bfloat16
    pools:
      - hardware: h100-sxm         # a name in the hardware catalog (or local-cpu, calibrated)
        provider: lambda           # whose price to use (default: the first listed)
        replicas: 4
        tensor_parallel: 1
        gpu_memory_utilization: 0.9   # KV pool = this x memory - weights (or kv_cache_bytes)
        host_cache_bytes: 0           # a second KV tier in host memory per replica
    scheduler: {max_num_batched_tokens: 8192, max_num_seqs: 256}
    prefix_caching: true
    eviction: lru                  # lru | value
    routing: {policy: kv_aware}    # the gateway's routing section
    slo: {ttft_ms: 2000, tpot_ms: 100}
    admission: {max_inflight_per_replica: 256, max_queued: 4096, queue_timeout_s: 30}
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field

from infercloud.engine.request_queue import SchedulingPolicy
from infercloud.gateway.config import SLO, Routing
from infercloud.units import parse_bytes

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Pool(_Strict):
    hardware: str
    provider: str | None = None
    replicas: int = Field(default=1, ge=1)
    tensor_parallel: int = Field(default=1, ge=1)
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)
    kv_cache_bytes: str | int | None = None
    """Overrides gpu_memory_utilization: the KV pool of one replica."""
    host_cache_bytes: str | int = 0

    def kv_bytes(self, memory_gb: float, weight_bytes: int) -> int:
        if self.kv_cache_bytes is not None:
            return parse_bytes(self.kv_cache_bytes)
        total = self.tensor_parallel * memory_gb * 1e9 * self.gpu_memory_utilization
        return int(total - weight_bytes)


class SchedulerSettings(_Strict):
    max_num_batched_tokens: int = Field(default=8192, ge=1)
    max_num_seqs: int = Field(default=256, ge=1)
    long_prefill_token_threshold: int | None = Field(default=None, ge=1)
    """Default: max_num_batched_tokens (no extra cap per request)."""
    policy: SchedulingPolicy = "fcfs"


class Admission(_Strict):
    max_inflight_per_replica: int = Field(default=256, ge=1)
    max_queued: int = Field(default=4096, ge=0)
    queue_timeout_s: float = Field(default=30.0, gt=0)


class Fleet(_Strict):
    model: str
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    block_size: int = Field(default=16, ge=1)
    max_model_len: int | None = Field(default=None, ge=1)
    pools: list[Pool] = Field(min_length=1)
    scheduler: SchedulerSettings = Field(default_factory=SchedulerSettings)
    prefix_caching: bool = True
    eviction: Literal["lru", "value"] = "lru"
    routing: Routing = Field(default_factory=Routing)
    slo: SLO = Field(default_factory=SLO)
    admission: Admission | None = None
    seed: int = 0

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @classmethod
    def load(cls, path: Path) -> Fleet:
        return cls.model_validate(yaml.safe_load(path.read_text()) or {})
