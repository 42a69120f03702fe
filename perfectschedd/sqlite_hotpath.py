"""The worker's transactions on SQLite, run on the sqlite3 connection itself.

Finishing a batch and claiming the next is a worker's whole conversation with the
database.  Through SQLAlchemy Core, one such transaction with one row in each direction
took 225 us of CPU (1,000 stored schedules, one process), most of it SQLAlchemy's: pool
check-out, the begin event, compiled-cache look-ups, result and row wrapping.  The same
statements on the driver's connection take 68 us, and a batch of 64 each way went from
1,000 to 530 us.  So these few statements are written here in SQLite's SQL, and
everything else (schema, adds, lists, history, the other dialects) stays on SQLAlchemy.
Connections still come from SQLAlchemy's pool (with its PRAGMAs), writers still queue on
the host's writer lock, and driver errors leave as SQLAlchemy's exceptions, so callers
and Store's retries see no difference.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError

from .writelock import HostWriteLock

# RETURNING: the claim is one statement that leases the rows and hands them back.
MIN_SQLITE = (3, 35, 0)

# The order of Claimed's fields.
CLAIMED_COLUMNS = ("key", "type", "cron", "delay", "timezone", "data", "next_time", "fence",
                   "attempt", "due_time", "has_extra", "policy")


class SQLiteHotPath:
    """Claim, finish and "when is the next one due" for one schedules table."""

    def __init__(self, engine: Engine, table: sa.Table, write_lock: HostWriteLock | None
                 ) -> None:
        self._engine = engine
        self._write_lock = write_lock
        quote = engine.dialect.identifier_preparer
        self._t = t = quote.format_table(table)
        self._returned = ", ".join(quote.quote(c) for c in CLAIMED_COLUMNS)
        key = quote.quote("key")
        self.restrict("1", ())
        # Every holder-side write names the fence it was given: a row that moved on (lease
        # lost, modified, deleted) matches nothing, and rowcount says so.
        self._advance_sql = (
            f"UPDATE {t} SET next_time = ?, next_run_time = ?, attempt = 0, owner = NULL,"
            f" claimed_at = NULL, fence = fence + 1 WHERE {key} = ? AND fence = ?")
        self._delete_sql = f"DELETE FROM {t} WHERE {key} = ? AND fence = ?"
        self._keeper: int | None = None
        self._generation = 0
        self._local = threading.local()

    def restrict(self, routed: str, params: tuple[str, ...]) -> None:
        """Claim only rows matching the SQL condition `routed` (with `params`)."""
        t = self._t
        self._routed_params = params
        # due_time = next_run_time: SQLite's SET reads the row as it was before the UPDATE.
        # The sub-select walks the due index, which holds the rowid (no key look-up).
        self._claim_sql = (
            f"UPDATE {t} SET next_run_time = ?, fence = fence + 1, attempt = attempt + 1,"
            f" owner = ?, claimed_at = ?, due_time = next_run_time"
            f" WHERE rowid IN (SELECT rowid FROM {t} WHERE paused = 0 AND next_run_time <= ?"
            f" AND {routed} ORDER BY next_run_time LIMIT ?) RETURNING {self._returned}")
        self._earliest_sql = (f"SELECT next_run_time FROM {t} WHERE paused = 0 AND {routed}"
                              " ORDER BY next_run_time LIMIT 1")

    def keep_connection(self) -> None:
        """The calling thread (a worker's claim loop: a transaction per batch of tasks)
        keeps one pooled connection instead of checking one out each time: the pool's
        check-out and return were an eighth of a worker's CPU in an exec burst.  Other
        threads check out per call, so many of them cannot exhaust the pool."""
        self._keeper = threading.get_ident()

    def drop_connections(self) -> None:
        """After a database error: the kept connection is replaced at its next use."""
        self._generation += 1

    @contextmanager
    def _connection(self, write: bool) -> Iterator[sqlite3.Connection]:
        """A pooled connection; for writers, inside BEGIN IMMEDIATE ... COMMIT under the
        host's writer lock.  The driver's errors are raised as SQLAlchemy's.  On any error
        the transaction is rolled back before the lock is let go, and a kept connection
        is given up.
        """
        lock = self._write_lock.held() if write and self._write_lock else nullcontext()
        with lock:
            keep = threading.get_ident() == self._keeper
            pooled = self._kept(keep)
            failed = True
            try:
                con: sqlite3.Connection = pooled.driver_connection  # type: ignore[assignment]
                if write:
                    con.execute("BEGIN IMMEDIATE")
                yield con
                if write:
                    con.execute("COMMIT")
                failed = False
            except sqlite3.Error as exc:
                raise DBAPIError.instance(None, None, exc, sqlite3.Error) from exc
            finally:
                if keep and failed:
                    self._local.held = None
                    pooled.close()  # the pool's reset-on-return rolls back
                elif not keep:
                    pooled.close()

    def _kept(self, keep: bool) -> Any:
        if not keep:
            return self._engine.raw_connection()
        held = getattr(self._local, "held", None)
        if held is not None and held[1] == self._generation:
            return held[0]
        if held is not None:
            held[0].close()
        pooled = self._engine.raw_connection()
        self._local.held = (pooled, self._generation)
        return pooled

    def finish_and_claim(self, finished: Sequence[tuple[Any, ...]],
                         now: float, lease_seconds: int, owner: str, limit: int
                         ) -> tuple[set[str], list[tuple[Any, ...]]]:
        """Write `finished` (key, fence, next_time, next_run_time; next_time None deletes
        a one-off) and lease up to `limit` due rows, in one transaction.  Returns the keys
        whose fence no longer matched (nothing was written for them) and the leased rows
        as CLAIMED_COLUMNS tuples."""
        lost: set[str] = set()
        claimed: list[tuple[Any, ...]] = []
        with self._connection(write=True) as con:
            cur = con.cursor()
            for key, fence, next_time, next_run_time, *_ in finished:
                if next_time is None:
                    cur.execute(self._delete_sql, (key, fence))
                else:
                    cur.execute(self._advance_sql, (next_time, next_run_time, key, fence))
                if cur.rowcount != 1:
                    lost.add(key)
            if limit > 0:
                ts = int(now)
                claimed = cur.execute(self._claim_sql, (
                    ts + lease_seconds, owner, now, ts, *self._routed_params, limit)).fetchall()
        return lost, claimed

    def earliest_due(self) -> int | None:
        """Smallest next_run_time of an unpaused row: one index probe, no write lock."""
        with self._connection(write=False) as con:
            row = con.execute(self._earliest_sql, self._routed_params).fetchone()
        return None if row is None else int(row[0])
