"""The ledger's inputs read from the platform's store: usage records, replica spans, outcomes.

A span still open is up until now if its gateway renewed it recently (within
`SPAN_STALE_AFTER_S`), else it ends at its last renewal: a gateway that died stops paying then.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from infercloud.gateway.store import OutcomeRecord, SpanRecord, Store, UsageRecord
from infercloud.ledger.cost import ReplicaSpan, RequestUsage, build_ledger
from infercloud.ledger.plans import PlanBook
from infercloud.ledger.report import build_report, request_rows
from infercloud.ledger.tasks import TaskOutcome

SPAN_RENEW_S = 10.0
"""How often a gateway renews the spans of the replicas it serves."""
SPAN_STALE_AFTER_S = 3 * SPAN_RENEW_S


def request_usage(r: UsageRecord) -> RequestUsage:
    failed: list[tuple[str, float]] = []
    if r.failed_replicas:
        names = r.failed_replicas.split(",")
        seconds = [float(x) for x in (r.failed_attempt_s or "").split(",") if x]
        seconds += [0.0] * (len(names) - len(seconds))
        failed = list(zip(names, seconds, strict=True))
    return RequestUsage(
        request_id=r.request_id,
        tenant=r.tenant,
        model=r.model,
        replica=r.replica,
        created_at_s=r.created_at_s,
        outcome=r.outcome,
        prompt_tokens=r.prompt_tokens,
        cached_tokens=r.cached_tokens,
        completion_tokens=r.completion_tokens,
        compute_s=r.compute_s,
        recompute_s=r.recompute_s,
        kv_byte_s=r.kv_byte_s,
        failed_attempts=tuple(failed),
        task_id=r.task_id,
        config=r.config,
        status=r.status,
        error=r.error,
        e2e_s=r.e2e_ms / 1e3,
        attempts=r.attempts,
    )


def replica_span(s: SpanRecord, now_s: float) -> ReplicaSpan:
    if s.stopped_at_s is not None:
        end = s.stopped_at_s
    elif now_s - s.last_seen_s <= SPAN_STALE_AFTER_S:
        end = now_s
    else:
        end = s.last_seen_s
    return ReplicaSpan(
        s.replica,
        s.model,
        s.hardware,
        s.usd_per_hour,
        s.kv_usd_per_hour,
        s.kv_cache_bytes,
        s.started_at_s,
        max(s.started_at_s, end),
    )


def task_outcome(o: OutcomeRecord) -> TaskOutcome:
    return TaskOutcome(**asdict(o))


def report_from_store(
    store: Store,
    since_s: float,
    until_s: float,
    now_s: float,
    by: str = "tenant",
    plans: PlanBook | None = None,
    with_requests: bool = False,
) -> dict[str, Any]:
    """The report of `[since_s, until_s)` from what the store holds (`ledger.report`)."""
    usages = [request_usage(r) for r in store.usage(since_s=since_s, until_s=until_s)]
    spans = [replica_span(s, now_s) for s in store.spans(since_s, until_s)]
    outcomes = {(o.tenant, o.task_id): task_outcome(o) for o in store.outcomes()}
    ledger = build_ledger(usages, spans, since_s, until_s)
    report = build_report(ledger, outcomes, by, plans)
    if with_requests:
        report["requests"] = request_rows(ledger)
    return report
