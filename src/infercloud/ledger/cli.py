"""`infercloud report`: the cost ledger of a period from the platform's store.

infercloud report [--period all|hour|day|month] [--since T] [--until T]
                  [--by tenant|model|config] [--plans FILE] [--requests] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from infercloud.gateway.cli import add_storage_args, open_store
from infercloud.ledger.period import PERIODS
from infercloud.ledger.report import GROUPINGS


def add_commands(sub: Any) -> None:
    report = sub.add_parser("report", help="cost ledger: five terms, cost per task, plans")
    report.add_argument("--period", choices=PERIODS, default="all", help="UTC period to now")
    report.add_argument("--since", default=None, help="epoch seconds or ISO 8601")
    report.add_argument("--until", default=None, help="epoch seconds or ISO 8601")
    report.add_argument("--by", choices=GROUPINGS, default="tenant")
    report.add_argument("--plans", type=Path, default=None, help="pricing plans YAML")
    report.add_argument("--requests", action="store_true", help="each request's ledger line")
    report.add_argument("--json", action="store_true")
    add_storage_args(report)


def run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from infercloud.ledger.period import resolve_period
    from infercloud.ledger.plans import PlanBook
    from infercloud.ledger.records import report_from_store

    now = time.time()
    try:
        since_s, until_s = resolve_period(args.period, args.since, args.until, now)
        plans = PlanBook.load(args.plans)
    except (OSError, ValueError, ValidationError) as exc:
        print(f"infercloud report: {exc}", file=sys.stderr)
        return 2
    store = open_store(args)
    try:
        report = report_from_store(store, since_s, until_s, now, args.by, plans, args.requests)
    finally:
        store.close()
    if args.json:
        print(json.dumps(report))
    else:
        print(format_report(report))
    return 0


def _usd(x: float | None) -> str:
    return "-" if x is None else f"${x:.6f}"


def format_report(report: dict[str, Any]) -> str:
    fleet = report["fleet"]
    lines = [
        f"fleet cost {_usd(fleet['cost_usd'])} over {fleet['replica_hours']:.4f} replica-hours"
        f" (unallocated {_usd(fleet['unallocated_usd'])}; sum of terms minus fleet cost "
        f"{report['reconciliation']['difference_usd']:+.2e})",
    ]
    by = report["by"]
    header = (
        f"{by:<16} {'requests':>8} {'cost':>12} {'$/Mtok':>10} {'tasks':>6} {'success':>8}"
        f" {'$/success':>12} {'tok/task':>9}"
    )
    lines.append(header)
    for g in [*report["groups"], {by: "total", **report["total"]}]:
        t = g["tasks"]
        rate = "-" if t["success_rate"] is None else f"{t['success_rate']:.0%}"
        per_mtok = "-" if g["cost_per_mtok_usd"] is None else f"{g['cost_per_mtok_usd']:.4f}"
        tpt = "-" if t["tokens_per_task"] is None else f"{t['tokens_per_task']:.0f}"
        lines.append(
            f"{g[by]:<16} {g['requests']:>8} {_usd(g['cost_usd']):>12} {per_mtok:>10} "
            f"{t['tasks']:>6} {rate:>8} {_usd(t['cost_per_successful_task_usd']):>12} {tpt:>9}"
        )
    terms = report["total"]["terms_usd"]
    lines.append(
        "terms: " + ", ".join(f"{k.removesuffix('_usd')} {_usd(v)}" for k, v in terms.items())
    )
    for p in report["plans"]:
        pct = "-" if p["margin_pct"] is None else f"{p['margin_pct']:.1f}%"
        lines.append(
            f"plan {p['name']} ({p['kind']}): revenue {_usd(p['revenue_usd'])}, margin "
            f"{_usd(p['margin_usd'])} ({pct})"
        )
    return "\n".join(lines)
