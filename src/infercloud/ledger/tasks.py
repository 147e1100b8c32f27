"""Tasks: the requests, tool calls, retries and verification of one job, and what it cost.

A client tags its requests with a task id and reports the outcome (`TaskOutcome`); the platform
adds the failures it saw itself on those requests (`observed_failure`). A task's cost is the
ledger cost of its requests; the figure that matters is cost per successful task: the cost of all
tasks (succeeded, failed or never reported) over the number that succeeded.

Invariants:
- one outcome per (tenant, task id): a later report replaces an earlier one;
- a task's cost is exactly the sum of its requests' ledger rows, so tasks never count a dollar
  twice and the tasks' cost plus untasked requests' cost is the ledger total.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from infercloud.ledger.cost import TERMS, RequestCost

LAYERS = ("model", "context", "runtime", "hardware", "routing", "verifier")
"""Where a failure is attributed (DESIGN: the feedback layer)."""


@dataclass(frozen=True, slots=True)
class TaskOutcome:
    tenant: str
    task_id: str
    success: bool
    verifier: str | None = None
    tool_calls: int = 0
    retries: int = 0
    """Retries the client made (the platform's own retries are counted from its records)."""
    blamed_layer: str | None = None
    config: str | None = None
    detail: str | None = None
    reported_at_s: float = 0.0


def observed_failure(row: RequestCost) -> str | None:
    """The layer of a failure the platform saw on this request itself, if any: a replica that
    failed it (runtime, even when a retry recovered), no replica to send it to (routing), or a
    prompt too long for the model (context)."""
    u = row.usage
    if u.status == 400 and "context length" in (u.error or ""):
        return "context"
    if u.failed_attempts or (u.outcome == "failed" and (u.status >= 500 or u.status == 200)):
        return "runtime"  # (200: a stream that broke after its first token)
    if u.outcome == "refused" and u.status == 503:
        return "routing"
    return None


@dataclass(slots=True)
class TaskSummary:
    tenant: str
    task_id: str
    outcome: TaskOutcome | None
    rows: list[RequestCost] = field(default_factory=list)

    @property
    def config(self) -> str:
        if self.outcome is not None and self.outcome.config:
            return self.outcome.config
        configs = Counter(r.usage.config for r in self.rows if r.usage.config)
        return configs.most_common(1)[0][0] if configs else "default"

    @property
    def model(self) -> str:
        return next((r.usage.model for r in self.rows if r.usage.model), "")

    @property
    def cost_usd(self) -> float:
        return sum(r.total_usd for r in self.rows)

    @property
    def tokens(self) -> int:
        return sum(r.usage.prompt_tokens + r.usage.completion_tokens for r in self.rows)

    @property
    def latency_s(self) -> float:
        """From its first request's arrival to its last request's end."""
        if not self.rows:
            return 0.0
        start = min(r.usage.created_at_s for r in self.rows)
        return max(r.usage.created_at_s + r.usage.e2e_s for r in self.rows) - start

    @property
    def retries(self) -> int:
        platform = sum(max(0, r.usage.attempts - 1) for r in self.rows)
        return platform + (self.outcome.retries if self.outcome else 0)

    @property
    def tool_calls(self) -> int:
        return self.outcome.tool_calls if self.outcome else 0

    @property
    def failures(self) -> list[str]:
        """Layers blamed: the client's, then each one the platform saw (once per request)."""
        out = []
        if self.outcome is not None and not self.outcome.success and self.outcome.blamed_layer:
            out.append(self.outcome.blamed_layer)
        out.extend(layer for r in self.rows if (layer := observed_failure(r)) is not None)
        return out

    def terms(self) -> dict[str, float]:
        return {t: sum(getattr(r, t) for r in self.rows) for t in TERMS}


def summarize_tasks(
    rows: Iterable[RequestCost], outcomes: Mapping[tuple[str, str], TaskOutcome]
) -> list[TaskSummary]:
    """One summary per task that has a request among `rows` (tasks whose requests all fall
    outside the period are not in it, even if their outcome is)."""
    tasks: dict[tuple[str, str], TaskSummary] = {}
    for row in rows:
        task_id = row.usage.task_id
        if task_id is None:
            continue
        key = (row.usage.tenant, task_id)
        if key not in tasks:
            tasks[key] = TaskSummary(key[0], key[1], outcomes.get(key))
        tasks[key].rows.append(row)
    return list(tasks.values())


def task_figures(tasks: list[TaskSummary]) -> dict[str, object]:
    """Cost per successful task and its companions for a group of tasks."""
    n = len(tasks)
    succeeded = sum(1 for t in tasks if t.outcome is not None and t.outcome.success)
    reported = sum(1 for t in tasks if t.outcome is not None)
    cost = sum(t.cost_usd for t in tasks)
    tokens = sum(t.tokens for t in tasks)
    latencies = np.array([t.latency_s for t in tasks]) if tasks else np.zeros(0)
    layers: dict[str, int] = defaultdict(int)
    for t in tasks:
        for layer in t.failures:
            layers[layer] += 1
    return {
        "tasks": n,
        "succeeded": succeeded,
        "failed": reported - succeeded,
        "unreported": n - reported,
        "success_rate": succeeded / n if n else None,
        "cost_usd": cost,
        "cost_per_successful_task_usd": cost / succeeded if succeeded else None,
        "tokens_per_task": tokens / n if n else None,
        "cost_per_token_usd": cost / tokens if tokens else None,
        "latency_s": {
            "mean": float(latencies.mean()) if n else None,
            "p50": float(np.percentile(latencies, 50)) if n else None,
            "p99": float(np.percentile(latencies, 99)) if n else None,
        },
        "retries_per_task": sum(t.retries for t in tasks) / n if n else None,
        "tool_calls_per_task": sum(t.tool_calls for t in tasks) / n if n else None,
        "failures_by_layer": dict(sorted(layers.items())),
    }
