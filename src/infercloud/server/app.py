"""The engine server's HTTP surface: OpenAI completions and chat, models, health, metrics.

Each handler validates, tokenizes, hands the prompts to the `AsyncEngine`, and either streams
SSE chunks or returns one JSON body. A client that goes away (mid-stream or while waiting for a
non-streamed answer) cancels its handler, and cancelling aborts its engine requests, which frees
their KV blocks before the next step.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from infercloud.engine.async_engine import AsyncEngine, EngineDeadError
from infercloud.engine.config import EngineConfig
from infercloud.engine.llm_engine import LLMEngine, RequestRejectedError
from infercloud.engine.outputs import RequestOutput
from infercloud.engine.request_meter import RequestMeter
from infercloud.engine.sampler import TokenLogprobs
from infercloud.engine.sampling_params import SamplingParams
from infercloud.models.prompts import chat_prompt_ids, text_prompt_ids
from infercloud.server.errors import (
    APIError,
    BodyLimitMiddleware,
    error_response,
    install_error_handlers,
)
from infercloud.server.metrics import EngineMetrics
from infercloud.server.protocol import ChatCompletionRequest, CompletionRequest

DEFAULT_MAX_BODY_BYTES = 8 << 20


class _Choice:
    """Accumulates one prompt's outputs for a non-streamed answer."""

    __slots__ = (
        "finish_reason",
        "logprobs",
        "meter",
        "num_cached_tokens",
        "num_output_tokens",
        "num_prompt_tokens",
        "stop_reason",
        "text",
    )

    def __init__(self) -> None:
        self.text = ""
        self.logprobs: list[TokenLogprobs] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_prompt_tokens = 0
        self.num_output_tokens = 0
        self.num_cached_tokens = 0
        self.meter: RequestMeter | None = None

    def add(self, out: RequestOutput) -> None:
        self.text += out.new_text
        self.logprobs.extend(out.new_logprobs)
        self.num_prompt_tokens = out.num_prompt_tokens
        self.num_output_tokens = out.num_output_tokens
        self.num_cached_tokens = out.num_cached_tokens
        if out.meter is not None:
            self.meter = out.meter
        if out.finished:
            self.finish_reason = out.finish_reason
            self.stop_reason = out.stop_reason


def build_engine_app(config: EngineConfig) -> tuple[FastAPI, AsyncEngine]:
    """Load the engine described by `config` and the app that serves it.

    The engine's loop is not started: call `run()` (on the main thread) or `start()`.
    """
    llm = LLMEngine(config)
    engine = AsyncEngine(llm)
    runner = llm.runner
    cache_config = {
        "block_size": str(runner.block_size),
        "num_blocks": str(runner.num_blocks),
        "cache_dtype": str(runner.dtype).removeprefix("torch."),
        "kv_cache_bytes": str(config.kv_cache_bytes),
    }
    metrics = EngineMetrics(lambda: engine.stats, llm.model_name, cache_config=cache_config)
    engine.output_listeners.append(metrics.observe)
    return create_app(engine, llm.model_name, metrics), engine


