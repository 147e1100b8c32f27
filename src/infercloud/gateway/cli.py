"""`infercloud serve`, `infercloud keys ...` and `infercloud usage`: the platform's commands.

All three read the same storage: `--database-url` (or `INFERCLOUD_DATABASE_URL`), else a
SQLite file in `--data-dir` (or `INFERCLOUD_DATA_DIR`, default `~/.local/share/infercloud`).
The admin key is `--admin-key` / `INFERCLOUD_ADMIN_KEY`, else one generated at the first
`serve` and kept in `<data dir>/admin_key` (mode 0600).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import secrets
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

DEFAULT_DATA_DIR = Path.home() / ".local" / "share" / "infercloud"


def add_storage_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-dir", type=Path, default=None, help="where SQLite and logs live")
    p.add_argument("--database-url", default=None, help="postgresql://... (default: SQLite)")


def add_access_log_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--access-log",
        action="store_true",
        help="log every HTTP request (off by default; the gateway keeps a usage record of each)",
    )


def uvicorn_options(args: argparse.Namespace) -> dict[str, Any]:
    """The HTTP server's options from `--host`, `--port`, `--log-level`, `--access-log`."""
    from infercloud.gateway.http_protocol import GatewayHttpProtocol

    return {
        "host": args.host,
        "port": args.port,
        "log_level": args.log_level,
        "access_log": args.access_log,
        "server_header": False,  # no `server: uvicorn` on every answer
        "http": GatewayHttpProtocol,
    }


def add_commands(sub: Any) -> None:
    serve = sub.add_parser("serve", help="start the platform: the gateway and its replicas")
    serve.add_argument("--config", type=Path, default=None, help="deployment YAML")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--redis-url", default=None, help="share limits through Redis")
    serve.add_argument("--admin-key", default=None)
    serve.add_argument("--log-level", default="info")
    add_access_log_arg(serve)
    serve.add_argument(
        "--launcher", choices=["local", "ray"], default=None, help="override the config's"
    )
    serve.add_argument("--ray-address", default=None, help="join this Ray cluster")
    add_storage_args(serve)

    keys = sub.add_parser("keys", help="create, list and revoke API keys")
    keys_sub = keys.add_subparsers(dest="keys_command", required=True)
    create = keys_sub.add_parser("create", help="create a key (printed once)")
    create.add_argument("--tenant", required=True)
    create.add_argument("--rpm", type=int, default=None)
    create.add_argument("--tpm", type=int, default=None)
    create.add_argument("--max-concurrent", type=int, default=None)
    create.add_argument(
        "--priority", default="standard", choices=["interactive", "standard", "batch"]
    )
    create.add_argument("--budget-usd", type=float, default=None)
    create.add_argument("--json", action="store_true")
    add_storage_args(create)
    listing = keys_sub.add_parser("list", help="list keys (never their secrets)")
    listing.add_argument("--tenant", default=None)
    listing.add_argument("--json", action="store_true", help="a JSON list, one object per key")
    add_storage_args(listing)
    revoke = keys_sub.add_parser("revoke", help="revoke a key by its id")
    revoke.add_argument("key_id")
    add_storage_args(revoke)

    usage = sub.add_parser("usage", help="print usage records")
    usage.add_argument("--tenant", default=None)
    usage.add_argument("--json", action="store_true")
    add_storage_args(usage)


def data_dir(args: argparse.Namespace) -> Path:
    given = args.data_dir or os.environ.get("INFERCLOUD_DATA_DIR")
    return Path(given) if given else DEFAULT_DATA_DIR


def open_store(args: argparse.Namespace) -> Any:
    from infercloud.gateway.store import Store, database_url_for

    url = args.database_url or os.environ.get("INFERCLOUD_DATABASE_URL")
    store = Store(url or database_url_for(data_dir(args)))
    store.migrate()
    return store


def run(args: argparse.Namespace) -> int:
    if args.command == "serve":
        return serve(args)
    if args.command == "keys":
        return keys_command(args)
    if args.command == "usage":
        return usage_command(args)
    return 2


