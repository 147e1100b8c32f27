"""Replicas the gateway sends requests to: builtin engines it starts itself, or upstream URLs.

A builtin replica is `infercloud engine` in a subprocess on a free loopback port, started with
priority scheduling so that the gateway's classes reach the engine's scheduler; the gateway waits
for its `/health` before serving and stops it (SIGTERM, then SIGKILL) on shutdown. An upstream
replica is only a URL.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from infercloud.gateway.config import BuiltinReplica, ModelDeployment, UpstreamReplica


@dataclass(slots=True)
class Replica:
    name: str
    """Stable label for usage records: `<model>/<index>`."""
    url: str
    """Base URL without `/v1`."""
    served_model: str
    builtin: bool
    api_key: str | None = None
    process: subprocess.Popen[bytes] | None = None
    log_path: Path | None = None

    def stop(self, timeout_s: float = 20.0) -> None:
        proc = self.process
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_builtin(
    deployment: ModelDeployment, index: int, spec: BuiltinReplica, log_dir: Path
) -> Replica:
    port = free_port()
    cmd = [sys.executable, "-m", "infercloud", "engine", "--model", spec.model]
    cmd += ["--served-model-name", deployment.name, "--port", str(port)]
    cmd += ["--dtype", spec.dtype, "--kv-cache-bytes", str(spec.kv_cache_bytes)]
    cmd += ["--scheduling-policy", "priority", "--log-level", "warning", *spec.args]
    if spec.threads is not None:
        cmd += ["--threads", str(spec.threads)]
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"replica-{deployment.name.replace('/', '_')}-{index}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
    return Replica(
        f"{deployment.name}/{index}",
        f"http://127.0.0.1:{port}",
        deployment.name,
        builtin=True,
        process=proc,
        log_path=log_path,
    )


def upstream(deployment: ModelDeployment, index: int, spec: UpstreamReplica) -> Replica:
    return Replica(
        f"{deployment.name}/{index}",
        spec.url.rstrip("/").removesuffix("/v1"),
        spec.model or deployment.name,
        builtin=False,
        api_key=spec.api_key,
    )


def wait_ready(replicas: list[Replica], timeout_s: float = 300.0) -> None:
    """Block until every builtin replica answers `/health`; raise if one exits or times out."""
    deadline = time.monotonic() + timeout_s
    for r in replicas:
        if not r.builtin:
            continue
        while True:
            if r.process is not None and r.process.poll() is not None:
                tail = r.log_path.read_text()[-2000:] if r.log_path else ""
                raise RuntimeError(f"replica {r.name} exited ({r.process.returncode}):\n{tail}")
            try:
                if httpx.get(r.url + "/health", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"replica {r.name} not ready after {timeout_s:.0f} s")
            time.sleep(0.2)
