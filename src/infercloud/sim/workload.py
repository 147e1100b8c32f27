"""Workloads: requests with arrival times, prompts and output lengths, from traces or generators.

A prompt is a sequence of segments, each `length` tokens drawn deterministically from a named
seed, so that two requests that share a segment share those exact tokens (and so a cached
prefix) and the same workload always yields the same token ids, for the simulator and for a
real engine replaying it alike. Token ids are materialised only when a request arrives.

Sources:
  - `load_trace(path)`: Azure LLM inference traces 2023 (CSV: TIMESTAMP, ContextTokens,
    GeneratedTokens; every prompt unique, the trace publishes no text) and Mooncake (JSONL:
    timestamp in ms, input_length, output_length, hash_ids; each hash id names one 512-token
    block, so requests with a common leading run of ids share that prefix);
  - generators: `poisson` and `gamma` arrivals (gamma with a coefficient of variation for
    burstiness), `shared_prefix_groups` (tenants each with a long system prompt), and
    `multi_turn_sessions` (each turn resends the conversation so far, answers included).

`time_scale` divides every arrival time by a speed-up factor (2.0: twice the rate);
`token_scale` multiplies lengths (a 15k-token Mooncake prompt times 1/16 fits a small model).
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import random
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

MOONCAKE_BLOCK_TOKENS = 512
FIRST_TOKEN_ID = 100
"""Generated ids start here, clear of the special tokens at the start of most vocabularies."""


@dataclass(frozen=True, slots=True)
class Segment:
    seed: str
    length: int


@dataclass(frozen=True, slots=True)
class SimRequest:
    request_id: str
    arrival_s: float
    prompt: tuple[Segment, ...]
    output_len: int
    tenant: str = "default"
    session: str | None = None
    priority: str = "standard"
    answer: Segment | None = None
    """The tokens this request generates, when a later turn resends them (multi-turn)."""

    @property
    def prompt_len(self) -> int:
        return sum(s.length for s in self.prompt)


class TokenSource:
    """Token ids of segments, deterministic per seed, with a small cache for shared prefixes."""

    def __init__(self, vocab_size: int, cache_segments: int = 4096) -> None:
        if vocab_size <= FIRST_TOKEN_ID + 1:
            raise ValueError(f"vocab_size must exceed {FIRST_TOKEN_ID + 1}")
        self.vocab_size = vocab_size
        self._cache: OrderedDict[Segment, list[int]] = OrderedDict()
        self._max = cache_segments

    def segment(self, seg: Segment) -> list[int]:
        hit = self._cache.get(seg)
        if hit is not None:
            self._cache.move_to_end(seg)
            return hit
        import numpy as np

        seed = int.from_bytes(hashlib.blake2b(seg.seed.encode(), digest_size=16).digest(), "big")
        ids: list[int] = (
            np.random.default_rng(seed)
            .integers(FIRST_TOKEN_ID, self.vocab_size - 1, seg.length)
            .tolist()
        )
        self._cache[seg] = ids
        if len(self._cache) > self._max:
            self._cache.popitem(last=False)
        return ids

    def prompt(self, request: SimRequest) -> list[int]:
        out: list[int] = []
        for seg in request.prompt:
            out.extend(self.segment(seg))
        return out

    def answer(self, request: SimRequest) -> list[int] | None:
        return None if request.answer is None else self.segment(request.answer)


# -- traces ------------------------------------------------------------------------------------


def _scaled(n: int, scale: float) -> int:
    return max(1, round(n * scale))


def load_azure(path: Path, token_scale: float = 1.0) -> list[SimRequest]:
    out: list[SimRequest] = []
    t0: datetime | None = None
    with path.open() as f:
        for i, row in enumerate(csv.DictReader(f)):
            t = datetime.fromisoformat(row["TIMESTAMP"][:26])
            t0 = t0 or t
            length = _scaled(int(row["ContextTokens"]), token_scale)
            out.append(
                SimRequest(
                    request_id=f"azure-{i}",
                    arrival_s=(t - t0).total_seconds(),
                    prompt=(Segment(f"{path.name}:{i}", length),),
                    output_len=_scaled(int(row["GeneratedTokens"]), token_scale),
                )
            )
    out.sort(key=lambda r: r.arrival_s)
    return out


def load_mooncake(path: Path, token_scale: float = 1.0) -> list[SimRequest]:
    block = _scaled(MOONCAKE_BLOCK_TOKENS, token_scale)
    out: list[SimRequest] = []
    with path.open() as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            raw = json.loads(line)
            length = _scaled(int(raw["input_length"]), token_scale)
            segments: list[Segment] = []
            left = length
            for h in raw["hash_ids"]:
                if left <= 0:
                    break
                n = min(block, left)
                # a partial last block is its own segment: it shares tokens with nobody
                seed = f"mooncake:{h}" if n == block else f"mooncake:{h}:req{i}"
                segments.append(Segment(seed, n))
                left -= n
            if left > 0:
                segments.append(Segment(f"mooncake:req{i}:tail", left))
            out.append(
                SimRequest(
                    request_id=f"mooncake-{i}",
                    arrival_s=float(raw["timestamp"]) / 1e3,
                    prompt=tuple(segments),
                    output_len=_scaled(int(raw["output_length"]), token_scale),
                )
            )
    out.sort(key=lambda r: r.arrival_s)
    return out


def load_trace(path: Path, token_scale: float = 1.0) -> list[SimRequest]:
    if path.suffix == ".csv":
        return load_azure(path, token_scale)
    if path.suffix in (".jsonl", ".json"):
        return load_mooncake(path, token_scale)
    raise ValueError(f"unknown trace format {path.suffix!r}: expected .csv (Azure) or .jsonl")


def time_scale(requests: Sequence[SimRequest], speedup: float) -> list[SimRequest]:
    if speedup <= 0:
        raise ValueError("speedup must be positive")
    return [replace(r, arrival_s=r.arrival_s / speedup) for r in requests]


def fit_to_context(
    requests: Sequence[SimRequest], max_model_len: int
) -> tuple[list[SimRequest], int]:
    """Drop requests whose prompt + output exceed the model's context; returns them and the
    number dropped (a real engine would refuse them with 400)."""
    kept = [r for r in requests if r.prompt_len + r.output_len <= max_model_len]
    return kept, len(requests) - len(kept)


# -- generators --------------------------------------------------------------------------------


def poisson_arrivals(rate_per_s: float, n: int, rng: random.Random) -> Iterator[float]:
    t = 0.0
    for _ in range(n):
        yield t
        t += rng.expovariate(rate_per_s)


def gamma_arrivals(rate_per_s: float, cv: float, n: int, rng: random.Random) -> Iterator[float]:
    """Gamma inter-arrival times with mean 1/rate and coefficient of variation `cv` (1: Poisson;
    above 1: bursty)."""
    shape = 1.0 / (cv * cv)
    scale = 1.0 / (rate_per_s * shape)
    t = 0.0
    for _ in range(n):
        yield t
        t += rng.gammavariate(shape, scale)


def poisson(
    rate_per_s: float,
    n: int,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
    seed: int = 0,
    cv: float = 1.0,
) -> list[SimRequest]:
    """Unique prompts with lengths uniform in the given ranges; Poisson (cv=1) or gamma
    arrivals."""
    rng = random.Random(seed)
    times = (
        poisson_arrivals(rate_per_s, n, rng)
        if math.isclose(cv, 1.0)
        else gamma_arrivals(rate_per_s, cv, n, rng)
    )
    return [
        SimRequest(
            f"req-{i}",
            t,
            (Segment(f"gen{seed}:{i}", rng.randint(*prompt_len)),),
            rng.randint(*output_len),
        )
        for i, t in enumerate(times)
    ]


def shared_prefix_groups(
    rate_per_s: float,
    n: int,
    num_groups: int,
    prefix_len: int,
    suffix_len: tuple[int, int],
    output_len: tuple[int, int],
    seed: int = 0,
) -> list[SimRequest]:
    """Each request belongs to one of `num_groups` tenants (uniformly) and starts with that
    tenant's system prompt, then a unique suffix."""
    rng = random.Random(seed)
    out = []
    for i, t in enumerate(poisson_arrivals(rate_per_s, n, rng)):
        g = rng.randrange(num_groups)
        out.append(
            SimRequest(
                f"req-{i}",
                t,
                (
                    Segment(f"group{seed}:{g}", prefix_len),
                    Segment(f"q{seed}:{i}", rng.randint(*suffix_len)),
                ),
                rng.randint(*output_len),
                tenant=f"tenant-{g}",
            )
        )
    return out


