"""Admission: how many requests run at once, who goes next, and who is shed when it is full.

Per model there are `max_inflight` slots (the replicas' capacity), first come first served, and
`reserved_slots` more above them that only a tenant below its fair share (`max_inflight /
active tenants`) may take. So a tenant flooding the model can fill every regular slot, as it
should when it is alone, yet a newcomer's request starts at once in a reserved slot instead of
waiting behind the flood; while the newcomer is in flight, the flood gets the regular slots it
frees back only down to `max_inflight` in all. A request that cannot start waits in its
priority class (interactive > standard > batch); classes are served in order where they can use
a slot. Within a class, tenants share by self-clocked weighted fair queueing: a request's
finish tag is `max(class clock, tenant's last tag) + cost / weight`, the waiting request with
the lowest tag among tenants that may start goes next, and the class clock advances to the tag
served. A tenant that sent nothing for a while starts level with the
clock, not behind it, so a trickle always goes ahead of a flood's backlog.

The queue is bounded (`max_queued`); when it is full, the newest request of the lowest class
waiting is shed, or the arrival itself if nothing waiting ranks below it. A request that waits
past its deadline expires. Shed and expired requests get 503 with Retry-After from the caller.

Pure: no clock reads (`now_s` comes in), no I/O; a `Ticket` is the caller's handle.

Invariants:
- `inflight <= max_inflight + reserved_slots`, and `inflight == sum(inflight per tenant)`;
- a ticket is in at most one place: waiting, started, or returned as shed/expired (never two);
- within one class and one tenant, requests start in arrival order.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

CLASSES = ("interactive", "standard", "batch")


@dataclass(eq=False, slots=True)
class Ticket:
    tenant: str
    priority: str
    """One of `CLASSES`."""
    cost: float
    """Work it brings (tokens), for fair shares."""
    arrival_s: float
    deadline_s: float
    finish_tag: float = 0.0
    seq: int = 0

    @property
    def class_rank(self) -> int:
        return CLASSES.index(self.priority)


@dataclass(slots=True)
class _ClassQueue:
    clock: float = 0.0
    last_tag: dict[str, float] = field(default_factory=dict)
    by_tenant: dict[str, deque[Ticket]] = field(default_factory=dict)

    def __len__(self) -> int:
        return sum(len(q) for q in self.by_tenant.values())


@dataclass(frozen=True, slots=True)
class Offer:
    started: bool
    """True: the ticket holds a slot now; False: it waits (unless it is in `shed`)."""
    shed: list[Ticket]
    """Tickets refused to make room (possibly the one offered)."""


class AdmissionQueue:
    def __init__(
        self,
        max_inflight: int,
        max_queued: int,
        reserved_slots: int | None = None,
        weight: Callable[[str], float] = lambda tenant: 1.0,
    ) -> None:
        if max_inflight < 1 or max_queued < 0:
            raise ValueError("max_inflight must be >= 1 and max_queued >= 0")
        self.max_inflight = max_inflight
        self.max_queued = max_queued
        self.reserved_slots = (
            max(1, max_inflight // 4) if reserved_slots is None else reserved_slots
        )
        if self.reserved_slots < 0:
            raise ValueError("reserved_slots must be >= 0")
        self.weight = weight
        self.inflight = 0
        self.inflight_by_tenant: dict[str, int] = {}
        self._classes = [_ClassQueue() for _ in CLASSES]
        self._seq = itertools.count()

    # -- state ---------------------------------------------------------------------------------

    @property
    def num_queued(self) -> int:
        return sum(len(c) for c in self._classes)

    def _active_tenants(self) -> set[str]:
        active = {t for t, n in self.inflight_by_tenant.items() if n}
        for c in self._classes:
            active.update(t for t, q in c.by_tenant.items() if q)
        return active

    def may_start(self, tenant: str, extra_active: int = 0) -> bool:
        """A slot is free for this tenant: a regular one, or a reserved one if the tenant is
        below its fair share."""
        if self.inflight < self.max_inflight:
            return True
        if self.inflight >= self.max_inflight + self.reserved_slots:
            return False
        active = self._active_tenants()
        num_active = len(active) + (extra_active if tenant not in active else 0)
        fair_share = self.max_inflight / max(1, num_active)
        return self.inflight_by_tenant.get(tenant, 0) < fair_share

    # -- transitions ---------------------------------------------------------------------------

    def offer(self, ticket: Ticket, now_s: float) -> Offer:
        ticket.seq = next(self._seq)
        if self.may_start(ticket.tenant, extra_active=1) and not self._waiting(ticket.tenant):
            self._start(ticket)
            return Offer(True, [])
        shed: list[Ticket] = []
        if self.num_queued >= self.max_queued:
            victim = self._newest_of_lowest_class()
            if victim is None or victim.class_rank <= ticket.class_rank:
                return Offer(False, [ticket])
            self._remove(victim)
            shed.append(victim)
        queue = self._classes[ticket.class_rank]
        start_tag = max(queue.clock, queue.last_tag.get(ticket.tenant, 0.0))
        ticket.finish_tag = start_tag + ticket.cost / max(self.weight(ticket.tenant), 1e-9)
        queue.last_tag[ticket.tenant] = ticket.finish_tag
        queue.by_tenant.setdefault(ticket.tenant, deque()).append(ticket)
        return Offer(False, shed)

    def release(self, ticket: Ticket) -> list[Ticket]:
        """A started request is done: free its slot; returns the tickets that start now."""
        self.inflight -= 1
        left = self.inflight_by_tenant[ticket.tenant] - 1
        if left:
            self.inflight_by_tenant[ticket.tenant] = left
        else:
            del self.inflight_by_tenant[ticket.tenant]
        return self.start_waiting()

    def cancel(self, ticket: Ticket) -> bool:
        """Drop a waiting ticket (its client went away); False if it is not waiting."""
        queue = self._classes[ticket.class_rank].by_tenant.get(ticket.tenant)
        if queue is None or ticket not in queue:
            return False
        self._remove(ticket)
        return True

    def expire(self, now_s: float) -> list[Ticket]:
        """Remove and return waiting tickets whose deadline has passed."""
        gone = [
            t
            for c in self._classes
            for q in c.by_tenant.values()
            for t in q
            if t.deadline_s <= now_s
        ]
        for t in gone:
            self._remove(t)
        return gone

    # -- helpers -------------------------------------------------------------------------------

    def _waiting(self, tenant: str) -> bool:
        return any(c.by_tenant.get(tenant) for c in self._classes)

    def _start(self, ticket: Ticket) -> None:
        self.inflight += 1
        self.inflight_by_tenant[ticket.tenant] = self.inflight_by_tenant.get(ticket.tenant, 0) + 1

    def start_waiting(self) -> list[Ticket]:
        """Start waiting tickets while slots allow (call after `cancel` or `expire` too: fewer
        active tenants can raise the fair share of those left)."""
        started: list[Ticket] = []
        while self.inflight < self.max_inflight + self.reserved_slots:
            ticket = self._next()
            if ticket is None:
                break
            self._remove(ticket)
            self._classes[ticket.class_rank].clock = ticket.finish_tag
            self._start(ticket)
            started.append(ticket)
        return started

    def _next(self) -> Ticket | None:
        for c in self._classes:
            heads = [q[0] for t, q in c.by_tenant.items() if q and self.may_start(t)]
            if heads:
                return min(heads, key=lambda t: (t.finish_tag, t.seq))
        return None

    def _newest_of_lowest_class(self) -> Ticket | None:
        for c in reversed(self._classes):
            tickets = [t for q in c.by_tenant.values() for t in q]
            if tickets:
                return max(tickets, key=lambda t: t.seq)
        return None

    def _remove(self, ticket: Ticket) -> None:
        c = self._classes[ticket.class_rank]
        queue = c.by_tenant[ticket.tenant]
        queue.remove(ticket)
        if not queue:
            del c.by_tenant[ticket.tenant]

    def check_invariants(self) -> None:
        assert 0 <= self.inflight <= self.max_inflight + self.reserved_slots
        assert self.inflight == sum(self.inflight_by_tenant.values())
        assert all(n > 0 for n in self.inflight_by_tenant.values())
        assert self.num_queued <= self.max_queued
        for c in self._classes:
            for q in c.by_tenant.values():
                seqs = [t.seq for t in q]
                assert seqs == sorted(seqs)
