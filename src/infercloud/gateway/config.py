"""The deployment config (YAML): which models are served by which replicas, at what price, and
the gateway's own settings (queueing, tenants' limits and weights).

    models:
      - name: smollm2-135m-instruct
        price: {input_per_mtok: 0.05, cached_input_per_mtok: 0.025, output_per_mtok: 0.10}
        replicas:
          - builtin: {model: smollm2-135m-instruct, dtype: bfloat16, kv_cache_bytes: 1GiB}
          - upstream: {url: "http://127.0.0.1:9000", model: served-name}
        max_inflight_per_replica: 32
    tenants:
      acme: {weight: 2, rpm: 600, tpm: 200000, max_concurrent: 64, budget_usd: 100,
             cache_group: acme}
      acme-eu: {cache_group: acme}   # shares acme's prefix cache, and only acme's
    gateway: {max_queued: 512, queue_timeout_s: 30, budget_period: month}

A builtin replica is our own engine, started by the gateway as a subprocess; an upstream is any
OpenAI-compatible server (vLLM, SGLang, trtllm-serve, llama.cpp) reached by URL.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from infercloud.models.registry import DEFAULT_MODEL_NAME


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Price(_Strict):
    """USD per million tokens."""

    input_per_mtok: float = Field(default=0.0, ge=0)
    cached_input_per_mtok: float = Field(default=0.0, ge=0)
    output_per_mtok: float = Field(default=0.0, ge=0)

    def cost_usd(self, prompt: int, cached: int, completion: int) -> float:
        return (
            (prompt - cached) * self.input_per_mtok
            + cached * self.cached_input_per_mtok
            + completion * self.output_per_mtok
        ) / 1e6


class BuiltinReplica(_Strict):
    model: str = DEFAULT_MODEL_NAME
    dtype: str = "auto"
    """"auto": bfloat16 where the hardware runs it natively, else float32."""
    kv_cache_bytes: str | int = "1GiB"
    threads: int | None = Field(default=None, ge=1)
    """torch CPU threads of the replica (default: one per core)."""
    args: list[str] = Field(default_factory=list)
    """Extra `infercloud engine` flags."""


class UpstreamReplica(_Strict):
    url: str
    model: str | None = None
    """The model name the upstream serves (defaults to the deployment's name)."""
    api_key: str | None = None
    priority: bool = False
    """The upstream schedules by a request's `priority` field (vLLM started with
    `--scheduling-policy priority`, or our own engine): send each request's class there."""


MEMORY_USD_PER_GIB_HOUR = 0.004237
"""GCP Compute Engine N2 memory, on demand, us-central1 (cloud.google.com/compute/
vm-instance-pricing; n2-standard-2 at $0.0971/h = 2 vCPU x $0.031611 + 8 GiB x $0.004237)."""

LOCAL_CPU_USD_PER_HOUR = 2 * 0.031611 + 24 * MEMORY_USD_PER_GIB_HOUR
"""This machine (2 cores, 24 GiB) at the same N2 rates: $0.1649 per hour."""


class Hardware(_Strict):
    """What a replica runs on, for the ledger and the simulator: a label and its price."""

    name: str = "local-cpu"
    price_per_hour: float = Field(default=0.0, ge=0)
    memory_usd_per_gib_hour: float = Field(default=MEMORY_USD_PER_GIB_HOUR, ge=0)
    """What a GiB of the KV cache's memory costs: the ledger charges the KV pool's share of
    `price_per_hour` (at most all of it) as cache occupancy, by bytes held x seconds."""


class ReplicaSpec(_Strict):
    builtin: BuiltinReplica | None = None
    upstream: UpstreamReplica | None = None
    hardware: Hardware = Field(default_factory=Hardware)

    @model_validator(mode="after")
    def _one_kind(self) -> ReplicaSpec:
        if (self.builtin is None) == (self.upstream is None):
            raise ValueError("a replica is either builtin or upstream")
        return self


class Routing(_Strict):
    """How the gateway picks a replica (`router.policies`) and watches replicas' health."""

    policy: Literal[
        "round_robin", "least_outstanding", "power_of_two", "session_affinity", "kv_aware"
    ] = "kv_aware"
    prefill_weight: float = Field(default=1.0, ge=0)
    """kv_aware's w: the cost of one uncached prompt token against the load terms."""
    decode_weight: float = Field(default=16.0, ge=0)
    """kv_aware's d: a running decode, in prompt tokens of prefill."""
    balance_abs: int = Field(default=8, ge=0)
    balance_rel: float = Field(default=1.5, ge=1)
    session_header: str = "x-session-id"
    """Affinity key when the body has no `user`."""
    kv_events_interval_s: float = Field(default=0.2, gt=0)
    learned_ttl_s: float = Field(default=120.0, gt=0)
    """Upstreams without KV events: how long a routed prompt counts as cached there."""
    health_interval_s: float = Field(default=1.0, gt=0)
    health_timeout_s: float = Field(default=1.0, gt=0)
    unhealthy_after: int = Field(default=2, ge=1)
    """Consecutive failed health checks that eject a replica."""
    max_attempts: int = Field(default=3, ge=1)
    """Replicas tried for one request that has produced no token yet."""


class SLO(_Strict):
    ttft_ms: float | None = Field(default=None, gt=0)
    tpot_ms: float | None = Field(default=None, gt=0)


class ModelDeployment(_Strict):
    name: str
    replicas: list[ReplicaSpec] = Field(min_length=1)
    price: Price = Field(default_factory=Price)
    routing: Routing = Field(default_factory=Routing)
    slo: SLO = Field(default_factory=SLO)
    max_inflight_per_replica: int = Field(default=32, ge=1)
    tokenizer: str | None = None
    """A Hugging Face folder whose tokenizer counts prompt tokens for limits (builtin replicas
    use their model's); without one, prompts are estimated at 4 bytes per token until the
    replica reports the real count."""


class TenantLimits(_Strict):
    weight: float = Field(default=1.0, gt=0)
    rpm: int | None = Field(default=None, ge=1)
    tpm: int | None = Field(default=None, ge=1)
    max_concurrent: int | None = Field(default=None, ge=1)
    budget_usd: float | None = Field(default=None, ge=0)
    cache_group: str | None = Field(
        default=None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.@-]+$"
    )
    """A prefix-cache group named by the operator: tenants in one group share cached prompt
    blocks (and can so time each other's prompts); a tenant in none shares with no one."""


