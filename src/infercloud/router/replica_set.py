"""The replicas of one model as the router tracks them, and each request's claim on one.

A replica is `starting` until its first good health check, then `healthy` (routable);
`ejected` after `unhealthy_after` failed checks in a row or a failed connection (a good check
brings it back); `draining` when an operator (or shutdown) takes it out: no new requests, the
ones it has run to their end; `stopped` at the end. Only `healthy` replicas are routable.

Load accounting, per replica: `route` adds one outstanding request and its uncached prompt
tokens to `pending_prefill_tokens`; `first_token` moves it to `decoding`; `finish` removes it.
Each of the three applies at most once per `Route`, so the counts never drift whatever path a
request takes out (the invariant the tests check: at rest every count is 0).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from infercloud.gateway.config import Routing
from infercloud.gateway.replicas import Replica
from infercloud.router.kv_index import KVIndex, prompt_block_hashes
from infercloud.router.policies import ReplicaView, RouteRequest, RouterPolicy, make_policy

LEARNED_BLOCK_SIZE = 16
"""Block size of the routing-history hashes for upstreams (they report none)."""

ROUTABLE = "healthy"


@dataclass(slots=True, eq=False)
class ReplicaState:
    replica: Replica
    status: str = "starting"
    outstanding: int = 0
    pending_prefill_tokens: int = 0
    decoding: int = 0
    failed_checks: int = 0
    kv_seq: int = 0
    block_size: int | None = None
    """The engine's KV block size, from its KV events (None: publishes none, or not yet)."""
    routed_total: int = 0
    restarts: int = 0
    on_eject: set[Callable[[], object]] = field(default_factory=set)
    """Called once each when the replica is ejected (`ReplicaSet.eject`), and dropped: the
    gateway's waits on it, so that they give up at once instead of polling its status."""

    @property
    def name(self) -> str:
        return self.replica.name


@dataclass(slots=True, eq=False)
class Route:
    """One request's claim on one replica."""

    state: ReplicaState
    pending_tokens: int
    cached_blocks: int
    reason: str
    started_decoding: bool = False
    finished: bool = False


class NoReplicaError(Exception):
    pass


