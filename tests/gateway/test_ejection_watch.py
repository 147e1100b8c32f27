"""`EjectionWatch`: a wait on a replica hears of its ejection once, at the moment it happens,
and not after the wait has ended."""

from __future__ import annotations

import asyncio

from infercloud.gateway.app import EjectionWatch
from infercloud.gateway.config import Routing
from infercloud.gateway.replicas import Replica
from infercloud.router.replica_set import ReplicaSet


def healthy_set() -> ReplicaSet:
    rs = ReplicaSet.of(
        "m",
        [Replica(f"m/{i}", f"http://127.0.0.1:{9000 + i}", "m", builtin=False) for i in range(2)],
        Routing(),
    )
    for s in rs.states:
        rs.check_passed(s)
    return rs


def test_a_watch_fires_once_when_its_replica_is_ejected_and_not_after_it_is_cancelled() -> None:
    async def run() -> None:
        rs = healthy_set()
        a, b = rs.states
        fired: list[str] = []
        watch = EjectionWatch(a, lambda: fired.append("a"))
        ended = EjectionWatch(a, lambda: fired.append("ended"))
        ended.cancel()
        elsewhere = EjectionWatch(b, lambda: fired.append("b"))
        rs.eject(a)
        assert fired == ["a"] and watch.fired and not ended.fired
        assert watch.failure(ConnectionError(), "mid-stream").connection
        rs.check_passed(a)
        rs.eject(a)
        await asyncio.sleep(0)
        assert fired == ["a"] and not elsewhere.fired
        elsewhere.cancel()
        assert not b.on_eject

    asyncio.run(run())


def test_a_watch_on_a_replica_already_ejected_fires_on_the_next_turn_unless_cancelled() -> None:
    async def run() -> None:
        rs = healthy_set()
        a = rs.states[0]
        rs.eject(a)
        fired: list[str] = []
        watch = EjectionWatch(a, lambda: fired.append("late"))
        cancelled = EjectionWatch(a, lambda: fired.append("cancelled"))
        cancelled.cancel()
        assert fired == []  # not from inside the caller's own step
        await asyncio.sleep(0)
        assert fired == ["late"] and watch.fired and not cancelled.fired

    asyncio.run(run())
