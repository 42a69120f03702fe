"""What every part of the Store shares: its backend (engine, tables), its transactions,
and the retry of a whole operation when the database says "try again".

The Store (sql.py) is this base and one mixin per job (upgrade.py, schedule_writes.py,
...), each a subclass of StoreBase so that it reads as a class of its own.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError

from perfectschedd.store.backends.choice import open_backend
from perfectschedd.store.deadline import DEADLINE_MAX, statement_deadline
from perfectschedd.store.schema import TRY_AGAIN_FOR
from perfectschedd.store.urls import engine_url

F = TypeVar("F", bound=Callable[..., Any])


def retried(method: F) -> F:
    """Re-run a whole store operation when the database says "try again" (the
    backend's should_try_again: never shown to users), or a connection found dead (a server
    restart: the pool was invalidated; one retry on a fresh connection)."""

    @functools.wraps(method)
    def wrapper(self: StoreBase, *args: Any, **kwargs: Any) -> Any:
        deadline = time.monotonic() + TRY_AGAIN_FOR
        delay = 0.005
        reconnected = False
        hung: float | None = None
        while True:
            try:
                return method(self, *args, **kwargs)
            except DBAPIError as exc:
                if self.backend.should_try_again(exc) and time.monotonic() < deadline:
                    time.sleep(delay)
                    delay = min(delay * 2, 0.2)
                    continue
                if exc.connection_invalidated and not reconnected:
                    # A server that hung (cut at its deadline) or is not the primary any
                    # more: one try on a new connection, to whichever host is primary now.
                    reconnected = True
                    hung = getattr(exc, "perfectsched_deadline", None)
                    continue
                if hung is not None and not getattr(exc, "perfectsched_deadline", None):
                    exc.perfectsched_deadline = hung  # type: ignore[attr-defined]
                raise

    return wrapper  # type: ignore[return-value]


class StoreBase:
    """Schedules and run history in one database; safe for many threads of one process.

    Create one per process, after fork (connections must not cross a fork), or call
    after_fork() in the child before using one the parent made.
    """

    def __init__(self, url: str, table: str = "perfectsched",
                 alive_time: float | None = None, page_cache_kib: int | None = None
                 ) -> None:
        """`page_cache_kib`: what each SQLite connection may cache (None: SQLite's
        default, 2 MiB); a process whose reads scan whole tables keeps that much per
        connection for good."""
        self.url = engine_url(url)
        # No statement waits on a server longer than this (deadline.py): a sixth of
        # alive_time, well inside the leases it renews.
        self.deadline = statement_deadline(alive_time) if alive_time else DEADLINE_MAX
        self.backend = open_backend(self.url, table, self.deadline)
        self.backend.page_cache_kib = page_cache_kib  # no connection exists yet
        self.dialect = self.backend.name
        self.engine = self.backend.engine
        self.write_lock = self.backend.write_lock
        self.metadata = self.backend.metadata
        self.t = self.backend.t
        self.h = self.backend.h
        self._initialized = False
        self.created_table = False  # by this Store (opening one creates a missing table)

    @contextmanager
    def _tx(self, readonly: bool = False, durable: bool = False) -> Iterator[Connection]:
        """One transaction.  `durable`: a user-side write, acknowledged to a user once it
        returns, so its commit reaches stable storage first (Backend.transaction)."""
        with self.backend.transaction(readonly, durable) as conn:
            yield conn

    def close(self) -> None:
        self.backend.close()

    def reset_connections(self) -> None:
        """Drop pooled connections (after an error): later calls connect afresh.  Those
        in use by other threads are closed when they are given back."""
        self.backend.drop_connections()
        self.backend.lost = True
        self.engine.dispose()

    def describe_error(self, exc: BaseException) -> str:
        """One line saying what a database error means: hung (no answer within the
        deadline), read-only or shutting down (not the primary any more), or the driver's
        message."""
        return self.backend.describe_error(exc)

    def after_fork(self) -> None:
        """In a process forked from the one that opened this store: forget the parent's
        pooled connections without using or closing them (they are still the parent's)."""
        self.engine.dispose(close=False)
        self.backend.drop_connections()  # a thread's kept one is the parent's too

    def keep_connection(self) -> None:
        """The calling thread keeps a connection for the hot path (where it pays)."""
        self.backend.keep_connection()

