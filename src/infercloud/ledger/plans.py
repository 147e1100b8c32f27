"""Pricing plans: what customers would pay for a period under each way of charging, and the
margin each leaves over what the period cost (the ledger).

A plan is data (YAML):

    plans:
      - name: gpu-hour
        per_gpu_hour: {usd: 0.25}              # per replica-hour, any hardware
      - name: tokens
        per_token: {input_per_mtok: 0.05, cached_input_per_mtok: 0.025, output_per_mtok: 0.10}
      - name: tasks
        per_task: {usd_per_success: 0.0005}    # and optionally usd_per_failure

A replica-hour plan may price hardware apart (`by_hardware: {h100-sxm: 3.2}`). Token plans
charge the requests that reached a replica (refused ones are free); task plans charge the tasks
with a reported outcome.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from infercloud.ledger.cost import Ledger
from infercloud.ledger.tasks import TaskSummary


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PerGpuHour(_Strict):
    usd: float = Field(ge=0)
    by_hardware: dict[str, float] = Field(default_factory=dict)
    """USD per replica-hour on this hardware, instead of `usd`."""


class PerToken(_Strict):
    input_per_mtok: float = Field(default=0.0, ge=0)
    cached_input_per_mtok: float = Field(default=0.0, ge=0)
    output_per_mtok: float = Field(default=0.0, ge=0)


class PerTask(_Strict):
    usd_per_success: float = Field(ge=0)
    usd_per_failure: float = Field(default=0.0, ge=0)


class PricingPlan(_Strict):
    name: str = Field(min_length=1)
    per_gpu_hour: PerGpuHour | None = None
    per_token: PerToken | None = None
    per_task: PerTask | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> PricingPlan:
        kinds = [k for k in ("per_gpu_hour", "per_token", "per_task") if getattr(self, k)]
        if len(kinds) != 1:
            raise ValueError(
                f"plan {self.name!r} needs exactly one of per_gpu_hour, per_token, "
                f"per_task (got {kinds or 'none'})"
            )
        return self

    @property
    def kind(self) -> str:
        if self.per_gpu_hour is not None:
            return "per_gpu_hour"
        return "per_token" if self.per_token is not None else "per_task"

    def revenue_usd(self, ledger: Ledger, tasks: list[TaskSummary]) -> float:
        if self.per_gpu_hour is not None:
            p = self.per_gpu_hour
            return sum(
                r.up_s / 3600 * p.by_hardware.get(r.hardware, p.usd) for r in ledger.replicas
            )
        if self.per_token is not None:
            t = self.per_token
            usd = 0.0
            for row in ledger.requests:
                u = row.usage
                if row.usage.replica is None or u.outcome == "refused":
                    continue
                cached = min(u.cached_tokens, u.prompt_tokens)
                usd += (u.prompt_tokens - cached) * t.input_per_mtok
                usd += cached * t.cached_input_per_mtok + u.completion_tokens * t.output_per_mtok
            return usd / 1e6
        assert self.per_task is not None
        k = self.per_task
        return sum(
            k.usd_per_success if t.outcome.success else k.usd_per_failure
            for t in tasks
            if t.outcome is not None
        )


class PlanBook(_Strict):
    plans: list[PricingPlan] = Field(min_length=1)

    @classmethod
    def load(cls, path: Path | None = None) -> PlanBook:
        """The plans in `path`, or the packaged defaults."""
        if path is None:
            text = resources.files("infercloud.ledger").joinpath("data/plans.yaml").read_text()
        else:
            text = path.read_text()
        data: Any = yaml.safe_load(text)
        return cls.model_validate(data or {})


def price_plans(book: PlanBook, ledger: Ledger, tasks: list[TaskSummary]) -> list[dict[str, Any]]:
    """Each plan's revenue for the ledger's period and its margin over the period's cost."""
    cost = ledger.fleet_cost_usd
    out = []
    for plan in book.plans:
        revenue = plan.revenue_usd(ledger, tasks)
        out.append(
            {
                "name": plan.name,
                "kind": plan.kind,
                "revenue_usd": revenue,
                "cost_usd": cost,
                "margin_usd": revenue - cost,
                "margin_pct": (revenue - cost) / revenue * 100 if revenue > 0 else None,
            }
        )
    return out
