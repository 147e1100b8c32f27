"""The discrete-event loop: one ordered agenda of callbacks in simulated time.

Events are ordered by `(time_s, priority, seq)`: earlier first; at the same time, lower
`priority` first; then the order they were scheduled in (`seq`, a counter). Nothing else orders
events, so a run is a function of its inputs and its seed alone.

Invariants:
- `now_s` never decreases; an event scheduled in the past is refused;
- each event runs at most once; a cancelled event never runs.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(order=True, slots=True)
class Event:
    time_s: float
    priority: int
    seq: int
    action: Callable[[], None] = field(compare=False)
    cancelled: bool = field(default=False, compare=False)

    def cancel(self) -> None:
        self.cancelled = True


# Priorities at one instant: work that finishes frees capacity before new work is placed.
FINISH = 0
ARRIVAL = 1
STEP = 2


class EventLoop:
    def __init__(self) -> None:
        self.now_s = 0.0
        self._agenda: list[Event] = []
        self._seq = itertools.count()
        self.num_events = 0
        """Events run so far."""

    def at(self, time_s: float, action: Callable[[], None], priority: int = STEP) -> Event:
        """Run `action` at `time_s` (not before now)."""
        if time_s < self.now_s:
            raise ValueError(f"cannot schedule at {time_s} s: the clock is at {self.now_s} s")
        event = Event(time_s, priority, next(self._seq), action)
        heapq.heappush(self._agenda, event)
        return event

    def after(self, delay_s: float, action: Callable[[], None], priority: int = STEP) -> Event:
        return self.at(self.now_s + delay_s, action, priority)

    def __len__(self) -> int:
        return len(self._agenda)

    def run(self, until_s: float | None = None) -> None:
        """Run events in order until none is left (or the next one is after `until_s`)."""
        while self._agenda:
            if until_s is not None and self._agenda[0].time_s > until_s:
                self.now_s = until_s
                return
            event = heapq.heappop(self._agenda)
            if event.cancelled:
                continue
            self.now_s = event.time_s
            self.num_events += 1
            event.action()
