"""The gateway's HTTP app: authenticate, limit, admit, forward to a replica, record usage.

One request's path, in order (each step can refuse it with an OpenAI error body):
  1. authenticate the bearer key (401), find the model (404);
  2. limits of its key and its tenant: requests and tokens per minute, concurrent requests,
     budget for the period (429 with `x-ratelimit-*` headers, and Retry-After wherever waiting
     helps: the bucket's refill, a slot, the budget's next period);
  3. admission: start now, wait in its priority class, or be shed (503 with Retry-After);
  4. route to a replica of the model (`router.replica_set`, the deployment's policy), with the
     tenant's cache salt, and for builtin replicas the class as the engine's priority; a replica
     that fails (connection refused or reset, a 5xx, ejected by its health checks) before the
     request's first token is left for another one, up to `routing.max_attempts`, unseen by the
     client;
  5. relay the answer (streamed or not) and, whatever happened, write exactly one usage record
     and settle the limits (the real prompt and output tokens, the money spent). A stream whose
     replica fails after its first token ends with an error event.

`Flight` carries one request through steps 2-5; its `finish` is idempotent, so every path out
(success, upstream error, client gone, refusal) ends in one record and one release of each slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import functools
import gc
import hashlib
import hmac
import json
import logging
import math
import re
import time
import uuid
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Mapping,
)
from dataclasses import asdict, dataclass, field
from typing import Annotated, Any

import aiohttp
import pydantic_core
from fastapi import FastAPI, Query, Request
from fastapi.responses import Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    generate_latest,
)
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from infercloud.gateway import keys as keyring
from infercloud.gateway.admission import CLASSES, AdmissionQueue, Ticket
from infercloud.gateway.config import DeploymentConfig, ModelDeployment, TenantLimits
from infercloud.gateway.hot_path import GatewayApp, HotPath, new_request_id
from infercloud.gateway.limits import Decision, Limits
from infercloud.gateway.protocol import (
    ADMIN_TENANT,
    INT32_MAX,
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
    KeyCreate,
    TaskOutcomeBody,
)
from infercloud.gateway.replicas import Replica
from infercloud.gateway.sse import UsageRelay
from infercloud.gateway.store import KeyRecord, OutcomeRecord, SpanRecord, Store, UsageRecord
from infercloud.gateway.upstream import Endpoint, UpstreamError, UpstreamPool, UpstreamResponse
from infercloud.gateway.usage_writer import UsageWriter
from infercloud.models.prompts import chat_prompt_ids, content_text, text_prompt_ids
from infercloud.router.replica_set import NoReplicaError, ReplicaSet, ReplicaState, Route
from infercloud.server.errors import (
    APIError,
    BodyLimitMiddleware,
    error_body,
    error_response,
    install_error_handlers,
)

log = logging.getLogger("infercloud.gateway")


@dataclass(frozen=True, slots=True)
class Caller:
    tenant: str
    key_id: str | None
    priority: str
    key: KeyRecord | None
    """None for the admin key."""


class Refusal(APIError):
    """An APIError with extra response headers (Retry-After, x-ratelimit-*)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(status, message, code=code)
        self.headers = headers or {}


def _retry_after(seconds: float) -> dict[str, str]:
    return {"retry-after": str(max(1, math.ceil(seconds)))} if math.isfinite(seconds) else {}


def _reset(seconds: float) -> str:
    return f"{seconds:.3f}s" if math.isfinite(seconds) else "inf"


def period_start_s(now_s: float, period: str) -> float:
    """Start of the budget period (UTC day or calendar month) that contains `now_s`."""
    t = dt.datetime.fromtimestamp(now_s, tz=dt.UTC)
    start = t.replace(hour=0, minute=0, second=0, microsecond=0)
    if period == "month":
        start = start.replace(day=1)
    return start.timestamp()


def period_end_s(now_s: float, period: str) -> float:
    """End of the budget period that contains `now_s` (the start of the next one)."""
    start = dt.datetime.fromtimestamp(period_start_s(now_s, period), tz=dt.UTC)
    if period == "month":
        year, month = divmod(start.month, 12)  # month 12 -> January of the next year
        return start.replace(year=start.year + year, month=month + 1).timestamp()
    return (start + dt.timedelta(days=1)).timestamp()