def keys_command(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from infercloud.gateway.app import create_key_record
    from infercloud.gateway.protocol import KeyCreate

    store = open_store(args)
    try:
        if args.keys_command == "create":
            try:
                body = KeyCreate(
                    tenant=args.tenant,
                    rpm=args.rpm,
                    tpm=args.tpm,
                    max_concurrent=args.max_concurrent,
                    priority=args.priority,
                    budget_usd=args.budget_usd,
                )
            except ValidationError as exc:
                print(f"infercloud keys create: {exc}", file=sys.stderr)
                return 2
            out = create_key_record(store, body, time.time())
            if args.json:
                print(json.dumps(out))
            else:
                print(f"key {out['key_id']} for tenant {out['tenant']} (shown once):")
                print(out["key"])
            return 0
        if args.keys_command == "list":
            keys = [k.public() for k in store.list_keys(args.tenant)]
            if args.json:
                print(json.dumps(keys))
                return 0
            for k in keys:  # one line per key: id, tenant, class, state, limits
                limits = ", ".join(
                    f"{name} {k[name]}"
                    for name in ("rpm", "tpm", "max_concurrent", "budget_usd")
                    if k[name] is not None
                )
                state = "revoked" if k["revoked_at_s"] is not None else "active"
                print(f"{k['key_id']}\t{k['tenant']}\t{k['priority']}\t{state}\t{limits}")
            return 0
        if args.keys_command == "revoke":
            if not store.revoke_key(args.key_id, time.time()):
                print(f"infercloud keys revoke: no active key {args.key_id!r}", file=sys.stderr)
                return 1
            print(json.dumps({"key_id": args.key_id, "revoked": True}))
            return 0
        return 2
    finally:
        store.close()


def usage_command(args: argparse.Namespace) -> int:
    from infercloud.gateway.app import usage_json

    store = open_store(args)
    try:
        records = [usage_json(r) for r in store.usage(args.tenant)]
    finally:
        store.close()
    if args.json:
        print(json.dumps(records))
    else:
        for r in records:
            print(
                f"{r['request_id']}\t{r['tenant']}\t{r['model']}\t{r['status']}\t{r['outcome']}"
                f"\t{r['prompt_tokens']}+{r['completion_tokens']} tokens\t{r['e2e_ms']:.0f} ms"
            )
    return 0


def admin_key(args: argparse.Namespace, directory: Path) -> str:
    given = args.admin_key or os.environ.get("INFERCLOUD_ADMIN_KEY")
    if given:
        return str(given)
    path = directory / "admin_key"
    if path.exists():
        return path.read_text().strip()
    directory.mkdir(parents=True, exist_ok=True)
    key = "ic-admin-" + secrets.token_urlsafe(24)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return key


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from infercloud.gateway.app import Gateway, create_gateway_app
    from infercloud.gateway.config import DeploymentConfig
    from infercloud.gateway.limits import LocalLimits, RedisLimits
    from infercloud.gateway.replicas import Replica, upstream, wait_ready
    from infercloud.launch.base import Launcher
    from infercloud.startup_heap import freeze_startup_heap

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    try:
        config = DeploymentConfig.load(args.config) if args.config else DeploymentConfig.default()
    except (OSError, ValueError) as exc:
        print(f"infercloud serve: bad config: {exc}", file=sys.stderr)
        return 2
    directory = data_dir(args)
    store = open_store(args)
    key = admin_key(args, directory)
    replicas: dict[str, list[Replica]] = {}
    started: list[Replica] = []
    launch: dict[str, Any] = {}
    logs = directory / "logs"
    launcher: Launcher | None = None
    try:
        kind = args.launcher or config.gateway.launcher
        if kind == "ray":
            from infercloud.launch.ray_actors import RayLauncher

            launcher = RayLauncher(args.ray_address or config.gateway.ray_address, logs)
        else:
            from infercloud.launch.local import LocalLauncher

            launcher = LocalLauncher(logs)
        for dep in config.models:
            for i, spec in enumerate(dep.replicas):
                if spec.builtin is not None:
                    r = launcher.start(dep, i, spec.builtin)
                    started.append(r)
                    launch[r.name] = (dep, i, spec.builtin)
                else:
                    assert spec.upstream is not None
                    r = upstream(dep, i, spec.upstream)
                replicas.setdefault(dep.name, []).append(r)
        wait_ready(started)
        limits = RedisLimits(args.redis_url) if args.redis_url else LocalLimits(time.monotonic)
        gateway = Gateway(config, store, limits, replicas, key, tokenizers=tokenizers(config))

        def restart(state: Any) -> Replica | None:
            """A new process in place of a builtin replica that died."""
            if state.name not in launch:
                return None
            dep, index, spec = launch[state.name]
            assert launcher is not None
            r = launcher.start(dep, index, spec)
            started.append(r)
            return r

        gateway.restart = restart

        def stop_replicas() -> None:
            with ThreadPoolExecutor(max_workers=max(1, len(started))) as pool:
                list(pool.map(lambda r: r.stop(), started))
            if launcher is not None:
                launcher.close()

        gateway.on_close.append(stop_replicas)
        app = create_gateway_app(gateway)
        print(
            f"infercloud serve: {', '.join(m.name for m in config.models)} on "
            f"http://{args.host}:{args.port}/v1 ({sum(len(v) for v in replicas.values())} "
            f"replicas); admin key in {directory / 'admin_key'} unless given",
            file=sys.stderr,
            flush=True,
        )
        # No full collections of the startup heap mid-request (see `startup_heap`), and the
        # event loop waits at most 0.5 ms, not Python's 5, for the GIL when the usage writer's
        # thread holds it: a light tenant's p99 TTFT under a flood (tests/gateway/
        # test_platform.py) went from 117-157 ms to 11-14 ms with both.
        freeze_startup_heap()
        sys.setswitchinterval(0.0005)
        uvicorn.run(app, **uvicorn_options(args))
    except (RuntimeError, TimeoutError) as exc:
        print(f"infercloud serve: {exc}", file=sys.stderr)
        return 1
    finally:
        for r in started:
            r.stop()
        if launcher is not None:
            launcher.close()
    return 0


def tokenizers(config: Any) -> dict[str, Any]:
    """The Hugging Face tokenizer of each model that has one on disk (builtin replicas' model,
    or the deployment's `tokenizer` folder): prompts are counted and routed by real token ids."""
    from infercloud.models.prompts import load_tokenizer
    from infercloud.models.registry import resolve_model

    out: dict[str, Any] = {}
    for dep in config.models:
        folder: Path | None = Path(dep.tokenizer) if dep.tokenizer else None
        if folder is None:
            builtin = next((s.builtin for s in dep.replicas if s.builtin is not None), None)
            if builtin is not None:
                folder = resolve_model(builtin.model)[1]
        if folder is not None and (folder / "tokenizer.json").exists():
            out[dep.name] = load_tokenizer(folder)
    return out
