"""Router policies route as documented (pure: views in, a choice out), the KV index follows
events and history, and a replica set's load counts never drift."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from infercloud.cache.prefix_cache import chain_hash, salt_hash
from infercloud.gateway.config import Routing
from infercloud.gateway.replicas import Replica
from infercloud.router.kv_index import KVIndex, prompt_block_hashes
from infercloud.router.policies import (
    KVAware,
    LeastOutstanding,
    PowerOfTwo,
    ReplicaView,
    RoundRobin,
    RouteRequest,
    SessionAffinity,
    make_policy,
)
from infercloud.router.replica_set import NoReplicaError, ReplicaSet


def req(seq: int = 0, prompt_tokens: int = 64, session: str | None = None) -> RouteRequest:
    return RouteRequest(f"req-{seq}", seq, prompt_tokens, session)


def views(*outstanding: int, cached: tuple[int, ...] = ()) -> list[ReplicaView]:
    cached = cached or (0,) * len(outstanding)
    return [
        ReplicaView(f"r{i}", o, cached_prefix_blocks=c, block_size=16)
        for i, (o, c) in enumerate(zip(outstanding, cached, strict=True))
    ]


def test_round_robin_takes_turns() -> None:
    picks = [RoundRobin().choose(req(i), views(5, 0, 0)).replica for i in range(6)]
    assert picks == ["r0", "r1", "r2", "r0", "r1", "r2"]


def test_least_outstanding_takes_the_least_loaded_and_spreads_ties() -> None:
    assert LeastOutstanding().choose(req(0), views(3, 1, 2)).replica == "r1"
    ties = {LeastOutstanding().choose(req(i), views(1, 1, 1)).replica for i in range(3)}
    assert ties == {"r0", "r1", "r2"}


def test_power_of_two_picks_the_lighter_of_two_distinct_and_is_deterministic() -> None:
    p = PowerOfTwo()
    for i in range(50):
        r = req(i)
        vs = views(4, 0, 9, 2)
        a = p.choose(r, vs)
        assert a == p.choose(r, vs)
        assert a.replica != "r2"  # r2 (9) can never beat the other, distinct, candidate
    # with only the busiest and the idlest, the idlest always wins
    assert {p.choose(req(i), views(7, 0)).replica for i in range(20)} == {"r1"}


def test_session_affinity_is_stable_and_moves_only_the_lost_replicas_sessions() -> None:
    p = SessionAffinity()
    sessions = [f"user-{i}" for i in range(200)]
    full = {s: p.choose(req(0, session=s), views(0, 0, 0)).replica for s in sessions}
    assert len(set(full.values())) == 3  # spread over all replicas
    assert all(p.choose(req(9, session=s), views(5, 0, 2)).replica == full[s] for s in sessions)
    without_r1 = [v for v in views(0, 0, 0) if v.name != "r1"]
    moved = {s for s in sessions if p.choose(req(0, session=s), without_r1).replica != full[s]}
    assert moved == {s for s in sessions if full[s] == "r1"}
    assert p.choose(req(0), views(2, 0, 1)).replica == "r1"  # no session: least loaded


def test_kv_aware_prefers_the_replica_holding_the_prefix() -> None:
    p = KVAware()
    # 64-token prompt, 4 blocks: r1 holds 3 of them and has a little more load
    vs = [
        ReplicaView("r0", 1, decoding=1, block_size=16),
        ReplicaView("r1", 2, decoding=2, cached_prefix_blocks=3, block_size=16),
    ]
    choice = p.choose(req(0, 64), vs)
    assert choice.replica == "r1" and choice.reason == "cache"
    # cost = w * uncached + pending + d * decoding = 16 + 0 + 16 * 2
    assert choice.cost == 48.0
    # the same prefix but r1's decode load outweighs the 48 tokens it would save
    busy = [vs[0], ReplicaView("r1", 6, decoding=6, cached_prefix_blocks=3, block_size=16)]
    assert p.choose(req(0, 64), busy).replica == "r0"


def test_kv_aware_falls_back_to_least_load_under_strong_imbalance() -> None:
    p = KVAware(balance_abs=8, balance_rel=1.5)
    vs = [
        ReplicaView("r0", 1, block_size=16),
        ReplicaView("r1", 12, cached_prefix_blocks=100, block_size=16),
    ]
    assert p.choose(req(0, 1600), vs).replica == "r0"
    assert p.choose(req(0, 1600), vs).reason == "balance"
    mild = [vs[0], ReplicaView("r1", 9, cached_prefix_blocks=100, block_size=16)]
    assert p.choose(req(0, 1600), mild).replica == "r1"  # 9 - 1 = 8: not above the threshold


def test_make_policy_by_name() -> None:
    assert make_policy("kv_aware", decode_weight=4.0) == KVAware(decode_weight=4.0)
    assert make_policy("round_robin").name == "round_robin"
    try:
        make_policy("random")
    except ValueError as exc:
        assert "unknown routing policy" in str(exc)
    else:
        raise AssertionError("no error")


def test_prompt_block_hashes_match_the_engine_chain() -> None:
    ids = list(range(40))
    hashes = prompt_block_hashes(ids, 16, "acme")
    assert len(hashes) == 2  # the partial third block is not cached by the engine either
    first = chain_hash(salt_hash("acme"), tuple(ids[:16]))
    assert hashes == [first, chain_hash(first, tuple(ids[16:32]))]
    assert prompt_block_hashes(ids, 16, "other")[0] != first


def test_kv_index_from_events_and_from_history() -> None:
    index = KVIndex(ttl_s=10.0)
    h = prompt_block_hashes(list(range(64)), 16, "t")
    index.apply("a", [{"type": "BlockStored", "block_hashes": h[:3]}], reset=False)
    assert index.cached_prefix_blocks("a", h, 0.0) == 3
    index.apply("a", [{"type": "BlockRemoved", "block_hashes": [h[1]]}], reset=False)
    assert index.cached_prefix_blocks("a", h, 0.0) == 1  # a prefix stops at the first gap
    index.apply("a", [{"type": "BlockStored", "block_hashes": [h[1]], "medium": "host"}], False)
    assert index.cached_prefix_blocks("a", h, 0.0) == 3  # the host tier counts as held
    index.apply("a", [], reset=True)
    assert index.cached_prefix_blocks("a", h, 0.0) == 0
    index.learn("b", h[:2], now_s=100.0)
    assert index.cached_prefix_blocks("b", h, 105.0) == 2
    assert index.cached_prefix_blocks("b", h, 111.0) == 0  # expired


def replica_set(policy: str, n: int = 3) -> ReplicaSet:
    rs = ReplicaSet.of(
        "m",
        [Replica(f"m/{i}", f"http://127.0.0.1:{9000 + i}", "m", builtin=False) for i in range(n)],
        Routing(policy=policy),  # type: ignore[arg-type]
    )
    for s in rs.states:
        rs.check_passed(s)
    return rs


def test_replica_set_routes_only_to_healthy_replicas_and_learns_upstream_prefixes() -> None:
    rs = replica_set("kv_aware")
    prompt = list(range(320))
    first = rs.route("a", prompt, "t", None, 0.0)
    ReplicaSet.finish(first)
    again = rs.route("b", prompt, "t", None, 1.0)
    assert again.state is first.state and again.cached_blocks == 20  # from routing history
    ReplicaSet.finish(again)
    rs.eject(first.state)
    moved = rs.route("c", prompt, "t", None, 2.0)
    assert moved.state is not first.state
    ReplicaSet.finish(moved)
    other_salt = rs.route("d", prompt, "u", None, 3.0)
    assert other_salt.cached_blocks == 0
    ReplicaSet.finish(other_salt)


def test_a_set_of_one_routes_to_it_without_the_index_and_refuses_when_it_is_out() -> None:
    rs = replica_set("kv_aware", n=1)
    only = rs.states[0]
    prompt = list(range(320))
    first = rs.route("a", prompt, "t", None, 0.0)
    assert first.state is only and (first.pending_tokens, first.cached_blocks) == (320, 0)
    assert rs.index.num_blocks(only.name) == 0  # nothing learned: there is no one to weigh
    ReplicaSet.finish(first)
    with pytest.raises(NoReplicaError):
        rs.route("b", prompt, "t", None, 1.0, exclude={only.name})
    rs.eject(only)
    with pytest.raises(NoReplicaError):
        rs.route("c", prompt, "t", None, 2.0)
    rs.check_passed(only)
    ReplicaSet.finish(rs.route("d", prompt, "t", None, 3.0))
    assert (only.outstanding, only.pending_prefill_tokens, only.routed_total) == (0, 0, 2)


def test_ejection_calls_each_wait_on_the_replica_once() -> None:
    rs = replica_set("least_outstanding", n=2)
    calls: list[str] = []
    a, b = rs.states
    a.on_eject.update({lambda: calls.append("x"), lambda: calls.append("y")})
    b.on_eject.add(lambda: calls.append("other"))
    rs.eject(a)
    assert sorted(calls) == ["x", "y"] and not a.on_eject
    rs.eject(a)  # already out: nothing more
    rs.check_passed(a)
    rs.eject(a)  # back, then out again: the waits were dropped with the first ejection
    assert sorted(calls) == ["x", "y"] and b.on_eject


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["route", "first", "finish", "eject", "pass"]), st.integers(0, 9)
        ),
        max_size=80,
    ),
    st.sampled_from([1, 3]),
)
def test_load_counts_never_drift(ops: list[tuple[str, int]], num_replicas: int) -> None:
    """Whatever order requests start, stream and end in (each step possibly repeated), the
    counts equal what the live routes imply, and are all zero once every route is finished
    (a set of one replica routes on its own path, so both sizes are run)."""
    rs = replica_set("least_outstanding", n=num_replicas)
    routes = []
    for op, i in ops:
        if op == "route":
            with contextlib.suppress(NoReplicaError):  # every replica ejected
                routes.append(rs.route(f"r{len(routes)}", list(range(i * 10)), "t", None, 0.0))
        elif op == "first" and routes:
            ReplicaSet.first_token(routes[i % len(routes)])
        elif op == "finish" and routes:
            ReplicaSet.finish(routes[i % len(routes)])
        elif op == "eject":
            rs.eject(rs.states[i % num_replicas])
        else:
            rs.check_passed(rs.states[i % num_replicas])
        for s in rs.states:
            live = [r for r in routes if r.state is s and not r.finished]
            assert s.outstanding == len(live)
            assert s.decoding == sum(r.started_decoding for r in live)
            assert s.pending_prefill_tokens == sum(
                r.pending_tokens for r in live if not r.started_decoding
            )
    for r in routes:
        ReplicaSet.finish(r)
    for s in rs.states:
        assert (s.outstanding, s.decoding, s.pending_prefill_tokens) == (0, 0, 0)
