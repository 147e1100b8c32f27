"""The ledger end to end: `infercloud serve` with a builtin replica on PostgreSQL, requests
through the gateway with the official openai client carrying task ids, outcomes posted, and the
report's figures checked against a hand computation from the raw records."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from infercloud.gateway.store import Store
from tests.conftest import EngineServer
from tests.gateway.conftest import cli, postgres_schema

ADMIN = "ic-admin-ledger"
PRICE_PER_HOUR = 36.0  # $0.01 per second: large enough that every term shows
KV_BYTES = 8 << 20
MEMORY_USD_PER_GIB_HOUR = 64.0  # the 8 MiB pool: $0.5/h of the $36/h


@pytest.fixture(scope="module")
def platform(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[EngineServer, str]]:
    config = tmp_path_factory.mktemp("ledger") / "deploy.yaml"
    config.write_text(
        "models:\n"
        "  - name: tiny\n"
        "    replicas:\n"
        f"      - builtin: {{model: '{tiny_model_dir}', dtype: float32, kv_cache_bytes: 8MiB, "
        "threads: 1}\n"
        f"        hardware: {{name: test-cpu, price_per_hour: {PRICE_PER_HOUR}, "
        f"memory_usd_per_gib_hour: {MEMORY_USD_PER_GIB_HOUR}}}\n"
    )
    with postgres_schema() as url:
        data = tmp_path_factory.mktemp("ledger-data")
        args = ["--config", str(config), "--database-url", url, "--admin-key", ADMIN]
        server = EngineServer([*args, "--data-dir", str(data)], command="serve", timeout_s=180)
        try:
            yield server, url
        finally:
            server.stop()


def report(server: EngineServer, **params: Any) -> dict[str, Any]:
    r = httpx.get(
        server.base_url + "/admin/report",
        params=params,
        headers={"authorization": f"Bearer {ADMIN}"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_tasks_through_the_gateway_reconcile_with_a_hand_computation(
    platform: tuple[EngineServer, str],
) -> None:
    server, url = platform
    tenant = f"acme-{uuid.uuid4().hex[:6]}"
    key = cli("keys", "create", "--tenant", tenant, "--json", "--database-url", url)["key"]
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0)
    since = time.time()
    time.sleep(0.5)  # idle time before the first request: it shows as idle loss

    # task a (config terse): two requests tagged by header, one of them streamed
    terse = {"x-infercloud-task": "task-a", "x-infercloud-config": "terse"}
    client.completions.create(
        model="tiny", prompt="one two three", max_tokens=8, extra_headers=terse
    )
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "count to five"}],
        max_tokens=12,
        stream=True,
        extra_headers=terse,
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) is not None
    # task b (config verbose): tagged in the body's metadata
    out = client.completions.create(
        model="tiny",
        prompt="a much longer prompt that takes more compute " * 6,
        max_tokens=24,
        extra_body={"metadata": {"task_id": "task-b", "config": "verbose"}},
    )
    assert out.usage is not None and out.usage.completion_tokens == 24
    # a request in no task, and one with a malformed task id (an OpenAI error, recorded)
    client.completions.create(model="tiny", prompt="untasked", max_tokens=4)
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(
            model="tiny", prompt="x", max_tokens=1, extra_headers={"x-infercloud-task": "no spaces"}
        )
    assert bad.value.code == "invalid_task_id"

    auth = {"authorization": f"Bearer {key}"}
    posted = httpx.post(
        server.base_url + "/v1/tasks/task-a/outcome",
        json={"success": True, "verifier": "exact", "tool_calls": 2, "retries": 1},
        headers=auth,
    )
    assert posted.status_code == 200, posted.text
    # reported twice with a change of mind: the last report counts, once
    for success in (True, False):
        body = {"success": success, "verifier": "regex", "blamed_layer": "model"}
        r = httpx.post(server.base_url + "/v1/tasks/task-b/outcome", json=body, headers=auth)
        assert r.status_code == 200
    wrong = httpx.post(
        server.base_url + "/v1/tasks/task-b/outcome",
        json={"success": "maybe", "blamed_layer": "weather"},
        headers=auth,
    )
    assert wrong.status_code == 400 and wrong.json()["error"]["type"] == "invalid_request_error"
    assert (
        httpx.post(server.base_url + "/v1/tasks/t/outcome", json={"success": True}).status_code
        == 401
    )
    task_b = httpx.get(server.base_url + "/v1/tasks/task-b", headers=auth).json()
    assert task_b["outcome"]["success"] is False and task_b["outcome"]["blamed_layer"] == "model"
    assert len(task_b["requests"]) == 1 and task_b["observed_failures"] == []
    assert task_b["requests"][0]["config"] == "verbose"
    other = cli("keys", "create", "--tenant", f"other-{tenant}", "--json", "--database-url", url)
    hidden = httpx.get(
        server.base_url + "/v1/tasks/task-b", headers={"authorization": f"Bearer {other['key']}"}
    )
    assert hidden.status_code == 404 and hidden.json()["error"]["code"] == "task_not_found"
    time.sleep(0.3)
    until = time.time()

    got = report(server, since=since, until=until, by="config", requests=True)
    # the raw records, read straight from the database
    store = Store(url)
    try:
        usage = [u for u in store.usage(since_s=since, until_s=until) if u.tenant == tenant]
        spans = [s for s in store.spans(since, until) if s.model == "tiny"]
    finally:
        store.close()
    assert len(usage) == 5 and len(spans) == 1
    span = spans[0]
    assert span.usd_per_hour == PRICE_PER_HOUR and span.kv_cache_bytes == KV_BYTES
    kv_per_hour = KV_BYTES / 2**30 * MEMORY_USD_PER_GIB_HOUR
    assert span.kv_usd_per_hour == pytest.approx(kv_per_hour)

    # by hand: the replica's time in the period, priced; compute and KV at their rates
    up_s = until - max(since, span.started_at_s)
    fleet = up_s * PRICE_PER_HOUR / 3600
    assert got["fleet"]["cost_usd"] == pytest.approx(fleet, rel=1e-9)
    compute_per_s = (PRICE_PER_HOUR - kv_per_hour) / 3600
    kv_per_byte_s = kv_per_hour / 3600 / KV_BYTES
    served = [u for u in usage if u.outcome == "completed"]
    assert len(served) == 4 and all(u.compute_s and u.kv_byte_s for u in served)
    assert sum(u.compute_s or 0 for u in served) < up_s  # the steps fit in the time
    direct = {
        u.request_id: (u.compute_s or 0) * compute_per_s
        + (u.recompute_s or 0) * compute_per_s
        + (u.kv_byte_s or 0) * kv_per_byte_s
        for u in served
    }
    idle = fleet - sum(direct.values())
    assert idle > 0
    expected = {rid: d + idle * d / sum(direct.values()) for rid, d in direct.items()}
    rows = {r["request_id"]: r for r in got["requests"] if r["tenant"] == tenant}
    assert set(rows) == {u.request_id for u in usage}
    for rid, total in expected.items():
        assert rows[rid]["total_usd"] == pytest.approx(total, rel=1e-6)
        assert rows[rid]["hardware"] == "test-cpu"
    refused = next(u for u in usage if u.outcome == "refused")
    assert refused.status == 400 and rows[refused.request_id]["total_usd"] == 0
    # to the cent, and in fact to rounding: every dollar of the replica is in some request
    assert got["reconciliation"]["difference_usd"] == pytest.approx(0.0, abs=1e-9)
    assert sum(r["total_usd"] for r in rows.values()) == pytest.approx(fleet, abs=0.005)

    # tasks: cost per successful task, tokens, retries, failures by layer
    groups = {g["config"]: g for g in got["groups"]}
    by_task: dict[str, list[Any]] = {}
    for u in usage:
        if u.task_id:
            by_task.setdefault(u.task_id, []).append(u)
    assert {k: len(v) for k, v in by_task.items()} == {"task-a": 2, "task-b": 1}
    cost_a = sum(expected[u.request_id] for u in by_task["task-a"])
    cost_b = sum(expected[u.request_id] for u in by_task["task-b"])
    ta, tb = groups["terse"]["tasks"], groups["verbose"]["tasks"]
    assert (ta["tasks"], ta["succeeded"], tb["tasks"], tb["succeeded"]) == (1, 1, 1, 0)
    assert ta["cost_per_successful_task_usd"] == pytest.approx(cost_a, rel=1e-6)
    assert tb["cost_per_successful_task_usd"] is None and tb["cost_usd"] == pytest.approx(
        cost_b, rel=1e-6
    )
    tokens_a = sum(u.prompt_tokens + u.completion_tokens for u in by_task["task-a"])
    assert ta["tokens_per_task"] == tokens_a
    assert ta["retries_per_task"] == 1 and ta["tool_calls_per_task"] == 2
    assert tb["failures_by_layer"] == {"model": 1}
    total = got["total"]["tasks"]
    assert total["tasks"] == 2 and total["success_rate"] == 0.5
    assert total["cost_per_successful_task_usd"] == pytest.approx(cost_a + cost_b, rel=1e-6)
    first = min(u.created_at_s for u in by_task["task-a"])
    last = max(u.created_at_s + u.e2e_ms / 1e3 for u in by_task["task-a"])
    assert ta["latency_s"]["mean"] == pytest.approx(last - first, rel=1e-6)
    # the untasked request counts under its own configuration, "default"
    assert groups["default"]["requests"] >= 1
    # the same figures from the command line, plans priced against the ledger
    from_cli = cli(
        "report", "--json", "--by", "config", "--since", str(since), "--until", str(until),
        "--database-url", url,
    )  # fmt: skip
    assert from_cli["fleet"]["cost_usd"] == pytest.approx(fleet, rel=1e-9)
    assert {p["name"] for p in from_cli["plans"]} == {"replica-hour", "tokens", "successful-tasks"}
    hour_plan = next(p for p in from_cli["plans"] if p["name"] == "replica-hour")
    assert hour_plan["revenue_usd"] == pytest.approx(up_s / 3600 * 0.25, rel=1e-6)
