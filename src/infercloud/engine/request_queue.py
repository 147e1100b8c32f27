"""The waiting queue, in two orders: first come first served, or by priority then arrival.
(The scheduler's "cache" policy keeps an FCFS queue and admits from its first few requests
the one with the longest cached prefix: `Scheduler._next_waiting`.)

Both keep preempted requests ahead of requests of equal standing that have not started, so a
preemption never lets a later arrival overtake: under FCFS a preempted request goes back to the
front; under PRIORITY its (priority, arrival) key already sorts it where it was.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from typing import Literal, Protocol

from infercloud.engine.request import Request

SchedulingPolicy = Literal["fcfs", "priority", "cache"]


class RequestQueue(Protocol):
    def add(self, request: Request) -> None: ...
    def prepend(self, request: Request) -> None:
        """Put back a preempted request."""

    def peek(self) -> Request: ...
    def first(self, n: int) -> list[Request]:
        """The first `n` requests (fewer if fewer wait), in the order they would be popped."""

    def pop(self) -> Request: ...
    def remove(self, request: Request) -> bool: ...
    def __len__(self) -> int: ...


class FCFSQueue:
    __slots__ = ("_queue",)

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def first(self, n: int) -> list[Request]:
        return list(itertools.islice(self._queue, n))

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> bool:
        try:
            self._queue.remove(request)
        except ValueError:
            return False
        return True

    def __len__(self) -> int:
        return len(self._queue)


class PriorityQueue:
    """Ordered by (priority, arrival_time_s, insertion order); lower priority value first."""

    __slots__ = ("_counter", "_heap")

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    def add(self, request: Request) -> None:
        key = (request.priority, request.arrival_time_s, next(self._counter), request)
        heapq.heappush(self._heap, key)

    prepend = add

    def peek(self) -> Request:
        return self._heap[0][3]

    def first(self, n: int) -> list[Request]:
        return [entry[3] for entry in heapq.nsmallest(n, self._heap)]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> bool:
        for i, entry in enumerate(self._heap):
            if entry[3] is request:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return True
        return False

    def __len__(self) -> int:
        return len(self._heap)


def make_queue(policy: SchedulingPolicy) -> RequestQueue:
    if policy in ("fcfs", "cache"):
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(
        f"unknown scheduling policy {policy!r}; expected 'fcfs', 'priority' or 'cache'"
    )
