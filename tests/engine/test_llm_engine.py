from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from infercloud.engine.async_engine import AsyncEngine
from infercloud.engine.config import EngineConfig
from infercloud.engine.llm import LLM
from infercloud.engine.llm_engine import LLMEngine, RequestRejectedError
from infercloud.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return LLM(str(tiny_model_dir), kv_cache_bytes=1 << 20)


PROMPT = [10, 20, 30, 40, 50]


def greedy(llm: LLM, **kw: object) -> list[int]:
    params = SamplingParams(temperature=0.0, **kw)  # type: ignore[arg-type]
    return llm.generate([PROMPT], params)[0].token_ids


def test_max_tokens_and_ignore_eos(llm: LLM) -> None:
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    assert len(out.token_ids) == 40 and out.finish_reason == "length"


def test_stop_token_ids_stop_and_report(llm: LLM) -> None:
    reference = greedy(llm, max_tokens=20, ignore_eos=True)
    stop_at = reference[5]
    first = reference.index(stop_at)
    out = llm.generate(
        [PROMPT],
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_at]),
    )[0]
    assert out.token_ids == reference[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at


def test_min_tokens_suppresses_stop_tokens(llm: LLM) -> None:
    reference = greedy(llm, max_tokens=20, ignore_eos=True)
    stop_at = reference[0]
    out = llm.generate(
        [PROMPT],
        SamplingParams(temperature=0, max_tokens=20, min_tokens=6, stop_token_ids=[stop_at]),
    )[0]
    assert len(out.token_ids) >= 6
    assert stop_at not in out.token_ids[:5]


def test_seeded_sampling_is_reproducible(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=42, max_tokens=16, ignore_eos=True)
    a = llm.generate([PROMPT], params)[0].token_ids
    b = llm.generate([PROMPT, [7, 8, 9]], [params, SamplingParams(temperature=1.0)])[0].token_ids
    assert a == b


def test_logprobs_reported_per_token(llm: LLM) -> None:
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=4, logprobs=2))[0]
    assert len(out.logprobs) == len(out.token_ids)
    for lp, token in zip(out.logprobs, out.token_ids, strict=True):
        assert lp.token_id == token and len(lp.top) == 2 and lp.top[0][0] == token


def test_rejects_requests_that_cannot_fit(llm: LLM) -> None:
    engine = llm.engine
    with pytest.raises(RequestRejectedError, match="maximum context length"):
        engine.add_request("x", [1] * engine.max_model_len, SamplingParams())
    with pytest.raises(RequestRejectedError, match="max_tokens"):
        engine.add_request("y", PROMPT, SamplingParams(max_tokens=engine.max_model_len))
    with pytest.raises(RequestRejectedError, match="at least one token"):
        engine.add_request("z", [], SamplingParams())
    with pytest.raises(RequestRejectedError, match="token ids"):
        engine.add_request("w", [10**9], SamplingParams())
    assert not engine.has_unfinished_requests()


def test_invalid_sampling_values_raise() -> None:
    for kwargs in (
        {"temperature": -1.0},
        {"top_p": 0.0},
        {"max_tokens": 0},
        {"top_k": -2},
        {"min_tokens": 5, "max_tokens": 2},
        {"logprobs": 99},
    ):
        with pytest.raises(ValueError):
            SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_async_engine_streams_and_abort_frees_blocks(tiny_model_dir: Path) -> None:
    config = EngineConfig(model=str(tiny_model_dir), kv_cache_bytes=1 << 20)
    engine = AsyncEngine(LLMEngine(config)).start()

    async def main() -> tuple[int, int]:
        full = 0
        stream = await engine.generate(PROMPT, SamplingParams(max_tokens=8, ignore_eos=True))
        async for out in stream:
            full += len(out.new_token_ids)
        long = await engine.generate(PROMPT, SamplingParams(max_tokens=500, ignore_eos=True))
        seen = 0
        async for _ in long:
            seen += 1
            if seen == 3:
                break
        await long.aclose()  # type: ignore[attr-defined]
        for _ in range(100):
            await asyncio.sleep(0.02)
            if engine.stats.num_requests_running == 0 and engine.stats.kv_cache_usage == 0:
                break
        return full, seen

    try:
        full, seen = asyncio.run(main())
        assert full == 8 and seen == 3
        assert engine.stats.num_requests_running == 0
        assert engine.stats.kv_cache_usage == 0.0
    finally:
        engine.shutdown()
