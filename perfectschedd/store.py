"""Schedules and run history in SQL, through SQLAlchemy Core (and, for the worker's few
statements on SQLite, sqlite_hotpath.py on the driver's connection).

One row per schedule.  `next_run_time` is both "when it may run" and, while a worker
holds the row, the lease expiry; `fence` grows on every claim and every write that takes
the row away from its holder, and every holder-side write names the fence it was given,
so a worker that lost its lease changes nothing (PreemptedError upstream).
"""

from __future__ import annotations

import functools
import json
import operator
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.engine.url import URL, make_url
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError

from .errors import ConfigError
from .writelock import HostWriteLock

if TYPE_CHECKING:
    from .sqlite_hotpath import SQLiteHotPath

F = TypeVar("F", bound=Callable[..., Any])
# Extra runs of a schedule (perfectschedctl run) are one-off rows keyed KEY@run-....
RUN_NOW_MARK = "@run-"
SA_MAJOR = int(sa.__version__.split(".")[0])
KEY_MAX = 256
TYPE_MAX = 256
CRON_MAX = 256
TZ_MAX = 64
DATA_MAX = 65536
PAUSED_REASON_MAX = 400
POLICY_MAX = 400
# How long a SQLite writer waits for the lock before giving up (busy_timeout + our retries).
SQLITE_LOCK_WAIT = 60.0


@dataclass(frozen=True)
class Row:
    """One schedule as stored."""

    key: str
    type: str
    cron: str | None
    delay: int
    timezone: str
    data: str
    next_time: int
    next_run_time: int
    paused: bool
    fence: int
    attempt: int
    owner: str | None
    claimed_at: float | None
    paused_reason: str | None = None
    policy: str | None = None  # policy.Policy.to_text(): NULL for the defaults


class Claimed(NamedTuple):
    """A row just leased to the caller, as it is after the claim.  (Named tuples, here
    and in Advance: one is made per fire, and a frozen dataclass costs several times as
    much to build.)"""

    key: str
    type: str
    cron: str | None
    delay: int
    timezone: str
    data: str
    next_time: int
    fence: int
    attempt: int
    due_time: int  # next_run_time before the claim: when it was due (lateness counts from it)
    has_extra: int | None  # `run` made extra runs of it (KEY@run-...): they must not overlap
    policy: str | None = None  # the schedule's policies (policy.from_text)


class Advance(NamedTuple):
    """A holder-side write: the new times of a schedule whose occurrence finished."""

    key: str
    fence: int
    next_time: int | None  # None: a one-off row, delete it
    next_run_time: int | None
    # Set when the schedule has no next occurrence (its cron runs past year 9999): the
    # row is paused with this reason instead of moved on.
    pause_reason: str | None = None


def engine_url(url: str) -> URL:
    """Map a user's URL to a SQLAlchemy URL with the driver this installation has."""
    try:
        u = make_url(url)
    except Exception as exc:  # noqa: BLE001 - any parse failure is a bad url
        # Not the URL itself: it may hold a password.
        raise ConfigError(f"url: cannot parse it: {str(exc)[:200]}") from None
    backend, _, driver = u.drivername.partition("+")
    if backend == "postgres":
        backend = "postgresql"
    if backend == "postgresql" and not driver:
        # SQLAlchemy 1.4 (Debian 12) has no psycopg 3 dialect; 2.x does.
        driver = "psycopg" if SA_MAJOR >= 2 else "psycopg2"
    if backend == "mysql" and not driver:
        driver = "pymysql"
    if backend not in ("sqlite", "postgresql", "mysql"):
        raise ConfigError(f"url: unsupported database {backend!r}")
    return u.set(drivername=f"{backend}+{driver}" if driver else backend)


def check_url(url: str) -> None:
    """Refuse, as ConfigError, a URL no Store could be made of: unparsable, an in-memory
    SQLite database (each process would have its own), a driver that is not installed.
    Connects to nothing."""
    u = engine_url(url)
    if u.get_backend_name() == "sqlite" and (u.database or "") in ("", ":memory:"):
        raise ConfigError("url: the SQLite database must be a file (sqlite:///path)")
    try:
        dialect = u.get_dialect()
        load_dbapi = getattr(dialect, "import_dbapi", None) or dialect.dbapi
        load_dbapi()
    except Exception as exc:  # noqa: BLE001 - NoSuchModuleError, ImportError: one line
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise ConfigError(f"url: no driver for {u.drivername}: {first}") from None


# Unix seconds with a fraction: double precision everywhere (MySQL's plain FLOAT is 4 bytes
# and would round today's times to ~2 minutes).
_SECONDS = sa.Float(precision=53)


def _data_type(dialect: str) -> sa.types.TypeEngine[Any]:
    """JSON text up to DATA_MAX bytes: MySQL's TEXT stops at 65535 bytes.  The MySQL
    dialect is imported only where it is used: every dialect module loaded costs each
    process about a megabyte."""
    if dialect != "mysql":
        return sa.Text()
    from sqlalchemy.dialects.mysql import MEDIUMTEXT

    return MEDIUMTEXT()


