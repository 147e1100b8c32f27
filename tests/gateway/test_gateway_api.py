"""`infercloud serve` in front of a second process of our own engine (as an upstream URL), driven
with the official `openai` client: keys, errors, limits, usage records, isolation."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.conftest import EngineServer

ADMIN = "ic-admin-test-key"


def run_cli(data_dir: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "infercloud", *args, "--data-dir", str(data_dir)],
        capture_output=True,
        text=True,
        check=check,
    )


def cli(data_dir: Path, *args: str) -> Any:
    return json.loads(run_cli(data_dir, *args).stdout)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gateway-data")


@pytest.fixture(scope="module")
def gateway(tiny_server: EngineServer, data_dir: Path) -> Iterator[EngineServer]:
    config = data_dir / "deploy.yaml"
    config.write_text(
        "models:\n"
        "  - name: tiny\n"
        "    price: {input_per_mtok: 1.0, cached_input_per_mtok: 0.5, output_per_mtok: 2.0}\n"
        "    replicas:\n"
        f"      - upstream: {{url: '{tiny_server.base_url}/v1', model: tiny}}\n"
        "tenants:\n"
        "  north: {cache_group: partners}\n"
        "  south: {cache_group: partners}\n"
        "  capped: {rpm: 2}\n"
        "gateway: {max_body_bytes: 65536}\n"
    )
    args = ["--config", str(config), "--data-dir", str(data_dir), "--admin-key", ADMIN]
    server = EngineServer(args, command="serve")
    yield server
    server.stop()


def new_key(data_dir: Path, tenant: str, *extra: str) -> str:
    out = cli(data_dir, "keys", "create", "--tenant", tenant, "--json", *extra)
    assert set(out) == {"key", "key_id", "tenant"} and out["tenant"] == tenant
    return str(out["key"])


def client_for(gateway: EngineServer, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url + "/v1", api_key=key, max_retries=0)


def test_sync_async_and_streaming_through_the_gateway(
    gateway: EngineServer, data_dir: Path
) -> None:
    key = new_key(data_dir, "acme")
    with client_for(gateway, key) as client:
        assert [m.id for m in client.models.list().data] == ["tiny"]
        out = client.completions.create(model="tiny", prompt="hello there", max_tokens=5)
        assert out.usage is not None and out.usage.completion_tokens == 5
        raw = client.chat.completions.with_raw_response.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert raw.headers["x-request-id"].startswith("req-")
        assert raw.parse().choices[0].message.role == "assistant"
        chunks = list(
            client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "stream"}],
                max_tokens=6,
                stream=True,
            )
        )
        assert all(c.usage is None for c in chunks)  # not asked for: stripped
        with_usage = list(
            client.completions.create(
                model="tiny",
                prompt="stream with usage",
                max_tokens=6,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert with_usage[-1].usage is not None and with_usage[-1].usage.completion_tokens == 6

    async def go() -> int:
        async with openai.AsyncOpenAI(
            base_url=gateway.base_url + "/v1", api_key=key, max_retries=0
        ) as aclient:
            outs = await asyncio.gather(
                *(
                    aclient.completions.create(model="tiny", prompt=f"n{i}", max_tokens=3)
                    for i in range(6)
                )
            )
        return sum(o.usage.completion_tokens for o in outs if o.usage)

    assert asyncio.run(go()) == 18
    records = cli(data_dir, "usage", "--tenant", "acme", "--json")
    assert len(records) == 10  # models.list is not a generation request
    assert {r["status"] for r in records} == {200}
    assert {r["outcome"] for r in records} == {"completed"}
    assert len({r["request_id"] for r in records}) == 10
    streamed = [r for r in records if r["stream"]]
    assert [r["completion_tokens"] for r in streamed] == [6, 6]
    assert all(r["ttft_ms"] is not None and r["ttft_ms"] <= r["e2e_ms"] for r in records)
    assert all(r["cost_usd"] > 0 and r["replica"] == "tiny/0" for r in records)


def error_of(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"])
    assert "x-request-id" in response.headers
    return dict(body["error"])


def test_bad_requests_get_openai_errors(gateway: EngineServer, data_dir: Path) -> None:
    key = new_key(data_dir, "errors")
    url = gateway.base_url + "/v1/completions"
    auth = {"authorization": f"Bearer {key}"}
    good = {"model": "tiny", "prompt": "x", "max_tokens": 1}
    r = httpx.post(url, json=good)
    assert r.status_code == 401 and error_of(r)["code"] == "invalid_api_key"
    r = httpx.post(url, json=good, headers={"authorization": "Bearer ic-nope-wrong"})
    assert r.status_code == 401
    r = httpx.post(url, json={**good, "model": "gpt-9"}, headers=auth)
    assert r.status_code == 404 and error_of(r)["code"] == "model_not_found"
    r = httpx.post(url, content=b"{not json", headers={**auth, "content-type": "application/json"})
    assert r.status_code == 400 and error_of(r)["code"] == "invalid_json"
    r = httpx.post(url, json={**good, "max_tokens": "lots"}, headers=auth)
    assert r.status_code == 400 and error_of(r)["param"] == "max_tokens"
    r = httpx.post(url, json={**good, "prompt": "x" * 70000}, headers=auth)
    assert r.status_code == 413
    chunked = json.dumps({**good, "prompt": "x" * 70000}).encode()
    r = httpx.post(  # no declared length: refused once the bytes pass the limit
        url,
        content=(chunked[i : i + 8192] for i in range(0, len(chunked), 8192)),
        headers={**auth, "content-type": "application/json"},
    )
    assert r.status_code == 413 and error_of(r)["type"] == "invalid_request_error"
    assert r.headers["x-request-id"].startswith("req-")
    r = httpx.post(url, json={**good, "temperature": -3}, headers=auth)
    assert r.status_code == 400  # the replica's own validation, relayed
    with client_for(gateway, key) as client, pytest.raises(openai.AuthenticationError):
        client.completions.create(
            model="tiny", prompt="x", max_tokens=1, extra_headers={"authorization": "Bearer bad"}
        )
    records = cli(data_dir, "usage", "--tenant", "errors", "--json")
    # one record each, with the tenant, also for bodies refused before the gateway read them
    assert sorted(r["status"] for r in records) == [400, 400, 400, 404, 413, 413]
    assert [r["outcome"] for r in records].count("refused") == 5  # the replica's 400 is failed
    anonymous = [r for r in cli(data_dir, "usage", "--json") if r["tenant"] == ""]
    assert len(anonymous) >= 3 and {r["status"] for r in anonymous} == {401}


def test_revoked_key_fails_on_its_next_request(gateway: EngineServer, data_dir: Path) -> None:
    created = httpx.post(
        gateway.base_url + "/admin/keys",
        json={"tenant": "temp", "priority": "batch"},
        headers={"authorization": f"Bearer {ADMIN}"},
    ).json()
    with client_for(gateway, created["key"]) as client:
        client.completions.create(model="tiny", prompt="x", max_tokens=1)
        cli(data_dir, "keys", "revoke", created["key_id"])
        with pytest.raises(openai.AuthenticationError):
            client.completions.create(model="tiny", prompt="x", max_tokens=1)
    listed = httpx.get(
        gateway.base_url + "/admin/keys", headers={"authorization": f"Bearer {ADMIN}"}
    ).json()["data"]
    mine = [k for k in listed if k["key_id"] == created["key_id"]]
    assert mine[0]["revoked_at_s"] is not None and "secret_sha256" not in mine[0]
    r = httpx.get(gateway.base_url + "/admin/keys", headers={"authorization": "Bearer x"})
    assert r.status_code == 401

    admin = {"authorization": f"Bearer {ADMIN}"}
    second = httpx.post(gateway.base_url + "/admin/keys", json={"tenant": "temp"}, headers=admin)
    key_id = second.json()["key_id"]
    with client_for(gateway, second.json()["key"]) as client:
        client.completions.create(model="tiny", prompt="x", max_tokens=1)
        r = httpx.delete(f"{gateway.base_url}/admin/keys/{key_id}", headers=admin)
        assert r.status_code == 200 and r.json() == {"key_id": key_id, "revoked": True}
        with pytest.raises(openai.AuthenticationError):
            client.completions.create(model="tiny", prompt="x", max_tokens=1)
    r = httpx.delete(f"{gateway.base_url}/admin/keys/{key_id}", headers=admin)
    assert r.status_code == 404 and error_of(r)["code"] == "key_not_found"
    listed = cli(data_dir, "keys", "list", "--tenant", "temp", "--json")
    assert {k["key_id"] for k in listed} == {created["key_id"], key_id}
    assert all(k["revoked_at_s"] is not None and "secret_sha256" not in k for k in listed)
    assert all(created["key"] not in json.dumps(k) for k in listed)
    text = run_cli(data_dir, "keys", "list", "--tenant", "temp").stdout
    lines = sorted(line.split("\t")[:4] for line in text.splitlines())
    assert lines == sorted([k["key_id"], "temp", k["priority"], "revoked"] for k in listed)


def test_a_tenant_reads_only_its_own_usage(gateway: EngineServer, data_dir: Path) -> None:
    key_a, key_b = new_key(data_dir, "tenant-a"), new_key(data_dir, "tenant-b")
    with client_for(gateway, key_a) as a:
        a.completions.create(model="tiny", prompt="secret of a", max_tokens=2)
    for key, tenant in ((key_a, "tenant-a"), (key_b, "tenant-b")):
        data = httpx.get(
            gateway.base_url + "/v1/usage", headers={"authorization": f"Bearer {key}"}
        ).json()["data"]
        assert {r["tenant"] for r in data} <= {tenant}
    data_b = httpx.get(
        gateway.base_url + "/v1/usage", headers={"authorization": f"Bearer {key_b}"}
    ).json()["data"]
    assert data_b == []


def test_no_key_can_be_made_for_the_admin_tenant(gateway: EngineServer, data_dir: Path) -> None:
    """Requests made with the admin key are recorded under the tenant "admin": a key of that
    tenant would read them through /v1/usage, so neither the CLI nor the admin API makes one."""
    admin = {"authorization": f"Bearer {ADMIN}"}
    body = {"model": "tiny", "prompt": "admin's own request", "max_tokens": 1}
    assert httpx.post(gateway.base_url + "/v1/completions", json=body, headers=admin).is_success
    out = run_cli(data_dir, "keys", "create", "--tenant", "admin", "--json", check=False)
    assert out.returncode == 2 and "reserved" in out.stderr and out.stdout == ""
    r = httpx.post(gateway.base_url + "/admin/keys", json={"tenant": "admin"}, headers=admin)
    assert r.status_code in (400, 422)
    error = error_of(r)
    assert error["type"] == "invalid_request_error" and "reserved" in error["message"]
    assert all(k["tenant"] != "admin" for k in cli(data_dir, "keys", "list", "--json"))


def test_requests_per_minute_limit(gateway: EngineServer, data_dir: Path) -> None:
    key = new_key(data_dir, "limited", "--rpm", "5")
    url = gateway.base_url + "/v1/completions"
    statuses, last = [], None
    for _ in range(8):
        last = httpx.post(
            url,
            json={"model": "tiny", "prompt": "x", "max_tokens": 1},
            headers={"authorization": f"Bearer {key}"},
        )
        statuses.append(last.status_code)
    assert statuses == [200] * 5 + [429] * 3
    assert last is not None
    assert error_of(last)["code"] == "rate_limit_exceeded"
    assert int(last.headers["retry-after"]) >= 1
    assert last.headers["x-ratelimit-limit-requests"] == "5"
    assert last.headers["x-ratelimit-remaining-requests"] == "0"
    records = cli(data_dir, "usage", "--tenant", "limited", "--json")
    assert sorted(r["status"] for r in records) == [200] * 5 + [429] * 3


def cached_tokens(client: openai.OpenAI, prompt: str, cache_salt: str | None = None) -> int:
    extra = {"cache_salt": cache_salt} if cache_salt is not None else None
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=1, extra_body=extra)
    assert out.usage is not None and out.usage.prompt_tokens_details is not None
    return int(out.usage.prompt_tokens_details.cached_tokens or 0)


def test_prefix_cache_is_isolated_by_tenant_and_shared_within_an_operators_group(
    gateway: EngineServer, data_dir: Path
) -> None:
    """Tenant B sending tenant A's exact prompt gets no cached tokens, A sending it again does;
    `north` and `south`, put in one cache group by the config, share theirs, and only with each
    other (also when the client gives a `cache_salt`: then only with the same salt)."""
    prompts = [f"{uuid.uuid4().hex} " + "the same long shared preamble " * 20 for _ in range(3)]
    keys = {t: new_key(data_dir, t) for t in ("iso-a", "iso-b", "north", "south")}
    clients = {t: client_for(gateway, k) for t, k in keys.items()}
    try:
        assert cached_tokens(clients["iso-a"], prompts[0]) == 0
        assert cached_tokens(clients["iso-b"], prompts[0]) == 0
        assert cached_tokens(clients["iso-a"], prompts[0]) > 0
        assert cached_tokens(clients["north"], prompts[0]) == 0

        assert cached_tokens(clients["north"], prompts[1]) == 0
        assert cached_tokens(clients["south"], prompts[1]) > 0
        assert cached_tokens(clients["iso-a"], prompts[1]) == 0

        assert cached_tokens(clients["north"], prompts[2], "project-x") == 0
        assert cached_tokens(clients["south"], prompts[2]) == 0  # no salt: another namespace
        assert cached_tokens(clients["south"], prompts[2], "project-x") > 0
    finally:
        for client in clients.values():
            client.close()


def post_completion(gateway: EngineServer, key: str, **body: Any) -> httpx.Response:
    return httpx.post(
        gateway.base_url + "/v1/completions",
        json={"model": "tiny", "prompt": "x", "max_tokens": 1, **body},
        headers={"authorization": f"Bearer {key}"},
        timeout=30,
    )


def test_tokens_per_minute_count_the_real_prompt_and_the_actual_output(
    gateway: EngineServer, data_dir: Path
) -> None:
    """A key of 120 tokens per minute: each request takes its prompt's tokens (from the real
    tokenizer) when it starts and its output's when it ends, so 30 generated tokens a request
    exhaust the bucket in a few requests (counting prompts alone would admit 120 / prompt).
    A prompt over the whole limit is refused at once, with no Retry-After: waiting cannot help."""
    key = new_key(data_dir, "metered-tokens", "--tpm", "120")
    statuses: list[int] = []
    prompt_tokens = 0
    for _ in range(12):
        r = post_completion(gateway, key, prompt="count the tokens", max_tokens=30, ignore_eos=True)
        statuses.append(r.status_code)
        if r.status_code != 200:
            break
        prompt_tokens = r.json()["usage"]["prompt_tokens"]
        assert r.json()["usage"]["completion_tokens"] == 30
    admitted = statuses.count(200)
    assert statuses[-1] == 429 and 2 <= admitted <= 120 // (prompt_tokens + 30) + 2, statuses
    assert admitted < 120 // prompt_tokens  # the output was counted
    assert error_of(r)["code"] == "rate_limit_exceeded"
    assert r.headers["x-ratelimit-limit-tokens"] == "120"
    assert int(r.headers["x-ratelimit-remaining-tokens"]) < prompt_tokens
    assert int(r.headers["retry-after"]) >= 1

    big = new_key(data_dir, "metered-tokens", "--tpm", "120")
    r = post_completion(gateway, big, prompt="many words " * 100)
    assert r.status_code == 429 and error_of(r)["code"] == "request_too_large"
    assert r.headers["x-ratelimit-limit-tokens"] == "120" and "retry-after" not in r.headers
    records = cli(data_dir, "usage", "--tenant", "metered-tokens", "--json")
    assert sorted(r["status"] for r in records) == sorted([*statuses, 429])


def test_a_spent_budget_refuses_until_the_next_period(
    gateway: EngineServer, data_dir: Path
) -> None:
    """A key with a budget of $0.00001 (the model costs $1 / $2 per million prompt / output
    tokens): its first request spends more than that, the next is refused with
    `insufficient_quota` and a Retry-After that points at the start of next month."""
    key = new_key(data_dir, "spender", "--budget-usd", "0.00001")
    first = post_completion(gateway, key, prompt="spend it all now", max_tokens=8, ignore_eos=True)
    assert first.status_code == 200
    r = post_completion(gateway, key)
    assert r.status_code == 429 and error_of(r)["code"] == "insufficient_quota"
    assert 1 <= int(r.headers["retry-after"]) <= 31 * 86400
    records = cli(data_dir, "usage", "--tenant", "spender", "--json")
    assert sorted(r["status"] for r in records) == [200, 429]
    assert records[0]["cost_usd"] + records[1]["cost_usd"] > 0.00001


def test_a_tenants_limit_in_the_config_binds_all_its_keys_together(
    gateway: EngineServer, data_dir: Path
) -> None:
    """`tenants: {capped: {rpm: 2}}`: two keys of that tenant, with no limits of their own,
    share its 2 requests per minute."""
    one, two = new_key(data_dir, "capped"), new_key(data_dir, "capped")
    assert post_completion(gateway, one).status_code == 200
    assert post_completion(gateway, two).status_code == 200
    r = post_completion(gateway, one)
    assert r.status_code == 429 and r.headers["x-ratelimit-limit-requests"] == "2"
    assert post_completion(gateway, new_key(data_dir, "uncapped")).status_code == 200
