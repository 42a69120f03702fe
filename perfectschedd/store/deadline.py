"""Client-side deadlines on database statements: no call waits on a server for good.

A connection checked out of the pool for longer than `seconds` (one transaction: its
statements, its commit, the pool's rollback; so every statement is bounded) has its
socket shut down by a watchdog thread: the thread blocked in the
driver wakes with "server closed the connection", SQLAlchemy takes that for a disconnect
and invalidates the connection (it never goes back to the pool, and the connections the
pool opened before it are replaced too: they lead to the same server), and the next try
connects afresh, to whichever host of a multi-host URL is the primary now.

Why this mechanism, and not one of the usual timeouts:
- `statement_timeout` and `lock_timeout` are enforced by the server: a frozen server
  (SIGSTOP of its processes, a stuck disk, a kernel in trouble) enforces nothing.
- TCP keepalives and `tcp_user_timeout` fire only when the peer's kernel stops
  acknowledging; a frozen server's kernel still acknowledges, so they never fire.
- A cancel request (psycopg's and psycopg2's `cancel()`) goes to the same frozen server.
- psycopg2 (Debian 12's driver under SQLAlchemy 1.4) waits inside libpq with no timeout
  of its own, and psycopg 3 has none for statements either.
`shutdown(SHUT_RDWR)` on the socket, from another thread, wakes the poll() or recv() of
both drivers at once; the descriptor itself stays its owner's to close (closing it here
could let its number be reused under the blocked thread).  PyMySQL needs none of this:
its own read and write timeouts bound every socket wait (backends/mysql.py).

Errors that say "this server is not the primary any more" are taken for disconnects in
the same way (backends' `not_primary`), so a demoted or read-only server is left too.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from sqlalchemy.exc import DBAPIError, OperationalError

from perfectschedd.errors import first_line
from perfectschedd.metrics import counters

log = logging.getLogger("perfectschedd")

# A statement's deadline: a sixth of alive_time, so that a heartbeat cut at its deadline
# is tried again well before the runs it renews fence themselves; never under 2 s (a busy
# server is not a hung one), never over 10 s (work resumes soon after a failover).
DEADLINE_MIN = 2.0
DEADLINE_MAX = 10.0
# Seconds to connect to one host of the URL (libpq's connect_timeout, per host; 2 is the
# least libpq takes).  A frozen host tried before the primary costs a new connection this
# long (backends/postgresql.py tries the last primary first).
CONNECT_TIMEOUT = 2


def statement_deadline(alive_time: float) -> float:
    """The client-side deadline of one transaction (each of its statements, its commit),
    from the lease length."""
    return min(DEADLINE_MAX, max(DEADLINE_MIN, alive_time / 6))


class StatementWatch:
    """The watchdog of one engine's connections.  arm() when a connection is checked
    out of the pool, disarm() when it is given back; a connection armed for longer than
    `seconds` has its socket shut down.  Any thread; one watchdog thread per process,
    started at the first arm() (after a fork, again in the child)."""

    TICK = 0.25  # how late past its deadline a statement may be cut

    def __init__(self, seconds: float, socket_of: Callable[[Any], int]) -> None:
        self.seconds = seconds
        self._socket_of = socket_of
        self._armed: dict[int, tuple[float, Any]] = {}
        self._cut: set[int] = set()  # connections cut, until their error is seen
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = threading.Event()
        ref = weakref.ref(self)

        def forget_thread() -> None:  # the watchdog thread does not survive a fork
            watch = ref()
            if watch is not None:
                watch._thread = None
                watch._lock = threading.Lock()

        os.register_at_fork(after_in_child=forget_thread)

    def arm(self, dbapi_conn: Any) -> None:
        if self._thread is None:
            self._start()
        with self._lock:
            self._armed[id(dbapi_conn)] = (time.monotonic() + self.seconds, dbapi_conn)

    def disarm(self, dbapi_conn: Any) -> None:
        with self._lock:
            self._armed.pop(id(dbapi_conn), None)

    def was_cut(self, dbapi_conn: Any) -> bool:
        """Whether the watchdog cut this connection (asked once, by its error)."""
        with self._lock:
            try:
                self._cut.remove(id(dbapi_conn))
            except KeyError:
                return False
            return True

    def close(self) -> None:
        self._closed.set()

    def _start(self) -> None:
        with self._lock:
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._watch, name="db-deadline",
                                            daemon=True)
            self._thread.start()

    def _watch(self) -> None:
        tick = min(self.TICK, self.seconds / 8)
        while not self._closed.wait(tick):
            now = time.monotonic()
            with self._lock:
                late = [k for k, (t, _) in self._armed.items() if t <= now]
                for k in late:
                    _, conn = self._armed.pop(k)
                    self._cut.add(k)
                    # Under the lock: a connection disarmed meanwhile is never cut.
                    self._shut_down(conn)

    def _shut_down(self, conn: Any) -> None:
        counters.db_deadline_expired()
        try:
            fd = self._socket_of(conn)
            # A duplicate of the descriptor: shutdown acts on the socket both share,
            # closing the duplicate leaves the driver's descriptor as it was.
            with socket.socket(fileno=os.dup(fd)) as sock:
                sock.shutdown(socket.SHUT_RDWR)
        except Exception as exc:  # noqa: BLE001 - a connection already gone has no socket
            log.debug("deadline: could not shut a connection down: %s", exc)
            return
        log.warning("database: no answer within %gs; connection abandoned", self.seconds)


# SQLSTATEs that mean "not the primary (any more)": a read-only transaction (a demoted
# primary, a replica), the server shutting down or crashed, still starting or in recovery.
PG_NOT_PRIMARY = frozenset({"25006", "57P01", "57P02", "57P03"})


def pg_sqlstate(orig: BaseException | None) -> str | None:
    """The SQLSTATE of a psycopg (3) or psycopg2 error."""
    return getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)


def unavailable(exc: BaseException) -> bool:
    """Whether a database error means "no usable server" (hung, unreachable, not the
    primary, connection lost), rather than a refusal of what was asked."""
    if not isinstance(exc, DBAPIError):
        return False
    if exc.connection_invalidated or getattr(exc, "perfectsched_deadline", None) or \
            isinstance(exc.orig, OSError):
        return True
    state = pg_sqlstate(exc.orig)
    if state is not None:
        return state.startswith("08") or state in PG_NOT_PRIMARY
    # A client-side failure (no SQLSTATE): libpq could not connect, or lost the server.
    return isinstance(exc, OperationalError) and pg_sqlstate(exc.orig) is None and \
        type(exc.orig).__module__.startswith(("psycopg", "psycopg2"))


def describe(exc: BaseException, deadline: float | None = None) -> str:
    """One line saying what a database error means for availability: hung (no answer
    within the deadline), read-only or shutting down (not the primary any more), or the
    driver's own first line."""
    if getattr(exc, "perfectsched_deadline", None):
        return (f"hung: no answer within {exc.perfectsched_deadline:g}s"  # type: ignore[attr-defined]
                "; connection abandoned")
    orig = exc.orig if isinstance(exc, DBAPIError) else None
    state = pg_sqlstate(orig)
    if state == "25006":
        return "read-only: the server is not the primary (any more)"
    if state in ("57P01", "57P02"):
        return "shutting down: the server ended the connection"
    if state == "57P03":
        return "starting or in recovery: the server takes no connection yet"
    line = first_line(orig if orig is not None else exc)
    if state is None and "timeout expired" in line:  # libpq's connect_timeout
        return (f"hung or unreachable: no answer to a new connection within "
                f"{CONNECT_TIMEOUT}s ({line})")
    return line