def _schedules_table(metadata: sa.MetaData, name: str, dialect: str) -> sa.Table:
    t = sa.Table(
        name, metadata,
        sa.Column("key", sa.String(KEY_MAX), primary_key=True),
        sa.Column("type", sa.String(TYPE_MAX), nullable=False),
        sa.Column("cron", sa.String(CRON_MAX), nullable=True),  # NULL: a one-off run
        sa.Column("delay", sa.Integer, nullable=False, default=0),
        sa.Column("timezone", sa.String(TZ_MAX), nullable=False),
        sa.Column("data", _data_type(dialect), nullable=False),
        sa.Column("next_time", sa.BigInteger, nullable=False),
        sa.Column("next_run_time", sa.BigInteger, nullable=False),
        sa.Column("paused", sa.SmallInteger, nullable=False, default=0),
        sa.Column("fence", sa.BigInteger, nullable=False, default=0),
        sa.Column("attempt", sa.Integer, nullable=False, default=0),
        sa.Column("owner", sa.String(128), nullable=True),
        sa.Column("claimed_at", _SECONDS, nullable=True),
        # next_run_time as it was when the current holder claimed the row.
        sa.Column("due_time", sa.BigInteger, nullable=True),
        # Set by `run KEY`: the schedule has had extra runs, which must not overlap it.
        sa.Column("has_extra", sa.SmallInteger, nullable=True),
        # Why the daemon paused the schedule (no next occurrence); NULL when a user did.
        sa.Column("paused_reason", sa.String(PAUSED_REASON_MAX), nullable=True),
        # Policies other than the defaults, as JSON (policy.py); NULL: all defaults.
        sa.Column("policy", sa.String(POLICY_MAX), nullable=True),
        # The member of this schedule's group (itself, or an extra run KEY@run-...) that
        # runs now, or ran last: the others wait while it holds a live lease.
        sa.Column("group_holder", sa.String(KEY_MAX), nullable=True),
    )
    # The claim reads "unpaused rows, smallest next_run_time first": O(log n) on this index.
    sa.Index(f"{name}_due", t.c.paused, t.c.next_run_time)
    if dialect != "mysql":
        # Leased rows only (status, release_owner): tiny, so claims and finishes barely
        # pay for it.  MySQL has no partial indexes; there those reads scan the table.
        # Only this dialect's keyword: naming another one makes SQLAlchemy import it.
        sa.Index(f"{name}_held", t.c.owner, **{f"{dialect}_where": t.c.owner.isnot(None)})
    return t


def _history_table(metadata: sa.MetaData, name: str) -> sa.Table:
    t = sa.Table(
        f"{name}_history", metadata,
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"),
                  primary_key=True, autoincrement=True),
        sa.Column("key", sa.String(KEY_MAX), nullable=False),
        sa.Column("type", sa.String(TYPE_MAX), nullable=False),
        sa.Column("scheduled_time", sa.BigInteger, nullable=False),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("started_at", _SECONDS, nullable=False),
        sa.Column("finished_at", _SECONDS, nullable=False),
        sa.Column("outcome", sa.String(32), nullable=False),
        sa.Column("worker", sa.String(128), nullable=False),
    )
    sa.Index(f"{name}_history_key", t.c.key, t.c.id)
    return t


HISTORY_COLUMNS = ("key", "type", "scheduled_time", "attempt", "started_at", "finished_at",
                   "outcome", "worker")


class _DriverStatement:
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


def _claimed(rows: Iterable[Sequence[Any]]) -> list[Claimed]:
    """Claimed rows in cron order (RETURNING gives no order)."""
    return sorted((Claimed(*r) for r in rows), key=operator.attrgetter("next_time"))


def _sqlite_hot_path(engine: Engine, table: sa.Table, write_lock: HostWriteLock | None
                     ) -> SQLiteHotPath:
    """Imported here: the other dialects never load sqlite3."""
    import sqlite3

    from .sqlite_hotpath import MIN_SQLITE, SQLiteHotPath

    if sqlite3.sqlite_version_info < MIN_SQLITE:
        raise ConfigError(
            f"url: SQLite {'.'.join(map(str, MIN_SQLITE))} or newer is needed"
            f" (this Python has {sqlite3.sqlite_version})")
    return SQLiteHotPath(engine, table, write_lock)


# A transaction the database rolled back to break a deadlock or a serialization conflict:
# running it again is the documented remedy (PostgreSQL 40P01/40001, MySQL 1213/1205).
# A worker's heartbeat and its finish touch the same rows from two connections.
_TRY_AGAIN_STATES = frozenset({"40P01", "40001"})
_TRY_AGAIN_MYSQL = frozenset({1213, 1205})


def _is_transient(exc: DBAPIError) -> bool:
    orig = exc.orig
    state = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    if state in _TRY_AGAIN_STATES:
        return True
    args = getattr(orig, "args", ())
    return bool(args) and isinstance(args[0], int) and args[0] in _TRY_AGAIN_MYSQL


def _is_sqlite_busy(exc: OperationalError) -> bool:
    text = str(exc.orig).lower()
    return "locked" in text or "busy" in text


def _retried(method: F) -> F:
    """Re-run a whole store operation when the database says "try again":
    SQLite busy/locked (never shown to users), or a connection found dead (a server
    restart: the pool was invalidated; one retry on a fresh connection)."""

    @functools.wraps(method)
    def wrapper(self: Store, *args: Any, **kwargs: Any) -> Any:
        deadline = time.monotonic() + SQLITE_LOCK_WAIT
        delay = 0.005
        reconnected = False
        while True:
            try:
                return method(self, *args, **kwargs)
            except DBAPIError as exc:
                if (self.dialect == "sqlite" and isinstance(exc, OperationalError)
                        and _is_sqlite_busy(exc) and time.monotonic() < deadline):
                    time.sleep(delay)
                    delay = min(delay * 2, 0.2)
                    continue
                if _is_transient(exc) and time.monotonic() < deadline:
                    time.sleep(delay)
                    delay = min(delay * 2, 0.2)
                    continue
                if exc.connection_invalidated and not reconnected:
                    reconnected = True
                    continue
                raise

    return wrapper  # type: ignore[return-value]


