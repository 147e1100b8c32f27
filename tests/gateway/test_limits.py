"""Token buckets: the pure arithmetic, the in-process store, and Redis (real server, shared)."""

from __future__ import annotations

import asyncio
import datetime as dt
import math
import uuid

import pytest

from infercloud.gateway.app import period_end_s, period_start_s
from infercloud.gateway.limits import LocalLimits, RedisLimits, take

REDIS_URL = "redis://127.0.0.1:6379/0"


def test_bucket_bursts_then_refills() -> None:
    bucket = None
    allowed = 0
    for _ in range(15):
        bucket, d = take(bucket, 10, 10 / 60, 1, now_s=0.0)
        allowed += d.allowed
    assert allowed == 10
    assert bucket is not None
    _, d = take(bucket, 10, 10 / 60, 1, now_s=0.0)
    assert not d.allowed and math.isclose(d.retry_after_s, 6.0)
    _, d = take(bucket, 10, 10 / 60, 1, now_s=6.0)
    assert d.allowed
    _, d = take(bucket, 10, 10 / 60, 11, now_s=100.0)
    assert not d.allowed and d.retry_after_s == math.inf  # larger than the bucket: never


def test_forced_charge_goes_negative_and_delays_the_next() -> None:
    bucket, _ = take(None, 100, 100 / 60, 50, now_s=0.0)
    bucket, d = take(bucket, 100, 100 / 60, 120, now_s=0.0, force=True)
    assert d.allowed and d.remaining == -70
    _, d = take(bucket, 100, 100 / 60, 1, now_s=10.0)
    assert not d.allowed


def test_local_limits_slots() -> None:
    limits = LocalLimits(lambda: 0.0)

    async def go() -> list[bool]:
        got = [await limits.acquire_slot("k", 2) for _ in range(3)]
        await limits.release_slot("k")
        got.append(await limits.acquire_slot("k", 2))
        return got

    assert asyncio.run(go()) == [True, True, False, True]


def test_redis_limits_are_shared_between_clients() -> None:
    """Two clients (as two gateway processes would) hit one bucket: 200 takes, 50 admitted."""
    prefix = f"infercloud-test-{uuid.uuid4().hex}:"

    async def go() -> int:
        a, b = RedisLimits(REDIS_URL, prefix), RedisLimits(REDIS_URL, prefix)
        try:
            results = await asyncio.gather(
                *((a if i % 2 else b).take("t:acme:rpm", 50, 50 / 60, 1) for i in range(200))
            )
            assert await a.acquire_slot("c", 1)
            assert not await b.acquire_slot("c", 1)
            await a.init_spend("s", 1.5, 60)
            await b.init_spend("s", 9.0, 60)  # already known: kept
            await b.add_spend("s", 0.25, 60)
            assert await a.spend("s") == pytest.approx(1.75)
            return sum(d.allowed for d in results)
        finally:
            await a.flush()
            await a.close()
            await b.close()

    assert asyncio.run(go()) == 50


def test_a_budget_period_ends_where_the_next_begins() -> None:
    """UTC days and calendar months, December into January included."""

    def at(*args: int) -> float:
        return dt.datetime(*args, tzinfo=dt.UTC).timestamp()

    assert period_end_s(at(2026, 12, 7, 21, 30), "month") == at(2027, 1, 1)
    assert period_end_s(at(2026, 2, 28, 23, 59), "month") == at(2026, 3, 1)
    assert period_end_s(at(2026, 12, 31, 23, 59), "day") == at(2027, 1, 1)
    for t in (at(2026, 1, 31, 12), at(2026, 12, 1)):
        for period in ("day", "month"):
            end = period_end_s(t, period)
            assert period_start_s(end, period) == end > t >= period_start_s(t, period)
