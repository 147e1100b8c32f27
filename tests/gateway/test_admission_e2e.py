"""Admission and concurrency limits end to end: `infercloud serve` in front of an upstream that
holds its requests until the test lets them go (`HeldUpstream`), so that requests are really in
flight and really waiting while the next ones arrive.

The model `held` has one slot (`max_inflight_per_replica: 1`) and a queue of one
(`max_queued: 1`); `held-by-priority` is the same upstream declared to schedule by priority.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.conftest import EngineServer
from tests.gateway.held_upstream import HeldUpstream
from tests.gateway.test_gateway_api import cli, error_of, new_key


@pytest.fixture(scope="module")
def upstream() -> Iterator[HeldUpstream]:
    held = HeldUpstream().start()
    yield held
    held.stop()


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("admission-data")


@pytest.fixture(scope="module")
def gateway(upstream: HeldUpstream, data_dir: Path) -> Iterator[EngineServer]:
    config = data_dir / "deploy.yaml"
    config.write_text(
        "models:\n"
        "  - name: held\n"
        "    max_inflight_per_replica: 1\n"
        "    replicas:\n"
        f"      - upstream: {{url: '{upstream.url}', model: held}}\n"
        "  - name: held-by-priority\n"
        "    replicas:\n"
        f"      - upstream: {{url: '{upstream.url}', model: held, priority: true}}\n"
        "gateway: {max_queued: 1, queue_timeout_s: 3}\n"
    )
    server = EngineServer(["--config", str(config), "--data-dir", str(data_dir)], command="serve")
    yield server
    server.stop()


@pytest.fixture()
def pool(upstream: HeldUpstream) -> Iterator[ThreadPoolExecutor]:
    """Threads for requests in flight; the gate is closed at the start of each test and opened
    at its end, so that nothing is left held for the next one."""
    upstream.gate.clear()
    with ThreadPoolExecutor(8) as executor:
        try:
            yield executor
        finally:
            upstream.gate.set()


def send(gateway: EngineServer, key: str, prompt: str = "x") -> httpx.Response:
    return httpx.post(
        gateway.base_url + "/v1/completions",
        json={"model": "held", "prompt": prompt, "max_tokens": 1},
        headers={"authorization": f"Bearer {key}"},
        timeout=30,
    )


def queued(gateway: EngineServer) -> float:
    for line in httpx.get(gateway.base_url + "/metrics").text.splitlines():
        if line.startswith('infercloud_gateway:queued_requests{model="held"}'):
            return float(line.split()[-1])
    return 0.0


def wait_queued(gateway: EngineServer, n: int) -> None:
    deadline = time.monotonic() + 10
    while queued(gateway) != n:
        assert time.monotonic() < deadline, f"queue never held {n}"
        time.sleep(0.01)


def test_a_keys_concurrent_requests_are_limited_and_the_slot_comes_back(
    gateway: EngineServer,
    upstream: HeldUpstream,
    data_dir: Path,
    pool: ThreadPoolExecutor,
) -> None:
    key = new_key(data_dir, "slots", "--max-concurrent", "1")
    arrived = upstream.arrived
    first = pool.submit(send, gateway, key)
    upstream.wait_arrived(arrived + 1)  # in flight at the upstream, holding the key's slot
    second = send(gateway, key)
    assert second.status_code == 429 and error_of(second)["code"] == "rate_limit_exceeded"
    assert "concurrent" in error_of(second)["message"] and second.headers["retry-after"] == "1"
    upstream.gate.set()
    assert first.result().status_code == 200
    assert send(gateway, key).status_code == 200  # its slot was given back
    records = cli(data_dir, "usage", "--tenant", "slots", "--json")
    assert sorted(r["status"] for r in records) == [200, 200, 429]


def test_when_saturated_the_lowest_class_is_shed_first_with_503(
    gateway: EngineServer,
    upstream: HeldUpstream,
    data_dir: Path,
    pool: ThreadPoolExecutor,
) -> None:
    """One slot, busy; a queue of one, holding a batch request. A standard request arrives:
    the batch one is shed (503, Retry-After) and the standard one waits in its place. A batch
    request arriving then finds nothing below it and is shed itself. The rest complete."""
    standard = new_key(data_dir, "crowd", "--priority", "standard")
    batch = new_key(data_dir, "crowd", "--priority", "batch")
    arrived = upstream.arrived
    running = pool.submit(send, gateway, standard, "running")
    upstream.wait_arrived(arrived + 1)
    waiting_batch = pool.submit(send, gateway, batch, "batch waits")
    wait_queued(gateway, 1)
    waiting_standard: Future[httpx.Response] = pool.submit(send, gateway, standard, "std waits")
    shed = waiting_batch.result(timeout=10)
    assert shed.status_code == 503 and error_of(shed)["code"] == "overloaded"
    assert int(shed.headers["retry-after"]) >= 1
    late_batch = send(gateway, batch, "late batch")
    assert late_batch.status_code == 503 and error_of(late_batch)["code"] == "overloaded"
    assert not waiting_standard.done()
    upstream.gate.set()
    assert running.result().status_code == 200
    assert waiting_standard.result().status_code == 200
    prompts = [b["prompt"] for b in upstream.bodies[arrived:]]
    assert prompts == ["running", "std waits"]  # the shed never reached the replica
    records = cli(data_dir, "usage", "--tenant", "crowd", "--json")
    assert sorted(r["status"] for r in records) == [200, 200, 503, 503]
    assert {r["outcome"] for r in records if r["status"] == 503} == {"refused"}


def test_a_request_waiting_past_its_deadline_gets_503(
    gateway: EngineServer,
    upstream: HeldUpstream,
    data_dir: Path,
    pool: ThreadPoolExecutor,
) -> None:
    key = new_key(data_dir, "patient")
    arrived = upstream.arrived
    running = pool.submit(send, gateway, key, "running")
    upstream.wait_arrived(arrived + 1)
    started = time.monotonic()
    expired = send(gateway, key, "waits too long")  # queue_timeout_s: 3
    waited_s = time.monotonic() - started
    assert expired.status_code == 503 and error_of(expired)["code"] == "queue_timeout"
    assert int(expired.headers["retry-after"]) >= 1
    assert 2.9 <= waited_s < 10.0
    assert not running.done()  # it expired while the slot was still taken
    upstream.gate.set()
    assert running.result().status_code == 200
    assert send(gateway, key).status_code == 200  # the expired one left no slot taken


def test_the_class_goes_down_as_priority_where_the_replica_schedules_by_it(
    gateway: EngineServer, upstream: HeldUpstream, data_dir: Path
) -> None:
    """Keys of each class: a replica declared `priority: true` (as our own engine always is)
    gets `priority` 0 / 1 / 2 for interactive / standard / batch; another gets no such field."""
    upstream.gate.set()
    seen: dict[str, object] = {}
    for cls in ("interactive", "standard", "batch"):
        key = new_key(data_dir, "classes", "--priority", cls)
        for model in ("held", "held-by-priority"):
            arrived = upstream.arrived
            r = httpx.post(
                gateway.base_url + "/v1/completions",
                json={"model": model, "prompt": f"{cls} {model}", "max_tokens": 1},
                headers={"authorization": f"Bearer {key}"},
                timeout=30,
            )
            assert r.status_code == 200
            body = upstream.bodies[arrived]
            seen[body["prompt"]] = body.get("priority", "absent")
    assert seen == {
        "interactive held": "absent",
        "interactive held-by-priority": 0,
        "standard held": "absent",
        "standard held-by-priority": 1,
        "batch held": "absent",
        "batch held-by-priority": 2,
    }