def create_app(
    engine: AsyncEngine,
    model_name: str,
    metrics: EngineMetrics,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    app = FastAPI(title="infercloud engine")
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=max_body_bytes)
    llm = engine.engine
    tokenizer = llm.tokenizer
    decoder = tokenizer.backend_tokenizer

    install_error_handlers(app)

    # -- small endpoints ------------------------------------------------------------------------

    @app.get("/health")
    async def health() -> Response:
        if engine.dead:
            return error_response(503, "engine thread stopped")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/kv_events")
    async def kv_events(since: int = 0) -> dict[str, Any]:
        """Prefix-cache changes after sequence number `since` (vLLM's KV events, polled).

        A router keeps `seq` and asks again; `since` older than what is kept returns what is
        kept, and `reset: true` tells the router to drop its view of this replica first.
        """
        seq, events, missed = llm.kv_events_since(since)
        return {
            "seq": seq,
            "reset": missed,
            "block_size": llm.config.block_size,
            "events": [e.as_dict() for e in events],
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": int(time.time()),
                    "owned_by": "infercloud",
                    "root": str(llm.model_path),
                    "max_model_len": llm.max_model_len,
                }
            ],
        }

    # -- shared request handling ----------------------------------------------------------------

    def check_common(body: CompletionRequest | ChatCompletionRequest) -> SamplingParams:
        if body.model is not None and body.model != model_name:
            raise APIError(
                404,
                f"The model `{body.model}` does not exist.",
                param="model",
                code="model_not_found",
            )
        problem = body.unsupported()
        if problem is not None:
            raise APIError(400, problem[1], param=problem[0])
        try:
            return body.to_sampling_params()
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc

    async def start(
        prompts: list[list[int]], params: SamplingParams, priority: int, cache_salt: str
    ) -> list[AsyncIterator[RequestOutput]]:
        try:
            for ids in prompts:
                llm.check_request(ids, params)
            return [
                await engine.generate(ids, params, priority=priority, cache_salt=cache_salt)
                for ids in prompts
            ]
        except RequestRejectedError as exc:
            raise APIError(400, str(exc), param=exc.param, code=exc.code) from exc
        except EngineDeadError as exc:
            raise APIError(503, str(exc)) from exc

    def usage(choices: list[_Choice]) -> dict[str, Any]:
        prompt = sum(c.num_prompt_tokens for c in choices)
        completion = sum(c.num_output_tokens for c in choices)
        cached = sum(c.num_cached_tokens for c in choices)
        out: dict[str, Any] = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        meters = [c.meter.as_usage() for c in choices if c.meter is not None]
        if meters:
            # What the request used of this replica, for the platform's ledger.
            out["infercloud"] = {k: sum(m[k] for m in meters) for k in meters[0]}
        return out

    def token_text(token_id: int) -> str:
        return str(decoder.decode([token_id], skip_special_tokens=False))

    # -- /v1/completions ------------------------------------------------------------------------

    def completion_logprobs(lps: list[TokenLogprobs], text_start: int) -> dict[str, Any]:
        tokens = [token_text(lp.token_id) for lp in lps]
        offsets, offset = [], text_start
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{token_text(t): v for t, v in lp.top} for lp in lps],
            "text_offset": offsets,
        }

    def completion_prompts(
        prompt: str | list[str] | list[int] | list[list[int]],
    ) -> list[list[int]]:
        if isinstance(prompt, str):
            return [text_prompt_ids(tokenizer, prompt)]
        if not prompt:
            raise APIError(400, "prompt must not be empty", param="prompt")
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]  # type: ignore[arg-type]
        if all(isinstance(p, str) for p in prompt):
            return [text_prompt_ids(tokenizer, p) for p in prompt]  # type: ignore[arg-type]
        return [list(p) for p in prompt]  # type: ignore[arg-type]

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        params = check_common(body)
        prompts = completion_prompts(body.prompt)
        streams = await start(prompts, params, body.priority, body.cache_salt or "")
        request_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        head = {
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": model_name,
        }
        want_logprobs = params.logprobs is not None

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            async def events() -> AsyncIterator[str]:
                choices = [_Choice() for _ in prompts]
                async for index, out in _merge(streams):
                    choice = choices[index]
                    start_offset = len(choice.text)
                    choice.add(out)
                    if not out.new_text and not out.finished:
                        continue
                    chunk_choice = {
                        "index": index,
                        "text": out.new_text,
                        "logprobs": completion_logprobs(out.new_logprobs, start_offset)
                        if want_logprobs
                        else None,
                        "finish_reason": out.finish_reason,
                        "stop_reason": out.stop_reason,
                    }
                    yield _sse(
                        {
                            **head,
                            "choices": [chunk_choice],
                            **({"usage": None} if include_usage else {}),
                        }
                    )
                if include_usage:
                    yield _sse({**head, "choices": [], "usage": usage(choices)})
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        choices = await _collect(raw, streams)
        return JSONResponse(
            {
                **head,
                "choices": [
                    {
                        "index": i,
                        "text": c.text,
                        "logprobs": completion_logprobs(c.logprobs, 0) if want_logprobs else None,
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                    }
                    for i, c in enumerate(choices)
                ],
                "usage": usage(choices),
            }
        )

    # -- /v1/chat/completions -------------------------------------------------------------------

    def chat_logprobs(lps: list[TokenLogprobs]) -> dict[str, Any]:
        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            text = token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {
            "content": [
                {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                for lp in lps
            ]
        }

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        params = check_common(body)
        try:
            ids = chat_prompt_ids(tokenizer, body.template_messages())
        except Exception as exc:
            raise APIError(400, f"cannot apply the chat template: {exc}", param="messages") from exc
        streams = await start([ids], params, body.priority, body.cache_salt or "")
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        head = {"id": request_id, "created": created, "model": model_name}
        want_logprobs = params.logprobs is not None

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            extra = {"usage": None} if include_usage else {}

            async def events() -> AsyncIterator[str]:
                choice = _Choice()
                chunk_head = {**head, "object": "chat.completion.chunk"}
                yield _sse(
                    {
                        **chunk_head,
                        "choices": [
                            {
                                "index": 0,
                                "delta": {"role": "assistant", "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ],
                        **extra,
                    }
                )
                async for _, out in _merge(streams):
                    choice.add(out)
                    if not out.new_text and not out.finished:
                        continue
                    delta = {"content": out.new_text} if out.new_text else {}
                    yield _sse(
                        {
                            **chunk_head,
                            "choices": [
                                {
                                    "index": 0,
                                    "delta": delta,
                                    "logprobs": chat_logprobs(out.new_logprobs)
                                    if want_logprobs
                                    else None,
                                    "finish_reason": out.finish_reason,
                                    "stop_reason": out.stop_reason,
                                }
                            ],
                            **extra,
                        }
                    )
                if include_usage:
                    yield _sse({**chunk_head, "choices": [], "usage": usage([choice])})
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        (choice,) = await _collect(raw, streams)
        return JSONResponse(
            {
                **head,
                "object": "chat.completion",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": choice.text},
                        "logprobs": chat_logprobs(choice.logprobs) if want_logprobs else None,
                        "finish_reason": choice.finish_reason,
                        "stop_reason": choice.stop_reason,
                    }
                ],
                "usage": usage([choice]),
            }
        )

    return app


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _merge(
    streams: list[AsyncIterator[RequestOutput]],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several output streams as (index, output); closing this closes them all."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | None, BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                await queue.put((index, out, None))
        except Exception as exc:
            await queue.put((index, None, exc))
            return
        await queue.put((index, None, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item, error = await queue.get()
            if error is not None:
                raise error
            if item is None:
                remaining -= 1
                continue
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _collect(raw: Request, streams: list[AsyncIterator[RequestOutput]]) -> list[_Choice]:
    """Gather whole answers; if the client disconnects first, cancel (and so abort) them."""
    choices = [_Choice() for _ in streams]

    async def gather() -> None:
        async for index, out in _merge(streams):
            choices[index].add(out)

    async def disconnected() -> None:
        while True:
            message = await raw.receive()
            if message["type"] == "http.disconnect":
                return

    work = asyncio.create_task(gather())
    watch = asyncio.create_task(disconnected())
    done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    watch.cancel()
    if work not in done:
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        raise asyncio.CancelledError("client disconnected")
    work.result()
    return choices