@dataclass(slots=True)
class ReplicaSet:
    model: str
    states: list[ReplicaState]
    routing: Routing
    index: KVIndex = field(default_factory=KVIndex)
    policy: RouterPolicy = field(init=False)
    _seq: itertools.count[int] = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        r = self.routing
        weights = (
            {
                "prefill_weight": r.prefill_weight,
                "decode_weight": r.decode_weight,
                "balance_abs": float(r.balance_abs),
                "balance_rel": r.balance_rel,
            }
            if r.policy == "kv_aware"
            else {}
        )
        self.policy = make_policy(r.policy, **weights)
        self.index.ttl_s = r.learned_ttl_s

    @classmethod
    def of(cls, model: str, replicas: Sequence[Replica], routing: Routing) -> ReplicaSet:
        return cls(model, [ReplicaState(r) for r in replicas], routing)

    def state(self, name: str) -> ReplicaState | None:
        return next((s for s in self.states if s.name == name), None)

    def routable(self, exclude: Collection[str] = ()) -> list[ReplicaState]:
        return [s for s in self.states if s.status == ROUTABLE and s.name not in exclude]

    def route(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        salt: str,
        session: str | None,
        now_s: float,
        exclude: Collection[str] = (),
        block_hashes: Mapping[int, list[int]] | None = None,
    ) -> Route:
        """Pick a replica for a request (raises `NoReplicaError` if none is routable).
        `block_hashes`: the prompt's block hashes by block size, if the caller has them
        (`prompt_block_hashes`), else computed here."""
        if len(self.states) == 1:
            return self._only(self.states[0], len(prompt_ids), exclude)
        candidates = self.routable(exclude)
        if not candidates:
            raise NoReplicaError(f"no healthy replica of {self.model!r}")
        hashes: dict[int, list[int]] = dict(block_hashes or {})
        views: list[ReplicaView] = []
        for s in candidates:
            size = s.block_size or LEARNED_BLOCK_SIZE
            if size not in hashes:
                hashes[size] = prompt_block_hashes(prompt_ids, size, salt)
            views.append(
                ReplicaView(
                    s.name,
                    s.outstanding,
                    s.pending_prefill_tokens,
                    s.decoding,
                    self.index.cached_prefix_blocks(s.name, hashes[size], now_s),
                    size,
                )
            )
        request = RouteRequest(request_id, next(self._seq), len(prompt_ids), session)
        choice = self.policy.choose(request, views)
        i = next(i for i, v in enumerate(views) if v.name == choice.replica)
        state, view = candidates[i], views[i]
        if state.block_size is None:  # no KV events from it: remember what we sent
            self.index.learn(state.name, hashes[view.block_size], now_s)
        pending = max(0, len(prompt_ids) - view.cached_prefix_blocks * view.block_size)
        state.outstanding += 1
        state.pending_prefill_tokens += pending
        state.routed_total += 1
        return Route(state, pending, view.cached_prefix_blocks, choice.reason)

    def _only(self, state: ReplicaState, prompt_tokens: int, exclude: Collection[str]) -> Route:
        """The route of a set of one replica: there is nothing to choose, so no block hashes,
        no cache index and no policy (which of its blocks the replica holds would only weigh
        against other replicas). Its whole prompt counts as pending prefill."""
        if state.status != ROUTABLE or state.name in exclude:
            raise NoReplicaError(f"no healthy replica of {self.model!r}")
        state.outstanding += 1
        state.pending_prefill_tokens += prompt_tokens
        state.routed_total += 1
        return Route(state, prompt_tokens, 0, "only replica")

    @staticmethod
    def first_token(route: Route) -> None:
        if route.started_decoding or route.finished:
            return
        route.started_decoding = True
        route.state.pending_prefill_tokens -= route.pending_tokens
        route.state.decoding += 1

    @staticmethod
    def finish(route: Route) -> None:
        if route.finished:
            return
        route.finished = True
        s = route.state
        s.outstanding -= 1
        if route.started_decoding:
            s.decoding -= 1
        else:
            s.pending_prefill_tokens -= route.pending_tokens

    # -- health ---------------------------------------------------------------------------

    def check_passed(self, state: ReplicaState) -> None:
        state.failed_checks = 0
        if state.status in ("starting", "ejected"):
            state.status = ROUTABLE

    def check_failed(self, state: ReplicaState) -> None:
        state.failed_checks += 1
        if state.status == ROUTABLE and state.failed_checks >= self.routing.unhealthy_after:
            self.eject(state)

    def eject(self, state: ReplicaState) -> None:
        """Out of routing at once (a failed connection, a dead process, failed checks)."""
        if state.status in ("starting", ROUTABLE):
            state.status = "ejected"
            waits, state.on_eject = state.on_eject, set()
            for wait in waits:
                wait()

    def restarted(self, state: ReplicaState, replica: Replica) -> None:
        """A new process took the replica's place: its cache is empty, its events start anew."""
        state.replica = replica
        state.status = "starting"
        state.kv_seq = 0
        state.failed_checks = 0
        state.restarts += 1
        self.index.forget(state.name)

    def snapshot(self) -> list[dict[str, object]]:
        return [
            {
                "name": s.name,
                "url": s.replica.url,
                "status": s.status,
                "builtin": s.replica.builtin,
                "pid": s.replica.process.pid if s.replica.process is not None else None,
                "launcher": type(s.replica.process).__name__ if s.replica.process else None,
                "outstanding": s.outstanding,
                "pending_prefill_tokens": s.pending_prefill_tokens,
                "decoding": s.decoding,
                "routed_total": s.routed_total,
                "cached_blocks_known": self.index.num_blocks(s.name),
                "restarts": s.restarts,
            }
            for s in self.states
        ]
