"""SQLite: one file shared by the processes of one host.

The worker's transactions run on the sqlite3 connection itself.  Finishing a batch and
claiming the next is a worker's whole conversation with the database.  Through
SQLAlchemy Core, one such transaction with one row in each direction took 225 us of CPU
(1,000 stored schedules, one process), most of it SQLAlchemy's: pool check-out, the
begin event, compiled-cache look-ups, result and row wrapping.  The same statements on
the driver's connection take 68 us, and a batch of 64 each way went from 1,000 to 530 us.
So these few statements are written here in SQLite's SQL.  Connections still come from
SQLAlchemy's pool (with its PRAGMAs), writers still queue on the host's writer lock, and
driver errors leave as SQLAlchemy's exceptions, so the store's retries see no difference.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.engine.url import URL
from sqlalchemy.exc import DBAPIError, OperationalError

from perfectschedd.errors import ConfigError
from perfectschedd.store.backends.base import Backend, in_cron_order
from perfectschedd.store.schema import TRY_AGAIN_FOR, Advance, Claimed, lease_until
from perfectschedd.store.writelock import HostWriteLock

# RETURNING: the claim is one statement that leases the rows and hands them back.
MIN_SQLITE = (3, 35, 0)


def missing_directory(url: URL) -> str | None:
    """Why the database file of `url` cannot be made: its directory does not exist
    (SQLite's own word is "unable to open database file", naming nothing).  None when it
    exists, or cannot be looked at (SQLite then says what it finds), or for a file: URI."""
    db = url.database or ""
    if db.startswith("file:") or url.query.get("uri"):
        return None
    folder = os.path.dirname(os.path.abspath(db))
    try:
        os.stat(folder)
    except (FileNotFoundError, NotADirectoryError):
        relative = "" if os.path.isabs(db) else \
            f" (sqlite:///{db} is relative to the current directory, {os.getcwd()})"
        return f"url: the SQLite database's directory {folder} does not exist{relative}"
    except OSError:
        pass
    return None


class SQLiteBackend(Backend):
    name = "sqlite"
    partial_index_dialect = "sqlite"
    pyformat = False

    def __init__(self, url: URL, table: str) -> None:
        db = url.database or ""
        if db in ("", ":memory:"):
            raise ConfigError("url: the SQLite database must be a file (sqlite:///path)")
        missing = missing_directory(url)
        if missing is not None:
            raise ConfigError(missing)
        if sqlite3.sqlite_version_info < MIN_SQLITE:
            raise ConfigError(
                f"url: SQLite {'.'.join(map(str, MIN_SQLITE))} or newer is needed"
                f" (this Python has {sqlite3.sqlite_version})")
        # The worker's route predicate (restrict_types); every type until it is set.
        self._routed: Callable[[str], bool] | None = None
        self._keeper: int | None = None
        self._generation = 0
        self._local = threading.local()
        super().__init__(url, table)
        self.write_lock = HostWriteLock(db, TRY_AGAIN_FOR)
        self._advance_one = self.sql.advance_one()
        self._delete_one = self.sql.delete_one()

    def create_engine(self) -> Engine:
        engine = sa.create_engine(
            self.url,
            poolclass=sa.pool.QueuePool, pool_size=4, max_overflow=16,
            connect_args={"timeout": TRY_AGAIN_FOR, "check_same_thread": False,
                          "isolation_level": None},
        )

        @event.listens_for(engine, "connect")
        def _on_connect(dbapi_conn: Any, _record: Any) -> None:
            dbapi_conn.create_function(
                "perfectsched_routed", 1,
                lambda type_: self._routed is None or bool(self._routed(type_)),
                deterministic=True)
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute(f"PRAGMA busy_timeout={int(TRY_AGAIN_FOR * 1000)}")
            cur.execute("PRAGMA synchronous=NORMAL")
            # Statement journals in memory: a multi-row UPDATE in a transaction would
            # otherwise write one to a temporary file.
            cur.execute("PRAGMA temp_store=MEMORY")
            if self.page_cache_kib is not None:
                cur.execute(f"PRAGMA cache_size=-{int(self.page_cache_kib)}")
            cur.close()

        @event.listens_for(engine, "begin")
        def _on_begin(conn: Connection) -> None:
            # Writers take the lock up front: a deferred transaction that upgrades to a
            # writer can fail with "database is locked" without waiting for busy_timeout.
            mode = "BEGIN" if conn.get_execution_options().get("readonly") else (
                "BEGIN IMMEDIATE")
            conn.exec_driver_sql(mode)

        return engine

    @contextmanager
    def transaction(self, readonly: bool = False, durable: bool = False
                    ) -> Iterator[Connection]:
        """Writers queue on the host's writer lock, then BEGIN IMMEDIATE (see _on_begin);
        readers never wait for writers (WAL).

        A `durable` write commits with synchronous=FULL, which syncs the WAL before
        COMMIT returns.  Under NORMAL (every other write: the claim/finish hot path) the
        WAL reaches the disk only at checkpoints: a power cut may undo those commits, and
        with them a finished occurrence's move (it runs again), but never a durable one
        nor anything before it, since FULL syncs the whole WAL up to its own frame.
        SQLite refuses to change the setting inside a transaction, so it is set on the
        driver's connection around the transaction, and set back before the connection
        returns to the pool."""
        if readonly:
            with self.engine.connect() as plain:
                conn = plain.execution_options(readonly=True)
                with conn.begin():
                    yield conn
            return
        lock = self.write_lock.held() if self.write_lock is not None else nullcontext()
        with lock, self.engine.connect() as conn:
            if not durable:
                with conn.begin():
                    yield conn
                return
            driver = conn.connection.driver_connection
            driver.execute("PRAGMA synchronous=FULL")
            try:
                with conn.begin():
                    yield conn
            finally:
                if not driver.in_transaction:
                    driver.execute("PRAGMA synchronous=NORMAL")
                else:  # a failed commit: the pool's reset rolls it back; start afresh
                    conn.invalidate()

    def sync(self) -> None:
        """A checkpoint syncs the WAL before copying it, whatever it manages to copy."""
        with self._connection(write=False) as con:
            con.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()

    def should_try_again(self, exc: DBAPIError) -> bool:
        text = str(exc.orig).lower()
        return isinstance(exc, OperationalError) and ("locked" in text or "busy" in text)

    # -- the hot path, on the driver's connection ----------------------------------------

    def param(self, name: str, sql_type: str | None) -> str:
        """sqlite3's named style."""
        return f":{name}"

    def routed_sql(self, exact: Sequence[str], patterns: Sequence[str],
                   routed: Callable[[str], bool] | None) -> tuple[str, dict[str, Any]]:
        """SQLite has no regular expressions of its own: with patterns, types are asked
        of `routed` itself, a function on each connection (see create_engine)."""
        self._routed = routed
        if routed is not None and patterns:
            return "perfectsched_routed(type)", {}
        return super().routed_sql(exact, patterns, routed)

    def build_claim(self, routed: str) -> None:
        """One UPDATE ... RETURNING; no lock to skip: a writer holds the whole file.  The
        sub-select walks the due index, which holds the rowid (no key look-up)."""
        sql = self.sql
        self._claim_sql = (f"UPDATE {sql.table} SET {sql.claim_set()} WHERE rowid IN"
                           f" ({sql.due('rowid', routed)}) RETURNING {sql.returned}")

    def keep_connection(self) -> None:
        """The calling thread keeps one pooled connection instead of checking one out
        each time: the pool's check-out and return were an eighth of a worker's CPU in an
        exec burst.  Other threads check out per call, so many of them cannot exhaust the
        pool."""
        self._keeper = threading.get_ident()

    def drop_connections(self) -> None:
        self._generation += 1

    @contextmanager
    def _connection(self, write: bool) -> Iterator[sqlite3.Connection]:
        """A pooled connection; for writers, inside BEGIN IMMEDIATE ... COMMIT under the
        host's writer lock.  The driver's errors are raised as SQLAlchemy's.  On any error
        the transaction is rolled back before the lock is let go, and a kept connection
        is given up.
        """
        lock = self.write_lock.held() if write and self.write_lock else nullcontext()
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
            return self.engine.raw_connection()
        held = getattr(self._local, "held", None)
        if held is not None and held[1] == self._generation:
            return held[0]
        if held is not None:
            held[0].close()
        pooled = self.engine.raw_connection()
        self._local.held = (pooled, self._generation)
        return pooled

    def finish_and_claim(self, finished: Sequence[Advance], now: float, lease_seconds: int,
                         owner: str, limit: int) -> tuple[set[str], list[Claimed]]:
        lost: set[str] = set()
        claimed: list[tuple[Any, ...]] = []
        with self._connection(write=True) as con:
            cur = con.cursor()
            for key, fence, next_time, next_run_time, *_ in finished:
                if next_time is None:
                    cur.execute(self._delete_one, {"k": key, "f": fence})
                else:
                    cur.execute(self._advance_one, {"nt": next_time, "nrt": next_run_time,
                                                    "k": key, "f": fence})
                if cur.rowcount != 1:
                    lost.add(key)
            if limit > 0:
                claimed = cur.execute(self._claim_sql, {
                    "lease_until": lease_until(now, lease_seconds), "holder": owner,
                    "claim_ts": now, "due_by": int(now), "batch": limit,
                    **self.routed_params}).fetchall()
        return lost, in_cron_order(claimed) if claimed else []

    def earliest_due(self) -> int | None:
        """One index probe, no write lock."""
        with self._connection(write=False) as con:
            row = con.execute(self.earliest_sql, self.routed_params).fetchone()
        return None if row is None else int(row[0])
