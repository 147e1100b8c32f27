"""The async streaming API: the engine's step loop on one thread, results as async streams.

Only the engine thread touches the `LLMEngine`. Callers on event loops send it commands (add,
abort) through a thread-safe queue and receive each request's outputs on an `asyncio.Queue`
filled with `call_soon_threadsafe`. torch releases the GIL inside its kernels, so the HTTP server
keeps serving while a step runs.

The loop runs either on a background thread (`start`, for embedding and tests) or on the calling
thread (`run`): the engine server runs it on the process's main thread and the HTTP server on a
second thread, because torch's OpenMP kernels ran 20-30% slower here when called from a thread
other than the main one (decode steps of 32 sequences: 150 vs 215 output tok/s).

Invariants:
- every request added gets exactly one finished output, or its stream ends with an exception;
- a consumer that stops iterating (client gone) aborts its request, whose blocks are freed at the
  engine thread's next turn, before the next step runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from infercloud.engine.llm_engine import EngineStats, LLMEngine
from infercloud.engine.outputs import RequestOutput
from infercloud.engine.sampling_params import SamplingParams
from infercloud.engine.step_shape import StepShape

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    cache_salt: str
    stream: asyncio.Queue[RequestOutput | BaseException]
    loop: asyncio.AbstractEventLoop


@dataclass(frozen=True, slots=True)
class _Abort:
    request_id: str


@dataclass(frozen=True, slots=True)
class _Stop:
    pass


_Command = _Add | _Abort | _Stop


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.output_listeners: list[Callable[[RequestOutput], None]] = []
        """Called on the engine thread with every output (metrics, ledgers)."""
        self.step_listeners: list[Callable[[StepShape, float], None]] = []
        """Called on the engine thread with each step's shape and its period: seconds from its
        start to the next step's start (or, when the engine then goes idle, to the end of its
        turn), so that serving work between steps counts (`infercloud calibrate`)."""
        self._commands: queue.Queue[_Command] = queue.Queue()
        self._streams: dict[
            str, tuple[asyncio.Queue[RequestOutput | BaseException], asyncio.AbstractEventLoop]
        ] = {}
        self._ids = itertools.count()
        self._stats = engine.stats()
        self._running = threading.Event()
        self._done = threading.Event()
        self._dead: BaseException | None = None

    def start(self) -> AsyncEngine:
        """Run the step loop on a background thread; returns self."""
        threading.Thread(target=self.run, name="infercloud-engine", daemon=True).start()
        self._running.wait()
        return self

    @property
    def dead(self) -> bool:
        """True once the loop has stopped (or died), or before it ever started."""
        return self._dead is not None or self._done.is_set() or not self._running.is_set()

    @property
    def stats(self) -> EngineStats:
        """The latest snapshot, taken by the engine thread after each turn."""
        return self._stats

    def stop(self) -> None:
        """Ask the loop to stop (pending requests end with `EngineDeadError`); returns at once.

        Safe from a signal handler that interrupts the loop's own thread.
        """
        self._commands.put(_Stop())

    def shutdown(self) -> None:
        """Stop the loop and wait for it (from a thread other than the loop's)."""
        self.stop()
        if self._running.is_set():
            self._done.wait(timeout=30)

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str = "",
    ) -> AsyncIterator[RequestOutput]:
        """Validate now (raises `RequestRejectedError`), then stream the request's outputs."""
        if self._dead is not None:
            raise EngineDeadError(f"engine thread stopped: {self._dead!r}")
        self.engine.check_request(prompt_token_ids, params)
        rid = request_id or f"req-{next(self._ids)}"
        stream: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._commands.put(
            _Add(
                rid,
                prompt_token_ids,
                params,
                priority,
                cache_salt,
                stream,
                asyncio.get_running_loop(),
            )
        )
        return self._iterate(rid, stream)

    async def _iterate(
        self, request_id: str, stream: asyncio.Queue[RequestOutput | BaseException]
    ) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._commands.put(_Abort(request_id))

    # -- engine thread --------------------------------------------------------------------------

    def run(self) -> None:
        """Run the step loop on the calling thread until `shutdown`."""
        self._running.set()
        previous: tuple[StepShape, float] | None = None
        try:
            while True:
                block = not self.engine.has_unfinished_requests()
                if block and previous is not None:
                    self._log_step(previous, time.perf_counter())
                    previous = None
                if not self._drain(block):
                    return
                if not self.engine.has_unfinished_requests():
                    continue
                started_s = time.perf_counter()
                if previous is not None:
                    self._log_step(previous, started_s)
                    previous = None
                try:
                    outputs = self.engine.step()
                except Exception as exc:
                    logger.exception("engine step failed; aborting its requests")
                    self._fail_all(exc)
                    continue
                self._deliver_step(outputs)
                self._stats = self.engine.stats()
                shape = self.engine.last_step
                if self.step_listeners and shape is not None:
                    previous = (shape, started_s)
        except BaseException as exc:  # pragma: no cover - the loop must not die silently
            self._dead = exc
            self._fail_all(exc)
            raise
        finally:
            self._done.set()

    def _log_step(self, step: tuple[StepShape, float], end_s: float) -> None:
        shape, started_s = step
        for listener in self.step_listeners:
            listener(shape, end_s - started_s)

    def _drain(self, block: bool) -> bool:
        """Apply pending commands; False when asked to stop."""
        while True:
            try:
                command = self._commands.get(block=block, timeout=None)
            except queue.Empty:
                return True
            block = False
            if isinstance(command, _Stop):
                self._fail_all(EngineDeadError("engine shut down"))
                return False
            if isinstance(command, _Abort):
                out = self.engine.abort_request(command.request_id)
                if out is not None:
                    self._deliver_step([out])
            else:
                self._streams[command.request_id] = (command.stream, command.loop)
                try:
                    self.engine.add_request(
                        command.request_id,
                        command.prompt_token_ids,
                        command.params,
                        priority=command.priority,
                        cache_salt=command.cache_salt,
                    )
                except Exception as exc:
                    self._streams.pop(command.request_id, None)
                    _post(command.loop, command.stream, exc)
            self._stats = self.engine.stats()

    def _deliver_step(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs, handed to each event loop in one call: one wake-up of the HTTP
        thread per step instead of one per request (each `call_soon_threadsafe` writes to the
        loop's self-pipe, and each wake-up takes a core from the step's OpenMP threads on a
        machine that has two)."""
        batches: dict[asyncio.AbstractEventLoop, list[_Item]] = {}
        for out in outputs:
            for listener in self.output_listeners:
                listener(out)
            target = self._streams.get(out.request_id)
            if target is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            stream, loop = target
            batches.setdefault(loop, []).append((stream, out))
        for loop, items in batches.items():
            with contextlib.suppress(RuntimeError):  # a closed loop has no reader left
                loop.call_soon_threadsafe(_put_all, items)

    def _fail_all(self, exc: BaseException) -> None:
        for request_id in list(self._streams):
            self.engine.abort_request(request_id)
            stream, loop = self._streams.pop(request_id)
            _post(loop, stream, exc)


_Item = tuple["asyncio.Queue[RequestOutput | BaseException]", RequestOutput]


def _put_all(items: list[_Item]) -> None:
    for stream, out in items:
        stream.put_nowait(out)


def _post(
    loop: asyncio.AbstractEventLoop,
    stream: asyncio.Queue[RequestOutput | BaseException],
    item: RequestOutput | BaseException,
) -> None:
    """Hand an item to a stream on its event loop; a closed loop has no reader left."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(stream.put_nowait, item)
