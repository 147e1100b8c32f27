"""The gateway's durable state: tenants, API keys (hashed) and usage records, in one schema.

SQLite by default (a file in the data directory), PostgreSQL given a `postgresql://` URL; the same
SQLAlchemy Core tables on both. The schema is versioned: `MIGRATIONS[i]` takes it from version
`i` to `i + 1`, and `migrate()` applies the missing ones in one transaction each, recording the
version in `infercloud_schema_version`, so starting a newer gateway on an older database brings
it up to date and starting it twice changes nothing.

Invariants:
- a key's secret is never stored: only its SHA-256, compared in constant time (`keys.verify`);
- `usage_records.request_id` is the primary key and writes use insert-if-absent, so recording a
  request twice keeps the first record and counts it once.
"""

from __future__ import annotations

import dataclasses
import functools
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Connection, Engine

metadata = sa.MetaData()

schema_version = sa.Table(
    "infercloud_schema_version",
    metadata,
    sa.Column("version", sa.Integer, nullable=False),
)

tenants = sa.Table(
    "tenants",
    metadata,
    sa.Column("name", sa.String(128), primary_key=True),
    sa.Column("created_at_s", sa.Float, nullable=False),
)

api_keys = sa.Table(
    "api_keys",
    metadata,
    sa.Column("key_id", sa.String(32), primary_key=True),
    sa.Column("tenant", sa.String(128), sa.ForeignKey("tenants.name"), nullable=False),
    sa.Column("secret_sha256", sa.String(64), nullable=False),
    sa.Column("rpm", sa.Integer, nullable=True),
    sa.Column("tpm", sa.Integer, nullable=True),
    sa.Column("max_concurrent", sa.Integer, nullable=True),
    sa.Column("priority", sa.String(16), nullable=False),
    sa.Column("budget_usd", sa.Float, nullable=True),
    sa.Column("created_at_s", sa.Float, nullable=False),
    sa.Column("revoked_at_s", sa.Float, nullable=True),
)

usage_records = sa.Table(
    "usage_records",
    metadata,
    sa.Column("request_id", sa.String(64), primary_key=True),
    sa.Column("tenant", sa.String(128), nullable=False, index=True),
    sa.Column("key_id", sa.String(32), nullable=True),
    sa.Column("model", sa.String(256), nullable=True),
    sa.Column("replica", sa.String(256), nullable=True),
    sa.Column("endpoint", sa.String(64), nullable=False),
    sa.Column("priority", sa.String(16), nullable=True),
    sa.Column("status", sa.Integer, nullable=False),
    sa.Column("outcome", sa.String(32), nullable=False),
    sa.Column("error", sa.Text, nullable=True),
    sa.Column("prompt_tokens", sa.Integer, nullable=False),
    sa.Column("cached_tokens", sa.Integer, nullable=False),
    sa.Column("completion_tokens", sa.Integer, nullable=False),
    sa.Column("cost_usd", sa.Float, nullable=False),
    sa.Column("queue_ms", sa.Float, nullable=True),
    sa.Column("ttft_ms", sa.Float, nullable=True),
    sa.Column("e2e_ms", sa.Float, nullable=False),
    sa.Column("stream", sa.Boolean, nullable=False),
    sa.Column("created_at_s", sa.Float, nullable=False, index=True),
    # version 2
    sa.Column("attempts", sa.Integer, nullable=False, server_default="1"),
    sa.Column("failed_replicas", sa.Text, nullable=True),
    # version 3: tasks and the replica's meter
    sa.Column("task_id", sa.String(128), nullable=True, index=True),
    sa.Column("config", sa.String(64), nullable=True),
    sa.Column("compute_s", sa.Float, nullable=True),
    sa.Column("recompute_s", sa.Float, nullable=True),
    sa.Column("recomputed_tokens", sa.Integer, nullable=True),
    sa.Column("kv_byte_s", sa.Float, nullable=True),
    sa.Column("failed_attempt_s", sa.Text, nullable=True),
)