@dataclass(slots=True)
class Flight:
    """One request between admission and its usage record."""

    gateway: Gateway
    request_id: str
    endpoint: str
    stream: bool
    started_s: float
    """Monotonic arrival time."""
    created_at_s: float
    """Wall-clock arrival time (for the record)."""
    caller: Caller | None = None
    deployment: ModelDeployment | None = None
    replica: Replica | None = None
    ticket: Ticket | None = None
    admitted_s: float | None = None
    first_token_s: float | None = None
    prompt_tokens_charged: int = 0
    slots: list[str] = field(default_factory=list)
    tpm_keys: list[tuple[str, int]] = field(default_factory=list)
    spend_keys: list[str] = field(default_factory=list)
    route: Route | None = None
    attempts: int = 0
    failed_replicas: list[str] = field(default_factory=list)
    failed_attempt_s: list[float] = field(default_factory=list)
    attempt_started_s: float | None = None
    task_id: str | None = None
    config: str | None = None
    done: bool = False

    def attempt_failed(self, replica: str) -> None:
        """The current attempt, on `replica`, failed: remember where and how long it took."""
        self.failed_replicas.append(replica)
        started = self.attempt_started_s
        self.failed_attempt_s.append(self.gateway.clock() - started if started else 0.0)
        self.attempt_started_s = None

    async def finish(
        self,
        outcome: str,
        status: int,
        usage: dict[str, Any] | None = None,
        error: str | None = None,
    ) -> None:
        if self.done:
            return
        self.done = True
        gw = self.gateway
        now = gw.clock()
        usage = usage or {}
        prompt = int(usage.get("prompt_tokens") or 0)
        completion = int(usage.get("completion_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        cached = int(details.get("cached_tokens") or 0) if isinstance(details, dict) else 0
        meter = usage.get("infercloud")
        meter = meter if isinstance(meter, dict) else {}
        dep = self.deployment
        cost = dep.price.cost_usd(prompt, cached, completion) if dep is not None else 0.0
        if self.route is not None:
            ReplicaSet.finish(self.route)
        if self.ticket is not None:
            gw.release(self.deployment, self.ticket)
        caller = self.caller
        record = UsageRecord(
            request_id=self.request_id,
            tenant=caller.tenant if caller else "",
            key_id=caller.key_id if caller else None,
            model=dep.name if dep else None,
            replica=self.replica.name if self.replica else None,
            endpoint=self.endpoint,
            priority=self.ticket.priority if self.ticket else None,
            status=status,
            outcome=outcome,
            error=error,
            prompt_tokens=prompt,
            cached_tokens=cached,
            completion_tokens=completion,
            cost_usd=cost,
            queue_ms=(self.admitted_s - self.started_s) * 1e3 if self.admitted_s else None,
            ttft_ms=(self.first_token_s - self.started_s) * 1e3 if self.first_token_s else None,
            e2e_ms=(now - self.started_s) * 1e3,
            stream=self.stream,
            created_at_s=self.created_at_s,
            attempts=self.attempts,
            failed_replicas=",".join(self.failed_replicas) or None,
            task_id=self.task_id,
            config=self.config,
            compute_s=_number(meter.get("compute_s")),
            recompute_s=_number(meter.get("recompute_s")),
            recomputed_tokens=_integer(meter.get("recomputed_tokens")),
            kv_byte_s=_number(meter.get("kv_byte_s")),
            failed_attempt_s=",".join(f"{x:.6f}" for x in self.failed_attempt_s) or None,
        )
        # Tokens per minute: charge the output and correct the prompt estimate.
        correction = prompt + completion - self.prompt_tokens_charged if usage else 0
        if self.slots or (correction and self.tpm_keys) or (cost and self.spend_keys):
            # shielded: shared limits (Redis) wait on the network, and a client leaving then
            # must not leave a slot taken, a spend uncounted or the record unwritten
            await gw.shielded(self._settle_then_record(correction, cost, record))
        else:
            self._record(record)

    def _record(self, record: UsageRecord) -> None:
        gw = self.gateway
        gw.writer.record(record)
        labels = (record.model or "", record.status, record.outcome)
        counter = gw.request_counters.get(labels)
        if counter is None:  # `labels()` locks and builds its key each time: 2-3 us a request
            counter = gw.request_counters[labels] = gw.metric_requests.labels(
                labels[0], str(labels[1]), labels[2]
            )
        counter.inc()

    async def _settle_then_record(self, correction: int, cost: float, record: UsageRecord) -> None:
        """Settle the limits (the spend first, so that a budget read back from the records
        never counts this request twice), then write the record."""
        gw = self.gateway
        for key in self.slots:
            await gw.limits.release_slot(key)
        if correction:
            for key, capacity in self.tpm_keys:
                await gw.limits.take(key, capacity, capacity / 60.0, correction, force=True)
        if cost:
            ttl = gw.budget_ttl_s
            for key in self.spend_keys:
                await gw.limits.add_spend(key, cost, ttl)
        self._record(record)


def _number(value: Any) -> float | None:
    """A replica's meter reading, if it is a finite non-negative number."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) and value >= 0 else None


def _integer(value: Any) -> int | None:
    number = _number(value)
    return int(number) if number is not None and number < INT32_MAX else None


TASK_ID = re.compile(r"^[A-Za-z0-9_.:@/-]{1,128}$")
CONFIG_LABEL = re.compile(r"^[A-Za-z0-9_.:@/-]{1,64}$")


def task_labels(
    headers: Mapping[str, str], body: GenerationRequest
) -> tuple[str | None, str | None]:
    """The task id and configuration label of a request: the `x-infercloud-task` and
    `x-infercloud-config` headers, else `metadata.task_id` and `metadata.config`."""
    meta = body.metadata or {}
    out: list[str | None] = []
    for header, key, pattern in (
        ("x-infercloud-task", "task_id", TASK_ID),
        ("x-infercloud-config", "config", CONFIG_LABEL),
    ):
        value = headers.get(header, meta.get(key))
        if value is not None and (not isinstance(value, str) or not pattern.match(value)):
            raise APIError(
                400,
                f"{header} / metadata.{key} must be a string of letters, digits and _.:@/- "
                f"(at most {128 if key == 'task_id' else 64})",
                param=f"metadata.{key}",
                code=f"invalid_{key}",
            )
        out.append(value)
    return out[0], out[1]


def _getter(queue: AdmissionQueue, attr: str) -> Callable[[], float]:
    return lambda: float(getattr(queue, attr))


class ReplicaFailed(Exception):
    """A replica failed a request before its first token (so another may take it)."""

    def __init__(self, reason: str, connection: bool) -> None:
        super().__init__(reason)
        self.connection = connection
        """The connection failed (refused, reset, timed out, ejected), not just one answer."""


class EjectionWatch:
    """Calls `on_eject` once if the replica is ejected while the gateway waits on it: the
    replica set calls it when it ejects the replica (`ReplicaState.on_eject`), so a wait costs
    no timer. Closing an upstream response makes a read pending on it fail with
    `UpstreamError`; cancelling the request's task ends a wait for its
    headers. A replica already ejected when the watch starts fires it on the next turn of the
    loop. `fired` tells that the watch did it."""

    __slots__ = ("_soon", "fired", "on_eject", "state")

    def __init__(self, state: ReplicaState, on_eject: Callable[[], object]) -> None:
        self.state = state
        self.on_eject = on_eject
        self.fired = False
        self._soon: asyncio.Handle | None = None
        if state.status == "ejected":
            self._soon = asyncio.get_running_loop().call_soon(self._fire)
        else:
            state.on_eject.add(self._fire)

    def _fire(self) -> None:
        if not self.fired:
            self.fired = True
            self.on_eject()

    def cancel(self) -> None:
        self.state.on_eject.discard(self._fire)
        if self._soon is not None:
            self._soon.cancel()

    def failure(self, exc: BaseException, when: str) -> ReplicaFailed:
        if self.fired:
            return ReplicaFailed(f"{when}: replica {self.state.name} was ejected", connection=True)
        return ReplicaFailed(f"{when}: {exc!r}", connection=True)


class Gateway:
    def __init__(
        self,
        config: DeploymentConfig,
        store: Store,
        limits: Limits,
        replicas: dict[str, list[Replica]],
        admin_key: str,
        tokenizers: dict[str, Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.store = store
        self.limits = limits
        self.replica_sets = {
            m.name: ReplicaSet.of(m.name, replicas.get(m.name, []), m.routing)
            for m in config.models
        }
        self.restart: Callable[[ReplicaState], Replica | None] | None = None
        """Set by `serve`: start a new process for a builtin replica that died."""
        self._monitors: list[asyncio.Task[None]] = []
        self.on_close: list[Callable[[], None]] = []
        """Run (in a thread) when the app shuts down: `serve` stops its replicas here, because
        uvicorn re-raises SIGTERM after its shutdown and the process ends right after it."""
        self._admin_sha = hashlib.sha256(admin_key.encode()).hexdigest()
        parsed_admin = keyring.parse(admin_key)
        self._admin_key_id = parsed_admin[0] if parsed_admin else None
        """The key id the admin key would parse to (None if it is not in the keys' format):
        a bearer token with another key id cannot be the admin key, so only tokens with this
        one (or unparseable ones) are hashed against it."""
        self.tokenizers = tokenizers or {}
        """Hugging Face tokenizers by model: prompts are counted and routed by their real
        token ids (the replica's own template and tokenizer, `models.prompts`)."""
        self.clock = clock
        self.wall_clock = wall_clock
        self.writer = UsageWriter(store)
        self.queues = {
            m.name: AdmissionQueue(
                max_inflight=m.max_inflight_per_replica * len(replicas.get(m.name, [])) or 1,
                max_queued=config.gateway.max_queued,
                weight=self._weight,
            )
            for m in config.models
        }
        self._waiters: dict[Ticket, asyncio.Future[None]] = {}
        self._spans: dict[str, str] = {}
        """Open replica span ids by replica name."""
        self._session: aiohttp.ClientSession | None = None
        self.upstream = UpstreamPool()
        """The request path's HTTP client to replicas (`gateway.upstream`)."""
        self._endpoints: dict[tuple[str, str], Endpoint] = {}
        """Parsed upstream URLs by (replica URL, endpoint)."""
        self._settling: set[asyncio.Task[None]] = set()
        """Shielded work in flight (`shielded`)."""
        self._key_reader = store.async_key_reader()
        """PostgreSQL key lookups on the event loop (SQLite's are local and synchronous)."""
        self.registry = CollectorRegistry()
        self.metric_requests = Counter(
            "infercloud_gateway:requests",
            "Requests by model, HTTP status and outcome.",
            ["model", "status", "outcome"],
            registry=self.registry,
        )
        self.metric_queued = Gauge(
            "infercloud_gateway:queued_requests",
            "Requests waiting for admission.",
            ["model"],
            registry=self.registry,
        )
        self.metric_inflight = Gauge(
            "infercloud_gateway:inflight_requests",
            "Requests admitted and not finished.",
            ["model"],
            registry=self.registry,
        )
        self.request_counters: dict[tuple[str, int, str], Any] = {}
        """`metric_requests`' children by (model, status, outcome)."""
        for name, queue in self.queues.items():
            self.metric_queued.labels(name).set_function(_getter(queue, "num_queued"))
            self.metric_inflight.labels(name).set_function(_getter(queue, "inflight"))

    async def shielded(self, work: Coroutine[Any, Any, None]) -> None:
        """Await `work` to its end even if the caller is cancelled meanwhile (the task is kept
        referenced until it ends)."""
        task = asyncio.ensure_future(work)
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)
        await asyncio.shield(task)

    async def session(self) -> aiohttp.ClientSession:
        """The HTTP client for watching replicas (health, KV events; made on first use, inside
        the running loop). Requests go through `upstream`."""
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
                cookie_jar=aiohttp.DummyCookieJar(),  # a replica's cookies are nobody's
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0, sock_read=600.0),
                auto_decompress=False,
            )
        return self._session

    @property
    def budget_ttl_s(self) -> float:
        return 32 * 86400.0 if self.config.gateway.budget_period == "month" else 86400.0 + 3600

    def _weight(self, tenant: str) -> float:
        limits = self.config.tenants.get(tenant)
        return limits.weight if limits else 1.0

    async def start(self) -> None:
        """Start watching the replicas (health, KV events, dead processes)."""
        from infercloud.router.monitor import watch

        session = await self.session()
        for rs in self.replica_sets.values():
            self._monitors.append(asyncio.create_task(watch(rs, session, self.restart)))
        await asyncio.to_thread(self._open_spans)
        self._monitors.append(asyncio.create_task(self._renew_spans()))
        # What exists now (config, tokenizers, the app) lives as long as the process: out of
        # the cyclic collector's way, so that its full collections scan only what requests made.
        gc.freeze()

    # -- replica spans (what the fleet costs: `ledger`) ----------------------------------------

    def _open_spans(self) -> None:
        from infercloud.ledger.cost import kv_usd_per_hour
        from infercloud.units import parse_bytes

        now = self.wall_clock()
        for dep in self.config.models:
            for position, rs_state in enumerate(self.replica_sets[dep.name].states):
                name = rs_state.name
                # `<model>/<index in the config>` (launchers and upstreams name them so)
                suffix = name.rsplit("/", 1)[-1]
                index = int(suffix) if suffix.isdigit() else position
                spec = dep.replicas[min(index, len(dep.replicas) - 1)]
                kv_bytes = parse_bytes(spec.builtin.kv_cache_bytes) if spec.builtin else 0
                hw = spec.hardware
                span = SpanRecord(
                    span_id=f"span-{uuid.uuid4().hex}",
                    replica=name,
                    model=dep.name,
                    hardware=hw.name,
                    usd_per_hour=hw.price_per_hour,
                    kv_usd_per_hour=kv_usd_per_hour(
                        hw.price_per_hour, kv_bytes, hw.memory_usd_per_gib_hour
                    ),
                    kv_cache_bytes=kv_bytes,
                    started_at_s=now,
                    last_seen_s=now,
                )
                self.store.open_span(span)
                self._spans[name] = span.span_id

    async def _renew_spans(self) -> None:
        from infercloud.ledger.records import SPAN_RENEW_S

        while True:
            await asyncio.sleep(SPAN_RENEW_S)
            try:
                await asyncio.to_thread(
                    self.store.renew_spans, list(self._spans.values()), self.wall_clock()
                )
            except Exception:
                log.exception("renewing replica spans failed")

    def _close_span(self, name: str) -> None:
        span_id = self._spans.pop(name, None)
        if span_id is not None:
            self.store.close_span(span_id, self.wall_clock())

    def replica_state(self, name: str) -> tuple[ReplicaSet, ReplicaState]:
        for rs in self.replica_sets.values():
            state = rs.state(name)
            if state is not None:
                return rs, state
        raise APIError(404, f"no replica {name!r}", code="replica_not_found")

    async def drain(self, name: str) -> dict[str, Any]:
        """Take a replica out of routing; once its requests are done, stop it (a builtin
        replica's process ends; an upstream is only forgotten)."""
        _, state = self.replica_state(name)
        if state.status not in ("draining", "stopped"):
            state.status = "draining"
            self._monitors.append(asyncio.create_task(self._stop_when_idle(state)))
        return {"name": name, "status": state.status, "outstanding": state.outstanding}

    async def _stop_when_idle(self, state: ReplicaState) -> None:
        while state.outstanding > 0:
            await asyncio.sleep(0.05)
        await asyncio.to_thread(state.replica.stop)
        state.status = "stopped"
        await asyncio.to_thread(self._close_span, state.name)
        log.info("replica %s drained and stopped", state.name)

    async def close(self) -> None:
        for task in self._monitors:
            task.cancel()
        await asyncio.gather(*self._monitors, return_exceptions=True)
        for hook in self.on_close:
            await asyncio.to_thread(hook)
        for name in list(self._spans):
            try:
                await asyncio.to_thread(self._close_span, name)
            except Exception:
                log.exception("closing the span of %s failed", name)
        await self.upstream.close()
        if self._session is not None:
            await self._session.close()
        if self._key_reader is not None:
            await self._key_reader.close()
        await asyncio.to_thread(self.writer.close)
        await self.limits.close()

    # -- authentication -----------------------------------------------------------------------

    async def authenticate(self, raw: Request) -> Caller:
        return await self.authenticate_header(raw.headers.get("authorization", ""))

    async def authenticate_header(self, header: str) -> Caller:
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise APIError(
                401,
                "You didn't provide an API key. Provide it as 'Authorization: Bearer KEY'.",
                code="invalid_api_key",
            )
        token = token.strip()
        parsed = keyring.parse(token)
        if (parsed is None or parsed[0] == self._admin_key_id) and self.is_admin(token):
            return Caller(ADMIN_TENANT, None, "interactive", None)
        record: KeyRecord | None = None
        if parsed is not None and self._key_reader is not None:
            record = await self._key_reader.get_key(parsed[0])
        elif parsed is not None:  # SQLite: a local read, cheaper than a hop to a thread
            record = self.store.get_key(parsed[0])
        if (
            parsed is None
            or record is None
            or not keyring.verify(parsed[1], record.secret_sha256)
            or record.revoked_at_s is not None
        ):
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")
        return Caller(record.tenant, record.key_id, record.priority, record)

    def is_admin(self, token: str) -> bool:
        digest = hashlib.sha256(token.encode()).hexdigest()
        return hmac.compare_digest(digest, self._admin_sha)

    async def require_admin(self, raw: Request) -> None:
        header = raw.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not self.is_admin(token.strip()):
            raise APIError(401, "this endpoint needs the admin key", code="invalid_api_key")

    # -- limits -------------------------------------------------------------------------------

    async def check_limits(
        self, flight: Flight, caller: Caller, prompt_tokens: int
    ) -> dict[str, str]:
        """Take from every bucket that applies; raise `Refusal` (429) if one refuses.

        Returns the `x-ratelimit-*` headers of the tightest request and token limits.
        """
        scopes: list[tuple[str, int | None, int | None, int | None, float | None]] = []
        if caller.key is not None:
            k = caller.key
            scopes.append((f"k:{k.key_id}", k.rpm, k.tpm, k.max_concurrent, k.budget_usd))
        tenant = self.config.tenants.get(caller.tenant, TenantLimits())
        scopes.append(
            (f"t:{caller.tenant}", tenant.rpm, tenant.tpm, tenant.max_concurrent, tenant.budget_usd)
        )
        headers: dict[str, str] = {}
        requests_seen: Decision | None = None
        tokens_seen: Decision | None = None
        for scope, rpm, tpm, max_concurrent, budget in scopes:
            if budget is not None:
                now_s = self.wall_clock()
                period = period_start_s(now_s, self.config.gateway.budget_period)
                key = f"{scope}:{int(period)}"
                spent = await self.limits.spend(key)
                if spent is None:
                    kind, _, ident = scope.partition(":")
                    spent = await asyncio.to_thread(
                        self.store.spend_usd,
                        period,
                        ident if kind == "t" else None,
                        ident if kind == "k" else None,
                    )
                    await self.limits.init_spend(key, spent, self.budget_ttl_s)
                if spent >= budget:
                    raise Refusal(
                        429,
                        f"budget of {budget:.2f} USD for this {self.config.gateway.budget_period} "
                        f"is spent ({spent:.4f} USD)",
                        code="insufficient_quota",
                        headers={
                            **headers,
                            **_retry_after(
                                period_end_s(now_s, self.config.gateway.budget_period) - now_s
                            ),
                        },
                    )
                flight.spend_keys.append(key)
            if rpm is not None:
                d = await self.limits.take(f"{scope}:rpm", rpm, rpm / 60.0, 1)
                h = {
                    "x-ratelimit-limit-requests": str(rpm),
                    "x-ratelimit-remaining-requests": str(max(0, math.floor(d.remaining))),
                    "x-ratelimit-reset-requests": _reset(d.reset_s),
                }
                if not d.allowed:
                    raise Refusal(
                        429,
                        f"Rate limit reached for requests: limit {rpm} per minute.",
                        code="rate_limit_exceeded",
                        headers={**headers, **h, **_retry_after(d.retry_after_s)},
                    )
                if requests_seen is None or d.remaining < requests_seen.remaining:
                    requests_seen = d
                    headers.update(h)
            if tpm is not None:
                if prompt_tokens > tpm:
                    # No Retry-After: waiting cannot make the prompt fit (OpenAI answers such
                    # a request with 429 too, and its limit).
                    raise Refusal(
                        429,
                        f"Request too large: {prompt_tokens} prompt tokens, "
                        f"limit {tpm} per minute.",
                        code="request_too_large",
                        headers={**headers, "x-ratelimit-limit-tokens": str(tpm)},
                    )
                d = await self.limits.take(f"{scope}:tpm", tpm, tpm / 60.0, prompt_tokens)
                h = {
                    "x-ratelimit-limit-tokens": str(tpm),
                    "x-ratelimit-remaining-tokens": str(max(0, math.floor(d.remaining))),
                    "x-ratelimit-reset-tokens": _reset(d.reset_s),
                }
                if not d.allowed:
                    raise Refusal(
                        429,
                        f"Rate limit reached for tokens: limit {tpm} per minute.",
                        code="rate_limit_exceeded",
                        headers={**headers, **h, **_retry_after(d.retry_after_s)},
                    )
                flight.tpm_keys.append((f"{scope}:tpm", tpm))
                if tokens_seen is None or d.remaining < tokens_seen.remaining:
                    tokens_seen = d
                    headers.update(h)
            if max_concurrent is not None:
                if not await self.limits.acquire_slot(f"{scope}:concurrent", max_concurrent):
                    raise Refusal(
                        429,
                        f"Too many concurrent requests: limit {max_concurrent}.",
                        code="rate_limit_exceeded",
                        headers={**headers, "retry-after": "1"},
                    )
                flight.slots.append(f"{scope}:concurrent")
        flight.prompt_tokens_charged = prompt_tokens if flight.tpm_keys else 0
        return headers

    # -- admission ----------------------------------------------------------------------------

    async def admit(self, flight: Flight, deployment: ModelDeployment, ticket: Ticket) -> None:
        queue = self.queues[deployment.name]
        offer = queue.offer(ticket, self.clock())
        for shed in offer.shed:
            if shed is ticket:
                raise Refusal(
                    503,
                    "the model is saturated; request shed",
                    code="overloaded",
                    headers={"retry-after": "1"},
                )
            waiter = self._waiters.pop(shed, None)
            if waiter is not None and not waiter.done():
                waiter.set_exception(
                    Refusal(
                        503,
                        "shed for higher-priority traffic",
                        code="overloaded",
                        headers={"retry-after": "2"},
                    )
                )
        if not offer.started:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters[ticket] = waiter
            timeout = max(0.0, ticket.deadline_s - self.clock())
            try:
                await asyncio.wait_for(asyncio.shield(waiter), timeout)
            except TimeoutError:
                self._waiters.pop(ticket, None)
                if queue.cancel(ticket):
                    self._start(deployment, queue.start_waiting())
                    raise Refusal(
                        503,
                        "timed out waiting for admission",
                        code="queue_timeout",
                        headers={"retry-after": "2"},
                    ) from None
                # it started in the meantime: go on
            except asyncio.CancelledError:
                self._waiters.pop(ticket, None)
                if queue.cancel(ticket):
                    self._start(deployment, queue.start_waiting())
                else:
                    flight.ticket = ticket  # started: finish() releases its slot
                raise
        flight.ticket = ticket
        flight.admitted_s = self.clock()

    def release(self, deployment: ModelDeployment | None, ticket: Ticket) -> None:
        if deployment is None:
            return
        queue = self.queues[deployment.name]
        self._start(deployment, queue.release(ticket))

    def _start(self, deployment: ModelDeployment, started: list[Ticket]) -> None:
        for t in started:
            waiter = self._waiters.pop(t, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
            else:  # nobody waits for it any more: give the slot back at once
                self.release(deployment, t)

    def prompt_ids(self, deployment: ModelDeployment, body: GenerationRequest) -> list[int]:
        """The prompt's token ids with the model's tokenizer (and chat template); without one,
        the prompt's UTF-8 bytes stand in (for routing history and a 4-bytes-per-token
        estimate)."""
        tokenizer = self.tokenizers.get(deployment.name)
        if isinstance(body, CompletionRequest):
            prompt = body.prompt
            if isinstance(prompt, list) and prompt and not isinstance(prompt[0], str):
                first = prompt if isinstance(prompt[0], int) else prompt[0]
                return [int(t) for t in first]
            text = prompt if isinstance(prompt, str) else (prompt[0] if prompt else "")
            if tokenizer is not None:
                return text_prompt_ids(tokenizer, str(text))
            return list(str(text).encode())
        assert isinstance(body, ChatCompletionRequest)
        messages = [{"role": m.role, "content": content_text(m.content)} for m in body.messages]
        if tokenizer is not None:
            with contextlib.suppress(Exception):  # the replica answers a template error
                return chat_prompt_ids(tokenizer, messages)
        return list(json.dumps(messages, ensure_ascii=False).encode())

    def count_prompt_tokens(
        self, deployment: ModelDeployment, body: GenerationRequest, ids: list[int]
    ) -> int:
        if isinstance(body, CompletionRequest):
            given = body.prompt_token_count()
            if given is not None:
                return given
            if isinstance(body.prompt, list) and len(body.prompt) > 1:
                text = body.prompt_text()
                tokenizer = self.tokenizers.get(deployment.name)
                if tokenizer is not None:
                    return len(text_prompt_ids(tokenizer, text))
                return max(1, len(text.encode()) // 4)
        if deployment.name in self.tokenizers:
            return len(ids)
        return max(1, len(ids) // 4)

    # -- one request --------------------------------------------------------------------------

    async def record_refusal(
        self, scope: Scope, headers: dict[str, str], status: int, message: str
    ) -> None:
        """One usage record for a generation request refused before `handle` saw it (a body
        too large or invalid), with its tenant when its key is good."""
        path = str(scope.get("path", ""))
        if path not in ("/v1/chat/completions", "/v1/completions"):
            return
        flight = Flight(
            self,
            scope.get("state", {}).get("request_id", f"req-{uuid.uuid4().hex}"),
            path.removeprefix("/v1/"),
            False,
            self.clock(),
            self.wall_clock(),
        )
        with contextlib.suppress(APIError):
            flight.caller = await self.authenticate_header(headers.get("authorization", ""))
        await flight.finish("refused", status, error=message)

    async def handle(
        self,
        raw: Request,
        body: GenerationRequest,
        endpoint: str,
        headers: Mapping[str, str] | None = None,
    ) -> Response:
        """`headers`: the request's headers by lower-case name, where the caller has them as a
        plain mapping already (the hot path: faster than Starlette's `raw.headers`)."""
        flight = Flight(
            self,
            raw.state.request_id,
            endpoint,
            body.stream,
            self.clock(),
            self.wall_clock(),
        )
        try:
            return await self._handle(
                raw, body, endpoint, flight, raw.headers if headers is None else headers
            )
        except APIError as exc:
            await flight.finish("refused", exc.status, error=exc.message)
            raise
        except asyncio.CancelledError:
            await flight.finish("cancelled", 499, error="client disconnected")
            raise
        except Exception as exc:
            await flight.finish("failed", 500, error=repr(exc))
            raise

    async def _handle(
        self,
        raw: Request,
        body: GenerationRequest,
        endpoint: str,
        flight: Flight,
        request_headers: Mapping[str, str],
    ) -> Response:
        caller = await self.authenticate_header(request_headers.get("authorization", ""))
        flight.caller = caller
        deployment = self.config.model(body.model)
        if deployment is None:
            raise APIError(
                404,
                f"The model `{body.model}` does not exist or you do not have access to it.",
                code="model_not_found",
            )
        flight.deployment = deployment
        flight.task_id, flight.config = task_labels(request_headers, body)
        ids = self.prompt_ids(deployment, body)
        prompt_tokens = self.count_prompt_tokens(deployment, body, ids)
        headers = await self.check_limits(flight, caller, prompt_tokens)
        output = getattr(body, "output_limit", None)
        now = self.clock()
        ticket = Ticket(
            caller.tenant,
            caller.priority,
            cost=float(prompt_tokens + (output if output is not None else 256)),
            arrival_s=now,
            deadline_s=now + self.config.gateway.queue_timeout_s,
        )
        await self.admit(flight, deployment, ticket)
        namespace = self.config.cache_namespace(caller.tenant)
        salt = namespace if body.cache_salt is None else f"{namespace}/{body.cache_salt}"
        session_key = body.user or request_headers.get(deployment.routing.session_header.lower())
        want_usage = bool(body.stream_options and body.stream_options.include_usage)
        replica_set = self.replica_sets[deployment.name]
        while True:
            try:
                route = replica_set.route(
                    flight.request_id, ids, salt, session_key, self.clock(), flight.failed_replicas
                )
            except NoReplicaError:
                if flight.failed_replicas:
                    return await self._all_failed(flight)
                raise APIError(
                    503, f"model {deployment.name!r} has no healthy replica", code="no_replica"
                ) from None
            flight.route = route
            flight.replica = route.state.replica
            flight.attempts += 1
            flight.attempt_started_s = self.clock()
            try:
                return await self._attempt(flight, body, endpoint, salt, want_usage, headers)
            except ReplicaFailed as exc:
                log.warning("replica %s failed %s: %s", route.state.name, flight.request_id, exc)
                ReplicaSet.finish(route)
                flight.route = None
                flight.attempt_failed(route.state.name)
                if exc.connection:
                    replica_set.eject(route.state)
                if flight.attempts >= deployment.routing.max_attempts:
                    return await self._all_failed(flight)

    async def _all_failed(self, flight: Flight) -> Response:
        tried = ", ".join(flight.failed_replicas)
        await flight.finish("failed", 502, error=f"replicas failed: {tried}")
        return error_response(
            502, f"the request failed on every replica tried ({tried})", code="replica_failed"
        )

    @staticmethod
    async def _unless_ejected(awaitable: Any, state: ReplicaState) -> Any:
        """Await `awaitable` in this task, giving up (`ReplicaFailed`) if the replica is
        ejected meanwhile (`EjectionWatch` cancels the wait): a hung replica's requests move
        on once its health checks fail."""
        task = asyncio.current_task()
        assert task is not None
        watch = EjectionWatch(state, task.cancel)
        try:
            return await awaitable
        except asyncio.CancelledError:
            if watch.fired and task.uncancel() == 0:
                raise ReplicaFailed(f"replica {state.name} was ejected", connection=True) from None
            raise
        finally:
            watch.cancel()

    async def _attempt(
        self,
        flight: Flight,
        body: GenerationRequest,
        endpoint: str,
        salt: str,
        want_usage: bool,
        headers: dict[str, str],
    ) -> Response:
        """Send the request to `flight.route`'s replica. Raises `ReplicaFailed` while nothing
        has reached the client; after that, failures end the response (and the flight)."""
        assert flight.route is not None and flight.ticket is not None
        assert flight.deployment is not None
        route = flight.route
        state = route.state
        replica = state.replica
        payload = body.forwarded()
        payload["model"] = replica.served_model
        payload["cache_salt"] = salt
        if replica.takes_priority:
            payload["priority"] = CLASSES.index(flight.ticket.priority)
        if body.stream:
            payload["stream_options"] = {
                **(payload.get("stream_options") or {}),
                "include_usage": True,
            }
        upstream_headers = {"x-request-id": flight.request_id, "content-type": "application/json"}
        if replica.api_key:
            upstream_headers["authorization"] = f"Bearer {replica.api_key}"
        url = self._endpoints.get((replica.url, endpoint))
        if url is None:
            url = self._endpoints[(replica.url, endpoint)] = Endpoint(
                f"{replica.url}/v1/{endpoint}"
            )
        try:
            upstream = await self._unless_ejected(
                self.upstream.post(
                    url,
                    pydantic_core.to_json(payload),  # the same JSON, 5x faster than json.dumps
                    upstream_headers,
                ),
                state,
            )
        except UpstreamError as exc:
            raise ReplicaFailed(repr(exc), connection=True) from exc
        watch = EjectionWatch(state, upstream.close)
        if upstream.status != 200 or not body.stream:
            try:
                content = await upstream.read()
            except UpstreamError as exc:
                upstream.close()
                raise watch.failure(exc, "reading the response") from exc
            finally:
                watch.cancel()
            if upstream.status >= 500:
                raise ReplicaFailed(
                    f"status {upstream.status}: {content[:200]!r}", connection=False
                )
            try:
                data = json.loads(content)
            except ValueError:
                data = None
            ok = upstream.status == 200 and isinstance(data, dict)
            usage = data.get("usage") if ok and isinstance(data, dict) else None
            if ok:
                flight.first_token_s = self.clock()
                ReplicaSet.first_token(route)
            error = None if ok else content[:500].decode(errors="replace")
            await flight.finish("completed" if ok else "failed", upstream.status, usage, error)
            return Response(
                content,
                status_code=upstream.status,
                media_type="application/json",
                headers=headers,
            )
        # A stream: hold its events back until the first token, so that a replica failing
        # before then can be replaced without the client seeing anything.
        relay = UsageRelay(want_usage)
        events = upstream
        held: list[bytes] = []
        try:
            while not relay.saw_token:
                out = relay.feed(await events.__anext__())
                if out:
                    held.append(out)
        except StopAsyncIteration:
            pass  # ended without a token (max_tokens 0, say): pass it on as it is
        except UpstreamError as exc:
            watch.cancel()
            upstream.close()
            raise watch.failure(exc, "before the first token") from exc
        except BaseException:
            watch.cancel()
            upstream.close()
            raise
        if relay.saw_token:
            flight.first_token_s = self.clock()
            ReplicaSet.first_token(route)

        return RelayResponse(
            self._relay(flight, upstream, watch, relay, held, events),
            media_type="text/event-stream",
            headers=headers,
            on_abandon=functools.partial(self._client_gone, flight, upstream, watch, relay),
        )

    async def _relay(
        self,
        flight: Flight,
        upstream: UpstreamResponse,
        watch: EjectionWatch,
        relay: UsageRelay,
        held: list[bytes],
        events: UpstreamResponse,
    ) -> AsyncGenerator[bytes, None]:
        """Pass the held events, then the rest as they come (`UsageRelay`), then finish.

        The last events (`[DONE]`) go out with the end of the response, as one `LastChunk`,
        when the replica's end has already arrived with them (one write to the client less);
        otherwise each block goes out as it comes."""
        assert flight.route is not None and flight.deployment is not None
        state = flight.route.state
        ending = b""
        try:
            if held and relay.saw_done and upstream.done:
                ending = held.pop()
            for out in held:
                yield out
            while True:
                try:
                    block = await events.__anext__()
                except StopAsyncIteration:
                    break
                out = relay.feed(block)
                if flight.first_token_s is None and relay.saw_token:
                    flight.first_token_s = self.clock()
                    ReplicaSet.first_token(flight.route)
                if out:
                    if relay.saw_done and upstream.done:
                        ending += out
                    else:
                        yield out
            ending += relay.finish()
        except UpstreamError as exc:
            watch.cancel()
            upstream.close()
            if not isinstance(exc, TimeoutError):  # the connection broke: out of routing
                self.replica_sets[flight.deployment.name].eject(state)
            failure = watch.failure(exc, "mid-stream")
            body = error_body(
                502, f"replica {state.name} failed mid-stream", None, "replica_failed"
            )
            flight.attempt_failed(state.name)
            await flight.finish("failed", 200, relay.usage, error=str(failure))
            yield ending + f"data: {json.dumps(body)}\n\n".encode()
            return
        except BaseException:
            await self._client_gone(flight, upstream, watch, relay)
            raise
        watch.cancel()
        await flight.finish("completed", 200, relay.usage)
        yield LastChunk(ending)

    @staticmethod
    async def _client_gone(
        flight: Flight, upstream: UpstreamResponse, watch: EjectionWatch, relay: UsageRelay
    ) -> None:
        """The client left a stream the flight has not finished (no-op once it has): drop the
        replica's answer (closing the connection aborts its work) and finish the flight, as
        completed if the last event had passed."""
        if flight.done:
            return
        watch.cancel()
        upstream.close()
        if relay.saw_done:  # it left after the last event, before the replica's end
            await flight.finish("completed", 200, relay.usage)
        else:
            await flight.finish(
                "cancelled", 200, relay.usage, error="client disconnected mid-stream"
            )


class LastChunk(bytes):
    """The last bytes of a `RelayResponse`'s stream: sent with the end of the response."""


class RelayResponse(Response):
    """Streams `chunks` to the client, and stops them once the client is gone.

    The server drops writes after a disconnect without an error, so a listener waits for
    `http.disconnect` and cancels the stream; the generator is then closed, which runs its own
    clean-up (the upstream response closed, the flight finished), or, if it never started,
    `on_abandon` does. One asyncio task per stream instead of Starlette's `StreamingResponse`
    and its anyio task group (a fifth of the gateway's CPU per streamed request). A
    `LastChunk` goes out with the end of the response, in one write."""

    def __init__(
        self,
        chunks: AsyncGenerator[bytes, None],
        media_type: str,
        headers: dict[str, str] | None = None,
        on_abandon: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """`on_abandon`: awaited at the end in every case, for the clean-up the generator's own
        code cannot do when it never started (closing a generator that never ran runs none of
        its body)."""
        self.chunks = chunks
        self.on_abandon = on_abandon
        self.status_code = 200
        self.media_type = media_type
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        gone = False
        sent = False

        async def listen() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            if not sent:
                gone = True
                task.cancel()

        listener = task.get_loop().create_task(listen())
        try:
            try:
                await send(
                    {"type": "http.response.start", "status": 200, "headers": self.raw_headers}
                )
                async for chunk in self.chunks:
                    last = isinstance(chunk, LastChunk)
                    sent = sent or last
                    await send({"type": "http.response.body", "body": chunk, "more_body": not last})
                if not sent:
                    sent = True
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
            finally:
                # Once the whole answer is out, the server reports the exchange over as a
                # disconnect and the listener ends by itself (cancelling it, as any other way
                # out must, raises in it, which cost more).
                if not sent:
                    listener.cancel()
                await self.chunks.aclose()  # a stream cut short cleans up now
                if self.on_abandon is not None:
                    await self.on_abandon()
        except asyncio.CancelledError:
            if not gone or task.uncancel() > 0:
                raise


class RequestIdMiddleware:
    """Give every request an id (`request.state.request_id`) and every response `x-request-id`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = new_request_id()
        scope.setdefault("state", {})["request_id"] = request_id
        header = (b"x-request-id", request_id.encode())

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), header]
            await send(message)

        await self.app(scope, receive, send_with_id)


def create_gateway_app(gateway: Gateway) -> GatewayApp:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        yield
        await gateway.close()

    app = GatewayApp(title="infercloud gateway", version="0.1", lifespan=lifespan)

    async def too_large(scope: Scope, status: int, message: str) -> None:
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        await gateway.record_refusal(scope, headers, status, message)

    async def invalid(request: Request, message: str) -> None:
        await gateway.record_refusal(request.scope, dict(request.headers), 400, message)

    app.add_middleware(
        BodyLimitMiddleware,
        max_body_bytes=gateway.config.gateway.max_body_bytes,
        on_refuse=too_large,
    )
    app.add_middleware(RequestIdMiddleware)
    install_error_handlers(app, on_invalid=invalid)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(gateway.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(raw: Request) -> dict[str, Any]:
        await gateway.authenticate(raw)
        return {
            "object": "list",
            "data": [
                {"id": m.name, "object": "model", "created": 0, "owned_by": "infercloud"}
                for m in gateway.config.models
            ],
        }

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await gateway.handle(raw, body, "chat/completions")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await gateway.handle(raw, body, "completions")

    # the routes above are the schema and the long way; most requests take the hot path
    app.hot_path = HotPath(gateway, app, gateway.config.gateway.max_body_bytes)

    @app.get("/v1/usage")
    async def own_usage(
        raw: Request, limit: Annotated[int, Query(ge=1, le=10000)] = 1000
    ) -> dict[str, Any]:
        """The caller's tenant's usage records (never another tenant's)."""
        caller = await gateway.authenticate(raw)
        await asyncio.to_thread(gateway.writer.flush)
        records = await asyncio.to_thread(gateway.store.usage, caller.tenant, None, None, limit)
        return {"object": "list", "data": [usage_json(r) for r in records]}

    # -- admin ---------------------------------------------------------------------------------

    @app.post("/admin/keys")
    async def create_key(body: KeyCreate, raw: Request) -> dict[str, Any]:
        await gateway.require_admin(raw)
        return await asyncio.to_thread(create_key_record, gateway.store, body, time.time())

    @app.get("/admin/keys")
    async def list_keys(raw: Request, tenant: str | None = None) -> dict[str, Any]:
        await gateway.require_admin(raw)
        records = await asyncio.to_thread(gateway.store.list_keys, tenant)
        return {"object": "list", "data": [r.public() for r in records]}

    @app.delete("/admin/keys/{key_id}")
    async def revoke_key(key_id: str, raw: Request) -> dict[str, Any]:
        await gateway.require_admin(raw)
        if not await asyncio.to_thread(gateway.store.revoke_key, key_id, time.time()):
            raise APIError(404, f"no active key {key_id!r}", code="key_not_found")
        return {"key_id": key_id, "revoked": True}

    @app.get("/admin/replicas")
    async def list_replicas(raw: Request) -> dict[str, Any]:
        await gateway.require_admin(raw)
        return {
            "object": "list",
            "data": [
                {"model": model, **row}
                for model, rs in gateway.replica_sets.items()
                for row in rs.snapshot()
            ],
        }

    @app.post("/admin/replicas/{name:path}/drain")
    async def drain_replica(name: str, raw: Request) -> dict[str, Any]:
        await gateway.require_admin(raw)
        return await gateway.drain(name)

    @app.post("/v1/tasks/{task_id}/outcome")
    async def task_outcome(task_id: str, body: TaskOutcomeBody, raw: Request) -> dict[str, Any]:
        """Record how a task ended (a later report replaces an earlier one)."""
        caller = await gateway.authenticate(raw)
        if not TASK_ID.match(task_id):
            raise APIError(400, "invalid task id", param="task_id", code="invalid_task_id")
        record = OutcomeRecord(
            tenant=caller.tenant,
            task_id=task_id,
            reported_at_s=gateway.wall_clock(),
            **body.model_dump(),
        )
        await asyncio.to_thread(gateway.store.put_outcome, record)
        return {"object": "task.outcome", **asdict(record)}

    @app.get("/v1/tasks/{task_id}")
    async def task(task_id: str, raw: Request) -> dict[str, Any]:
        """One of the caller's tenant's tasks: its outcome, its requests, and the failures the
        platform saw on them (the layer each is attributed to)."""
        from infercloud.ledger.cost import RequestCost
        from infercloud.ledger.records import request_usage
        from infercloud.ledger.tasks import observed_failure

        caller = await gateway.authenticate(raw)
        await asyncio.to_thread(gateway.writer.flush)
        records = await asyncio.to_thread(gateway.store.task_usage, caller.tenant, task_id)
        outcome = await asyncio.to_thread(gateway.store.outcome, caller.tenant, task_id)
        if not records and outcome is None:
            raise APIError(404, f"no task {task_id!r}", param="task_id", code="task_not_found")
        failures = [
            {"request_id": r.request_id, "layer": layer}
            for r in records
            if (layer := observed_failure(RequestCost(request_usage(r)))) is not None
        ]
        return {
            "object": "task",
            "task_id": task_id,
            "outcome": asdict(outcome) if outcome else None,
            "requests": [usage_json(r) for r in records],
            "observed_failures": failures,
        }

    @app.get("/admin/report")
    async def admin_report(
        raw: Request,
        period: str = "all",
        since: str | None = None,
        until: str | None = None,
        by: str = "tenant",
        requests: bool = False,
    ) -> dict[str, Any]:
        """The ledger's report (`infercloud report`) with the default pricing plans."""
        from infercloud.ledger.period import resolve_period
        from infercloud.ledger.plans import PlanBook
        from infercloud.ledger.records import report_from_store
        from infercloud.ledger.report import GROUPINGS

        await gateway.require_admin(raw)
        now = gateway.wall_clock()
        try:
            since_s, until_s = resolve_period(period, since, until, now)
        except ValueError as exc:
            raise APIError(400, str(exc), param="period", code="invalid_period") from None
        if by not in GROUPINGS:
            raise APIError(400, f"by must be one of {', '.join(GROUPINGS)}", param="by")
        await asyncio.to_thread(gateway.writer.flush)
        return await asyncio.to_thread(
            report_from_store,
            gateway.store,
            since_s,
            until_s,
            now,
            by,
            PlanBook.load(),
            requests,
        )

    @app.get("/admin/usage")
    async def admin_usage(
        raw: Request,
        tenant: str | None = None,
        limit: Annotated[int, Query(ge=1, le=100000)] = 10000,
    ) -> dict[str, Any]:
        await gateway.require_admin(raw)
        await asyncio.to_thread(gateway.writer.flush)
        records = await asyncio.to_thread(gateway.store.usage, tenant, None, None, limit)
        return {"object": "list", "data": [usage_json(r) for r in records]}

    return app


def usage_json(record: UsageRecord) -> dict[str, Any]:
    return asdict(record)


def create_key_record(store: Store, body: KeyCreate, now_s: float) -> dict[str, Any]:
    """Make a key, store its hash, and return the key (shown this once) with its id."""
    key, key_id, secret_sha = keyring.new_key()
    store.add_key(
        KeyRecord(
            key_id=key_id,
            tenant=body.tenant,
            secret_sha256=secret_sha,
            rpm=body.rpm,
            tpm=body.tpm,
            max_concurrent=body.max_concurrent,
            priority=body.priority,
            budget_usd=body.budget_usd,
            created_at_s=now_s,
            revoked_at_s=None,
        )
    )
    return {"key": key, "key_id": key_id, "tenant": body.tenant}