class GatewaySettings(_Strict):
    max_queued: int = Field(default=512, ge=0)
    queue_timeout_s: float = Field(default=30.0, gt=0)
    budget_period: Literal["day", "month"] = "month"
    max_body_bytes: int = Field(default=4 << 20, ge=1024)
    launcher: Literal["local", "ray"] = "local"
    """How builtin replicas run: local subprocesses, or Ray actors (`launch/`)."""
    ray_address: str | None = None
    """A Ray cluster to join (`ray://...` or `host:port`); none: start a local one."""


class DeploymentConfig(_Strict):
    models: list[ModelDeployment] = Field(min_length=1)
    tenants: dict[str, TenantLimits] = Field(default_factory=dict)
    gateway: GatewaySettings = Field(default_factory=GatewaySettings)

    @model_validator(mode="after")
    def _unique_names(self) -> DeploymentConfig:
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"model names must be unique, got {names}")
        return self

    def model(self, name: str) -> ModelDeployment | None:
        return next((m for m in self.models if m.name == name), None)

    def cache_namespace(self, tenant: str) -> str:
        """The prefix-cache salt of a tenant's requests: `group:NAME` for a tenant the operator
        put in a cache group, else the tenant's own name. Tenant names (`KeyCreate`) have no
        `:`, so a tenant's namespace never equals a group's."""
        limits = self.tenants.get(tenant)
        if limits is not None and limits.cache_group is not None:
            return f"group:{limits.cache_group}"
        return tenant

    @classmethod
    def load(cls, path: Path) -> DeploymentConfig:
        data: Any = yaml.safe_load(path.read_text())
        return cls.model_validate(data or {})

    @classmethod
    def default(cls) -> DeploymentConfig:
        """The embedded model on one builtin replica."""
        return cls(
            models=[
                ModelDeployment(
                    name=DEFAULT_MODEL_NAME,
                    replicas=[
                        ReplicaSpec(
                            builtin=BuiltinReplica(),
                            hardware=Hardware(price_per_hour=LOCAL_CPU_USD_PER_HOUR),
                        )
                    ],
                    price=Price(
                        input_per_mtok=0.05, cached_input_per_mtok=0.025, output_per_mtok=0.10
                    ),
                )
            ]
        )
