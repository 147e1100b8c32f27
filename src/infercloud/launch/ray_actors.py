"""Builtin replicas as Ray actors, on a local Ray cluster (`ray.init()`) or one at an address.

Each replica is one actor (`EngineActor`, no CPUs reserved: the engine's torch threads are its
real use) that runs `infercloud engine` as its child on the actor's node, bound to the node's
address, with `--parent-pid` so that the engine ends when the actor does (killed, or its node
lost). The actor reports the engine's URL; the gateway talks HTTP to it like to any replica.
Ray's own actor restarts are off: the gateway replaces a dead replica itself (with backoff),
the same way for every launcher.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from infercloud.gateway.config import BuiltinReplica, ModelDeployment
from infercloud.gateway.replicas import Replica
from infercloud.launch.base import engine_argv

NAMESPACE = "infercloud"


class EngineActor:
    """Runs inside the actor's worker process."""

    def __init__(self, argv: list[str], log_path: str | None) -> None:
        import socket

        import ray

        host: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        with socket.socket() as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        cmd = [sys.executable, "-m", "infercloud", "engine", *argv]
        cmd += ["--host", host, "--port", str(port), "--parent-pid", str(os.getpid())]
        out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115
        self.popen = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        self.url = f"http://{host}:{port}"

    def info(self) -> dict[str, Any]:
        return {"url": self.url, "pid": os.getpid(), "engine_pid": self.popen.pid}

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, timeout_s: float) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


class RayActor:
    """The gateway's handle on one replica actor."""

    def __init__(self, actor: Any, pid: int) -> None:
        self.actor = actor
        self._pid = pid

    @property
    def pid(self) -> int | None:
        return self._pid

    def exit_status(self) -> str | None:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        try:
            alive = ray.get(self.actor.alive.remote(), timeout=5.0)
        except GetTimeoutError:
            return None  # busy or slow: the health checks judge it
        except RayActorError as exc:
            return f"actor died: {type(exc).__name__}"
        return None if alive else "engine exited"

    def stop(self, timeout_s: float = 20.0) -> None:
        import ray
        from ray.exceptions import RayActorError

        with contextlib.suppress(RayActorError, ray.exceptions.GetTimeoutError):
            ray.get(self.actor.stop.remote(timeout_s), timeout=timeout_s + 10)
        ray.kill(self.actor, no_restart=True)


class RayLauncher:
    name = "ray"

    def __init__(self, address: str | None, log_dir: Path | None = None) -> None:
        import ray

        self.log_dir = log_dir
        if not ray.is_initialized():
            ray.init(
                address=address,
                namespace=NAMESPACE,
                include_dashboard=False,
                log_to_driver=False,
                configure_logging=False,
            )
        self._remote = ray.remote(num_cpus=0, max_restarts=0)(EngineActor)
        self._generation = 0

    def start(self, deployment: ModelDeployment, index: int, spec: BuiltinReplica) -> Replica:
        import ray

        self._generation += 1
        log_path = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            log_path = str(self.log_dir / f"ray-{deployment.name.replace('/', '_')}-{index}.log")
        actor = self._remote.options(
            name=f"{deployment.name}-{index}-{self._generation}-{time.time_ns()}"
        ).remote(engine_argv(deployment, spec), log_path)
        info: Any = ray.get(actor.info.remote(), timeout=300)  # type: ignore[attr-defined]
        return Replica(
            f"{deployment.name}/{index}",
            info["url"],
            deployment.name,
            builtin=True,
            process=RayActor(actor, info["pid"]),
            log_path=Path(log_path) if log_path else None,
        )

    def close(self) -> None:
        import ray

        if ray.is_initialized():
            ray.shutdown()
