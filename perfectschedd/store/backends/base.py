"""What a database backend does for the store: its engine, its tables, and the worker's
hot path (finish a batch and claim the next, "when is the next one due", run history).

Everything else the store does (adds, lists, leases' other writes, history reads) is
portable SQLAlchemy Core and lives in the Store's modules (store/sql.py and its mixins).
The hot path's SQL is written once (hot_sql.py); what differs between databases lives in
one subclass each (sqlite.py, postgresql.py, mysql.py), never as a dialect branch inside
shared code.
"""

from __future__ import annotations

import operator
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.engine.url import URL
from sqlalchemy.exc import DBAPIError

from perfectschedd.metrics import counters
from perfectschedd.store import schema
from perfectschedd.store.backends.hot_sql import HotPathSQL
from perfectschedd.store.deadline import DEADLINE_MAX, StatementWatch
from perfectschedd.store.schema import Advance, Claimed
from perfectschedd.store.writelock import HostWriteLock
from perfectschedd.vocabulary.history import HISTORY_COLUMNS


class DriverStatement:
    """A statement compiled once to the driver's own SQL, for executemany on the hot path.

    SQLAlchemy processes every row's parameters on each execute; for the 64 finishes or
    history rows of a batch that cost more than the database spent on them.  None of the
    types these statements bind (text, integers, doubles, NULL) needs bind processing on
    sqlite3, psycopg or PyMySQL, so the rows go to the driver as they are.
    """

    def __init__(self, stmt: Any, dialect: Any, column_keys: Sequence[str] | None = None
                 ) -> None:
        compiled = stmt.compile(dialect=dialect, column_keys=column_keys)
        self.sql = compiled.string
        # Values written into the statement itself (attempt=0, fence + 1, owner=NULL).
        self.fixed = {name: b.value for b, name in compiled.bind_names.items()
                      if not b.required}
        names = list(compiled.positiontup or ()) if compiled.positional else []
        # Positional drivers (sqlite3's "?"): the row's values in the statement's order.
        self.positional: Callable[[dict[str, Any]], Any] | None = None
        if len(names) > 1:
            self.positional = operator.itemgetter(*names)
        elif names:
            self.positional = lambda row, name=names[0]: (row[name],)

    def executemany(self, conn: Connection, rows: Sequence[dict[str, Any]]) -> int:
        fixed, get = self.fixed, self.positional
        params: Any = ([{**fixed, **r} for r in rows] if get is None
                       else [get({**fixed, **r}) for r in rows])
        return int(conn.exec_driver_sql(self.sql, params).rowcount)


def in_cron_order(rows: Iterable[Sequence[Any]]) -> list[Claimed]:
    """Claimed rows in cron order (RETURNING gives no order)."""
    return sorted((Claimed(*r) for r in rows), key=operator.attrgetter("next_time"))