replica_spans = sa.Table(
    "replica_spans",
    metadata,
    sa.Column("span_id", sa.String(64), primary_key=True),
    sa.Column("replica", sa.String(256), nullable=False, index=True),
    sa.Column("model", sa.String(256), nullable=False),
    sa.Column("hardware", sa.String(128), nullable=False),
    sa.Column("usd_per_hour", sa.Float, nullable=False),
    sa.Column("kv_usd_per_hour", sa.Float, nullable=False),
    sa.Column("kv_cache_bytes", sa.BigInteger, nullable=False),
    sa.Column("started_at_s", sa.Float, nullable=False),
    sa.Column("last_seen_s", sa.Float, nullable=False),
    sa.Column("stopped_at_s", sa.Float, nullable=True),
)
"""When each replica was up and paid for: a gateway opens a span when it starts serving a
replica, renews `last_seen_s` while it runs and closes it when the replica stops; a span whose
gateway died ends at its last renewal."""

task_outcomes = sa.Table(
    "task_outcomes",
    metadata,
    sa.Column("tenant", sa.String(128), primary_key=True),
    sa.Column("task_id", sa.String(128), primary_key=True),
    sa.Column("success", sa.Boolean, nullable=False),
    sa.Column("verifier", sa.String(128), nullable=True),
    sa.Column("tool_calls", sa.Integer, nullable=False),
    sa.Column("retries", sa.Integer, nullable=False),
    sa.Column("blamed_layer", sa.String(16), nullable=True),
    sa.Column("config", sa.String(64), nullable=True),
    sa.Column("detail", sa.Text, nullable=True),
    sa.Column("reported_at_s", sa.Float, nullable=False),
)


def _v1(conn: Connection) -> None:
    for table in (tenants, api_keys, usage_records):
        table.create(conn, checkfirst=True)


def _v2(conn: Connection) -> None:
    """Retries: how many replicas a request was sent to, and which of them failed it. (On a
    database that `_v1` created from this module's tables the columns exist already.)"""
    have = {c["name"] for c in sa.inspect(conn).get_columns("usage_records")}
    if "attempts" not in have:
        conn.execute(
            sa.text("ALTER TABLE usage_records ADD COLUMN attempts INTEGER NOT NULL DEFAULT 1")
        )
    if "failed_replicas" not in have:
        conn.execute(sa.text("ALTER TABLE usage_records ADD COLUMN failed_replicas TEXT"))


_V3_COLUMNS = {
    "task_id": "VARCHAR(128)",
    "config": "VARCHAR(64)",
    "compute_s": "FLOAT",
    "recompute_s": "FLOAT",
    "recomputed_tokens": "INTEGER",
    "kv_byte_s": "FLOAT",
    "failed_attempt_s": "TEXT",
}


def _v3(conn: Connection) -> None:
    """Tasks and the ledger: a task id and configuration per request, what the replica metered,
    how long failed attempts took; replica spans and task outcomes."""
    have = {c["name"] for c in sa.inspect(conn).get_columns("usage_records")}
    for name, kind in _V3_COLUMNS.items():
        if name not in have:
            conn.execute(sa.text(f"ALTER TABLE usage_records ADD COLUMN {name} {kind}"))
    indexes = {i["name"] for i in sa.inspect(conn).get_indexes("usage_records")}
    if "ix_usage_records_task_id" not in indexes:
        conn.execute(sa.text("CREATE INDEX ix_usage_records_task_id ON usage_records (task_id)"))
    replica_spans.create(conn, checkfirst=True)
    task_outcomes.create(conn, checkfirst=True)


MIGRATIONS: Sequence[Callable[[Connection], None]] = (_v1, _v2, _v3)
"""`MIGRATIONS[i]` upgrades the schema from version i to i + 1."""


@dataclass(frozen=True, slots=True)
class KeyRecord:
    key_id: str
    tenant: str
    secret_sha256: str
    rpm: int | None
    tpm: int | None
    max_concurrent: int | None
    priority: str
    budget_usd: float | None
    created_at_s: float
    revoked_at_s: float | None

    def public(self) -> dict[str, Any]:
        """What `keys list` shows: everything but the hash."""
        out = asdict(self)
        del out["secret_sha256"]
        return out


