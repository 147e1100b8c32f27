"""Replicas the gateway sends requests to: builtin engines a launcher started (`launch/`), or
upstream URLs.

A builtin replica carries its process handle (`ReplicaProcess`: alive or not, stop); the gateway
waits for its `/health` before serving and stops it on shutdown. An upstream replica is only a
URL.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import httpx

from infercloud.gateway.config import ModelDeployment, UpstreamReplica


class ReplicaProcess(Protocol):
    @property
    def pid(self) -> int | None:
        """The process to signal (a Ray replica's actor worker)."""
        ...

    def exit_status(self) -> str | None:
        """None while the engine lives; what happened once it is gone."""
        ...

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM (the engine finishes what it runs), SIGKILL after the timeout."""
        ...


@dataclass(slots=True)
class Replica:
    name: str
    """Stable label for usage records: `<model>/<index>`."""
    url: str
    """Base URL without `/v1`."""
    served_model: str
    builtin: bool
    api_key: str | None = None
    takes_priority: bool = False
    """Whether requests carry their class as `priority` (0 interactive, 1 standard, 2 batch;
    lower goes first, as in vLLM): always for our own engine, for an upstream where the config
    says it schedules by priority (vLLM with `--scheduling-policy priority` refuses the field
    otherwise)."""
    process: ReplicaProcess | None = None
    log_path: Path | None = None

    def __post_init__(self) -> None:
        self.takes_priority = self.takes_priority or self.builtin

    def stop(self, timeout_s: float = 20.0) -> None:
        if self.process is not None:
            self.process.stop(timeout_s)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def upstream(deployment: ModelDeployment, index: int, spec: UpstreamReplica) -> Replica:
    return Replica(
        f"{deployment.name}/{index}",
        spec.url.rstrip("/").removesuffix("/v1"),
        spec.model or deployment.name,
        builtin=False,
        api_key=spec.api_key,
        takes_priority=spec.priority,
    )


def wait_ready(replicas: list[Replica], timeout_s: float = 300.0) -> None:
    """Block until every builtin replica answers `/health`; raise if one exits or times out."""
    deadline = time.monotonic() + timeout_s
    for r in replicas:
        if not r.builtin:
            continue
        while True:
            status = r.process.exit_status() if r.process is not None else None
            if status is not None:
                tail = r.log_path.read_text()[-2000:] if r.log_path else ""
                raise RuntimeError(f"replica {r.name} {status}:\n{tail}")
            try:
                if httpx.get(r.url + "/health", timeout=2.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"replica {r.name} not ready after {timeout_s:.0f} s")
            time.sleep(0.2)
