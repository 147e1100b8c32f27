"""Watching a model's replicas: health checks, KV events, dead processes (the router's I/O).

Per replica, one task:
  - every `health_interval_s`: `GET /health` within `health_timeout_s` (any answer below 500
    passes: an upstream may have no such route or want a key); a pass makes a starting
    or ejected replica routable, `unhealthy_after` failures in a row eject it (so a dead or hung
    replica leaves routing within about `unhealthy_after x interval + timeout` seconds);
  - a builtin replica whose process has exited is ejected at once and, unless it is draining or
    stopped, restarted through `restart` with exponential backoff (1, 2, 4, ... 30 s);
  - a replica that publishes KV events (our engine, builtin or as an upstream: `GET
    /kv_events?since=N`) is polled every `kv_events_interval_s` and its events applied to the
    set's `KVIndex`; one that answers 404 publishes none and is not asked again (the router's
    routing history stands in).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import aiohttp

from infercloud.gateway.replicas import Replica
from infercloud.router.replica_set import ReplicaSet, ReplicaState

log = logging.getLogger("infercloud.router")

MAX_BACKOFF_S = 30.0


async def watch(
    replica_set: ReplicaSet,
    session: aiohttp.ClientSession,
    restart: Callable[[ReplicaState], Replica | None] | None = None,
) -> None:
    tasks = [
        asyncio.create_task(_health(replica_set, state, session, restart))
        for state in replica_set.states
    ]
    tasks += [
        asyncio.create_task(_kv_events(replica_set, state, session)) for state in replica_set.states
    ]
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()


async def check_once(
    replica_set: ReplicaSet, state: ReplicaState, session: aiohttp.ClientSession
) -> bool:
    timeout = aiohttp.ClientTimeout(total=replica_set.routing.health_timeout_s)
    try:
        async with session.get(state.replica.url + "/health", timeout=timeout) as r:
            ok = r.status < 500  # an upstream without /health (404) or behind auth is up
    except (aiohttp.ClientError, TimeoutError):
        ok = False
    if state.status in ("draining", "stopped"):
        return ok
    if ok:
        if state.status != "healthy":
            log.info("replica %s is healthy", state.name)
        replica_set.check_passed(state)
    else:
        was = state.status
        replica_set.check_failed(state)
        if was != state.status:
            log.warning("replica %s ejected: health checks failed", state.name)
    return ok


async def _health(
    replica_set: ReplicaSet,
    state: ReplicaState,
    session: aiohttp.ClientSession,
    restart: Callable[[ReplicaState], Replica | None] | None,
) -> None:
    interval = replica_set.routing.health_interval_s
    backoff_s = 1.0
    last_restart = 0.0
    while state.status != "stopped":
        proc = state.replica.process
        exited = await asyncio.to_thread(proc.exit_status) if proc is not None else None
        if exited is not None and state.status not in ("draining", "stopped"):
            replica_set.eject(state)
            log.warning("replica %s %s", state.name, exited)
            if restart is None:
                return
            if time.monotonic() - last_restart > 4 * MAX_BACKOFF_S:
                backoff_s = 1.0  # it had run a while: start the backoff over
            await asyncio.sleep(backoff_s)
            backoff_s = min(MAX_BACKOFF_S, backoff_s * 2)
            last_restart = time.monotonic()
            new = await asyncio.to_thread(restart, state)
            if new is None:
                return
            replica_set.restarted(state, new)
            log.info("replica %s restarted at %s", state.name, new.url)
            continue
        await check_once(replica_set, state, session)
        await asyncio.sleep(interval)


async def _kv_events(
    replica_set: ReplicaSet, state: ReplicaState, session: aiohttp.ClientSession
) -> None:
    interval = replica_set.routing.kv_events_interval_s
    timeout = aiohttp.ClientTimeout(total=max(1.0, 5 * interval))
    while state.status != "stopped":
        await asyncio.sleep(interval)
        if state.status not in ("healthy", "draining"):
            continue
        url = f"{state.replica.url}/kv_events?since={state.kv_seq}"
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
            async with session.get(url, timeout=timeout) as r:
                if r.status == 404:
                    return  # publishes none: the routing history stands in
                if r.status != 200:
                    continue
                data = await r.json()
            replica_set.index.apply(state.name, data["events"], bool(data["reset"]))
            state.kv_seq = int(data["seq"])
            state.block_size = int(data["block_size"])