class Store:
    """Schedules and run history in one database; safe for many threads of one process.

    Create one per process, after fork (connections must not cross a fork).
    """

    def __init__(self, url: str, table: str = "perfectsched") -> None:
        self.url = engine_url(url)
        self.dialect = self.url.get_backend_name()
        self._routed: Callable[[str], bool] | None = None  # SQLite: perfectsched_routed()
        self.engine = self._create_engine()
        self.write_lock = (HostWriteLock(self.url.database or "", SQLITE_LOCK_WAIT)
                            if self.dialect == "sqlite" else None)
        self.metadata = sa.MetaData()
        self.t = _schedules_table(self.metadata, table, self.dialect)
        self.h = _history_table(self.metadata, table)
        self._hot: SQLiteHotPath | None = None
        if self.dialect == "sqlite":
            self._hot = _sqlite_hot_path(self.engine, self.t, self.write_lock)
        self._build_claim_statements(sa.true())
        t = self.t
        self._advance_stmt = t.update().where(
            t.c.key == sa.bindparam("k"), t.c.fence == sa.bindparam("f")).values(
            next_time=sa.bindparam("nt"), next_run_time=sa.bindparam("nrt"), attempt=0,
            owner=None, claimed_at=None, fence=t.c.fence + 1)
        fences = sa.select(t.c.key, t.c.fence).where(
            t.c.key.in_(sa.bindparam("keys", expanding=True)))
        self._fences_stmt = (fences.with_for_update() if self.dialect == "mysql" else fences)
        self._delete_fenced_stmt = t.delete().where(
            t.c.key == sa.bindparam("k"), t.c.fence == sa.bindparam("f"))
        dialect = self.engine.dialect
        if self.dialect == "postgresql":
            # The driver's own SQL ("%" escaped for its paramstyle).  A batch travels as
            # one JSON text: json.dumps is C, where psycopg dumps array items one by one
            # in Python.
            table = dialect.identifier_preparer.format_table(t).replace("%", "%%")
            self._pg_advance_sql = (
                f"UPDATE {table} AS t SET next_time = adv.nt, next_run_time = adv.nrt,"
                " attempt = 0, owner = NULL, claimed_at = NULL, fence = t.fence + 1"
                " FROM json_to_recordset(%(rows)s::json) AS adv(k text, f bigint, nt bigint,"
                " nrt bigint) WHERE t.key = adv.k AND t.fence = adv.f RETURNING t.key")
            self._pg_delete_sql = (
                f"DELETE FROM {table} AS t USING json_to_recordset(%(rows)s::json)"
                " AS d(k text, f bigint) WHERE t.key = d.k AND t.fence = d.f RETURNING t.key")
            history = dialect.identifier_preparer.format_table(self.h).replace("%", "%%")
            columns = ", ".join(HISTORY_COLUMNS)
            typed = ", ".join(f"{c} {pg_type}" for c, pg_type in zip(
                HISTORY_COLUMNS, ("text", "text", "bigint", "integer", "double precision",
                                  "double precision", "text", "text"), strict=True))
            self._pg_history_sql = (
                f"INSERT INTO {history} ({columns}) SELECT {columns}"
                f" FROM json_to_recordset(%(rows)s::json) AS r({typed})")
        else:  # SQLite, MySQL: executemany of SQL compiled once
            if self.dialect == "mysql":
                self._advance_many = _DriverStatement(self._advance_stmt, dialect)
                self._delete_fenced_many = _DriverStatement(self._delete_fenced_stmt, dialect)
            self._record_runs_many = _DriverStatement(self.h.insert().inline(), dialect,
                                                     HISTORY_COLUMNS)
        self._initialized = False
        self.created_table = False  # by this Store (opening one creates a missing table)

    # -- engine ---------------------------------------------------------------------------

    def _create_engine(self) -> Engine:
        if self.dialect == "sqlite":
            db = self.url.database or ""
            if db in ("", ":memory:"):
                raise ConfigError("url: the SQLite database must be a file (sqlite:///path)")
            engine = sa.create_engine(
                self.url,
                poolclass=sa.pool.QueuePool, pool_size=4, max_overflow=16,
                connect_args={"timeout": SQLITE_LOCK_WAIT, "check_same_thread": False,
                              "isolation_level": None},
            )

            @event.listens_for(engine, "connect")
            def _on_connect(dbapi_conn: Any, _record: Any) -> None:
                # The worker's route predicate (restrict_types); every type until it is set.
                dbapi_conn.create_function(
                    "perfectsched_routed", 1,
                    lambda type_: self._routed is None or bool(self._routed(type_)),
                    deterministic=True)
                cur = dbapi_conn.cursor()
                cur.execute("PRAGMA journal_mode=WAL")
                cur.execute(f"PRAGMA busy_timeout={int(SQLITE_LOCK_WAIT * 1000)}")
                cur.execute("PRAGMA synchronous=NORMAL")
                # Statement journals in memory: a multi-row UPDATE in a transaction would
                # otherwise write one to a temporary file.
                cur.execute("PRAGMA temp_store=MEMORY")
                cur.close()

            @event.listens_for(engine, "begin")
            def _on_begin(conn: Connection) -> None:
                # Writers take the lock up front: a deferred transaction that upgrades to a
                # writer can fail with "database is locked" without waiting for busy_timeout.
                mode = "BEGIN" if conn.get_execution_options().get("readonly") else (
                    "BEGIN IMMEDIATE")
                conn.exec_driver_sql(mode)

            return engine
        # No pre-ping: it costs a round trip per transaction; a dead connection is caught
        # by _retried instead (the pool is invalidated and the operation re-run once).
        kwargs: dict[str, Any] = {"pool_size": 4, "max_overflow": 16, "pool_recycle": 3600}
        # A server that stops answering must surface as an error (and a retry), never as
        # a worker blocked for good: bounded connects, TCP keepalives, unacknowledged
        # data timeout (libpq parameters; ignored on Unix sockets).
        if self.dialect == "postgresql":
            kwargs["connect_args"] = {
                "connect_timeout": 10, "keepalives": 1, "keepalives_idle": 30,
                "keepalives_interval": 10, "keepalives_count": 3, "tcp_user_timeout": 60000}
        if self.dialect == "mysql":
            kwargs["isolation_level"] = "READ COMMITTED"
            kwargs["connect_args"] = {"connect_timeout": 10, "read_timeout": 120,
                                      "write_timeout": 120}
        return sa.create_engine(self.url, **kwargs)

    @contextmanager
    def _tx(self, readonly: bool = False) -> Iterator[Connection]:
        """One transaction (SQLite: BEGIN IMMEDIATE unless readonly)."""
        if self.write_lock is not None and not readonly:
            with self.write_lock.held(), self.engine.connect() as conn, conn.begin():
                yield conn
            return
        conn = self.engine.connect()
        if readonly and self.dialect == "sqlite":
            conn = conn.execution_options(readonly=True)
        with conn, conn.begin():
            yield conn

    def close(self) -> None:
        self.engine.dispose()

    def reset_connections(self) -> None:
        """Drop pooled connections (after an error): later calls connect afresh.  Those
        in use by other threads are closed when they are given back."""
        if self._hot is not None:
            self._hot.drop_connections()
        self.engine.dispose()

    def keep_connection(self) -> None:
        """The calling thread keeps a connection for the hot path (SQLite)."""
        if self._hot is not None:
            self._hot.keep_connection()

    # -- schema ---------------------------------------------------------------------------

    def init(self) -> bool:
        """Create the tables and indexes if missing (idempotent, safe to race), and add
        columns that a newer version introduced to a table an older one created; True if
        this call created the schedules table."""
        existed = sa.inspect(self.engine).has_table(self.t.name)
        try:
            self.metadata.create_all(self.engine, checkfirst=True)
        except (IntegrityError, OperationalError, sa.exc.ProgrammingError):
            # Another process created them between the check and the CREATE.
            self.metadata.create_all(self.engine, checkfirst=True)
        self._add_missing_columns()
        self._initialized = True
        self.created_table = self.created_table or not existed
        return not existed

    def _add_missing_columns(self) -> None:
        have = {c["name"] for c in sa.inspect(self.engine).get_columns(self.t.name)}
        for column in self.t.columns:
            if column.name in have:
                continue
            if not column.nullable:
                raise ConfigError(f"table {self.t.name}: column {column.name} is missing; "
                                  "the table was made by an incompatible version")
            ddl = (f"ALTER TABLE {self.engine.dialect.identifier_preparer.format_table(self.t)}"
                   f" ADD COLUMN {self.engine.dialect.identifier_preparer.quote(column.name)}"
                   f" {column.type.compile(dialect=self.engine.dialect)}")
            try:
                with self.engine.begin() as conn:
                    conn.exec_driver_sql(ddl)
            except (OperationalError, sa.exc.ProgrammingError):
                # Another process added it at the same time.
                have = {c["name"] for c in sa.inspect(self.engine).get_columns(self.t.name)}
                if column.name not in have:
                    raise

    def ensure_initialized(self) -> None:
        if not self._initialized:
            self.init()

    # -- user-side writes -----------------------------------------------------------------

    @_retried
    def insert(self, row: Row) -> bool:
        """Insert a schedule; False if the key exists."""
        values = {
            "key": row.key, "type": row.type, "cron": row.cron, "delay": row.delay,
            "timezone": row.timezone, "data": row.data, "next_time": row.next_time,
            "next_run_time": row.next_run_time, "paused": int(row.paused),
            "fence": 0, "attempt": 0, "owner": None, "claimed_at": None,
            "policy": row.policy,
        }
        try:
            with self._tx() as conn:
                conn.execute(self.t.insert().values(**values))
        except IntegrityError:
            return False
        return True

    @_retried
    def insert_many(self, rows: Sequence[Row]) -> None:
        """Bulk insert; raises IntegrityError (nothing stored) if any key exists."""
        payload = [
            {"key": r.key, "type": r.type, "cron": r.cron, "delay": r.delay,
             "timezone": r.timezone, "data": r.data, "next_time": r.next_time,
             "next_run_time": r.next_run_time, "paused": int(r.paused), "fence": 0,
             "attempt": 0, "owner": None, "claimed_at": None, "policy": r.policy}
            for r in rows
        ]
        with self._tx() as conn:
            conn.execute(self.t.insert(), payload)

    @_retried
    def delete(self, key: str) -> bool:
        with self._tx() as conn:
            return conn.execute(self.t.delete().where(self.t.c.key == key)).rowcount > 0

    @_retried
    def update(self, key: str, values: dict[str, Any], *, take_lease: bool) -> bool:
        """Change a schedule's fields; `take_lease` preempts a current holder."""
        if take_lease:
            values = {**values, "fence": self.t.c.fence + 1, "owner": None, "claimed_at": None}
        with self._tx() as conn:
            res = conn.execute(self.t.update().where(self.t.c.key == key).values(**values))
            return res.rowcount > 0

    # -- reads ----------------------------------------------------------------------------

    @_retried
    def get(self, key: str) -> Row | None:
        with self._tx(readonly=True) as conn:
            r = conn.execute(sa.select(self.t).where(self.t.c.key == key)).first()
        return self._row(r) if r is not None else None

    @_retried
    def exists(self, key: str) -> bool:
        with self._tx(readonly=True) as conn:
            return conn.execute(
                sa.select(self.t.c.key).where(self.t.c.key == key)).first() is not None

    @_retried
    def rows(self, *, prefix: str | None = None, limit: int | None = None,
             after_key: str | None = None) -> list[Row]:
        q = sa.select(self.t).order_by(self.t.c.key)
        if prefix:
            q = q.where(self.t.c.key.startswith(prefix, autoescape=True))
        if after_key is not None:
            q = q.where(self.t.c.key > after_key)
        if limit is not None:
            q = q.limit(limit)
        with self._tx(readonly=True) as conn:
            return [self._row(r) for r in conn.execute(q)]

    @_retried
    def running(self) -> list[Row]:
        with self._tx(readonly=True) as conn:
            res = conn.execute(sa.select(self.t).where(self.t.c.owner.isnot(None))
                               .order_by(self.t.c.claimed_at))
            return [self._row(r) for r in res]

    @_retried
    def earliest_due(self) -> int | None:
        """Smallest next_run_time of an unpaused row: one index probe."""
        if self._hot is not None:
            return self._hot.earliest_due()
        with self._tx(readonly=True) as conn:
            return conn.execute(self._earliest_stmt).scalar()

    @_retried
    def counts(self, now: int) -> dict[str, int]:
        """Totals for status and metrics; `overdue` counts through the due index only."""
        t = self.t
        with self._tx(readonly=True) as conn:
            total = conn.execute(sa.select(sa.func.count()).select_from(t)).scalar() or 0
            paused = conn.execute(sa.select(sa.func.count()).select_from(t)
                                  .where(t.c.paused == 1)).scalar() or 0
            due = conn.execute(sa.select(sa.func.count()).select_from(t).where(
                t.c.paused == 0, t.c.next_run_time <= now, t.c.owner.is_(None))).scalar() or 0
            running = conn.execute(sa.select(sa.func.count()).select_from(t).where(
                t.c.owner.isnot(None), t.c.next_run_time > now)).scalar() or 0
        return {"schedules": total, "paused": paused, "due": due, "running": running}

    @_retried
    def keys_matching(self, bad: Callable[[str], bool], limit: int = 100) -> list[str]:
        """Up to `limit` schedule keys for which `bad(key)` is true, the table read in
        key order in slices (never all of it in memory)."""
        t = self.t
        found: list[str] = []
        after = ""
        while len(found) < limit:
            q = sa.select(t.c.key).where(t.c.key > after).order_by(t.c.key).limit(10_000)
            with self._tx(readonly=True) as conn:
                keys = [r[0] for r in conn.execute(q)]
            if not keys:
                break
            found.extend(k for k in keys if bad(k))
            after = keys[-1]
        return found[:limit]

    @_retried
    def unclaimed(self, due_before: int, limit: int = 100) -> dict[str, int]:
        """Occurrences due before `due_before` that nobody holds, by type (the `limit`
        types with most of them): work no live worker takes."""
        t = self.t
        n = sa.func.count().label("n")
        q = (sa.select(t.c.type, n).where(t.c.paused == 0, t.c.next_run_time < due_before,
                                          t.c.owner.is_(None))
             .group_by(t.c.type).order_by(n.desc()).limit(limit))
        with self._tx(readonly=True) as conn:
            return {r[0]: int(r[1]) for r in conn.execute(q)}

    def _row(self, r: Any) -> Row:
        m = r._mapping
        return Row(
            key=m["key"], type=m["type"], cron=m["cron"], delay=int(m["delay"]),
            timezone=m["timezone"], data=m["data"], next_time=int(m["next_time"]),
            next_run_time=int(m["next_run_time"]), paused=bool(m["paused"]),
            fence=int(m["fence"]), attempt=int(m["attempt"]), owner=m["owner"],
            claimed_at=m["claimed_at"], paused_reason=m.get("paused_reason"),
            policy=m.get("policy"),
        )

    # -- holder-side: claim, heartbeat, finish, retry, release ----------------------------

    @_retried
    def claim(self, now: float, lease_seconds: int, owner: str, limit: int = 1) -> list[Claimed]:
        """Lease up to `limit` due rows, oldest first; one winner per row across all hosts."""
        if self._hot is not None:
            return _claimed(self._hot.finish_and_claim([], now, lease_seconds, owner, limit)[1])
        with self._tx() as conn:
            return self._claim_in(conn, now, lease_seconds, owner, limit)

    @_retried
    def finish_and_claim(self, finished: Sequence[Advance], now: float, lease_seconds: int,
                         owner: str, limit: int) -> tuple[set[str], list[Claimed]]:
        """advance() and claim() in one transaction: the worker's hot path.

        Returns the preempted keys of `finished` and the newly claimed rows.
        """
        finished, pauses = _split_pauses(finished)
        paused_lost = self.pause_exhausted(pauses) if pauses else set()
        if self._hot is not None:
            lost, rows = self._hot.finish_and_claim(finished, now, lease_seconds, owner, limit)
            return lost | paused_lost, _claimed(rows)
        with self._tx() as conn:
            lost = self._advance_in(conn, finished) if finished else set()
            claimed = self._claim_in(conn, now, lease_seconds, owner, limit) if limit > 0 else []
        return lost | paused_lost, claimed

    def _claim_in(self, conn: Connection, now: float, lease_seconds: int, owner: str,
                  limit: int) -> list[Claimed]:
        ts = int(now)
        params = {"due_by": ts, "lease_until": ts + lease_seconds, "holder": owner,
                  "claim_ts": now, "batch": limit}
        if self.dialect == "postgresql":
            return _claimed(conn.execute(self._claim_returning_stmt, params))
        # MySQL/MariaDB (no UPDATE ... RETURNING): read and write in one transaction that
        # holds the rows (SKIP LOCKED).
        found = conn.execute(self._claim_select_stmt, params).all()
        if not found:
            return []
        conn.execute(self._claim_update_stmt, {**params, "keys": [r[0] for r in found]})
        return [Claimed(*r[:7], fence=r[7] + 1, attempt=r[8] + 1, due_time=r[9],
                        has_extra=r[10], policy=r[11]) for r in found]

    def restrict_types(self, exact: Sequence[str], patterns: Sequence[str],
                       routed: Callable[[str], bool]) -> None:
        """Claim, and look for, only occurrences of types this process routes: `exact`
        names or `patterns` (Python regular expressions searched in the type, as routes'
        /re/ are), `routed` being the exact predicate.  Set once, by a worker, before its
        first claim; the statements are rebuilt once here, never per claim.

        SQLite asks `routed` itself (a function on the connection); PostgreSQL and MySQL
        use their own regular expressions (`~`, REGEXP), which agree with Python's on
        everyday patterns: a type they match that Python does not is given back by the
        worker untried (see leases.py)."""
        t = self.t
        conds: list[Any] = []
        if exact:
            conds.append(t.c.type.in_(list(exact)))
        conds.extend(t.c.type.regexp_match(p) for p in patterns)
        cond = sa.or_(*conds) if conds else sa.false()
        self._build_claim_statements(cond)
        if self._hot is not None:
            self._routed = routed
            if patterns:
                self._hot.restrict("perfectsched_routed(type)", ())
            else:
                self._hot.restrict(f"type IN ({', '.join('?' * len(exact))})" if exact
                                   else "0", tuple(exact))

    def _build_claim_statements(self, routed: Any) -> None:
        """The claim statements, built once: building them per claim cost more Python time
        than the database spent running them.  `routed`: the types this process claims."""
        t = self.t
        # Built once: each worker asks every poll_interval, and building it cost more
        # than running it (idle CPU).
        self._earliest_stmt = (sa.select(t.c.next_run_time).where(t.c.paused == 0, routed)
                               .order_by(t.c.next_run_time).limit(1))
        cols = (t.c.key, t.c.type, t.c.cron, t.c.delay, t.c.timezone, t.c.data, t.c.next_time,
                t.c.fence, t.c.attempt)
        due_rows = (t.c.paused == 0, t.c.next_run_time <= sa.bindparam("due_by"), routed)
        changes = {"next_run_time": sa.bindparam("lease_until"), "fence": t.c.fence + 1,
                   "attempt": t.c.attempt + 1, "owner": sa.bindparam("holder"),
                   "claimed_at": sa.bindparam("claim_ts")}
        batch = sa.bindparam("batch", type_=sa.Integer)
        due = sa.select(t.c.key).where(*due_rows).order_by(t.c.next_run_time).limit(batch)
        if self.dialect == "postgresql":
            due = due.with_for_update(skip_locked=True)
        # due_time = next_run_time: SET reads the row as it was before the UPDATE.
        self._claim_returning_stmt = (
            t.update().where(t.c.key.in_(due.scalar_subquery()))
            .values(**changes, due_time=t.c.next_run_time)
            .returning(*cols, t.c.due_time, t.c.has_extra, t.c.policy))
        # MySQL assigns SET values left to right, so there due_time comes from the read.
        select_rows = (sa.select(*cols, t.c.next_run_time, t.c.has_extra, t.c.policy)
                       .where(*due_rows)
                       .order_by(t.c.next_run_time).limit(batch))
        if self.dialect == "mysql":
            select_rows = select_rows.with_for_update(skip_locked=True)
        self._claim_select_stmt = select_rows
        self._claim_update_stmt = (t.update()
                                   .where(t.c.key.in_(sa.bindparam("keys", expanding=True)))
                                   .values(**changes))

    @_retried
    def warm_up(self) -> None:
        """Run the hot-path statements once on nothing, so SQLAlchemy has compiled them
        before the first burst (a first claim cost ~3 ms of compilation)."""
        if self._hot is not None:  # sqlite3 prepares them: run the claim once on nothing
            self._hot.finish_and_claim([], -1, 0, "", 1)
            return
        with self._tx() as conn:
            self._claim_in(conn, -1, 0, "", 0)
            if self.dialect == "mysql":  # PostgreSQL's finishes are driver SQL, not compiled
                conn.execute(self._fences_stmt, {"keys": [""]}).all()

    @_retried
    def heartbeat(self, held: Sequence[tuple[str, int]], lease_until: int) -> set[str]:
        """Extend leases; returns the keys whose lease was lost."""
        if not held:
            return set()
        t = self.t
        lost: set[str] = set()
        with self._tx() as conn:
            for key, fence in sorted(held):  # one lock order with the finishes (by key)
                res = conn.execute(t.update().where(t.c.key == key, t.c.fence == fence)
                                   .values(next_run_time=lease_until))
                if res.rowcount == 0:
                    lost.add(key)
        return lost

    @_retried
    def advance(self, items: Sequence[Advance]) -> set[str]:
        """Finish occurrences (move to the next time, or delete one-offs).

        Returns the keys that were preempted (nothing written for them).
        """
        if not items:
            return set()
        items, pauses = _split_pauses(items)
        lost = self.pause_exhausted(pauses) if pauses else set()
        if not items:
            return lost
        if self._hot is not None:
            return lost | self._hot.finish_and_claim(items, 0, 0, "", 0)[0]
        with self._tx() as conn:
            return lost | self._advance_in(conn, items)

    @_retried
    def retarget(self, key: str, fence: int, next_time: int) -> bool:
        """The lease holder runs a later occurrence than it claimed (misfire `latest`):
        the row says which, so a worker that dies running it leaves that one to redo.
        Fenced; the lease is kept.  False when the lease was lost."""
        t = self.t
        with self._tx() as conn:
            return conn.execute(t.update().where(t.c.key == key, t.c.fence == fence)
                                .values(next_time=next_time)).rowcount == 1

    @_retried
    def pause_exhausted(self, items: Sequence[Advance]) -> set[str]:
        """Pause schedules that have no next occurrence, with the reason, ending their
        leases (fenced like any holder-side write); returns the keys that were preempted."""
        t = self.t
        lost: set[str] = set()
        with self._tx() as conn:
            for a in items:
                done = conn.execute(
                    t.update().where(t.c.key == a.key, t.c.fence == a.fence)
                    .values(paused=1, paused_reason=(a.pause_reason or "")[:PAUSED_REASON_MAX],
                            owner=None, claimed_at=None, attempt=0, fence=t.c.fence + 1))
                if done.rowcount != 1:
                    lost.add(a.key)
        return lost

    def _advance_in(self, conn: Connection, items: Sequence[Advance]) -> set[str]:
        if self.dialect == "postgresql":
            return self._advance_pg(conn, items)
        # MySQL: which rows still carry the caller's fence, read (and locked) inside the
        # transaction; the writes below then match exactly those.
        fences = {a.key: a.fence for a in items}
        held = {k for k, f in conn.execute(self._fences_stmt, {"keys": list(fences)})
                if fences.get(k) == f}
        moves = [{"k": a.key, "f": a.fence, "nt": a.next_time, "nrt": a.next_run_time}
                 for a in items if a.key in held and a.next_time is not None]
        oneoffs = [{"k": a.key, "f": a.fence} for a in items
                   if a.key in held and a.next_time is None]
        if moves:
            self._advance_many.executemany(conn, moves)
        if oneoffs:
            self._delete_fenced_many.executemany(conn, oneoffs)
        return set(fences) - held

    def _advance_pg(self, conn: Connection, items: Sequence[Advance]) -> set[str]:
        """One statement for all advances, one for all one-offs, whatever the batch size:
        the batch goes as one parameter to a fixed statement, so nothing is compiled per
        call (a VALUES list built per batch cost half a worker's time in SQL compilation).
        """
        done: set[str] = set()
        moves = sorted(({"k": a.key, "f": a.fence, "nt": a.next_time, "nrt": a.next_run_time}
                        for a in items if a.next_time is not None), key=operator.itemgetter("k"))
        if moves:
            done.update(r[0] for r in conn.exec_driver_sql(
                self._pg_advance_sql, {"rows": json.dumps(moves)}))
        oneoffs = [{"k": a.key, "f": a.fence} for a in items if a.next_time is None]
        if oneoffs:
            done.update(r[0] for r in conn.exec_driver_sql(
                self._pg_delete_sql, {"rows": json.dumps(oneoffs)}))
        return {a.key for a in items} - done

    @_retried
    def mark_extra(self, key: str) -> bool:
        """`run KEY` is about to add an extra run: from now on, claims of KEY check that
        none of its extra runs is running (and the extra runs check KEY).  No fence
        change: a running occurrence keeps its lease."""
        t = self.t
        with self._tx() as conn:
            return conn.execute(t.update().where(t.c.key == key)
                                .values(has_extra=1)).rowcount > 0

    @_retried
    def extra_runs(self, key: str) -> list[Row]:
        """The extra runs (`run KEY`) of `key` that have not ended."""
        t = self.t
        q = sa.select(t).where(t.c.key.startswith(f"{key}{RUN_NOW_MARK}", autoescape=True))
        with self._tx(readonly=True) as conn:
            return [self._row(r) for r in conn.execute(q.order_by(t.c.next_run_time))]

    @_retried
    def group_busy(self, key: str, base: str, now: int) -> bool:
        """Whether another member of `base`'s group (the schedule and its extra runs
        `base@run-...`) than `key` holds a live lease.  Read after the caller's own claim
        was committed, so of two members claimed at the same time at least one sees the
        other (and gives its occurrence back)."""
        t = self.t
        members = sa.or_(t.c.key == base,
                         t.c.key.startswith(f"{base}{RUN_NOW_MARK}", autoescape=True))
        q = (sa.select(t.c.key).where(members, t.c.key != key, t.c.owner.isnot(None),
                                      t.c.next_run_time > now).limit(1))
        with self._tx(readonly=True) as conn:
            return conn.execute(q).first() is not None

    @_retried
    def group_acquire(self, key: str, base: str, now: int) -> bool:
        """Whether `key`, a member of `base`'s group (the schedule and its extra runs
        `base@run-...`), may start now; if so it becomes the group's holder.  Decided under
        the base row's lock (one transaction), so of members claimed at the same time
        exactly one starts and the others wait: no overlap and no livelock, as there would
        be if each gave way to every other's lease.  A running base claimed before `run`
        marked it (so it did not ask) blocks the extra runs through its own lease."""
        t = self.t
        with self._tx() as conn:
            row = conn.execute(
                sa.select(t.c.group_holder, t.c.owner, t.c.next_run_time)
                .where(t.c.key == base).with_for_update()).first()
            if row is None:
                return True  # the schedule is gone: its extra runs are on their own
            holder, base_owner, base_lease = row
            if key != base and base_owner is not None and base_lease > now:
                return False
            if holder is not None and holder != key:
                live = conn.execute(sa.select(t.c.key).where(
                    t.c.key == holder, t.c.owner.isnot(None),
                    t.c.next_run_time > now)).first()
                if live is not None:
                    return False
            if holder != key:
                conn.execute(t.update().where(t.c.key == base).values(group_holder=key))
            return True

    @_retried
    def reschedule(self, key: str, fence: int, run_at: int, *, count_attempt: bool) -> bool:
        """Give the occurrence back to run again at `run_at` (retry, release, SCHED_LATER)."""
        t = self.t
        values: dict[str, Any] = {"next_run_time": run_at, "owner": None, "claimed_at": None,
                                  "fence": t.c.fence + 1}
        if not count_attempt:
            values["attempt"] = t.c.attempt - 1
        with self._tx() as conn:
            res = conn.execute(t.update().where(t.c.key == key, t.c.fence == fence)
                               .values(**values))
        return res.rowcount > 0

    @_retried
    def release_owner(self, owner: str, now: int) -> int:
        """Hand back every lease of a dead/stopping process at once."""
        t = self.t
        with self._tx() as conn:
            return conn.execute(t.update().where(t.c.owner == owner).values(
                next_run_time=now, owner=None, claimed_at=None, fence=t.c.fence + 1,
                attempt=t.c.attempt - 1)).rowcount

    @_retried
    def reclaim_owner(self, owner: str, now: float) -> int:
        """A worker died and its runs were killed: record each attempt it held as `lost`
        and give the occurrences back to run now; the attempt counts.  One transaction."""
        t = self.t
        with self._tx() as conn:
            held = conn.execute(sa.select(t.c.key, t.c.type, t.c.next_time, t.c.attempt,
                                          t.c.claimed_at, t.c.fence)
                                .where(t.c.owner == owner)).all()
            if not held:
                return 0
            conn.execute(self.h.insert(), [
                {"key": r.key, "type": r.type, "scheduled_time": r.next_time,
                 "attempt": r.attempt, "started_at": r.claimed_at or now,
                 "finished_at": now, "outcome": "lost", "worker": owner} for r in held])
            stmt = t.update().where(t.c.key == sa.bindparam("k"),
                                    t.c.fence == sa.bindparam("f")).values(
                next_run_time=int(now), owner=None, claimed_at=None, fence=t.c.fence + 1)
            conn.execute(stmt, [{"k": r.key, "f": r.fence} for r in held])
        return len(held)

    # -- run history ----------------------------------------------------------------------

    @_retried
    def record_runs(self, runs: Iterable[dict[str, Any]]) -> None:
        payload = list(runs)
        if not payload:
            return
        with self._tx() as conn:
            if self.dialect == "postgresql":  # one statement, as in advance
                conn.exec_driver_sql(self._pg_history_sql, {"rows": json.dumps(payload)})
            else:
                self._record_runs_many.executemany(conn, payload)

    @_retried
    def history(self, key: str, limit: int) -> list[dict[str, Any]]:
        """Newest runs of `key`, including its extra runs (`run`: keys KEY@run-...)."""
        h = self.h
        q = (sa.select(h).where(sa.or_(h.c.key == key,
                                       h.c.key.startswith(f"{key}{RUN_NOW_MARK}",
                                                          autoescape=True)))
             .order_by(h.c.id.desc()).limit(limit))
        with self._tx(readonly=True) as conn:
            return [dict(r._mapping) for r in conn.execute(q)]

    @_retried
    def prune_history(self, keep_per_key: int) -> int:
        """Keep only the newest `keep_per_key` runs of each key (bounded history)."""
        h = self.h
        removed = 0
        over = (sa.select(h.c.key).group_by(h.c.key)
                .having(sa.func.count() > keep_per_key))
        with self._tx(readonly=True) as conn:
            keys = [r[0] for r in conn.execute(over)]
        for key in keys:
            with self._tx() as conn:
                oldest_kept = conn.execute(
                    sa.select(h.c.id).where(h.c.key == key).order_by(h.c.id.desc())
                    .limit(1).offset(max(keep_per_key - 1, 0))).scalar()
                if oldest_kept is None:
                    continue
                if keep_per_key == 0:
                    oldest_kept += 1
                removed += conn.execute(
                    h.delete().where(h.c.key == key, h.c.id < oldest_kept)).rowcount
        return removed


def _split_pauses(items: Sequence[Advance]) -> tuple[Sequence[Advance], list[Advance]]:
    """(advances, pauses): the rare exhausted schedules apart from the hot path."""
    pauses = [a for a in items if a.pause_reason is not None]
    if not pauses:
        return items, pauses
    return [a for a in items if a.pause_reason is None], pauses


def dumps_data(data: Any) -> str:
    # allow_nan=False: NaN/Infinity are not JSON; other clients could not read them.
    return json.dumps(data, separators=(",", ":"), sort_keys=True, allow_nan=False)
