"""Writes usage records to the store in batches, off the event loop.

`record` never blocks the gateway: records go to a queue that one writer thread drains every
`interval_s` (or sooner when `max_batch` are waiting) in one transaction. `flush` waits until
everything recorded before it is stored (readers call it first, so a client sees its own
requests); `close` flushes and stops the thread. A batch that fails to write is kept and retried
on the next round, so a database hiccup delays records but loses none; the store's insert is
idempotent, so a retried batch cannot count twice.
"""

from __future__ import annotations

import logging
import threading

from infercloud.gateway.store import Store, UsageRecord

log = logging.getLogger("infercloud.gateway")


class UsageWriter:
    def __init__(self, store: Store, interval_s: float = 0.05, max_batch: int = 512) -> None:
        self._store = store
        self._interval_s = interval_s
        self._max_batch = max_batch
        self._pending: list[UsageRecord] = []
        self._cond = threading.Condition()
        self._recorded = 0
        self._written = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="usage-writer", daemon=True)
        self._thread.start()

    def record(self, rec: UsageRecord) -> None:
        with self._cond:
            self._pending.append(rec)
            self._recorded += 1
            if len(self._pending) >= self._max_batch:
                self._cond.notify_all()

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Block until every record so far is written; False on timeout."""
        with self._cond:
            target = self._recorded
            self._cond.notify_all()
            return self._cond.wait_for(lambda: self._written >= target, timeout=timeout_s)

    def close(self) -> None:
        self.flush()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(
                    lambda: self._closed or len(self._pending) >= self._max_batch,
                    timeout=self._interval_s,
                )
                batch, self._pending = self._pending, []
                closed = self._closed
            if batch:
                try:
                    self._store.add_usage(batch)
                except Exception:
                    log.exception("writing %d usage records failed; retrying", len(batch))
                    with self._cond:
                        self._pending[:0] = batch
                    if closed:
                        return
                    self._cond_sleep()
                    continue
                with self._cond:
                    self._written += len(batch)
                    self._cond.notify_all()
            if closed:
                return

    def _cond_sleep(self) -> None:
        with self._cond:
            self._cond.wait(timeout=max(self._interval_s, 0.5))
