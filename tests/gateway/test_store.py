"""The store on SQLite and on the real PostgreSQL: migrations, keys, idempotent usage records."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from infercloud.gateway import keys as keyring
from infercloud.gateway.store import MIGRATIONS, KeyRecord, Store, UsageRecord, api_keys
from tests.gateway.conftest import postgres_schema


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'db' / 'infercloud.db'}"
        return
    with postgres_schema() as url:
        yield url


def usage(
    request_id: str, tenant: str = "acme", cost: float = 0.5, at: float = 100.0
) -> UsageRecord:
    return UsageRecord(
        request_id=request_id,
        tenant=tenant,
        key_id="k1",
        model="m",
        replica="m/0",
        endpoint="completions",
        priority="standard",
        status=200,
        outcome="completed",
        error=None,
        prompt_tokens=10,
        cached_tokens=4,
        completion_tokens=5,
        cost_usd=cost,
        queue_ms=1.0,
        ttft_ms=2.0,
        e2e_ms=3.0,
        stream=False,
        created_at_s=at,
    )


def test_version_2_adds_the_retry_columns_to_an_old_database(store_url: str) -> None:
    """A database at version 1 (no attempts / failed_replicas columns) with a record in it."""
    import sqlalchemy as sa

    store = Store(store_url)
    try:
        store.migrate()
        store.add_usage([usage("old")])
        with store.engine.begin() as conn:
            conn.execute(sa.text("ALTER TABLE usage_records DROP COLUMN attempts"))
            conn.execute(sa.text("ALTER TABLE usage_records DROP COLUMN failed_replicas"))
            conn.execute(sa.text("UPDATE infercloud_schema_version SET version = 1"))
        assert store.version() == 1
        assert store.migrate() == 3
        store.add_usage([replace(usage("new"), attempts=2, failed_replicas="m/1")])
        rows = {r.request_id: r for r in store.usage()}
        assert (rows["old"].attempts, rows["old"].failed_replicas) == (1, None)
        assert (rows["new"].attempts, rows["new"].failed_replicas) == (2, "m/1")
    finally:
        store.close()


def test_version_3_adds_tasks_meters_and_spans_to_an_old_database(store_url: str) -> None:
    import sqlalchemy as sa

    from infercloud.gateway.store import _V3_COLUMNS, OutcomeRecord

    store = Store(store_url)
    try:
        store.migrate()
        store.add_usage([usage("old")])
        with store.engine.begin() as conn:
            conn.execute(sa.text("DROP INDEX ix_usage_records_task_id"))
            for column in _V3_COLUMNS:
                conn.execute(sa.text(f"ALTER TABLE usage_records DROP COLUMN {column}"))
            conn.execute(sa.text("DROP TABLE replica_spans"))
            conn.execute(sa.text("DROP TABLE task_outcomes"))
            conn.execute(sa.text("UPDATE infercloud_schema_version SET version = 2"))
        assert store.migrate() == 3
        store.add_usage([replace(usage("new"), task_id="t1", compute_s=0.5, kv_byte_s=2.0)])
        rows = {r.request_id: r for r in store.usage()}
        assert (rows["old"].task_id, rows["old"].compute_s) == (None, None)
        assert (rows["new"].task_id, rows["new"].compute_s) == ("t1", 0.5)
        outcome = OutcomeRecord("acme", "t1", False, "v", 1, 0, "model", None, None, 1.0)
        store.put_outcome(outcome)
        store.put_outcome(replace(outcome, success=True, blamed_layer=None, reported_at_s=2.0))
        assert store.outcomes() == [
            replace(outcome, success=True, blamed_layer=None, reported_at_s=2.0)
        ]
    finally:
        store.close()


def test_migrations_are_idempotent_and_versioned(store_url: str) -> None:
    store = Store(store_url)
    try:
        assert store.migrate() == len(MIGRATIONS)
        assert store.migrate() == len(MIGRATIONS)  # a second start changes nothing
        assert store.version() == len(MIGRATIONS)
    finally:
        store.close()


def test_keys_are_stored_hashed_and_revocable(store_url: str) -> None:
    store = Store(store_url)
    try:
        store.migrate()
        key, key_id, sha = keyring.new_key()
        record = KeyRecord(key_id, "acme", sha, 50, None, None, "interactive", 10.0, 1.0, None)
        store.add_key(record)
        store.add_key(replace(record, key_id="other", secret_sha256="0" * 64))  # same tenant
        got = store.get_key(key_id)
        assert got == record
        parsed = keyring.parse(key)
        assert parsed is not None and parsed[0] == key_id
        assert keyring.verify(parsed[1], got.secret_sha256)
        assert not keyring.verify(parsed[1] + "x", got.secret_sha256)
        assert key.split("-", 2)[2] not in repr(store.list_keys())  # the secret is nowhere
        assert store.revoke_key(key_id, 5.0)
        assert not store.revoke_key(key_id, 6.0)
        revoked = store.get_key(key_id)
        assert revoked is not None and revoked.revoked_at_s == 5.0
        assert sorted(k.key_id for k in store.list_keys("acme")) == sorted([key_id, "other"])
    finally:
        store.close()


def test_sqlite_key_lookups_see_every_commit_of_any_connection(tmp_path: Path) -> None:
    """SQLite lookups keep the keys they read until the database changes: a revocation or a
    changed limit committed by another process (another Store: its own connections) or by
    this store's own writes is seen on the very next lookup; an unknown id stays unknown
    until it is added."""
    url = f"sqlite:///{tmp_path / 'db' / 'infercloud.db'}"
    store, other = Store(url), Store(url)
    try:
        store.migrate()
        _, key_id, sha = keyring.new_key()
        record = KeyRecord(key_id, "acme", sha, 50, None, None, "interactive", None, 1.0, None)
        assert store.get_key(key_id) is None
        other.add_key(record)
        assert store.get_key(key_id) == record
        assert store.get_key(key_id) == record  # cached, unchanged
        assert other.revoke_key(key_id, 5.0)
        assert store.get_key(key_id) == replace(record, revoked_at_s=5.0)
        with other.engine.begin() as conn:
            conn.execute(api_keys.update().values(rpm=7, revoked_at_s=None))
        assert store.get_key(key_id) == replace(record, rpm=7)
        store.add_usage([usage("u1")])  # its own writes change the version too
        assert store.revoke_key(key_id, 6.0)
        assert store.get_key(key_id) == replace(record, rpm=7, revoked_at_s=6.0)
    finally:
        store.close()
        other.close()


def test_the_event_loop_key_reader_sees_revocations_and_survives_a_lost_connection() -> None:
    """PostgreSQL key lookups made on the loop (`PostgresKeyReader`): the record as committed,
    None for an unknown id, a revocation seen on the next lookup, and a connection that the
    server closed replaced without failing the lookup."""
    import asyncio

    import sqlalchemy as sa

    with postgres_schema() as url:
        store = Store(url)
        try:
            store.migrate()
            _, key_id, sha = keyring.new_key()
            record = KeyRecord(key_id, "acme", sha, None, None, None, "standard", 1.0, 1.0, None)
            store.add_key(record)
            reader = store.async_key_reader()
            assert reader is not None

            async def lookups() -> None:
                try:
                    assert await reader.get_key(key_id) == record
                    assert await reader.get_key("nope") is None
                    store.revoke_key(key_id, 7.0)
                    got = await reader.get_key(key_id)
                    assert got is not None and got.revoked_at_s == 7.0
                    with store.engine.begin() as conn:  # the server drops the reader's sessions
                        conn.execute(
                            sa.text(
                                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                "WHERE pid <> pg_backend_pid() AND datname = current_database() "
                                "AND query LIKE '%FROM api_keys WHERE key_id%'"
                            )
                        )
                    got = await reader.get_key(key_id)
                    assert got is not None and got.key_id == key_id
                finally:
                    await reader.close()

            asyncio.run(lookups())
        finally:
            store.close()


def test_usage_records_are_written_once(store_url: str) -> None:
    store = Store(store_url)
    try:
        store.migrate()
        store.add_usage([usage("r1"), usage("r2", tenant="beta", at=200.0)])
        store.add_usage([usage("r1", cost=99.0), usage("r3", at=300.0)])  # r1 again: ignored
        assert [r.request_id for r in store.usage()] == ["r1", "r2", "r3"]
        assert store.usage("acme")[0].cost_usd == 0.5
        assert [r.request_id for r in store.usage("beta")] == ["r2"]
        assert store.spend_usd(0.0, tenant="acme") == pytest.approx(1.0)
        assert store.spend_usd(250.0, tenant="acme") == pytest.approx(0.5)
        assert store.spend_usd(0.0, key_id="k1") == pytest.approx(1.5)
    finally:
        store.close()


def test_a_large_batch_of_usage_records_round_trips_every_field(store_url: str) -> None:
    """More records than one SQLite statement holds, each field set, one id repeated: every
    record reads back equal to what was written, and the repeat is stored once."""
    store = Store(store_url)
    try:
        store.migrate()
        records = [
            replace(
                usage(f"r{i:04d}", tenant=f"t{i % 3}", cost=i / 7, at=1000.0 + i),
                error="boom" if i % 5 == 0 else None,
                stream=i % 2 == 0,
                ttft_ms=None if i % 4 == 0 else i / 3,
                attempts=1 + i % 2,
                failed_replicas="m/1" if i % 2 else None,
                task_id=f"task{i % 11}",
                config="c",
                compute_s=i / 100,
                recompute_s=0.0,
                recomputed_tokens=i % 13,
                kv_byte_s=float(i),
                failed_attempt_s="0.250000" if i % 2 else None,
            )
            for i in range(601)
        ]
        store.add_usage([*records, records[300]])
        store.add_usage(records[:10])  # all stored already: nothing changes
        assert store.usage() == records
    finally:
        store.close()
