"""schemathesis against the gateway's own OpenAPI schema, over a real loopback server.

Every operation is called with bodies, parameters and headers generated from the schema, both
valid ones (positive mode: they reach our engine behind the gateway) and invalid ones (negative
mode: wrong types, missing fields). No answer may be a 5xx, and every error must be an OpenAI
error body. Called once with the admin key (which reaches every endpoint) and once with a bad key.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from tests.conftest import EngineServer

ADMIN = "ic-admin-schema-key"


@pytest.fixture(scope="module")
def schema_gateway(
    tiny_server: EngineServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineServer]:
    data_dir: Path = tmp_path_factory.mktemp("gateway-schema")
    config = data_dir / "deploy.yaml"
    config.write_text(
        "models:\n"
        "  - name: tiny\n"
        "    replicas:\n"
        f"      - upstream: {{url: '{tiny_server.base_url}', model: tiny}}\n"
        "gateway: {max_body_bytes: 65536, queue_timeout_s: 5}\n"
    )
    args = ["--config", str(config), "--data-dir", str(data_dir), "--admin-key", ADMIN]
    server = EngineServer(args, command="serve")
    yield server
    server.stop()


def _check(response: Any, label: str) -> None:
    assert response.status_code < 500, (label, response.status_code, response.text[:500])
    if response.status_code >= 400:
        body = response.json()
        assert set(body) == {"error"}, (label, body)
        assert {"message", "type", "param", "code"} <= set(body["error"]), (label, body)
    (request_id,) = response.headers["x-request-id"]
    assert request_id.startswith("req-"), label


@pytest.mark.slow
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
@pytest.mark.parametrize("key", ["admin", "bad"])
def test_no_server_error_on_any_operation(
    schema_gateway: EngineServer, mode: GenerationMode, key: str
) -> None:
    # The pytest plugin of schemathesis 4.32 fails on pytest 9 ('Function' has no '_nodeid'),
    # so each operation's strategy is drawn from with hypothesis directly.
    schema = schemathesis.openapi.from_url(schema_gateway.base_url + "/openapi.json")
    token = ADMIN if key == "admin" else "ic-nope-nope"
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/completions"}
    fuzzed = set()
    for op in operations:
        try:
            _fuzz(op, mode, schema_gateway.base_url, token, expect_4xx=key == "bad")
        except Unsatisfiable:  # negative mode: an operation without inputs has none to break
            assert mode is GenerationMode.NEGATIVE and not op.body and not op.query, op.label
            continue
        fuzzed.add(op.path)
    assert {"/v1/chat/completions", "/v1/completions", "/admin/keys"} <= fuzzed


def _fuzz(op: Any, mode: GenerationMode, base_url: str, token: str, expect_4xx: bool) -> None:
    @settings(
        max_examples=10 if expect_4xx else 30,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    @given(case=op.as_strategy(generation_mode=mode))
    def call(case: Any) -> None:
        # A generated max_tokens can be large; keep the engine's work per call small.
        if isinstance(case.body, dict) and isinstance(case.body.get("max_tokens"), int):
            case.body["max_tokens"] = min(case.body["max_tokens"], 8)
        headers = {**(case.headers or {}), "Authorization": f"Bearer {token}"}
        response = case.call(base_url=base_url, headers=headers, timeout=60)
        _check(response, case.as_curl_command())
        if expect_4xx and op.path.startswith(("/v1/", "/admin/")):
            assert 400 <= response.status_code < 500, (op.label, response.text[:300])

    call()
