"""Router policies: pure functions of (one request, the routable replicas' state) -> a replica.

Every policy has one method, `choose(request, replicas) -> Choice`. `replicas` holds only the
routable replicas (healthy, not draining) and is never empty: the caller answers 503 before
asking. Nothing in a policy reads a clock, a socket or a random source: a round-robin turn is the
request's sequence number, a random pick is a hash of the request id, a replica's cache state is
already folded into `ReplicaView.cached_prefix_blocks` by the caller (`router.kv_index`). The
simulator of a later issue calls the same objects.

kv_aware, the cache-aware policy, prices each replica in prompt tokens of work:

    cost(r) = w * uncached_prompt_tokens(r) + pending_prefill_tokens(r) + d * decoding(r)

  - uncached_prompt_tokens(r) = prompt tokens - block_size x the leading prompt blocks that r
    already holds (from its KV events, or the router's routing history for upstreams): the
    prefill this request would cost there. w (`prefill_weight`, default 1) scales it against
    the load terms.
  - pending_prefill_tokens(r): prompt tokens of requests routed to r that have not produced
    their first token yet, the prefill queue this request would wait behind.
  - decoding(r): requests on r past their first token. Each makes every step of r longer, so a
    running decode is charged as d prompt tokens (`decode_weight`, default 16).

The lowest cost wins (ties: fewer outstanding, then the round-robin turn). The guard: when the
routable replicas are strongly imbalanced (most outstanding - fewest > `balance_abs`, and most >
`balance_rel` x fewest), the request goes to the least loaded replica instead, so that a hot
prefix cannot pile every request onto one replica (SGLang's router uses the same two
thresholds).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class RouteRequest:
    request_id: str
    seq: int
    """The router's count of requests so far (round-robin turns come from it)."""
    prompt_tokens: int
    session: str | None = None
    """Affinity key: the request's `user` field or `x-session-id` header."""


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """What a policy may know of one routable replica, for one request."""

    name: str
    outstanding: int
    """Requests routed to it and not finished."""
    pending_prefill_tokens: int = 0
    decoding: int = 0
    cached_prefix_blocks: int = 0
    """Leading blocks of this request's prompt that the replica holds (device or host tier)."""
    block_size: int = 16


@dataclass(frozen=True, slots=True)
class Choice:
    replica: str
    reason: str
    """Why: "turn", "least_load", "two_choices", "affinity", "cache", "balance"."""
    cost: float | None = None


class RouterPolicy(Protocol):
    @property
    def name(self) -> str: ...

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> Choice: ...


def _hash64(*parts: str) -> int:
    digest = hashlib.blake2b("\x00".join(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def _rotation(request: RouteRequest, n: int, i: int) -> int:
    """Tie-break order that moves with each request, so ties do not all go to replica 0."""
    return (i - request.seq) % n


def least_loaded(request: RouteRequest, replicas: Sequence[ReplicaView]) -> ReplicaView:
    n = len(replicas)
    return min(
        enumerate(replicas), key=lambda ir: (ir[1].outstanding, _rotation(request, n, ir[0]))
    )[1]


class RoundRobin:
    name = "round_robin"

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> Choice:
        return Choice(replicas[request.seq % len(replicas)].name, "turn")


class LeastOutstanding:
    name = "least_outstanding"

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> Choice:
        return Choice(least_loaded(request, replicas).name, "least_load")


class PowerOfTwo:
    """Two distinct replicas drawn by hashing the request id; the less loaded one wins."""

    name = "power_of_two"

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> Choice:
        n = len(replicas)
        if n == 1:
            return Choice(replicas[0].name, "two_choices")
        h = _hash64(request.request_id)
        a = h % n
        b = (a + 1 + (h >> 32) % (n - 1)) % n
        pick = min((replicas[a], replicas[b]), key=lambda r: r.outstanding)
        return Choice(pick.name, "two_choices")


class SessionAffinity:
    """Requests of one session go to one replica: rendezvous hashing (the replica with the
    highest hash of (session, replica name)), so that losing a replica moves only its own
    sessions. Requests without a session go to the least loaded replica."""

    name = "session_affinity"

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> Choice:
        if not request.session:
            return Choice(least_loaded(request, replicas).name, "least_load")
        session = request.session
        pick = max(replicas, key=lambda r: _hash64(session, r.name))
        return Choice(pick.name, "affinity")


@dataclass(frozen=True, slots=True)
class KVAware:
    """Cache-aware routing; the formula and its weights are in the module docstring."""

    prefill_weight: float = 1.0
    decode_weight: float = 16.0
    balance_abs: int = 8
    balance_rel: float = 1.5
    name: str = "kv_aware"

    def cost(self, request: RouteRequest, r: ReplicaView) -> float:
        uncached = max(0, request.prompt_tokens - r.cached_prefix_blocks * r.block_size)
        return (
            self.prefill_weight * uncached
            + r.pending_prefill_tokens
            + self.decode_weight * r.decoding
        )

    def imbalanced(self, replicas: Sequence[ReplicaView]) -> bool:
        loads = [r.outstanding for r in replicas]
        most, fewest = max(loads), min(loads)
        return most - fewest > self.balance_abs and most > self.balance_rel * fewest

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaView]) -> Choice:
        if self.imbalanced(replicas):
            return Choice(least_loaded(request, replicas).name, "balance")
        n = len(replicas)
        _, best = min(
            enumerate(replicas),
            key=lambda ir: (
                self.cost(request, ir[1]),
                ir[1].outstanding,
                _rotation(request, n, ir[0]),
            ),
        )
        return Choice(
            best.name,
            "cache" if best.cached_prefix_blocks else "least_load",
            self.cost(request, best),
        )


POLICIES: dict[str, Callable[[], RouterPolicy]] = {
    "round_robin": RoundRobin,
    "least_outstanding": LeastOutstanding,
    "power_of_two": PowerOfTwo,
    "session_affinity": SessionAffinity,
    "kv_aware": KVAware,
}


def make_policy(name: str, **weights: float) -> RouterPolicy:
    """A policy by its config name; `weights` (the fields of `KVAware`) only for kv_aware."""
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; one of {sorted(POLICIES)}")
    if name == "kv_aware":
        return KVAware(**weights)  # type: ignore[arg-type]  # weights are its float fields
    if weights:
        raise ValueError(f"routing policy {name!r} takes no weights")
    return POLICIES[name]()
