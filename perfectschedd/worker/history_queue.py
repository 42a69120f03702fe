"""A worker's history rows on their way to the database: queued by the runs (any thread)
and the claim loop (occurrences skipped), written in batches every HISTORY_FLUSH by the
claim loop, kept (bounded) while the database is away, and handed to `on_recorded` once
written (notifications react to what the database holds)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy.exc import DBAPIError

from perfectschedd.store.sql import Store

log = logging.getLogger("perfectschedd.worker")

HISTORY_FLUSH = 0.5
# Unwritten history a worker keeps while the database is away, in output bytes at most
# (HistoryQueue.kept): with output_limit at its maximum, 10,000 rows would be 10 GiB.
HISTORY_KEPT_BYTES = 64 << 20


class HistoryQueue:
    def __init__(self, output_limit: int,
                 on_recorded: Callable[[list[dict[str, Any]]], None] | None) -> None:
        self.output_limit = output_limit
        self.rows: list[dict[str, Any]] = []
        self.lock = threading.Lock()  # puts rows back in front, or several at once
        # Called with each batch of history rows once it is written (flush): what reacts
        # to runs (notifications) sees only what the database holds.
        self.on_recorded = on_recorded
        self.on_recorded_failed = False  # its first exception was logged
        self.last_flush = time.monotonic()

    def add(self, row: dict[str, Any]) -> None:
        """Queue one row; any thread."""
        self.rows.append(row)  # one step under the GIL; flush takes a prefix

    def add_many(self, rows: list[dict[str, Any]]) -> None:
        with self.lock:
            self.rows.extend(rows)

    def wait(self) -> float | None:
        """How long until the rows queued are due to be written; None: none is."""
        if not self.rows:
            return None
        return max(0.0, HISTORY_FLUSH - (time.monotonic() - self.last_flush))

    def flush(self, store: Store | None, force: bool = False) -> None:
        """Write the rows queued, at most every HISTORY_FLUSH unless `force`; with no
        store (no history kept), drop them, still handed to on_recorded."""
        now = time.monotonic()
        if not force and now - self.last_flush < HISTORY_FLUSH:
            return
        self.last_flush = now
        # Copy, then delete what was copied: rows task threads append meanwhile (without
        # the lock) stay for the next flush.
        batch = self.rows[:]
        del self.rows[:len(batch)]
        if not batch:
            return
        if store is None:
            self._recorded(batch)
            return
        try:
            store.record_runs(batch)
        except DBAPIError:
            with self.lock:  # keep them for the next flush, bounded
                self.rows[:0] = batch[-self.kept:]
            return
        self._recorded(batch)

    @property
    def kept(self) -> int:
        """How many unwritten history rows a worker keeps while the database is away:
        10,000, fewer when their output could make them weigh more than HISTORY_KEPT_BYTES."""
        return max(100, min(10_000, HISTORY_KEPT_BYTES // max(1, self.output_limit)))

    def _recorded(self, batch: list[dict[str, Any]]) -> None:
        """Hand a written batch to on_recorded.  It runs on the claim loop: it must not
        block (it queues); what it raises is logged once and swallowed, since a run's
        record is written whatever its observers do."""
        if self.on_recorded is None:
            return
        try:
            self.on_recorded(batch)
        except Exception:  # noqa: BLE001 - an observer never stops the worker
            if not self.on_recorded_failed:
                self.on_recorded_failed = True
                log.exception("on_recorded failed (logged once; the history is written)")
