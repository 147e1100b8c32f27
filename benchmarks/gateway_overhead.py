"""What a gateway adds: a stub upstream measured directly, through infercloud, through LiteLLM.

One run, same machine, same load: `wrk` keeps C connections busy (C = 1, 16 and 64) for D
seconds each, POSTing a streamed chat completion (16 chunks + usage) to
  - the stub itself (`benchmarks/stub_upstream.py`), the floor;
  - `infercloud serve` with the stub as its upstream replica, with a real tenant key (so the
    key lookup in SQLite, the rate-limit buckets, admission and the usage record are all on
    the path);
  - the LiteLLM proxy (`litellm[proxy]` in .bench-venvs/litellm, master key only,
    LITELLM_LOCAL_MODEL_COST_MAP=True) with the stub as its model.
Reports requests per second and p50 / p99 latency, and each gateway's added p50 / p99 over the
stub's.

    .venv/bin/python benchmarks/gateway_overhead.py [--duration 15] [--rounds 3] [--out F]

With `--rounds N` each concurrency runs the targets N times, alternating (stub, infercloud,
LiteLLM, stub, ...), and reports medians: this machine's noise moves one 15 s run by 5-20%.

Needs `wrk` (Debian: apt-get install wrk) and, for the LiteLLM column,
`python3 -m venv .bench-venvs/litellm && .bench-venvs/litellm/bin/pip install 'litellm[proxy]'`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
LITELLM = ROOT / ".bench-venvs" / "litellm" / "bin" / "litellm"
BODY = {
    "model": "stub",
    "messages": [{"role": "user", "content": "hello"}],
    "max_tokens": 16,
    "stream": True,
}


def wait_http(url: str, timeout_s: float, headers: dict[str, str] | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2.0, headers=headers).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} did not answer in {timeout_s:.0f} s")


def start(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    with log.open("wb") as f:
        return subprocess.Popen(
            cmd,
            stdout=f,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )


def stop(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        with __import__("contextlib").suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def wrk(url: str, key: str, connections: int, duration_s: int, work: Path) -> dict[str, float]:
    script = work / "post.lua"
    script.write_text(
        'wrk.method = "POST"\n'
        f"wrk.body = {json.dumps(json.dumps(BODY))}\n"
        'wrk.headers["Content-Type"] = "application/json"\n'
        f'wrk.headers["Authorization"] = "Bearer {key}"\n'
    )
    out = subprocess.run(
        [
            "wrk",
            "-t",
            str(min(2, connections)),
            "-c",
            str(connections),
            "-d",
            f"{duration_s}s",
            "--latency",
            # wrk's default of 2 s leaves slower answers out of the latency histogram (only
            # counted as timeouts): LiteLLM at C = 64 then showed a p50 of 0
            "--timeout",
            "60s",
            "-s",
            str(script),
            url,
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout

    def latency_ms(pct: str) -> float:
        m = re.search(rf"^\s+{pct}%\s+([\d.]+)(us|ms|s)\s*$", out, re.M)
        assert m, out
        scale = {"us": 1e-3, "ms": 1.0, "s": 1e3}[m.group(2)]
        return float(m.group(1)) * scale

    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errors = re.search(r"Socket errors: (.*)", out)
    assert rps, out
    return {
        "requests_per_s": float(rps.group(1)),
        "p50_ms": latency_ms("50"),
        "p99_ms": latency_ms("99"),
        "non_2xx": float(non2xx.group(1)) if non2xx else 0.0,
        "socket_errors": errors.group(1) if errors else "",  # type: ignore[dict-item]
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of each figure over the rounds (added latencies: of each round's own
    difference to the stub), and every round's figures under `rounds` when there are several."""
    out: dict[str, Any] = {
        field: statistics.median(r[field] for r in runs)
        for field, value in runs[0].items()
        if isinstance(value, int | float)
    }
    out["socket_errors"] = "; ".join(sorted({r["socket_errors"] for r in runs} - {""}))
    if len(runs) > 1:
        out["rounds"] = runs
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--duration", type=int, default=15)
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="runs of each target per concurrency, alternating; figures are their medians",
    )
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks" / "results" / "gateway_overhead.json"
    )
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        sys.exit("wrk not found: apt-get install wrk")
    work = Path(tempfile.mkdtemp(prefix="gateway-overhead-"))
    logs = ROOT / "benchmarks" / "results"
    procs: list[subprocess.Popen[bytes]] = []
    targets: dict[str, tuple[str, str]] = {}
    try:
        stub = start(
            [sys.executable, str(ROOT / "benchmarks" / "stub_upstream.py"), "--port", "9100"],
            logs / "gateway_overhead_stub.log",
        )
        procs.append(stub)
        wait_http("http://127.0.0.1:9100/health", 30)
        targets["stub"] = ("http://127.0.0.1:9100/v1/chat/completions", "none")

        config = work / "deploy.yaml"
        config.write_text(
            "models:\n  - name: stub\n    max_inflight_per_replica: 256\n"
            "    replicas:\n      - upstream: {url: 'http://127.0.0.1:9100/v1'}\n"
        )
        data = work / "data"
        key = json.loads(
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "infercloud",
                    "keys",
                    "create",
                    "--tenant",
                    "bench",
                    "--json",
                    "--data-dir",
                    str(data),
                ],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
        )["key"]
        gateway = start(
            [
                sys.executable,
                "-m",
                "infercloud",
                "serve",
                "--config",
                str(config),
                "--port",
                "9200",
                "--data-dir",
                str(data),
                "--log-level",
                "warning",
            ],
            logs / "gateway_overhead_infercloud.log",
        )
        procs.append(gateway)
        wait_http("http://127.0.0.1:9200/health", 60)
        targets["infercloud"] = ("http://127.0.0.1:9200/v1/chat/completions", key)

        if LITELLM.exists():
            lconf = work / "litellm.yaml"
            lconf.write_text(
                "model_list:\n  - model_name: stub\n    litellm_params:\n"
                "      model: openai/stub\n      api_base: http://127.0.0.1:9100/v1\n"
                "      api_key: none\ngeneral_settings:\n  master_key: sk-bench\n"
            )
            litellm = start(
                [str(LITELLM), "--config", str(lconf), "--port", "9300"],
                logs / "gateway_overhead_litellm.log",
                env={"LITELLM_LOCAL_MODEL_COST_MAP": "True"},
            )
            procs.append(litellm)
            wait_http("http://127.0.0.1:9300/health/liveliness", 180)
            targets["litellm"] = ("http://127.0.0.1:9300/v1/chat/completions", "sk-bench")
        else:
            print(f"no LiteLLM at {LITELLM}: its column is skipped", file=sys.stderr)

        results: dict[str, dict[str, Any]] = {}
        for c in (int(x) for x in args.concurrency.split(",")):
            rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in targets}
            for i in range(args.rounds):
                for name, (url, k) in targets.items():
                    wrk(url, k, c, 3, work)  # warm up
                    rounds[name].append(wrk(url, k, c, args.duration, work))
                    print(f"c={c} round {i} {name}: {json.dumps(rounds[name][-1])}", flush=True)
                floor = rounds["stub"][-1]
                for name in targets:
                    if name != "stub":  # against the stub's run of the same round
                        m = rounds[name][-1]
                        m["added_p50_ms"] = m["p50_ms"] - floor["p50_ms"]
                        m["added_p99_ms"] = m["p99_ms"] - floor["p99_ms"]
            row: dict[str, Any] = {name: summarize(runs) for name, runs in rounds.items()}
            if "litellm" in row:
                row["ratios"] = {
                    "infercloud_over_litellm_rps": row["infercloud"]["requests_per_s"]
                    / row["litellm"]["requests_per_s"]
                }
            results[f"concurrency_{c}"] = row
            print(json.dumps(row.get("ratios", {})), flush=True)
    finally:
        for p in reversed(procs):
            stop(p)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
