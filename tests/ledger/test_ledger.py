"""The ledger's invariants (hypothesis) and one period computed by hand."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infercloud.ledger.cost import TERMS, ReplicaSpan, RequestUsage, build_ledger
from infercloud.ledger.plans import PlanBook, PricingPlan
from infercloud.ledger.report import build_report
from infercloud.ledger.tasks import TaskOutcome

MODELS = ("m0", "m1")


@st.composite
def fleets(draw: st.DrawFn) -> list[ReplicaSpan]:
    spans = []
    for i in range(draw(st.integers(1, 4))):
        model = MODELS[i % 2] if draw(st.booleans()) else MODELS[0]
        price = draw(st.floats(0.0, 40.0))
        kv_bytes = draw(st.sampled_from([0, 1 << 20, 1 << 30]))
        kv_price = draw(st.floats(0.0, 2 * price)) if kv_bytes else 0.0
        for _ in range(draw(st.integers(1, 3))):
            start = draw(st.floats(0.0, 900.0))
            end = start + draw(st.floats(0.0, 600.0))
            spans.append(
                ReplicaSpan(f"{model}/{i}", model, "h100", price, kv_price, kv_bytes, start, end)
            )
    return spans


@st.composite
def usages(draw: st.DrawFn, spans: list[ReplicaSpan]) -> list[RequestUsage]:
    names = sorted({s.replica for s in spans})
    model_of = {s.replica: s.model for s in spans}
    out = []
    for i in range(draw(st.integers(0, 30))):
        replica = draw(st.sampled_from([*names, None, "gone/9"]))
        metered = draw(st.booleans())
        failed = draw(st.lists(st.tuples(st.sampled_from(names), st.floats(0.0, 60.0)), max_size=2))
        out.append(
            RequestUsage(
                request_id=f"r{i}",
                tenant=draw(st.sampled_from(["a", "b"])),
                model=model_of.get(replica or "", MODELS[0]),
                replica=replica,
                created_at_s=draw(st.floats(0.0, 1500.0)),
                outcome=draw(st.sampled_from(["completed", "failed", "refused", "cancelled"])),
                prompt_tokens=draw(st.integers(0, 5000)),
                cached_tokens=draw(st.integers(0, 100)),
                completion_tokens=draw(st.integers(0, 500)),
                compute_s=draw(st.floats(0.0, 200.0)) if metered else None,
                recompute_s=draw(st.floats(0.0, 50.0)) if metered else None,
                kv_byte_s=draw(st.floats(0.0, 1e12)) if metered else None,
                failed_attempts=tuple(failed),
                task_id=draw(st.sampled_from([None, "t1", "t2"])),
            )
        )
    return out


def fleet_cost(spans: list[ReplicaSpan], since_s: float, until_s: float) -> float:
    return sum(s.overlap_s(since_s, until_s) * s.usd_per_hour / 3600 for s in spans)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_terms_are_never_negative_and_reconcile_with_the_fleet(data: st.DataObject) -> None:
    spans = data.draw(fleets())
    records = data.draw(usages(spans))
    since = data.draw(st.floats(0.0, 1200.0))
    until = since + data.draw(st.floats(0.0, 1500.0))
    ledger = build_ledger(records, spans, since, until)
    expected = fleet_cost(spans, since, until)
    assert ledger.fleet_cost_usd == pytest.approx(expected, abs=1e-9)
    for row in ledger.requests:
        for term in TERMS:
            assert getattr(row, term) >= 0.0
        assert since <= row.usage.created_at_s < until
    total = sum(row.total_usd for row in ledger.requests) + ledger.unallocated_usd
    assert total == pytest.approx(expected, abs=0.005)  # to the cent
    assert total == pytest.approx(expected, rel=1e-9, abs=1e-9)  # in fact to rounding
    # the unallocated part is only ever the idle time of models nobody used in the period
    served = {r.usage.model for r in ledger.requests if r.hardware is not None}
    up = {s.model for s in spans if s.overlap_s(since, until) > 0 and s.usd_per_hour > 0}
    if up <= served:
        assert ledger.unallocated_usd == pytest.approx(0.0, abs=1e-12)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_recording_a_usage_record_twice_changes_nothing(data: st.DataObject) -> None:
    spans = data.draw(fleets())
    records = data.draw(usages(spans))
    twice = records + data.draw(st.lists(st.sampled_from(records), max_size=10)) if records else []
    once = build_ledger(records, spans, 0.0, 2000.0)
    again = build_ledger(twice, spans, 0.0, 2000.0)
    assert sorted(once.by_request) == sorted(again.by_request)
    for rid, row in once.by_request.items():
        assert again.by_request[rid].terms() == pytest.approx(row.terms())
    assert again.fleet_cost_usd == once.fleet_cost_usd


def test_one_period_by_hand() -> None:
    """One replica at $3.60/h ($0.001/s) for 100 s, $0.36/h of it the KV pool (1000 bytes)."""
    span = ReplicaSpan("m0/0", "m0", "h100", 3.6, 0.36, 1000, 0.0, 100.0)
    a = RequestUsage(
        "a", "t", "m0", "m0/0", 1.0, "completed", 100, 0, 10,
        compute_s=10.0, recompute_s=5.0, kv_byte_s=20_000.0,
    )  # fmt: skip
    b = RequestUsage(
        "b", "t", "m0", "m0/0", 2.0, "completed", 200, 0, 20,
        compute_s=20.0, recompute_s=0.0, kv_byte_s=30_000.0, failed_attempts=(("m0/0", 10.0),),
    )  # fmt: skip
    ledger = build_ledger([a, b], [span], 0.0, 100.0)
    ra, rb = ledger.by_request["a"], ledger.by_request["b"]
    per_s = 0.09 / 100  # compute dollars per second: (0.1 - 0.01) / 100
    assert ra.new_compute_usd == pytest.approx(10 * per_s)
    assert ra.non_reusable_context_usd == pytest.approx(5 * per_s)
    assert rb.new_compute_usd == pytest.approx(20 * per_s)
    assert ra.cache_occupancy_usd == pytest.approx(20_000 * 0.01 / (100 * 1000))
    assert rb.cache_occupancy_usd == pytest.approx(30_000 * 0.01 / (100 * 1000))
    # b's failed attempt: 10 s at the compute price, out of the idle time
    assert rb.network_failure_usd == pytest.approx(10 * per_s)
    idle = 0.1 - (35 * per_s + 0.005) - 10 * per_s
    direct_a, direct_b = 15 * per_s + 0.002, 20 * per_s + 0.003
    assert ra.queueing_idle_usd == pytest.approx(idle * direct_a / (direct_a + direct_b))
    assert rb.queueing_idle_usd == pytest.approx(idle * direct_b / (direct_a + direct_b))
    assert ra.total_usd + rb.total_usd == pytest.approx(0.1)
    # the same period, priced three ways
    outcomes = {("t", "x"): TaskOutcome("t", "x", True)}
    book = PlanBook(
        plans=[
            PricingPlan.model_validate({"name": "hour", "per_gpu_hour": {"usd": 7.2}}),
            PricingPlan.model_validate(
                {"name": "tok", "per_token": {"input_per_mtok": 100, "output_per_mtok": 1000}}
            ),
        ]
    )
    report = build_report(ledger, outcomes, "tenant", book)
    plans = {p["name"]: p for p in report["plans"]}
    assert plans["hour"]["revenue_usd"] == pytest.approx(0.2)
    assert plans["hour"]["margin_usd"] == pytest.approx(0.1)
    assert plans["tok"]["revenue_usd"] == pytest.approx((300 * 100 + 30 * 1000) / 1e6)
    assert report["reconciliation"]["difference_usd"] == pytest.approx(0.0, abs=1e-12)


def test_a_failed_request_costs_failure_only() -> None:
    span = ReplicaSpan("m0/0", "m0", "cpu", 3.6, 0.0, 0, 0.0, 10.0)
    ok = RequestUsage("ok", "t", "m0", "m0/0", 1.0, "completed", compute_s=2.0, recompute_s=0.0)
    bad = RequestUsage("bad", "t", "m0", "m0/0", 1.0, "failed", compute_s=1.0, recompute_s=0.0)
    ledger = build_ledger([ok, bad], [span], 0.0, 10.0)
    row = ledger.by_request["bad"]
    assert row.new_compute_usd == row.queueing_idle_usd == 0.0
    assert row.network_failure_usd == pytest.approx(0.01 / 3)  # its third of the 10 s
    assert ledger.by_request["ok"].total_usd == pytest.approx(0.01 * 2 / 3)


def test_a_plan_needs_exactly_one_kind() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        PricingPlan.model_validate({"name": "x"})
    with pytest.raises(ValueError, match="exactly one"):
        PricingPlan.model_validate(
            {"name": "x", "per_gpu_hour": {"usd": 1}, "per_task": {"usd_per_success": 1}}
        )
    assert len(PlanBook.load().plans) == 3


@pytest.mark.parametrize(
    ("outcome", "status", "error", "failed", "layer"),
    [
        ("completed", 200, None, (), None),
        ("completed", 200, None, (("m0/1", 1.0),), "runtime"),  # recovered by a retry
        ("failed", 502, "replicas failed: m0/0", (("m0/0", 1.0),), "runtime"),
        ("failed", 200, "mid-stream: reset", (("m0/0", 3.0),), "runtime"),
        ("refused", 503, "the model is saturated; request shed", (), "routing"),
        ("failed", 400, "This model's maximum context length is 2048 tokens.", (), "context"),
        ("refused", 429, "rate limit", (), None),  # the client's own limit, not a failure
        ("failed", 400, "bad temperature", (), None),
    ],
)
def test_the_platform_attributes_what_it_saw(
    outcome: str, status: int, error: str | None, failed: tuple[tuple[str, float], ...],
    layer: str | None,
) -> None:  # fmt: skip
    from infercloud.ledger.cost import RequestCost
    from infercloud.ledger.tasks import observed_failure

    usage = RequestUsage(
        "r", "t", "m0", "m0/0", 0.0, outcome, status=status, error=error, failed_attempts=failed
    )
    assert observed_failure(RequestCost(usage)) == layer


def test_periods_resolve_and_refuse_what_is_not_a_time() -> None:
    from infercloud.ledger.period import resolve_period

    now = 1_764_720_000.0  # 2025-12-03 00:00 UTC
    assert resolve_period("all", None, None, now) == (0.0, now)
    assert resolve_period("day", None, None, now + 3600) == (now, now + 3600)
    assert resolve_period("all", "2025-12-03T00:00:00", "1764723600", now)[0] == now
    for bad in ("nan", "inf", "yesterday"):
        with pytest.raises(ValueError, match="not a time"):
            resolve_period("all", bad, None, now)
    with pytest.raises(ValueError, match="ends before"):
        resolve_period("all", "10", "5", now)
    with pytest.raises(ValueError, match="period must be"):
        resolve_period("week", None, None, now)
