"""Rate limits, concurrency limits and spend: token buckets, counters, kept here or in Redis.

A limit of N per minute is a token bucket of capacity N refilled at N / 60 per second: a burst
of N is admitted at once, then one more every 60 / N seconds. Requests-per-minute takes 1 per
request at admission; tokens-per-minute takes the prompt's tokens at admission and is charged
the output tokens (and any correction of the prompt count) when the request ends, which may
take the bucket below zero: the next request then waits until it refills.

`LocalLimits` keeps state in this process; `RedisLimits` keeps it in Redis, with the bucket
arithmetic in one Lua script run atomically on Redis's own clock, so every gateway process
sharing a Redis enforces one limit. Both implement `Limits`.

`take` is pure (state and clock in, state and decision out); the classes only store the state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class Bucket:
    tokens: float
    updated_s: float


@dataclass(frozen=True, slots=True)
class Decision:
    allowed: bool
    remaining: float
    """Tokens left in the bucket after this decision."""
    retry_after_s: float
    """When refused: seconds until the bucket holds the amount (inf if it never can)."""
    reset_s: float
    """Seconds until the bucket is full again."""


def take(
    bucket: Bucket | None,
    capacity: float,
    refill_per_s: float,
    amount: float,
    now_s: float,
    force: bool = False,
) -> tuple[Bucket, Decision]:
    """Refill to `now_s`, then take `amount` if the bucket holds it (always, if `force`)."""
    if bucket is None:
        tokens = capacity
    else:
        elapsed = max(0.0, now_s - bucket.updated_s)
        tokens = min(capacity, bucket.tokens + elapsed * refill_per_s)
    allowed = force or tokens >= amount
    if allowed:
        tokens -= amount
    if allowed:
        retry = 0.0
    elif amount > capacity:
        retry = math.inf
    else:
        retry = (amount - tokens) / refill_per_s
    reset = max(0.0, capacity - tokens) / refill_per_s
    return Bucket(tokens, now_s), Decision(allowed, tokens, retry, reset)


class Limits(Protocol):
    async def take(
        self, key: str, capacity: float, refill_per_s: float, amount: float, force: bool = False
    ) -> Decision: ...

    async def acquire_slot(self, key: str, limit: int) -> bool: ...

    async def release_slot(self, key: str) -> None: ...

    async def spend(self, key: str) -> float | None:
        """Money spent under `key` (a tenant's period), None if not known here yet."""
        ...

    async def init_spend(self, key: str, usd: float, ttl_s: float) -> None:
        """Set the spend under `key` unless it is already known."""
        ...

    async def add_spend(self, key: str, usd: float, ttl_s: float) -> None: ...

    async def close(self) -> None: ...


class LocalLimits:
    """In-process state; the clock is passed in (monotonic seconds)."""

    def __init__(self, clock: Any) -> None:
        self._clock = clock
        self._buckets: dict[str, Bucket] = {}
        self._slots: dict[str, int] = {}
        self._spend: dict[str, float] = {}

    async def take(
        self, key: str, capacity: float, refill_per_s: float, amount: float, force: bool = False
    ) -> Decision:
        bucket, decision = take(
            self._buckets.get(key), capacity, refill_per_s, amount, self._clock(), force
        )
        self._buckets[key] = bucket
        return decision

    async def acquire_slot(self, key: str, limit: int) -> bool:
        used = self._slots.get(key, 0)
        if used >= limit:
            return False
        self._slots[key] = used + 1
        return True

    async def release_slot(self, key: str) -> None:
        left = self._slots.get(key, 0) - 1
        if left > 0:
            self._slots[key] = left
        else:
            self._slots.pop(key, None)

    async def spend(self, key: str) -> float | None:
        return self._spend.get(key)

    async def init_spend(self, key: str, usd: float, ttl_s: float) -> None:
        self._spend.setdefault(key, usd)

    async def add_spend(self, key: str, usd: float, ttl_s: float) -> None:
        self._spend[key] = self._spend.get(key, 0.0) + usd

    async def close(self) -> None:
        return None


# The same arithmetic as `take`, on Redis's clock. Numbers go back as strings: Redis would
# truncate Lua floats to integers.
_TAKE_LUA = """
local capacity = tonumber(ARGV[1])
local rate = tonumber(ARGV[2])
local amount = tonumber(ARGV[3])
local force = tonumber(ARGV[4])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local state = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(state[1])
if tokens == nil then
  tokens = capacity
else
  tokens = math.min(capacity, tokens + math.max(0, now - tonumber(state[2])) * rate)
end
local allowed = 0
if force == 1 or tokens >= amount then
  tokens = tokens - amount
  allowed = 1
end
local left = string.format('%.17g', tokens)
redis.call('HSET', KEYS[1], 'tokens', left, 'ts', string.format('%.17g', now))
redis.call('EXPIRE', KEYS[1], math.ceil(capacity / rate) + 60)
return {allowed, left}
"""

_ACQUIRE_LUA = """
local used = redis.call('INCR', KEYS[1])
redis.call('EXPIRE', KEYS[1], 3600)
if used > tonumber(ARGV[1]) then
  redis.call('DECR', KEYS[1])
  return 0
end
return 1
"""


class RedisLimits:
    """Shared state in Redis (`redis.asyncio`); keys live under `prefix`."""

    def __init__(self, url: str, prefix: str = "infercloud:") -> None:
        import redis.asyncio as aioredis

        self._redis: Any = aioredis.from_url(url, decode_responses=True)
        self._prefix = prefix
        self._take = self._redis.register_script(_TAKE_LUA)
        self._acquire = self._redis.register_script(_ACQUIRE_LUA)

    async def take(
        self, key: str, capacity: float, refill_per_s: float, amount: float, force: bool = False
    ) -> Decision:
        allowed, left = await self._take(
            keys=[self._prefix + "bucket:" + key],
            args=[repr(capacity), repr(refill_per_s), repr(amount), 1 if force else 0],
        )
        tokens = float(left)
        ok = bool(int(allowed))
        if ok:
            retry = 0.0
        elif amount > capacity:
            retry = math.inf
        else:
            retry = (amount - tokens) / refill_per_s
        return Decision(ok, tokens, retry, max(0.0, capacity - tokens) / refill_per_s)

    async def acquire_slot(self, key: str, limit: int) -> bool:
        got = await self._acquire(keys=[self._prefix + "slots:" + key], args=[limit])
        return bool(int(got))

    async def release_slot(self, key: str) -> None:
        await self._redis.decr(self._prefix + "slots:" + key)

    async def spend(self, key: str) -> float | None:
        value = await self._redis.get(self._prefix + "spend:" + key)
        return None if value is None else float(value)

    async def init_spend(self, key: str, usd: float, ttl_s: float) -> None:
        await self._redis.set(self._prefix + "spend:" + key, repr(usd), nx=True, ex=int(ttl_s))

    async def add_spend(self, key: str, usd: float, ttl_s: float) -> None:
        name = self._prefix + "spend:" + key
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.incrbyfloat(name, usd)
            pipe.expire(name, int(ttl_s), nx=True)
            await pipe.execute()

    async def flush(self) -> None:
        """Delete every key under the prefix (tests)."""
        async for name in self._redis.scan_iter(match=self._prefix + "*"):
            await self._redis.delete(name)

    async def close(self) -> None:
        await self._redis.aclose()
