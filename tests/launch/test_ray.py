"""Replicas as Ray actors: the test starts a local Ray cluster (`ray start --head`), the gateway
joins it and starts two replica actors, requests are served through the gateway by both, and an
actor killed with SIGKILL is replaced by a new one that serves again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from infercloud.models.registry import cache_dir
from tests.conftest import EngineServer, free_port
from tests.gateway.conftest import cli

ADMIN = "ic-admin-ray"
RAY = str(Path(sys.executable).parent / "ray")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    port = free_port()
    temp = tmp_path_factory.mktemp("ray")
    env = {**os.environ, **ray_env(temp)}
    subprocess.run(
        [
            *(
                RAY,
                "start",
                "--head",
                f"--port={port}",
                "--num-cpus=2",
                "--node-ip-address=127.0.0.1",
            ),
            *("--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={temp}"),
        ],
        check=True,
        capture_output=True,
        env=env,
        timeout=180,
    )
    try:
        yield f"127.0.0.1:{port}", temp
    finally:
        subprocess.run([RAY, "stop", "--force"], capture_output=True, env=env, timeout=120)


def ray_env(temp: Path) -> dict[str, str]:
    """A private HOME: `ray start` keeps an auth token in ~/.ray, and a token left there by an
    earlier cluster makes the next one refuse its clients. The cache stays where it was (the
    CPU kernels built once, the embedded model converted once): under the private HOME, each
    actor's first replica rebuilt the kernels, 3.5 of the test's 4 minutes on a Zen 3."""
    return {
        "RAY_USAGE_STATS_ENABLED": "0",
        "HOME": str(temp),
        "INFERCLOUD_CACHE_DIR": str(cache_dir()),
    }


def rows(gw: EngineServer) -> list[dict[str, object]]:
    r = httpx.get(gw.base_url + "/admin/replicas", headers={"Authorization": f"Bearer {ADMIN}"})
    return list(r.json()["data"])


def test_two_ray_actors_serve_and_a_killed_one_is_replaced(
    ray_cluster: tuple[str, Path], tiny_model_dir: Path, tmp_path: Path
) -> None:
    address, ray_home = ray_cluster
    replica = (
        f"      - builtin: {{model: '{tiny_model_dir}', dtype: float32, kv_cache_bytes: 4MiB, "
        "threads: 1}\n"
    )
    (tmp_path / "deploy.yaml").write_text(
        "models:\n"
        "  - name: tiny\n"
        "    routing: {policy: round_robin, health_interval_s: 0.25}\n"
        "    replicas:\n" + replica * 2 + f"gateway: {{launcher: ray, ray_address: '{address}'}}\n"
    )
    args = ["--config", str(tmp_path / "deploy.yaml"), "--data-dir", str(tmp_path)]
    gw = EngineServer(
        [*args, "--admin-key", ADMIN],
        command="serve",
        timeout_s=240,
        env=ray_env(ray_home),
    )
    try:
        key = cli("keys", "create", "--tenant", "r", "--json", "--data-dir", str(tmp_path))["key"]
        with openai.OpenAI(base_url=gw.base_url + "/v1", api_key=key, max_retries=0) as client:

            def ask(n: int) -> None:
                for i in range(n):
                    out = client.completions.create(model="tiny", prompt=f"ray {i}", max_tokens=3)
                    assert out.usage is not None and out.usage.completion_tokens == 3

            ask(4)
            before = {str(r["name"]): r for r in rows(gw)}
            assert {r["launcher"] for r in before.values()} == {"RayActor"}
            assert all(r["status"] == "healthy" for r in before.values())
            victim = before["tiny/0"]
            os.kill(int(str(victim["pid"])), signal.SIGKILL)  # the actor's worker process
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                now = {str(r["name"]): r for r in rows(gw)}
                if now["tiny/0"]["restarts"] == 1 and now["tiny/0"]["status"] == "healthy":
                    break
                time.sleep(0.25)
            assert now["tiny/0"]["restarts"] == 1 and now["tiny/0"]["status"] == "healthy", now
            assert now["tiny/0"]["pid"] != victim["pid"]
            ask(4)
        records = cli("usage", "--tenant", "r", "--json", "--data-dir", str(tmp_path))
        assert len(records) == 8 and {r["status"] for r in records} == {200}
        assert {r["replica"] for r in records} == {"tiny/0", "tiny/1"}
    finally:
        gw.stop()