class Backend(ABC):
    """One database: its engine, its tables and the worker's hot path on them."""

    name: ClassVar[str]
    # Where the leased rows have an index of their own (None: no partial indexes).
    partial_index_dialect: ClassVar[str | None] = None
    # The operator of the database's own regular expressions (routed_sql).
    regexp_operator: ClassVar[str] = "REGEXP"
    # The driver reads "%" as a parameter's start (psycopg's and PyMySQL's pyformat).
    pyformat: ClassVar[bool] = True
    # KiB of pages each connection may cache, where the database caches in the client
    # (SQLite); None: the database's default.  Set before the first connection.
    page_cache_kib: int | None = None

    def __init__(self, url: URL, table: str, deadline: float = DEADLINE_MAX) -> None:
        self.url = url
        # Seconds a statement may go unanswered (store/deadline.py); server backends.
        self.deadline = deadline
        self.write_lock: HostWriteLock | None = None
        # Set when connections were lost: the next one opened counts as a reconnect.
        self.lost = False
        self.engine = self.create_engine()
        self.metadata = sa.MetaData()
        self.t = schema.schedules_table(self.metadata, table, self.data_type(),
                                        self.partial_index_dialect)
        self.h = schema.history_table(self.metadata, table, self.data_type())
        self.meta = schema.meta_table(self.metadata, table)
        self.hosts = schema.hosts_table(self.metadata, table)
        self.tokens = schema.tokens_table(self.metadata, table)
        self.sql = HotPathSQL(self.engine.dialect.identifier_preparer, self.t, self.param,
                              self.pyformat)
        self.history_many = DriverStatement(self.h.insert().inline(), self.engine.dialect,
                                            HISTORY_COLUMNS)
        self.restrict_types((), (), None)

    # -- set-up ---------------------------------------------------------------------------

    @abstractmethod
    def create_engine(self) -> Engine:
        """The engine, with this database's connection options."""

    def param(self, name: str, sql_type: str | None) -> str:
        """How the driver's SQL writes the parameter `name` (hot_sql.Param): pyformat."""
        return f"%({name})s"

    def data_type(self) -> sa.types.TypeEngine[Any]:
        """The column type of `data` (JSON text up to DATA_MAX bytes) and of history's
        `output` (up to config.OUTPUT_LIMIT_MAX bytes)."""
        return sa.Text()

    # -- transactions and errors ----------------------------------------------------------

    @contextmanager
    def transaction(self, readonly: bool = False, durable: bool = False
                    ) -> Iterator[Connection]:
        """One transaction on a pooled connection.  `durable`: its commit must be on
        stable storage when this returns (a user was told it is done).  Database servers
        at their defaults sync every commit (PostgreSQL's synchronous_commit=on,
        InnoDB's innodb_flush_log_at_trx_commit=1), so here it changes nothing."""
        with self.engine.connect() as conn, conn.begin():
            yield conn

    def sync(self) -> None:
        """Put every commit so far on stable storage (after schema changes, which are
        not made in `durable` transactions).  Servers sync each commit already."""
        return

    def should_try_again(self, exc: DBAPIError) -> bool:
        """Whether the database asks for the operation to be run again (a lock it could
        not take in time, a deadlock or serialization victim); never shown to users."""
        return False

    def not_primary(self, orig: BaseException | None) -> bool:
        """Whether a driver error says this server is not the primary (any more):
        read-only, shutting down, in recovery.  Its connection is then abandoned like a
        broken one, and the next goes to whichever host is primary now."""
        return False

    def timed_out(self, orig: BaseException | None) -> bool:
        """Whether a driver error is the driver's own timeout, where that is this
        backend's statement deadline (MySQL), as the watchdog's cut is elsewhere."""
        return False

    def describe_error(self, exc: BaseException) -> str:
        """One line for logs and status: what a database error means (deadline.py)."""
        from perfectschedd.store.deadline import describe

        return describe(exc)

    def keep_connection(self) -> None:
        """The calling thread (a worker's claim loop) may keep a connection for the hot
        path, where checking one out each time is a measurable share of the work.  By
        default it does not: the pool's check-out is cheap next to a network round trip."""
        return

    def drop_connections(self) -> None:
        """After a database error: connections a thread kept are replaced at next use
        (by default none are kept)."""
        return

    def close(self) -> None:
        self.engine.dispose()

    # -- the worker's hot path ------------------------------------------------------------

    def routed_sql(self, exact: Sequence[str], patterns: Sequence[str],
                   routed: Callable[[str], bool] | None) -> tuple[str, dict[str, Any]]:
        """The SQL condition "a type this process routes" (TRUE: every type) and its
        parameters: exact names an IN list, patterns the database's own regular
        expressions (`regexp_operator`), which agree with Python's on everyday patterns:
        a type one matches that Python does not is given back by the worker untried
        (see worker/runs.py)."""
        if routed is None:
            return "TRUE", {}
        column = self.engine.dialect.identifier_preparer.quote("type")
        params: dict[str, Any] = {f"route_{i}": name for i, name in enumerate(exact)}
        conds = [f"{column} IN ({', '.join(self.param(n, None) for n in params)})"
                 ] if exact else []
        for i, pattern in enumerate(patterns):
            params[f"pattern_{i}"] = pattern
            conds.append(f"{column} {self.regexp_operator} {self.param(f'pattern_{i}', None)}")
        return (f"({' OR '.join(conds)})" if conds else "FALSE"), params

    def restrict_types(self, exact: Sequence[str], patterns: Sequence[str],
                       routed: Callable[[str], bool] | None) -> None:
        """Claim, and look for, only rows of the types this process routes: `exact` names
        or `patterns` (Python regular expressions searched in the type), `routed` being
        the exact predicate (None: every type).  The statements are built here, once:
        building them per claim cost more Python time than the database spent on them."""
        routed_sql, self.routed_params = self.routed_sql(exact, patterns, routed)
        self.earliest_sql = self.sql.earliest(routed_sql)
        self.build_claim(routed_sql)

    @abstractmethod
    def build_claim(self, routed: str) -> None:
        """Build the claim statement(s) for rows matching the SQL condition `routed`
        (whose parameters are `routed_params`)."""

    @abstractmethod
    def finish_and_claim(self, finished: Sequence[Advance], now: float, lease_seconds: int,
                         owner: str, limit: int) -> tuple[set[str], list[Claimed]]:
        """In one transaction: write `finished` (move each to its next time, or delete a
        one-off), fenced, and lease up to `limit` due rows (none when 0), oldest first,
        one winner per row across all hosts.  Returns the keys of `finished` whose fence
        no longer matched (nothing was written for them) and the leased rows in cron
        order."""

    @abstractmethod
    def earliest_due(self) -> int | None:
        """Smallest next_run_time of an unpaused routed row: one index probe."""

    def warm_up(self) -> None:
        """Run the hot path once on nothing, so it is compiled or prepared before the
        first burst (a first claim cost ~3 ms of compilation)."""
        self.finish_and_claim([], -1, 0, "", 1)

    def record_runs(self, runs: list[dict[str, Any]]) -> None:
        """Append run history rows (HISTORY_COLUMNS), in one transaction."""
        with self.transaction() as conn:
            self.history_many.executemany(conn, runs)