@dataclass(frozen=True, slots=True)
class UsageRecord:
    request_id: str
    tenant: str
    key_id: str | None
    model: str | None
    replica: str | None
    endpoint: str
    priority: str | None
    status: int
    """The HTTP status the client got (200 also for a stream that ended in an error event)."""
    outcome: str
    """completed | failed | cancelled (client went away) | refused (never reached a replica)."""
    error: str | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cost_usd: float
    queue_ms: float | None
    ttft_ms: float | None
    e2e_ms: float
    stream: bool
    created_at_s: float
    attempts: int = 1
    """Replicas the request was sent to (more than 1 when one failed before its first token)."""
    failed_replicas: str | None = None
    """Comma-separated names of the replicas that failed it, in order: before its first token
    (then it was retried elsewhere), or mid-stream (the last one; the request failed)."""
    task_id: str | None = None
    config: str | None = None
    """The client's label for the configuration it ran (prompt, sampling), for comparisons."""
    compute_s: float | None = None
    """Step time the replica spent on this request's new tokens (None: it meters nothing)."""
    recompute_s: float | None = None
    recomputed_tokens: int | None = None
    kv_byte_s: float | None = None
    failed_attempt_s: str | None = None
    """Comma-separated seconds spent on each replica of `failed_replicas`."""


@dataclass(frozen=True, slots=True)
class SpanRecord:
    span_id: str
    replica: str
    model: str
    hardware: str
    usd_per_hour: float
    kv_usd_per_hour: float
    kv_cache_bytes: int
    started_at_s: float
    last_seen_s: float
    stopped_at_s: float | None = None


@dataclass(frozen=True, slots=True)
class OutcomeRecord:
    tenant: str
    task_id: str
    success: bool
    verifier: str | None
    tool_calls: int
    retries: int
    blamed_layer: str | None
    config: str | None
    detail: str | None
    reported_at_s: float


def database_url_for(data_dir: Path) -> str:
    return f"sqlite:///{data_dir / 'infercloud.db'}"


