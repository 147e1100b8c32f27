"""Shared fixtures: the tiny random Llama (seconds), the real SmolLM2 (converted once), servers."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from infercloud.models.tiny import build_tiny_llama


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    from infercloud.models.registry import prepare_default_model

    return prepare_default_model()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EngineServer:
    """`infercloud <command> --port P ...` in a subprocess, its output in a temporary log file;
    ready once `/health` answers 200."""

    def __init__(
        self,
        args: list[str],
        timeout_s: float = 120.0,
        command: str = "engine",
        env: dict[str, str] | None = None,
    ) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "infercloud", command, "--port", str(self.port), *args]
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - lives as long as the server
            prefix=f"infercloud-{command}-", suffix=".log"
        )
        self.process = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                output = Path(self.log.name).read_text()[-4000:]
                raise RuntimeError(f"{command} exited with {self.process.returncode}:\n{output}")
            try:
                if httpx.get(self.base_url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"{command} server did not become healthy")

    def metric(self, name: str, labels: str = "", default: float | None = None) -> float:
        """The first sample of `name` whose line contains `labels` (e.g.
        'finished_reason="abort"'); `default` when there is none, else KeyError."""
        text = httpx.get(self.base_url + "/metrics", timeout=5.0).text
        for line in text.splitlines():
            if (line.startswith(name + "{") or line.startswith(name + " ")) and labels in line:
                return float(line.rsplit(" ", 1)[1])
        if default is not None:
            return default
        raise KeyError(name)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


@pytest.fixture(scope="session")
def tiny_server(tiny_model_dir: Path) -> Iterator[EngineServer]:
    server = EngineServer(
        ["--model", str(tiny_model_dir), "--served-model-name", "tiny", "--kv-cache-bytes", "4MiB"]
    )
    yield server
    server.stop()
