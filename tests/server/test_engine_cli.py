"""`infercloud engine`'s start flags, read back from the running server: --dtype, --host and
--kv-cache-bytes reach the engine (the pool holds kv_cache_bytes // bytes per block blocks)."""

from __future__ import annotations

from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from infercloud.engine.model_config import ModelConfig
from tests.conftest import EngineServer


def cache_config(server: EngineServer) -> dict[str, str]:
    """The labels of `infercloud:cache_config_info`, read with prometheus_client's own parser."""
    text = httpx.get(server.base_url + "/metrics").text
    family = next(
        f for f in text_string_to_metric_families(text) if f.name == "infercloud:cache_config_info"
    )
    return dict(family.samples[0].labels)


def test_dtype_host_and_pool_bytes_reach_the_engine(tiny_model_dir: Path) -> None:
    per_block = 16 * ModelConfig.from_folder(tiny_model_dir).kv_bytes_per_token * 2  # bfloat16
    pool = 3 << 20
    server = EngineServer(
        [
            "--model",
            str(tiny_model_dir),
            "--served-model-name",
            "tiny-bf16",
            "--dtype",
            "bfloat16",
            "--host",
            "127.0.0.1",
            "--kv-cache-bytes",
            "3MiB",
        ]
    )
    try:
        config = cache_config(server)
        assert config["model_name"] == "tiny-bf16"
        assert config["cache_dtype"] == "bfloat16" and config["block_size"] == "16"
        assert config["kv_cache_bytes"] == str(pool)
        assert int(config["num_blocks"]) == pool // per_block
        r = httpx.post(
            server.base_url + "/v1/completions",
            json={"model": "tiny-bf16", "prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True},
            timeout=60.0,
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        server.stop()


def test_default_server_reports_its_float32_pool(
    tiny_server: EngineServer, tiny_model_dir: Path
) -> None:
    per_block = 16 * ModelConfig.from_folder(tiny_model_dir).kv_bytes_per_token * 4
    config = cache_config(tiny_server)
    assert config["cache_dtype"] == "float32"
    assert int(config["num_blocks"]) == (4 << 20) // per_block
