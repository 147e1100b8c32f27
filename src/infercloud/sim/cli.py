"""`infercloud simulate` and `infercloud calibrate`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from infercloud.units import parse_bytes


def _span(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


def add_commands(sub: Any) -> None:
    sim = sub.add_parser(
        "simulate", help="run a workload through a simulated fleet (the real policies)"
    )
    sim.add_argument("--config", type=Path, required=True, help="fleet YAML (see sim/fleet.py)")
    source = sim.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", type=Path, help="Azure 2023 CSV or Mooncake JSONL")
    source.add_argument(
        "--generate", choices=["poisson", "gamma", "shared-prefix", "multi-turn"], default=None
    )
    sim.add_argument("--time-scale", type=float, default=1.0, help="speed-up of arrivals (2: x2)")
    sim.add_argument("--token-scale", type=float, default=1.0, help="multiplies trace lengths")
    sim.add_argument("--limit", type=int, default=None, help="first N requests only")
    sim.add_argument("--rate", type=float, default=1.0, help="generators: requests (sessions)/s")
    sim.add_argument("--num-requests", type=int, default=1000, help="generators")
    sim.add_argument("--prompt-len", type=_span, default=(256, 1024), help="generators: A:B")
    sim.add_argument("--output-len", type=_span, default=(32, 256), help="generators: A:B")
    sim.add_argument("--cv", type=float, default=2.0, help="gamma: coefficient of variation")
    sim.add_argument("--groups", type=int, default=8, help="shared-prefix: tenants")
    sim.add_argument("--prefix-len", type=int, default=2048, help="shared-prefix / multi-turn")
    sim.add_argument("--seed", type=int, default=None, help="default: the fleet's seed")
    sim.add_argument("--json", action="store_true", help="print the report as JSON")
    sim.add_argument("--quiet", action="store_true", help="no progress bar")

    cal = sub.add_parser(
        "calibrate", help="measure this CPU and the builtin engine; fit the performance model"
    )
    cal.add_argument("--model", default=None, help="model name or folder (default: embedded)")
    cal.add_argument("--dtype", default="auto")
    cal.add_argument("--threads", type=int, default=None)
    cal.add_argument("--kv-cache-bytes", type=parse_bytes, default=2 << 30)
    cal.add_argument("--usd-per-hour", type=float, default=None, help="price of this machine")
    cal.add_argument("--out", type=Path, default=None, help="default: the calibration file")
    cal.add_argument("--samples", type=Path, default=None, help="also write the measured steps")
    cal.add_argument("--json", action="store_true")


def _workload(args: argparse.Namespace, seed: int) -> list[Any]:
    from infercloud.sim import workload as w

    if args.trace is not None:
        requests = w.load_trace(args.trace, args.token_scale)
    elif args.generate in ("poisson", "gamma"):
        cv = args.cv if args.generate == "gamma" else 1.0
        requests = w.poisson(
            args.rate, args.num_requests, args.prompt_len, args.output_len, seed, cv
        )
    elif args.generate == "shared-prefix":
        requests = w.shared_prefix_groups(
            args.rate,
            args.num_requests,
            args.groups,
            args.prefix_len,
            args.prompt_len,
            args.output_len,
            seed,
        )
    else:
        requests = w.multi_turn_sessions(
            args.rate,
            args.num_requests,
            (2, 8),
            args.prefix_len,
            args.prompt_len,
            args.output_len,
            think_time_s=10.0,
            seed=seed,
        )
    if args.limit is not None:
        requests = requests[: args.limit]
    if args.time_scale != 1.0:
        requests = w.time_scale(requests, args.time_scale)
    return requests


def format_report(report: dict[str, Any]) -> str:
    lines = ["============ Simulated Serving Result ============"]
    skip = {"replicas", "efficiency"}
    for key, value in report.items():
        if key in skip:
            continue
        shown = f"{value:.4f}" if isinstance(value, float) else str(value)
        lines.append(f"{key:<40}{shown:>12}")
    for name, source in report["efficiency"].items():
        lines.append(f"perf model {name}: {source}")
    for r in report["replicas"]:
        lines.append(
            f"replica {r['name']}: routed {r['routed']}, steps {r['steps']}, "
            f"utilization {r['utilization']:.1%}"
        )
    lines.append("=" * 50)
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    name = "infercloud " + args.command
    try:
        if args.command == "calibrate":
            return _calibrate(args)
        from infercloud.sim.fleet import Fleet
        from infercloud.sim.simulator import Simulation

        fleet = Fleet.load(args.config)
        requests = _workload(args, fleet.seed if args.seed is None else args.seed)
        if not requests:
            raise ValueError("the workload has no requests")
        progress = not args.quiet and sys.stderr.isatty()
        report = Simulation(fleet, requests, progress=progress).run()
    except (OSError, ValueError, KeyError) as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from infercloud.models.registry import DEFAULT_MODEL_NAME
    from infercloud.sim.calibrate import calibrate

    result = calibrate(
        args.model or DEFAULT_MODEL_NAME,
        args.dtype,
        args.threads,
        args.kv_cache_bytes,
        args.usd_per_hour,
        args.out,
        args.samples,
    )
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        eff = result["efficiency"]
        print(f"wrote {result['path']}")
        print(
            f"local-cpu: peak {result['peak_tflops']:.3f} TFLOP/s, "
            f"bandwidth {result['bandwidth_gbps']:.1f} GB/s"
        )
        print(
            f"efficiency: compute {eff['compute']:.3f}, attention {eff['attention']:.3f}, "
            f"bandwidth {eff['bandwidth']:.3f}, overhead {eff['overhead_s'] * 1e3:.2f} ms/step, "
            f"{eff['per_seq_s'] * 1e6:.1f} us/seq, "
            f"{eff['per_chunk_s'] * 1e3:.2f} ms/prefill chunk; median step error "
            f"{result['calibration']['median_abs_error']:.1%} over "
            f"{result['calibration']['num_steps']} steps"
        )
    return 0
