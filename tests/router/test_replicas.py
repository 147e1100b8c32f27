"""Several real engine replicas behind one gateway: each policy routes as documented; a replica
killed with SIGKILL under load loses nothing (unstarted requests complete elsewhere, mid-stream
ones end with an error event, one usage record per request); a drain under load loses nothing;
a builtin replica that dies is restarted."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import EngineServer
from tests.gateway.conftest import cli

ADMIN = "ic-admin-router"
POLICIES = ["round_robin", "least_outstanding", "power_of_two", "session_affinity", "kv_aware"]
pytestmark = pytest.mark.slow


def engines(tiny_model_dir: Path, n: int) -> list[EngineServer]:
    args = ["--model", str(tiny_model_dir), "--served-model-name", "tiny"]
    args += ["--kv-cache-bytes", "8MiB", "--threads", "1"]
    return [EngineServer(args) for _ in range(n)]


def gateway_for(
    upstreams: list[EngineServer], data: Path, policies: list[str], tokenizer: Path
) -> EngineServer:
    lines = ["models:"]
    for p in policies:
        lines += [f"  - name: {p}", f"    tokenizer: '{tokenizer}'", "    routing:"]
        lines += [f"      policy: {p}", "      health_interval_s: 0.25"]
        lines += ["      kv_events_interval_s: 0.05", "    replicas:"]
        lines += [f"      - upstream: {{url: '{u.base_url}', model: tiny}}" for u in upstreams]
    (data / "deploy.yaml").write_text("\n".join(lines) + "\n")
    args = ["--config", str(data / "deploy.yaml"), "--data-dir", str(data), "--admin-key", ADMIN]
    return EngineServer(args, command="serve")


def wait_healthy(gateway: EngineServer, model: str, n: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rows = replicas(gateway, model)
        if sum(r["status"] == "healthy" for r in rows) == n:
            return
        time.sleep(0.1)
    raise TimeoutError(replicas(gateway, model))


def replicas(gateway: EngineServer, model: str) -> list[dict[str, Any]]:
    r = httpx.get(
        gateway.base_url + "/admin/replicas", headers={"Authorization": f"Bearer {ADMIN}"}
    )
    return [row for row in r.json()["data"] if row["model"] == model]


@pytest.fixture(scope="module")
def routed(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[EngineServer, Path, str, str]]:
    """Three engines; one model per policy, each over the same three replicas."""
    ups = engines(tiny_model_dir, 3)
    data = tmp_path_factory.mktemp("routed")
    gw = gateway_for(ups, data, POLICIES, tiny_model_dir)
    try:
        for p in POLICIES:
            wait_healthy(gw, p, 3)
        key_a = cli("keys", "create", "--tenant", "a", "--json", "--data-dir", str(data))["key"]
        key_b = cli("keys", "create", "--tenant", "b", "--json", "--data-dir", str(data))["key"]
        yield gw, data, key_a, key_b
    finally:
        gw.stop()
        for u in ups:
            u.stop()


def complete(
    gw: EngineServer,
    key: str,
    model: str,
    prompt: str,
    headers: dict[str, str] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    r = httpx.post(
        gw.base_url + "/v1/completions",
        headers={"Authorization": f"Bearer {key}", **(headers or {})},
        json={"model": model, "prompt": prompt, "max_tokens": 2, **extra},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return {"request_id": r.headers["x-request-id"], **r.json()}


def records_by_id(data: Path, tenant: str) -> dict[str, dict[str, Any]]:
    return {
        r["request_id"]: r
        for r in cli("usage", "--tenant", tenant, "--json", "--data-dir", str(data))
    }


def test_round_robin_takes_turns(routed: tuple[EngineServer, Path, str, str]) -> None:
    gw, data, key, _ = routed
    ids = [complete(gw, key, "round_robin", f"turn {i}")["request_id"] for i in range(6)]
    recs = records_by_id(data, "a")
    names = [recs[i]["replica"] for i in ids]
    assert names[:3] == names[3:] and sorted(names[:3]) == [f"round_robin/{i}" for i in range(3)]


def test_least_outstanding_spreads_concurrent_requests(
    routed: tuple[EngineServer, Path, str, str],
) -> None:
    gw, data, key, _ = routed

    async def go() -> list[str]:
        async with httpx.AsyncClient(timeout=60) as client:
            rs = await asyncio.gather(
                *(
                    client.post(
                        gw.base_url + "/v1/completions",
                        headers={"Authorization": f"Bearer {key}"},
                        json={
                            "model": "least_outstanding",
                            "prompt": f"p{i}",
                            "max_tokens": 48,
                            "ignore_eos": True,
                        },
                    )
                    for i in range(6)
                )
            )
        return [r.headers["x-request-id"] for r in rs]

    ids = asyncio.run(go())
    recs = records_by_id(data, "a")
    counts: dict[str, int] = {}
    for i in ids:
        counts[recs[i]["replica"]] = counts.get(recs[i]["replica"], 0) + 1
    assert sorted(counts.values()) == [2, 2, 2], counts


@pytest.mark.parametrize("named_by", ["user", "header"])
def test_session_affinity_keeps_a_session_on_one_replica(
    routed: tuple[EngineServer, Path, str, str], named_by: str
) -> None:
    """A session is named by the body's `user`, or without one by the `x-session-id` header
    (in either case)."""
    gw, data, key, _ = routed
    by_session: dict[str, set[str]] = {}
    for i in range(12):
        session = f"{named_by}-{i % 4}"
        if named_by == "user":
            extra: dict[str, Any] = {"user": session}
        else:
            extra = {"headers": {"X-Session-Id" if i % 2 else "x-session-id": session}}
        rid = complete(gw, key, "session_affinity", f"hello {i}", **extra)["request_id"]
        by_session.setdefault(session, set()).add(rid)
    recs = records_by_id(data, "a")
    for rids in by_session.values():
        assert len({recs[r]["replica"] for r in rids}) == 1
    assert len({recs[r]["replica"] for rids in by_session.values() for r in rids}) >= 2


def test_kv_aware_sends_a_prefix_where_it_is_cached_and_never_across_tenants(
    routed: tuple[EngineServer, Path, str, str],
) -> None:
    gw, data, key_a, key_b = routed
    system = " ".join(f"rule{i} keep answers short and exact" for i in range(12))
    first = complete(gw, key_a, "kv_aware", system + " question 0")
    time.sleep(0.3)  # the replica's KV events reach the router
    later = [complete(gw, key_a, "kv_aware", system + f" question {i}") for i in range(1, 5)]
    recs = records_by_id(data, "a")
    home = recs[first["request_id"]]["replica"]
    assert {recs[r["request_id"]]["replica"] for r in later} == {home}
    assert all(r["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 for r in later)
    other = complete(gw, key_b, "kv_aware", system + " question 1")
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    rows = {r["name"]: r for r in replicas(gw, "kv_aware")}
    assert rows[home]["cached_blocks_known"] > 0


async def stream_one(
    client: httpx.AsyncClient, url: str, key: str, model: str, i: int, max_tokens: int = 40
) -> dict[str, Any]:
    """One streamed completion; what the client saw (`tokens` from the usage chunk)."""
    out: dict[str, Any] = {"tokens": 0, "text_events": 0, "error": None, "finished": False}
    body = {"model": model, "prompt": f"story {i}", "max_tokens": max_tokens, "ignore_eos": True}
    body |= {"stream": True, "stream_options": {"include_usage": True}}
    async with client.stream(
        "POST", url + "/v1/completions", headers={"Authorization": f"Bearer {key}"}, json=body
    ) as r:
        out["status"] = r.status_code
        out["request_id"] = r.headers.get("x-request-id")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                out["error"] = event["error"]
                continue
            if event.get("usage"):
                out["tokens"] = event["usage"]["completion_tokens"]
            for choice in event["choices"]:
                out["finished"] = out["finished"] or bool(choice["finish_reason"])
                out["text_events"] += bool(choice["text"])
    return out


def test_kill_9_under_load_loses_nothing(tiny_model_dir: Path, tmp_path: Path) -> None:
    ups = engines(tiny_model_dir, 3)
    gw = gateway_for(ups, tmp_path, ["least_outstanding"], tiny_model_dir)
    try:
        wait_healthy(gw, "least_outstanding", 3)
        key = cli("keys", "create", "--tenant", "k", "--json", "--data-dir", str(tmp_path))["key"]

        async def go() -> list[dict[str, Any]]:
            async with httpx.AsyncClient(timeout=120) as client:
                first = [
                    asyncio.create_task(
                        stream_one(client, gw.base_url, key, "least_outstanding", i, 400)
                    )
                    for i in range(24)
                ]
                # Kill replica 1 once streams are running on it (a fixed wait of 0.8 s let a
                # faster engine finish every stream first).
                deadline = time.monotonic() + 30
                gauge = "infercloud:num_requests_running"
                while await asyncio.to_thread(ups[1].metric, gauge) == 0:
                    assert time.monotonic() < deadline, "no stream reached replica 1"
                    await asyncio.sleep(0.01)
                os.kill(ups[1].process.pid, signal.SIGKILL)
                # a second wave right away: some are routed to the dead replica before the
                # router knows, and must complete elsewhere
                second = [
                    asyncio.create_task(
                        stream_one(client, gw.base_url, key, "least_outstanding", i, 400)
                    )
                    for i in range(24, 40)
                ]
                return list(await asyncio.gather(*first, *second))

        seen = asyncio.run(go())
        recs = records_by_id(tmp_path, "k")
        assert len(recs) == len(seen) == 40
        assert {s["request_id"] for s in seen} == set(recs)
        dead = "least_outstanding/1"
        for s in seen:
            rec = recs[s["request_id"]]
            assert s["status"] == 200, (rec, Path(gw.log.name).read_text()[-3000:])
            if s["error"] is not None:  # was mid-stream on the killed replica
                assert rec["replica"] == dead and rec["outcome"] == "failed"
                assert rec["failed_replicas"] == dead and float(rec["failed_attempt_s"]) > 0
                assert s["text_events"] > 0 and not s["finished"]
            else:
                assert s["finished"] and s["tokens"] == 400, s
                assert rec["outcome"] == "completed" and rec["completion_tokens"] == 400
        assert any(s["error"] for s in seen), "nothing was mid-stream on the killed replica"
        retried = [r for r in recs.values() if r["attempts"] > 1]
        assert all(r["failed_replicas"] == dead and r["attempts"] == 2 for r in retried)
        assert all(r["outcome"] == "completed" for r in retried)
        rows = {r["name"]: r for r in replicas(gw, "least_outstanding")}
        assert rows[dead]["status"] == "ejected"
        assert all(r["outstanding"] == 0 for r in rows.values())
    finally:
        gw.stop()
        for u in ups:
            u.stop()


def test_drain_under_load_loses_nothing(routed: tuple[EngineServer, Path, str, str]) -> None:
    gw, data, key, _ = routed
    model = "power_of_two"

    async def go() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(timeout=120) as client:
            tasks = [
                asyncio.create_task(stream_one(client, gw.base_url, key, model, i))
                for i in range(18)
            ]
            await asyncio.sleep(0.3)
            r = await client.post(
                gw.base_url + f"/admin/replicas/{model}/0/drain",
                headers={"Authorization": f"Bearer {ADMIN}"},
            )
            assert r.status_code == 200 and r.json()["status"] == "draining"
            after = [
                asyncio.create_task(stream_one(client, gw.base_url, key, model, i))
                for i in range(18, 30)
            ]
            return list(await asyncio.gather(*tasks, *after))

    seen = asyncio.run(go())
    assert all(s["finished"] and s["tokens"] == 40 and s["error"] is None for s in seen)
    recs = records_by_id(data, "a")
    late = [recs[s["request_id"]] for s in seen[18:]]
    assert all(r["replica"] != f"{model}/0" for r in late)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        rows = {r["name"]: r for r in replicas(gw, model)}
        if rows[f"{model}/0"]["status"] == "stopped":
            break
        time.sleep(0.1)
    assert rows[f"{model}/0"]["status"] == "stopped"


def test_a_dead_builtin_replica_is_restarted(tiny_model_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "deploy.yaml").write_text(
        "models:\n"
        "  - name: tiny\n"
        "    routing: {health_interval_s: 0.25}\n"
        "    replicas:\n"
        f"      - builtin: {{model: '{tiny_model_dir}', dtype: float32, kv_cache_bytes: 4MiB, "
        "threads: 1}\n"
    )
    args = ["--config", str(tmp_path / "deploy.yaml"), "--data-dir", str(tmp_path)]
    gw = EngineServer([*args, "--admin-key", ADMIN], command="serve", timeout_s=120)
    try:
        wait_healthy(gw, "tiny", 1)
        (row,) = replicas(gw, "tiny")
        os.kill(row["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            (row,) = replicas(gw, "tiny")
            if row["restarts"] == 1 and row["status"] == "healthy":
                break
            time.sleep(0.2)
        assert row["restarts"] == 1 and row["status"] == "healthy", row
        out = complete(gw, ADMIN, "tiny", "after the restart")
        assert out["usage"]["completion_tokens"] == 2
    finally:
        gw.stop()
    # stopping the gateway stops its replicas (uvicorn re-raises SIGTERM after its shutdown,
    # so this happens in the app's shutdown, not after it)
    with pytest.raises(ProcessLookupError):
        os.kill(row["pid"], 0)


def test_a_hung_replica_is_ejected_and_its_requests_move_on(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """SIGSTOP a replica: within seconds its health checks eject it; a stream it was serving
    ends with an error event, a request waiting on it for its first token completes on the
    other replica, and each request has one record."""
    ups = engines(tiny_model_dir, 2)
    gw = gateway_for(ups, tmp_path, ["round_robin"], tiny_model_dir)
    hung = ups[0].process.pid
    try:
        wait_healthy(gw, "round_robin", 2)
        key = cli("keys", "create", "--tenant", "h", "--json", "--data-dir", str(tmp_path))["key"]

        async def go() -> tuple[dict[str, Any], list[str], float]:
            async with httpx.AsyncClient(timeout=120) as client:
                stream = asyncio.create_task(
                    stream_one(client, gw.base_url, key, "round_robin", 0, 900)
                )  # turn 0: replica 0
                await asyncio.sleep(0.5)
                os.kill(hung, signal.SIGSTOP)
                t0 = time.monotonic()
                ids = []
                for i in range(2):  # turns 1 and 2: replica 1, then replica 0 (hung)
                    r = await client.post(
                        gw.base_url + "/v1/completions",
                        headers={"Authorization": f"Bearer {key}"},
                        json={"model": "round_robin", "prompt": f"after {i}", "max_tokens": 3},
                    )
                    assert r.status_code == 200, r.text
                    ids.append(r.headers["x-request-id"])
                return await stream, ids, time.monotonic() - t0

        streamed, ids, elapsed_s = asyncio.run(go())
        assert streamed["error"] is not None and streamed["text_events"] > 0
        assert elapsed_s < 8.0, elapsed_s  # ejected within seconds, not at a read timeout
        recs = records_by_id(tmp_path, "h")
        assert len(recs) == 3
        assert recs[streamed["request_id"]]["outcome"] == "failed"
        moved = recs[ids[1]]
        assert moved["outcome"] == "completed" and moved["replica"] == "round_robin/1"
        assert moved["failed_replicas"] == "round_robin/0" and moved["attempts"] == 2
        rows = {r["name"]: r for r in replicas(gw, "round_robin")}
        assert rows["round_robin/0"]["status"] == "ejected"
        os.kill(hung, signal.SIGCONT)
        wait_healthy(gw, "round_robin", 2)  # a good check brings it back
    finally:
        os.kill(hung, signal.SIGCONT)
        gw.stop()
        for u in ups:
            u.stop()
