"""The `infercloud` command: `serve` starts the platform (gateway and replicas), `engine` serves
one replica, `keys` and `usage` manage tenants' keys and read usage records, `models` lists what
can be served, `cache-replay` replays a trace through the prefix cache, `simulate` runs a
workload through a simulated fleet, `calibrate` fits the simulator's performance model to this
machine."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from infercloud.engine.config import DEFAULT_DECODE_GROUP_OVERHEAD_TOKENS, DEFAULT_KV_CACHE_BYTES
from infercloud.engine.step_shape import StepShape
from infercloud.gateway import cli as gateway_cli
from infercloud.ledger import cli as ledger_cli
from infercloud.models.registry import DEFAULT_MODEL_NAME
from infercloud.sim import cli as sim_cli
from infercloud.units import parse_bytes


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="infercloud", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    engine = sub.add_parser("engine", help="serve one engine replica with the OpenAI API")
    engine.add_argument("--model", default=DEFAULT_MODEL_NAME, help="model name or HF folder")
    engine.add_argument("--served-model-name", default=None)
    engine.add_argument("--host", default="127.0.0.1")
    engine.add_argument("--port", type=int, default=8000)
    engine.add_argument(
        "--dtype", default="float32", choices=["auto", "float32", "bfloat16", "float16"]
    )
    engine.add_argument(
        "--kv-cache-bytes",
        type=parse_bytes,
        default=DEFAULT_KV_CACHE_BYTES,
        help="KV pool size, e.g. 1073741824 or 1GiB",
    )
    engine.add_argument("--block-size", type=int, default=16)
    engine.add_argument(
        "--parent-pid",
        type=int,
        default=None,
        help="exit when this process is gone (a Ray actor that supervises the engine)",
    )
    engine.add_argument("--max-model-len", type=int, default=None)
    engine.add_argument("--max-num-seqs", type=int, default=64)
    engine.add_argument("--max-num-batched-tokens", type=int, default=512)
    engine.add_argument("--long-prefill-token-threshold", type=int, default=256)
    engine.add_argument(
        "--scheduling-policy",
        default="fcfs",
        choices=["fcfs", "priority", "cache"],
        help="cache: FCFS, but of the first 16 waiting the one with the longest cached prefix "
        "is admitted first (SGLang's longest-prefix-match), none overtaken more than 16 times",
    )
    engine.add_argument(
        "--no-enable-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help="turn the prefix cache off",
    )
    engine.add_argument(
        "--no-pack-kv-blocks",
        dest="pack_kv_blocks",
        action="store_false",
        help="with prefix caching on a CPU, take new blocks where eviction freed them instead "
        "of the lowest ids nobody uses (which moves idle cached blocks out of the way)",
    )
    engine.add_argument(
        "--eviction-policy",
        default="lru",
        choices=["lru", "value"],
        help="lru: evict the least recently used first (vLLM's); value: keep longest the blocks "
        "queued requests will match (the soonest needed first), rank the rest by learned reuse",
    )
    engine.add_argument(
        "--decode-attention",
        default="auto",
        choices=["auto", "kernel", "torch"],
        help="decodes through our CPU kernel (in place, no padding) or padded groups in torch",
    )
    engine.add_argument(
        "--prefill-attention",
        default="auto",
        choices=["auto", "kernel", "torch"],
        help="prefill chunks through our CPU kernel (bfloat16 with AVX512-BF16, float32 with "
        "AVX2 or AVX-512) or torch matmuls",
    )
    engine.add_argument(
        "--linear-kernel",
        default="auto",
        choices=["auto", "kernel", "onednn"],
        help="linear layers through our GEMM (bfloat16 with AVX512-BF16, float32 with AVX2 or "
        "AVX-512) or oneDNN; "
        "auto: whichever is faster on this CPU, timed at start (for ours in bfloat16 without "
        "AMX, also vdpbf16ps against float32 multiply-adds; kernel keeps vdpbf16ps)",
    )
    engine.add_argument(
        "--no-fused-layer-ops",
        dest="fused_layer_ops",
        action="store_false",
        help="keep RMSNorm, rotary embedding and SiLU * up in plain torch on the CPU",
    )
    engine.add_argument(
        "--no-stacked-layers",
        dest="stacked_layers",
        action="store_false",
        help="run the decoder layers as a Python loop even where all of a layer runs on our "
        "CPU kernels (else one C++ call)",
    )
    engine.add_argument(
        "--kv-layout",
        choices=["auto", "plain"],
        default="auto",
        help="auto: KV blocks in the tiled layout our attention kernels read fastest where both "
        "kernels run; plain: [tokens][head_dim] blocks everywhere",
    )
    engine.add_argument(
        "--no-attention-tiles",
        dest="attention_tiles",
        action="store_false",
        help="keep both attention kernels on vdpbf16ps where the CPU has the AMX tile unit (else "
        "their products run on the tile unit, with the tiled KV layout)",
    )
    engine.add_argument(
        "--decode-group-overhead-tokens",
        type=int,
        default=DEFAULT_DECODE_GROUP_OVERHEAD_TOKENS,
        help="fixed cost of one more group of decodes, in padded tokens (large: one group)",
    )
    engine.add_argument(
        "--host-cache-bytes",
        type=parse_bytes,
        default=0,
        help="second tier for evicted prefix blocks, e.g. 4GiB (default 0: none)",
    )
    engine.add_argument(
        "--host-cache-load",
        default="auto",
        choices=["auto", "always"],
        help="auto: copy a host hit back only when measured cheaper than recomputing it",
    )
    engine.add_argument(
        "--host-cache-path", default=None, help="keep the second tier in this file (disk)"
    )
    engine.add_argument("--device", default="cpu")
    engine.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: one per core)"
    )
    engine.add_argument("--seed", type=int, default=0)
    engine.add_argument(
        "--step-log",
        type=Path,
        default=None,
        help="append each step's shape and period as JSON lines (infercloud calibrate)",
    )
    engine.add_argument("--log-level", default="info")
    gateway_cli.add_access_log_arg(engine)

    models = sub.add_parser("models", help="list the models this installation can serve")
    models.add_argument("--json", action="store_true", help="print JSON")

    replay = sub.add_parser(
        "cache-replay", help="replay a Mooncake trace through the prefix cache (no model)"
    )
    replay.add_argument("--trace", type=Path, required=True, help="Mooncake-format JSONL")
    replay.add_argument("--capacity-blocks", type=int, required=True)
    replay.add_argument("--policy", default="lru", choices=["lru", "value", "belady"])
    replay.add_argument("--time-scale", type=float, default=1.0, help="< 1 compresses time")
    replay.add_argument("--prefill-tokens-per-s", type=float, default=20_000.0)
    replay.add_argument("--decode-ms-per-token", type=float, default=20.0)
    replay.add_argument("--json", action="store_true", help="print JSON")
    gateway_cli.add_commands(sub)
    sim_cli.add_commands(sub)
    ledger_cli.add_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "models":
        from infercloud.models.registry import list_models

        entries = [{"name": e.name, "path": str(e.path)} for e in list_models()]
        if args.json:
            print(json.dumps(entries))
        else:
            for e in entries:
                print(f"{e['name']}\t{e['path']}")
        return 0
    if args.command == "engine":
        return _serve_engine(args)
    if args.command == "cache-replay":
        return _cache_replay(args)
    if args.command in ("serve", "keys", "usage"):
        return gateway_cli.run(args)
    if args.command in ("simulate", "calibrate"):
        return sim_cli.run(args)
    if args.command == "report":
        return ledger_cli.run(args)
    return 2  # pragma: no cover - argparse rejects unknown commands


def _cache_replay(args: argparse.Namespace) -> int:
    from infercloud.cache.replay import load_mooncake, replay

    try:
        requests = load_mooncake(args.trace, args.time_scale)
        report = replay(
            requests,
            args.capacity_blocks,
            args.policy,
            prefill_tokens_per_s=args.prefill_tokens_per_s,
            decode_s_per_token=args.decode_ms_per_token / 1000.0,
        )
    except (OSError, ValueError) as exc:
        print(f"infercloud cache-replay: {exc}", file=sys.stderr)
        return 2
    data = report.to_json()
    if args.json:
        print(json.dumps(data))
    else:
        for key, value in data.items():
            print(f"{key}\t{value}")
    return 0


def _exit_with_parent(pid: int) -> None:
    """End this process at once when `pid` no longer exists (checked twice a second)."""
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            os._exit(0)
        except PermissionError:
            pass
        time.sleep(0.5)


def _step_logger(path: Path) -> Callable[[StepShape, float], None]:
    log = path.open("a", buffering=1)

    def write(shape: StepShape, period_s: float) -> None:
        row = {
            "chunks": shape.chunks,
            "num_sampled": shape.num_sampled,
            "host_blocks_loaded": shape.host_blocks_loaded,
            "seconds": period_s,
        }
        log.write(json.dumps(row) + "\n")

    return write


def _serve_engine(args: argparse.Namespace) -> int:
    import uvicorn

    from infercloud.engine.config import EngineConfig
    from infercloud.engine.scheduler import SchedulerConfig
    from infercloud.server.app import build_engine_app
    from infercloud.startup_heap import freeze_startup_heap

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    config = EngineConfig(
        model=args.model,
        served_model_name=args.served_model_name,
        dtype=args.dtype,
        kv_cache_bytes=args.kv_cache_bytes,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        device=args.device,
        num_threads=args.threads,
        seed=args.seed,
        enable_prefix_caching=args.enable_prefix_caching,
        pack_kv_blocks=args.pack_kv_blocks,
        eviction_policy=args.eviction_policy,
        host_cache_bytes=args.host_cache_bytes,
        host_cache_path=args.host_cache_path,
        host_cache_load=args.host_cache_load,
        decode_attention=args.decode_attention,
        fused_layer_ops=args.fused_layer_ops,
        stacked_layers=args.stacked_layers,
        kv_layout=args.kv_layout,
        attention_tiles=args.attention_tiles,
        linear_kernel=args.linear_kernel,
        prefill_attention=args.prefill_attention,
        decode_group_overhead_tokens=args.decode_group_overhead_tokens,
        scheduler=SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
            policy=args.scheduling_policy,
        ),
    )
    app, engine = build_engine_app(config)
    llm = engine.engine
    if args.step_log is not None:
        engine.step_listeners.append(_step_logger(args.step_log))
    linear = "kernel" if llm.linear_kernel else "oneDNN"
    if llm.linear_times is not None:
        times = llm.linear_times
        fma = "" if times.kernel_fma_s is None else f", on FMA {times.kernel_fma_s * 1e3:.1f}"
        linear += (
            f" (timed: kernel {times.kernel_s * 1e3:.1f} ms{fma}, other {times.other_s * 1e3:.1f})"
        )
    if llm.runner.linear_fma:
        linear += ", float32 multiply-adds"
    print(
        f"infercloud engine: {llm.model_name} ({config.dtype}, {llm.block_pool.num_blocks} KV "
        f"blocks of {config.block_size} tokens, decode attention: "
        f"{'kernel' if llm.decode_kernel else 'torch'}, prefill attention: "
        f"{'kernel' if llm.prefill_kernel else 'torch'}"
        f"{' (both on the tile unit)' if llm.attention_tiles else ''}, linear layers: {linear}"
        f"{', layers stacked in C++' if llm.stacked_layers else ''}"
        f"{', tiled KV blocks' if llm.kv_tiled else ''}) "
        f"on http://{args.host}:{args.port}",
        file=sys.stderr,
        flush=True,
    )
    # The engine loop runs on this (the main) thread, where torch's kernels run fastest, and
    # the HTTP server on a second one; either stopping stops the other. The two share the GIL:
    # a thread waiting for it forces a hand-over after the switch interval, 5 ms by default,
    # which the engine thread paid between its kernels. At 0.5 ms the 32 x (128 + 64) anchor
    # gained ~5% over HTTP (medians of 6 rounds, alternating, twice: 542-545 vs 516-518 tok/s).
    sys.setswitchinterval(0.0005)
    freeze_startup_heap()  # no 155 ms full collections of the startup heap mid-request
    server = uvicorn.Server(uvicorn.Config(app, **gateway_cli.uvicorn_options(args)))

    def serve_http() -> None:
        try:
            server.run()
        finally:
            engine.stop()

    def on_signal(signum: int, _frame: object) -> None:
        server.should_exit = True
        engine.stop()

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, on_signal)
    if args.parent_pid is not None:
        threading.Thread(
            target=_exit_with_parent, args=(args.parent_pid,), name="infercloud-parent", daemon=True
        ).start()
    http = threading.Thread(target=serve_http, name="infercloud-http")
    http.start()
    engine.run()
    server.should_exit = True
    http.join(timeout=30)
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