class ServerBackend(Backend):
    """A database server (PostgreSQL, MySQL): the hot path is statements on the driver's
    cursor inside a SQLAlchemy transaction (`execute`), each backend writing how it
    leases and finishes.  A server may hang or stop being the primary: every statement
    runs under a deadline (`watch`, where the driver has no socket timeout of its own),
    and a connection that missed it or reached a server that is not the primary is
    abandoned (deadline.py)."""

    def __init__(self, url: URL, table: str, deadline: float = DEADLINE_MAX) -> None:
        self.watch: StatementWatch | None = None
        super().__init__(url, table, deadline)
        dialect = self.engine.dialect
        self._driver_error = (getattr(dialect, "loaded_dbapi", None) or dialect.dbapi).Error
        self._listen()

    def socket_of(self, dbapi_conn: Any) -> int:
        """The descriptor of a driver connection's socket (for the watchdog)."""
        return int(dbapi_conn.fileno())

    def _listen(self) -> None:
        engine, watch = self.engine, self.watch
        if watch is not None:
            # Armed while a connection is checked out of the pool: from the first
            # statement of a transaction to its commit (or the pool's rollback), so each
            # statement, commit and rollback is bounded.  Per checkout, not per statement:
            # cursor-execute listeners put SQLAlchemy on its slow path (+15 % client CPU
            # on the claim loop); one transaction is a few statements of milliseconds.
            def checked_out(dbapi_conn: Any, record: Any, proxy: Any) -> None:
                watch.arm(dbapi_conn)

            def checked_in(dbapi_conn: Any, record: Any) -> None:
                if dbapi_conn is not None:
                    watch.disarm(dbapi_conn)

            event.listen(engine, "checkout", checked_out)
            event.listen(engine, "checkin", checked_in)

        def failed(ctx: Any) -> None:
            dbapi_conn = _dbapi_of(ctx.connection, getattr(ctx, "cursor", None))
            cut = False
            if watch is not None and dbapi_conn is not None:
                watch.disarm(dbapi_conn)
                cut = watch.was_cut(dbapi_conn)
            if not cut and self.timed_out(ctx.original_exception):
                cut = True
                counters.db_deadline_expired()  # the watchdog counts its own cuts
            if cut and ctx.sqlalchemy_exception is not None:
                ctx.sqlalchemy_exception.perfectsched_deadline = self.deadline
            if cut or self.not_primary(ctx.original_exception):
                # Never back to the pool; the pool's older connections lead to the same
                # server and are replaced as well.
                ctx.is_disconnect = True

        def invalidated(dbapi_conn: Any, record: Any, exc: BaseException | None) -> None:
            if exc is not None:
                counters.db_connection_abandoned()
                self.lost = True

        def connected(dbapi_conn: Any, record: Any) -> None:
            if self.lost:
                self.lost = False
                counters.db_reconnected()

        event.listen(engine, "handle_error", failed)
        event.listen(engine, "invalidate", invalidated)
        event.listen(engine, "connect", connected)

    def close(self) -> None:
        if self.watch is not None:
            self.watch.close()
        super().close()

    def execute(self, conn: Connection, sql: str, params: dict[str, Any]
                ) -> list[tuple[Any, ...]]:
        """One statement of the hot path on the driver's cursor, in `conn`'s transaction;
        its rows (no look at `description`, which psycopg 3 builds anew, a Column per
        column, at each look).  Through SQLAlchemy (compiled-cache look-up, execution
        context, a Row and a fetchone() per row) the claim of a batch cost more client CPU
        than the driver's round trip.  The transaction, the pool and the deadline
        watchdog are still SQLAlchemy's; a driver error goes through SQLAlchemy's own
        handling of a failed statement (the handle_error listeners: deadline, not the
        primary; invalidation on disconnect) and leaves as its DBAPIError, as before."""
        cur = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
        try:
            cur.execute(sql, params)
            return list(cur.fetchall())
        except self._driver_error as exc:
            # Private, but the same in SQLAlchemy 1.4 and 2.x; it raises.
            conn._handle_dbapi_exception(exc, sql, params, cur, None)  # type: ignore[attr-defined]
            raise
        finally:
            cur.close()

    def earliest_due(self) -> int | None:
        with self.transaction(readonly=True) as conn:
            rows = self.execute(conn, self.earliest_sql, self.routed_params)
        return None if not rows else int(rows[0][0])

    def finish_and_claim(self, finished: Sequence[Advance], now: float, lease_seconds: int,
                         owner: str, limit: int) -> tuple[set[str], list[Claimed]]:
        with self.transaction() as conn:
            lost = self.advance_in(conn, finished) if finished else set()
            if limit <= 0:
                return lost, []
            return lost, self.claim_in(conn, {
                "due_by": int(now), "lease_until": schema.lease_until(now, lease_seconds),
                "holder": owner,
                "claim_ts": now, "batch": limit})

    @abstractmethod
    def advance_in(self, conn: Connection, items: Sequence[Advance]) -> set[str]:
        """finish_and_claim's writes, in its transaction; the keys whose fence moved."""

    @abstractmethod
    def claim_in(self, conn: Connection, params: dict[str, Any]) -> list[Claimed]:
        """finish_and_claim's claim (`due_by`, `lease_until`, `holder`, `claim_ts`,
        `batch`), in its transaction."""


def _dbapi_of(conn: Any, cursor: Any = None) -> Any:
    """The driver connection under a SQLAlchemy Connection (or a cursor), without
    reconnecting an invalidated one (the public `connection` attribute would)."""
    if cursor is not None:
        return getattr(cursor, "connection", None)
    fairy = getattr(conn, "_dbapi_connection", None)
    return getattr(fairy, "dbapi_connection", None)
