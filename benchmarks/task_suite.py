"""What a successful task costs: a small program-checked task suite through the gateway against
the embedded model (SmolLM2-135M-Instruct), under two configurations, priced by the ledger.

The suite (seeded, `--tasks-per-family` of each):
  - arithmetic: "What is 7 + 5?" (checked: the first integer in the answer is the sum);
  - extraction: pull the email address out of a sentence (checked: the address appears);
  - format: answer a yes/no question with exactly YES or NO (checked: the answer, stripped of
    punctuation, is that one word and the right one).

Two configurations, run interleaved in one period on one replica (the ledger apportions the
replica's idle time to both by their direct cost):
  - `terse`: a system prompt asking for only the final answer, greedy, max 16 tokens, one try;
  - `retry`: no system prompt, temperature 0.8, max 48 tokens, and the verifier in the loop:
    up to 3 tries, each a request of the same task, until the check passes.

Every request carries `x-infercloud-task` and `x-infercloud-config`; each task's outcome is
posted (`POST /v1/tasks/{id}/outcome`, verifier = its family, retries = tries - 1), then the
report comes from `GET /admin/report?by=config`: tokens per task, cost per token and cost per
successful task side by side, and which configuration is cheaper per success.

    .venv/bin/python benchmarks/task_suite.py [--tasks-per-family 8] [--concurrency 4]
        [--out benchmarks/results/task_suite.json] [--markdown docs/tasks_demo.md]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_throughput import Server

ROOT = Path(__file__).resolve().parent.parent
INFERCLOUD = ROOT / ".venv" / "bin" / "infercloud"
PORT = 8402

ADMIN = "ic-admin-task-suite"
MODEL = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class Task:
    task_id: str
    family: str
    question: str
    check: Callable[[str], bool]


def _first_int(text: str) -> int | None:
    m = re.search(r"-?\d+", text)
    return int(m.group()) if m else None


def make_suite(per_family: int, seed: int) -> list[Task]:
    rng = random.Random(seed)
    tasks: list[Task] = []
    names = ["alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi", "ivan", "judy"]
    hosts = ["example.com", "mail.org", "corp.net", "uni.edu"]
    facts = [
        ("Is the sun hot?", "YES"),
        ("Is ice hot?", "NO"),
        ("Do fish live in water?", "YES"),
        ("Can a cat fly?", "NO"),
        ("Is two bigger than one?", "YES"),
        ("Is the sea made of sand?", "NO"),
        ("Do birds have wings?", "YES"),
        ("Is snow black?", "NO"),
        ("Is water wet?", "YES"),
        ("Can a stone talk?", "NO"),
    ]
    for i in range(per_family):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        tasks.append(
            Task(
                f"arith-{i}",
                "arithmetic",
                f"What is {a} + {b}?",
                lambda text, s=a + b: _first_int(text) == s,
            )
        )
        email = f"{rng.choice(names)}.{rng.choice(names)}@{rng.choice(hosts)}"
        tasks.append(
            Task(
                f"extract-{i}",
                "extraction",
                f"Find the email address in this sentence and write it: "
                f"'Please send the report to {email} before Friday.'",
                lambda text, e=email: e in text,
            )
        )
        question, answer = facts[i % len(facts)]
        tasks.append(
            Task(
                f"format-{i}",
                "format",
                f"{question} Answer with exactly one word: YES or NO.",
                lambda text, want=answer: re.sub(r"[^A-Za-z]", "", text).upper() == want,
            )
        )
    return tasks


@dataclass(frozen=True)
class Config:
    name: str
    system: str | None
    temperature: float
    max_tokens: int
    max_tries: int


CONFIGS = (
    Config("terse", "Answer with only the final answer, nothing else.", 0.0, 16, 1),
    Config("retry", None, 0.8, 48, 3),
)


async def run_task(
    client: openai.AsyncOpenAI, http: httpx.AsyncClient, key: str, task: Task, cfg: Config
) -> dict[str, Any]:
    task_id = f"{cfg.name}-{task.task_id}"
    headers = {"x-infercloud-task": task_id, "x-infercloud-config": cfg.name}
    messages: list[dict[str, str]] = []
    if cfg.system:
        messages.append({"role": "system", "content": cfg.system})
    messages.append({"role": "user", "content": task.question})
    tries, ok, answer = 0, False, ""
    while tries < cfg.max_tries and not ok:
        tries += 1
        out = await client.chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            temperature=cfg.temperature,
            max_tokens=cfg.max_tokens,
            seed=tries,
            extra_headers=headers,
        )
        answer = out.choices[0].message.content or ""
        ok = task.check(answer)
    r = await http.post(
        f"/v1/tasks/{task_id}/outcome",
        json={"success": ok, "verifier": task.family, "retries": tries - 1, "config": cfg.name,
              **({} if ok else {"blamed_layer": "model"})},
        headers={"authorization": f"Bearer {key}"},
    )  # fmt: skip
    r.raise_for_status()
    return {"task_id": task_id, "family": task.family, "tries": tries, "ok": ok, "answer": answer}


async def run_suite(base_url: str, key: str, tasks: list[Task], concurrency: int) -> list[Any]:
    jobs = [(t, c) for t in tasks for c in CONFIGS]
    random.Random(1).shuffle(jobs)  # interleaved: both configurations share the same period
    gate = asyncio.Semaphore(concurrency)
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key=key, max_retries=0, timeout=300)
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:

        async def one(task: Task, cfg: Config) -> dict[str, Any]:
            async with gate:
                return await run_task(client, http, key, task, cfg)

        return list(await asyncio.gather(*(one(t, c) for t, c in jobs)))


def markdown(report: dict[str, Any], results: list[dict[str, Any]], command: str) -> str:
    groups = {g["config"]: g for g in report["groups"]}
    replica = report["fleet"]["replicas"][0]
    usd_per_hour = replica["cost_usd"] / replica["up_s"] * 3600 if replica["up_s"] else 0.0
    lines = [
        "# Task suite: cost per successful task (issue 7)",
        "",
        f"Made by `{command}`: {len(results)} tasks through the gateway against the embedded "
        "SmolLM2-135M-Instruct on this machine's CPU (2 cores), one builtin replica priced at "
        f"local-cpu's ${usd_per_hour:.4f}/h "
        "(GCP N2 rates for 2 vCPU + 24 GiB). Both configurations ran interleaved in one period;",
        "the ledger charges each request its measured step time, KV bytes held and a share of "
        "the replica's idle time.",
        "",
        "| | " + " | ".join(c.name for c in CONFIGS) + " |",
        "|---|" + "---|" * len(CONFIGS),
    ]

    def row(label: str, fn: Callable[[dict[str, Any]], str]) -> None:
        lines.append(f"| {label} | " + " | ".join(fn(groups[c.name]) for c in CONFIGS) + " |")

    def t(g: dict[str, Any]) -> dict[str, Any]:
        return dict(g["tasks"])

    row("tasks", lambda g: str(t(g)["tasks"]))
    row("succeeded", lambda g: f"{t(g)['succeeded']} ({t(g)['success_rate']:.0%})")
    row("requests", lambda g: str(g["requests"]))
    row("retries per task", lambda g: f"{t(g)['retries_per_task']:.2f}")
    row("tokens per task", lambda g: f"{t(g)['tokens_per_task']:.1f}")
    row("cost per Mtok", lambda g: f"${g['cost_per_mtok_usd']:.4f}")
    row("cost per token", lambda g: f"${t(g)['cost_per_token_usd']:.3e}")
    row("cost of all tasks", lambda g: f"${t(g)['cost_usd']:.6f}")
    row(
        "**cost per successful task**",
        lambda g: (
            "-"
            if t(g)["cost_per_successful_task_usd"] is None
            else f"**${t(g)['cost_per_successful_task_usd']:.3e}**"
        ),
    )
    row("task latency p50 / p99 (s)", lambda g: f"{t(g)['latency_s']['p50']:.2f} / "
        f"{t(g)['latency_s']['p99']:.2f}")  # fmt: skip
    for term in report["total"]["terms_usd"]:
        row(
            term.removesuffix("_usd").replace("_", " "),
            lambda g, k=term: f"${g['terms_usd'][k]:.3e}",
        )
    per_success = {c.name: t(groups[c.name])["cost_per_successful_task_usd"] for c in CONFIGS}
    known = {k: v for k, v in per_success.items() if v is not None}

    def token_ratio(a: str, b: str) -> float:
        return float(t(groups[a])["cost_per_token_usd"] / t(groups[b])["cost_per_token_usd"])

    lines.append("")
    if len(known) == 2:
        cheap, dear = sorted(known, key=lambda k: known[k])
        lines.append(
            f"**{cheap}** is cheaper per successful task: ${known[cheap]:.3e} against "
            f"${known[dear]:.3e} ({known[dear] / known[cheap]:.2f}x); per token it costs "
            f"{token_ratio(cheap, dear):.2f}x what {dear} does."
        )
    by_family: dict[str, dict[str, list[bool]]] = {}
    for r in results:
        cfg = r["task_id"].split("-", 1)[0]
        by_family.setdefault(r["family"], {}).setdefault(cfg, []).append(r["ok"])
    lines += ["", "Success by family: " + "; ".join(
        f"{fam} " + ", ".join(f"{c} {sum(v)}/{len(v)}" for c, v in sorted(d.items()))
        for fam, d in sorted(by_family.items())
    ) + "."]  # fmt: skip
    fleet = report["fleet"]
    lines += [
        "",
        f"Fleet cost of the period ${fleet['cost_usd']:.6f} over "
        f"{fleet['replica_hours'] * 3600:.0f} "
        f"replica-seconds; sum of the five terms minus fleet cost "
        f"{report['reconciliation']['difference_usd']:+.1e} USD. Plans on the same period: "
        + "; ".join(
            f"{p['name']} revenue ${p['revenue_usd']:.6f}, margin ${p['margin_usd']:+.6f}"
            for p in report["plans"]
        )
        + ".",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tasks-per-family", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/task_suite.json"))
    ap.add_argument("--markdown", type=Path, default=Path("docs/tasks_demo.md"))
    ap.add_argument(
        "--kv-cache-bytes",
        default=None,
        help="a smaller KV pool than the embedded default's (preemption and eviction show as "
        "non-reusable context)",
    )
    args = ap.parse_args()
    tasks = make_suite(args.tasks_per_family, args.seed)
    data = Path(tempfile.mkdtemp(prefix="task-suite-"))
    serve_args = ["--admin-key", ADMIN, "--data-dir", str(data), "--log-level", "warning"]
    if args.kv_cache_bytes:
        # the embedded deployment (`DeploymentConfig.default()`) with another pool size
        from infercloud.gateway.config import DeploymentConfig

        config = DeploymentConfig.default().model_dump(mode="json")
        config["models"][0]["replicas"][0]["builtin"]["kv_cache_bytes"] = args.kv_cache_bytes
        path = data / "deploy.yaml"
        path.write_text(json.dumps(config))  # JSON is YAML
        serve_args += ["--config", str(path)]
    cmd = [str(INFERCLOUD), "serve", "--port", str(PORT), *serve_args]
    server = Server(cmd, PORT, {}, data / "gateway.log", 600.0)
    try:
        key = httpx.post(
            server.url + "/admin/keys",
            json={"tenant": "suite"},
            headers={"authorization": f"Bearer {ADMIN}"},
        ).json()["key"]
        since = time.time()
        results = asyncio.run(run_suite(server.url, key, tasks, args.concurrency))
        until = time.time()
        report = httpx.get(
            server.url + "/admin/report",
            params={"since": since, "until": until, "by": "config"},
            headers={"authorization": f"Bearer {ADMIN}"},
            timeout=120,
        ).json()
    finally:
        server.stop()
    command = "python benchmarks/task_suite.py " + " ".join(sys.argv[1:])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"report": report, "results": results}, indent=1) + "\n")
    text = markdown(report, results, command.strip())
    args.markdown.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
