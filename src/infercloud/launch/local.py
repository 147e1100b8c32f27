"""Builtin replicas as local subprocesses: `infercloud engine` on a free loopback port."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from infercloud.gateway.config import BuiltinReplica, ModelDeployment
from infercloud.gateway.replicas import Replica, free_port
from infercloud.launch.base import engine_argv


@dataclass(slots=True)
class Subprocess:
    popen: subprocess.Popen[bytes]

    @property
    def pid(self) -> int | None:
        return self.popen.pid

    def exit_status(self) -> str | None:
        code = self.popen.poll()
        return None if code is None else f"exited with {code}"

    def stop(self, timeout_s: float = 20.0) -> None:
        if self.popen.poll() is not None:
            return
        self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()


class LocalLauncher:
    name = "local"

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir

    def start(self, deployment: ModelDeployment, index: int, spec: BuiltinReplica) -> Replica:
        port = free_port()
        cmd = [sys.executable, "-m", "infercloud", "engine", *engine_argv(deployment, spec)]
        cmd += ["--port", str(port)]
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"replica-{deployment.name.replace('/', '_')}-{index}.log"
        with log_path.open("ab") as log:
            popen = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ)
            )
        return Replica(
            f"{deployment.name}/{index}",
            f"http://127.0.0.1:{port}",
            deployment.name,
            builtin=True,
            process=Subprocess(popen),
            log_path=log_path,
        )

    def close(self) -> None:
        pass