class Store:
    """Synchronous access to the schema; the gateway calls it from worker threads."""

    def __init__(self, url: str) -> None:
        if url.startswith("postgresql://"):
            url = "postgresql+psycopg://" + url.removeprefix("postgresql://")
        kwargs: dict[str, Any] = {}
        path = url.removeprefix("sqlite:///") if url.startswith("sqlite:///") else ""
        self._key_path = path if path and path != ":memory:" else None
        """The SQLite file, if the store is one (key lookups read it directly)."""
        if url.startswith("sqlite"):
            if self._key_path is not None:
                Path(self._key_path).parent.mkdir(parents=True, exist_ok=True)
            kwargs["connect_args"] = {"check_same_thread": False, "timeout": 30}
        else:
            # key lookups have their own connections (`async_key_reader`)
            kwargs.update(pool_pre_ping=True, pool_size=4, max_overflow=12)
        self.url = url
        self.engine: Engine = sa.create_engine(url, **kwargs)
        if url.startswith("sqlite"):
            sa.event.listen(self.engine, "connect", _sqlite_pragmas)
        self._key_conn: sqlite3.Connection | None = None
        self._key_lock = threading.Lock()
        self._key_cache: dict[str, KeyRecord] = {}
        """SQLite: keys read since the database last changed (`get_key`)."""
        self._key_cache_version: int | None = None

    def async_key_reader(self) -> PostgresKeyReader | None:
        """A reader of keys for the event loop, where the database is PostgreSQL (SQLite's
        lookups, `get_key`, read a local file in tens of microseconds and need none)."""
        return PostgresKeyReader(self.url) if self.url.startswith("postgresql") else None

    # -- schema --------------------------------------------------------------------------------

    def migrate(self) -> int:
        """Bring the schema to the latest version; returns it."""
        with self.engine.begin() as conn:
            schema_version.create(conn, checkfirst=True)
        while True:
            with self.engine.begin() as conn:
                if conn.dialect.name == "postgresql":
                    # one migrator at a time across processes
                    conn.execute(sa.text("SELECT pg_advisory_xact_lock(7342001)"))
                current = self._version(conn)
                if current >= len(MIGRATIONS):
                    return current
                MIGRATIONS[current](conn)
                conn.execute(schema_version.delete())
                conn.execute(schema_version.insert().values(version=current + 1))

    @staticmethod
    def _version(conn: Connection) -> int:
        row = conn.execute(sa.select(schema_version.c.version)).first()
        return int(row[0]) if row else 0

    def version(self) -> int:
        with self.engine.connect() as conn:
            return self._version(conn)

    # -- keys ----------------------------------------------------------------------------------

    def add_key(self, record: KeyRecord) -> None:
        with self.engine.begin() as conn:
            exists = conn.execute(
                sa.select(tenants.c.name).where(tenants.c.name == record.tenant)
            ).first()
            if exists is None:
                conn.execute(tenants.insert().values(name=record.tenant, created_at_s=time.time()))
            conn.execute(api_keys.insert().values(**asdict(record)))

    def get_key(self, key_id: str) -> KeyRecord | None:
        """The key's record as committed now (by any process: a revocation counts at once)."""
        if self._key_path is not None:
            with self._key_lock:
                if self._key_conn is None:
                    # autocommit: every lookup reads the latest commit
                    self._key_conn = sqlite3.connect(
                        self._key_path, check_same_thread=False, isolation_level=None, timeout=30
                    )
                reader = self._key_conn
                # Any commit by another connection (a revocation by `infercloud keys revoke`
                # in another process, the usage writer's batches) changes data_version, and
                # then the cached keys go: a lookup never returns what a commit replaced.
                (version,) = reader.execute("PRAGMA data_version").fetchone()
                if version != self._key_cache_version:
                    self._key_cache.clear()
                    self._key_cache_version = version
                record = self._key_cache.get(key_id)
                if record is not None:
                    return record
                found = reader.execute(_KEY_BY_ID, (key_id,)).fetchone()
                if found is None:
                    return None  # unknown ids are not cached: anyone can send any number
                record = KeyRecord(*found)
                if len(self._key_cache) < _KEY_CACHE_MAX:
                    self._key_cache[key_id] = record
            return record
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(api_keys).where(api_keys.c.key_id == key_id)).first()
        return KeyRecord(**row._mapping) if row else None

    def list_keys(self, tenant: str | None = None) -> list[KeyRecord]:
        query = sa.select(api_keys).order_by(api_keys.c.created_at_s, api_keys.c.key_id)
        if tenant is not None:
            query = query.where(api_keys.c.tenant == tenant)
        with self.engine.connect() as conn:
            return [KeyRecord(**r._mapping) for r in conn.execute(query)]

    def revoke_key(self, key_id: str, now_s: float) -> bool:
        """Revoke a key; False if there is no such key or it was already revoked."""
        with self.engine.begin() as conn:
            result = conn.execute(
                api_keys.update()
                .where(api_keys.c.key_id == key_id, api_keys.c.revoked_at_s.is_(None))
                .values(revoked_at_s=now_s)
            )
        return bool(result.rowcount)

    # -- usage ---------------------------------------------------------------------------------

    def add_usage(self, records: Iterable[UsageRecord]) -> None:
        """Insert records; one whose request id is already stored is skipped (idempotent)."""
        unique = list({r.request_id: r for r in records}.values())
        if not unique:
            return
        if self.engine.dialect.name == "sqlite":
            self._add_usage_sqlite(unique)
            return
        rows = [_usage_row(r) for r in unique]
        if self.engine.dialect.name == "postgresql":
            statement: Any = pg_insert(usage_records)
        else:
            statement = sqlite_insert(usage_records)
        statement = statement.on_conflict_do_nothing(index_elements=["request_id"])
        with self.engine.begin() as conn:
            conn.execute(statement, rows)

    def _add_usage_sqlite(self, records: list[UsageRecord]) -> None:
        """SQLite: many rows per INSERT statement. One statement per row (`executemany`) lets
        go of the GIL and takes it back around every row's step; the writer thread then trades
        the GIL with the event loop twice a row, which cost the gateway about a third of its
        CPU per request under load."""
        per_statement = _SQLITE_ROWS_PER_INSERT
        with self.engine.begin() as conn:
            for start in range(0, len(records), per_statement):
                chunk = records[start : start + per_statement]
                params = tuple([getattr(r, f) for r in chunk for f in _USAGE_FIELDS])
                conn.exec_driver_sql(_sqlite_usage_insert(len(chunk)), params)

    def usage(
        self,
        tenant: str | None = None,
        since_s: float | None = None,
        until_s: float | None = None,
        limit: int | None = None,
    ) -> list[UsageRecord]:
        query = sa.select(usage_records).order_by(
            usage_records.c.created_at_s, usage_records.c.request_id
        )
        if tenant is not None:
            query = query.where(usage_records.c.tenant == tenant)
        if since_s is not None:
            query = query.where(usage_records.c.created_at_s >= since_s)
        if until_s is not None:
            query = query.where(usage_records.c.created_at_s < until_s)
        if limit is not None:
            query = query.limit(limit)
        with self.engine.connect() as conn:
            return [UsageRecord(**r._mapping) for r in conn.execute(query)]

    def spend_usd(
        self, since_s: float, tenant: str | None = None, key_id: str | None = None
    ) -> float:
        """Money spent since `since_s` by a tenant, or by one key."""
        query = sa.select(sa.func.coalesce(sa.func.sum(usage_records.c.cost_usd), 0.0)).where(
            usage_records.c.created_at_s >= since_s
        )
        if tenant is not None:
            query = query.where(usage_records.c.tenant == tenant)
        if key_id is not None:
            query = query.where(usage_records.c.key_id == key_id)
        with self.engine.connect() as conn:
            return float(conn.execute(query).scalar_one())

    # -- replica spans -------------------------------------------------------------------------

    def open_span(self, span: SpanRecord) -> None:
        with self.engine.begin() as conn:
            conn.execute(replica_spans.insert().values(**asdict(span)))

    def renew_spans(self, span_ids: Sequence[str], now_s: float) -> None:
        """Mark open spans as still up at `now_s`."""
        if not span_ids:
            return
        with self.engine.begin() as conn:
            conn.execute(
                replica_spans.update()
                .where(replica_spans.c.span_id.in_(list(span_ids)))
                .where(replica_spans.c.stopped_at_s.is_(None))
                .values(last_seen_s=now_s)
            )

    def close_span(self, span_id: str, now_s: float) -> None:
        with self.engine.begin() as conn:
            conn.execute(
                replica_spans.update()
                .where(replica_spans.c.span_id == span_id)
                .where(replica_spans.c.stopped_at_s.is_(None))
                .values(stopped_at_s=now_s, last_seen_s=now_s)
            )

    def spans(self, since_s: float | None = None, until_s: float | None = None) -> list[SpanRecord]:
        """Spans that may overlap `[since_s, until_s)`: those started before its end and not
        stopped before its start (an open span may have ended at its last renewal)."""
        query = sa.select(replica_spans).order_by(replica_spans.c.started_at_s)
        if until_s is not None:
            query = query.where(replica_spans.c.started_at_s < until_s)
        if since_s is not None:
            query = query.where(
                sa.or_(
                    replica_spans.c.stopped_at_s.is_(None), replica_spans.c.stopped_at_s > since_s
                )
            )
        with self.engine.connect() as conn:
            return [SpanRecord(**r._mapping) for r in conn.execute(query)]

    # -- task outcomes --------------------------------------------------------------------------

    def put_outcome(self, record: OutcomeRecord) -> None:
        """Store a task's outcome, replacing an earlier one for the same (tenant, task)."""
        row = asdict(record)
        if self.engine.dialect.name == "postgresql":
            statement: Any = pg_insert(task_outcomes)
        else:
            statement = sqlite_insert(task_outcomes)
        keys = ("tenant", "task_id")
        statement = statement.values(**row).on_conflict_do_update(
            index_elements=list(keys), set_={k: v for k, v in row.items() if k not in keys}
        )
        with self.engine.begin() as conn:
            conn.execute(statement)

    def task_usage(self, tenant: str, task_id: str) -> list[UsageRecord]:
        """The usage records of one task, oldest first."""
        query = (
            sa.select(usage_records)
            .where(usage_records.c.tenant == tenant, usage_records.c.task_id == task_id)
            .order_by(usage_records.c.created_at_s, usage_records.c.request_id)
        )
        with self.engine.connect() as conn:
            return [UsageRecord(**r._mapping) for r in conn.execute(query)]

    def outcome(self, tenant: str, task_id: str) -> OutcomeRecord | None:
        query = sa.select(task_outcomes).where(
            task_outcomes.c.tenant == tenant, task_outcomes.c.task_id == task_id
        )
        with self.engine.connect() as conn:
            row = conn.execute(query).first()
        return OutcomeRecord(**row._mapping) if row else None

    def outcomes(self, tenant: str | None = None) -> list[OutcomeRecord]:
        query = sa.select(task_outcomes)
        if tenant is not None:
            query = query.where(task_outcomes.c.tenant == tenant)
        with self.engine.connect() as conn:
            return [OutcomeRecord(**r._mapping) for r in conn.execute(query)]

    def drop_all(self) -> None:
        """Remove every table of the schema (tests)."""
        with self.engine.begin() as conn:
            for table in (
                task_outcomes,
                replica_spans,
                usage_records,
                api_keys,
                tenants,
                schema_version,
            ):
                table.drop(conn, checkfirst=True)

    def close(self) -> None:
        with self._key_lock:
            if self._key_conn is not None:
                self._key_conn.close()
                self._key_conn = None
        self.engine.dispose()


