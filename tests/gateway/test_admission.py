"""Admission policy: slots, fair shares, priority classes, shedding, deadlines (pure, no I/O)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from infercloud.gateway.admission import CLASSES, AdmissionQueue, Ticket


def ticket(tenant: str, priority: str = "standard", cost: float = 10.0, t: float = 0.0) -> Ticket:
    return Ticket(tenant, priority, cost, arrival_s=t, deadline_s=t + 30.0)


def test_flood_fills_regular_slots_and_a_newcomer_gets_a_reserved_one() -> None:
    q = AdmissionQueue(max_inflight=8, max_queued=100, reserved_slots=2)
    flood = [ticket("a") for _ in range(20)]
    started = [q.offer(t, 0.0).started for t in flood]
    assert started.count(True) == 8  # alone, a may use every regular slot, not the reserved
    newcomer = ticket("b")
    assert q.offer(newcomer, 0.0).started  # b starts at once, in a reserved slot
    assert q.inflight == 9
    running = [t for t, s in zip(flood, started, strict=True) if s]
    # a's freed slot is not refilled while that would keep 9 in flight
    assert q.release(running[0]) == []
    assert q.release(running[1]) == [flood[8]]  # back down to 8 in all: a refills
    assert q.offer(ticket("c"), 0.0).started  # a second newcomer, second reserved slot
    q.check_invariants()


def test_light_tenant_goes_before_a_flood_backlog() -> None:
    q = AdmissionQueue(max_inflight=2, max_queued=100, reserved_slots=0)
    running = [ticket("a"), ticket("a")]
    for t in running:
        assert q.offer(t, 0.0).started
    backlog = [ticket("a") for _ in range(10)]
    for t in backlog:
        assert not q.offer(t, 0.0).started
    light = ticket("b")
    assert not q.offer(light, 1.0).started
    # b's finish tag starts level with the class clock, so it ties with the head of a's backlog
    # and is ahead of the other nine: it starts within the next two freed slots, not after ten
    assert q.release(running[0]) + q.release(running[1]) == [backlog[0], light]
    q.check_invariants()


def test_weights_share_slots_in_proportion() -> None:
    weights = {"a": 3.0, "b": 1.0}
    q = AdmissionQueue(max_inflight=1, max_queued=1000, reserved_slots=0, weight=weights.get)
    first = ticket("a")
    assert q.offer(first, 0.0).started
    for _ in range(40):
        q.offer(ticket("a"), 0.0)
        q.offer(ticket("b"), 0.0)
    served: list[str] = []
    current = first
    for _ in range(40):
        (current,) = q.release(current)
        served.append(current.tenant)
    assert 28 <= served.count("a") <= 32  # 3:1


def test_classes_go_in_order_and_the_lowest_is_shed_first() -> None:
    q = AdmissionQueue(max_inflight=1, max_queued=2, reserved_slots=0)
    running = ticket("x", "standard")
    assert q.offer(running, 0.0).started
    batch1, batch2 = ticket("a", "batch"), ticket("b", "batch")
    assert q.offer(batch1, 0.0).shed == []
    assert q.offer(batch2, 0.0).shed == []
    urgent = ticket("c", "interactive")
    offer = q.offer(urgent, 0.0)
    assert offer.shed == [batch2]  # the newest of the lowest class makes room
    late = ticket("d", "batch")
    assert q.offer(late, 0.0).shed == [late]  # nothing below batch: the arrival is shed
    assert q.release(running) == [urgent]
    q.check_invariants()


def test_deadlines_expire_waiting_tickets() -> None:
    q = AdmissionQueue(max_inflight=1, max_queued=10, reserved_slots=0)
    assert q.offer(ticket("a"), 0.0).started
    waiting = Ticket("b", "standard", 1.0, 0.0, deadline_s=5.0)
    q.offer(waiting, 0.0)
    assert q.expire(4.9) == []
    assert q.expire(5.0) == [waiting]
    assert q.num_queued == 0
    assert not q.cancel(waiting)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["offer", "offer", "release", "cancel"]),
            st.sampled_from(["a", "b", "c"]),
            st.sampled_from(CLASSES),
            st.integers(0, 50),
        ),
        max_size=80,
    )
)
def test_invariants_under_random_traffic(ops: list[tuple[str, str, str, int]]) -> None:
    q = AdmissionQueue(max_inflight=3, max_queued=5, reserved_slots=1)
    started: list[Ticket] = []
    waiting: list[Ticket] = []
    for op, tenant, priority, n in ops:
        if op == "offer":
            t = ticket(tenant, priority, cost=float(n + 1))
            offer = q.offer(t, 0.0)
            for s in offer.shed:
                if s in waiting:
                    waiting.remove(s)
            if offer.started:
                started.append(t)
            elif t not in offer.shed:
                waiting.append(t)
        elif op == "release" and started:
            for t in q.release(started.pop(n % len(started))):
                waiting.remove(t)
                started.append(t)
        elif op == "cancel" and waiting:
            t = waiting.pop(n % len(waiting))
            assert q.cancel(t)
            for s in q.start_waiting():
                waiting.remove(s)
                started.append(s)
        q.check_invariants()
        assert q.inflight == len(started)
        assert q.num_queued == len(waiting)
