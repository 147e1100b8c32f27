"""The second tier over HTTP: a prefix evicted from a tiny device pool comes back from the host,
reported in `cached_tokens`, the per-tier metrics, the migration counters and the KV events."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from infercloud.engine.model_config import ModelConfig
from tests.conftest import EngineServer


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[EngineServer]:
    block_bytes = 16 * ModelConfig.from_folder(tiny_model_dir).kv_bytes_per_token * 4
    args = ["--model", str(tiny_model_dir), "--served-model-name", "tiny"]
    args += ["--kv-cache-bytes", str(5 * block_bytes), "--host-cache-bytes", "8MiB"]
    args += ["--host-cache-load", "always"]  # the tiny model may recompute faster than it copies
    s = EngineServer(args)
    yield s
    s.stop()


def test_evicted_prefix_is_served_from_the_host_tier(server: EngineServer) -> None:
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0) as client:
        check_round_trip(server, client)


def check_round_trip(server: EngineServer, client: openai.OpenAI) -> None:
    prompt_a = list(range(100, 170))  # 70 tokens: 4 full blocks may hit
    prompt_b = list(range(300, 370))

    def cached(prompt: list[int]) -> int:
        usage = client.completions.create(model="tiny", prompt=prompt, max_tokens=2).usage
        assert usage is not None and usage.prompt_tokens_details is not None
        return usage.prompt_tokens_details.cached_tokens or 0

    seq = httpx.get(server.base_url + "/kv_events").json()["seq"]
    assert cached(prompt_a) == 0
    assert cached(prompt_b) == 0  # the device pool holds one of them: a's blocks move out
    migrations = 'infercloud:kv_block_migrations_total{direction="%s",model_name="tiny"}'
    assert server.metric(migrations % "device_to_host") >= 4
    assert cached(prompt_a) == 64
    assert server.metric('infercloud:prefix_cache_hits_total{model_name="tiny",tier="host"}') == 64
    assert server.metric(migrations % "host_to_device") == 4
    events = httpx.get(server.base_url + "/kv_events", params={"since": seq}).json()["events"]
    host_stored = [e for e in events if e["medium"] == "host" and e["type"] == "BlockStored"]
    assert sum(len(e["block_hashes"]) for e in host_stored) >= 4