def multi_turn_sessions(
    session_rate_per_s: float,
    num_sessions: int,
    turns: tuple[int, int],
    system_len: int,
    user_len: tuple[int, int],
    output_len: tuple[int, int],
    think_time_s: float,
    seed: int = 0,
) -> list[SimRequest]:
    """Conversations: sessions start as a Poisson process; each turn resends the system prompt
    and every earlier (question, answer) pair, then a new question, after an exponential think
    time from the previous turn's arrival (a simplification: real users wait for the answer)."""
    rng = random.Random(seed)
    out: list[SimRequest] = []
    for s, start in enumerate(poisson_arrivals(session_rate_per_s, num_sessions, rng)):
        history: list[Segment] = [Segment(f"sys{seed}", system_len)]
        t = start
        for turn in range(rng.randint(*turns)):
            question = Segment(f"user{seed}:{s}:{turn}", rng.randint(*user_len))
            answer = Segment(f"answer{seed}:{s}:{turn}", rng.randint(*output_len))
            out.append(
                SimRequest(
                    f"s{s}-t{turn}",
                    t,
                    (*history, question),
                    answer.length,
                    session=f"session-{s}",
                    answer=answer,
                )
            )
            history += [question, answer]
            t += rng.expovariate(1.0 / think_time_s)
    out.sort(key=lambda r: (r.arrival_s, r.request_id))
    return out
