"""The cost report of a period: the fleet's cost, the five terms, cost per million tokens and per
successful task, grouped by tenant, model or configuration, and each pricing plan's margin.

The same JSON comes out of `infercloud report --json` and the gateway's `GET /admin/report`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from infercloud.ledger.cost import TERMS, Ledger, RequestCost
from infercloud.ledger.plans import PlanBook, price_plans
from infercloud.ledger.tasks import TaskOutcome, TaskSummary, summarize_tasks, task_figures

GROUPINGS = ("tenant", "model", "config")


def _row_key(row: RequestCost, by: str, task_config: Mapping[tuple[str, str], str]) -> str:
    u = row.usage
    if by == "tenant":
        return u.tenant or "(none)"
    if by == "model":
        return u.model or "(none)"
    if u.task_id is not None:
        return task_config.get((u.tenant, u.task_id), "default")
    return u.config or "default"


def _task_key(task: TaskSummary, by: str) -> str:
    if by == "tenant":
        return task.tenant
    if by == "model":
        return task.model or "(none)"
    return task.config


def _request_figures(rows: list[RequestCost]) -> dict[str, Any]:
    terms = {t: sum(getattr(r, t) for r in rows) for t in TERMS}
    cost = sum(terms.values())
    prompt = sum(r.usage.prompt_tokens for r in rows)
    cached = sum(r.usage.cached_tokens for r in rows)
    completion = sum(r.usage.completion_tokens for r in rows)
    tokens = prompt + completion
    return {
        "requests": len(rows),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "completion_tokens": completion,
        "cost_usd": cost,
        "terms_usd": terms,
        "cost_per_mtok_usd": cost / tokens * 1e6 if tokens else None,
    }


def build_report(
    ledger: Ledger,
    outcomes: Mapping[tuple[str, str], TaskOutcome],
    by: str = "tenant",
    plans: PlanBook | None = None,
) -> dict[str, Any]:
    if by not in GROUPINGS:
        raise ValueError(f"by must be one of {', '.join(GROUPINGS)}, got {by!r}")
    tasks = summarize_tasks(ledger.requests, outcomes)
    task_config = {(t.tenant, t.task_id): t.config for t in tasks}
    rows_by: dict[str, list[RequestCost]] = defaultdict(list)
    for row in ledger.requests:
        rows_by[_row_key(row, by, task_config)].append(row)
    tasks_by: dict[str, list[TaskSummary]] = defaultdict(list)
    for task in tasks:
        tasks_by[_task_key(task, by)].append(task)
    groups = []
    for key in sorted(set(rows_by) | set(tasks_by)):
        groups.append(
            {
                by: key,
                **_request_figures(rows_by.get(key, [])),
                "tasks": task_figures(tasks_by.get(key, [])),
            }
        )
    total_terms = ledger.terms()
    summed = sum(total_terms.values()) + ledger.unallocated_usd
    return {
        "period": {"since_s": ledger.since_s, "until_s": ledger.until_s},
        "by": by,
        "fleet": {
            "cost_usd": ledger.fleet_cost_usd,
            "unallocated_usd": ledger.unallocated_usd,
            "replica_hours": sum(r.up_s for r in ledger.replicas) / 3600,
            "replicas": [
                {
                    "replica": r.replica,
                    "model": r.model,
                    "hardware": r.hardware,
                    "up_s": r.up_s,
                    "cost_usd": r.cost_usd,
                    "metered_busy_s": r.metered_busy_s,
                    "idle_usd": r.idle_usd,
                    "failure_usd": r.failure_usd,
                    "requests": r.num_requests,
                }
                for r in ledger.replicas
            ],
        },
        "total": {**_request_figures(ledger.requests), "tasks": task_figures(tasks)},
        "groups": groups,
        "plans": price_plans(plans, ledger, tasks) if plans is not None else [],
        "reconciliation": {
            "sum_of_terms_usd": summed,
            "fleet_cost_usd": ledger.fleet_cost_usd,
            "difference_usd": summed - ledger.fleet_cost_usd,
        },
    }


def request_rows(ledger: Ledger) -> list[dict[str, Any]]:
    """Each request's line of the ledger: its dimensions and its five terms."""
    out = []
    for row in ledger.requests:
        u = row.usage
        out.append(
            {
                "request_id": u.request_id,
                "tenant": u.tenant,
                "model": u.model,
                "replica": u.replica,
                "hardware": row.hardware,
                "task_id": u.task_id,
                "outcome": u.outcome,
                "created_at_s": u.created_at_s,
                **row.terms(),
                "total_usd": row.total_usd,
            }
        )
    return out