_KEY_CACHE_MAX = 4096
"""Keys a SQLite store keeps between changes of the database (more are read each time)."""
_KEY_COLUMNS = ", ".join(f.name for f in dataclasses.fields(KeyRecord))
_KEY_BY_ID = f"SELECT {_KEY_COLUMNS} FROM {api_keys.name} WHERE key_id = ?"
"""The one statement of a per-request key lookup on SQLite (columns in `KeyRecord`'s order)."""


class PostgresKeyReader:
    """Per-request key lookups on PostgreSQL from the event loop: a small pool of autocommit
    psycopg connections, one round trip each (its statement prepared after a few uses).

    A SQLAlchemy checkout on a worker thread cost 2.4 ms median here, and 18 ms at p99 while a
    flood's lookups held the threads and the GIL; this is about a tenth of that. Every lookup
    reads the latest commit, so a revocation by any process counts on the key's next request.
    A lookup that finds its connection broken (the server restarted, say) has the idle ones
    checked, the broken dropped, and is tried once more.
    """

    def __init__(self, url: str, max_connections: int = 4) -> None:
        from psycopg_pool import AsyncConnectionPool

        conninfo = "postgresql://" + url.split("://", 1)[1]
        self._pool: Any = AsyncConnectionPool(
            conninfo,
            min_size=1,
            max_size=max_connections,
            kwargs={"autocommit": True},
            open=False,
        )
        self._opened = False

    async def get_key(self, key_id: str) -> KeyRecord | None:
        import psycopg

        if not self._opened:
            self._opened = True
            await self._pool.open()
        try:
            return await self._lookup(key_id)
        except psycopg.OperationalError:
            await self._pool.check()  # drop every idle connection found broken
            return await self._lookup(key_id)

    async def _lookup(self, key_id: str) -> KeyRecord | None:
        async with self._pool.connection() as conn:
            cursor = await conn.execute(_KEY_BY_ID_PG, (key_id,))
            found = await cursor.fetchone()
        return KeyRecord(*found) if found else None

    async def close(self) -> None:
        if self._opened:
            await self._pool.close()


_KEY_BY_ID_PG = f"SELECT {_KEY_COLUMNS} FROM {api_keys.name} WHERE key_id = %s"


_USAGE_FIELDS = tuple(f.name for f in dataclasses.fields(UsageRecord))
_SQLITE_ROWS_PER_INSERT = 256
"""28 columns a row: 7,168 parameters a statement, under SQLite's limit (32,766 since 3.32)."""


def _usage_row(record: UsageRecord) -> dict[str, Any]:
    """A record as a row (shallow: `asdict` copies recursively, several times slower)."""
    return {f: getattr(record, f) for f in _USAGE_FIELDS}


@functools.lru_cache(maxsize=16)
def _sqlite_usage_insert(num_rows: int) -> str:
    """An insert-if-absent of `num_rows` usage records in one statement."""
    one = "(" + ", ".join("?" * len(_USAGE_FIELDS)) + ")"
    return (
        f"INSERT INTO {usage_records.name} ({', '.join(_USAGE_FIELDS)}) VALUES "
        + ", ".join([one] * num_rows)
        + " ON CONFLICT (request_id) DO NOTHING"
    )


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cursor = dbapi_conn.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()
