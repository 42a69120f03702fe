"""Schedules and run history in SQL, through SQLAlchemy Core: what every database does
alike.  What differs (engine options, the worker's claim and finish, history appends,
which errors mean "try again") is a backend's (backends/).

The tables and their rules are in schema.py.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.engine.url import URL, make_url
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError

from perfectschedd.errors import ConfigError, SchemaError, first_line
from perfectschedd.store import tokens as token_sql
from perfectschedd.store import version as schemaversion
from perfectschedd.store.backends.choice import open_backend
from perfectschedd.store.backends.sqlite import missing_directory
from perfectschedd.store.deadline import DEADLINE_MAX, statement_deadline
from perfectschedd.store.schema import (
    TRY_AGAIN_FOR,
    Advance,
    Claimed,
    Row,
)
from perfectschedd.store.tokens import TokenRow
from perfectschedd.vocabulary import outcomes, states
from perfectschedd.vocabulary.fields import (
    CRON_MAX,
    DATA_MAX,
    DELETED_META,
    ERROR_MAX,
    EXEC_TYPE,
    KEY_MAX,
    PAUSED_ALL_META,
    PAUSED_ALL_REASON,
    PAUSED_REASON_MAX,
    POLICY_MAX,
    REFUSED_ROW_REASON,
    ROW_FIELDS,
    RUN_NOW_MARK,
    SCHEDULE_FIELDS,
    SOURCE_FILE,
    TYPE_MAX,
    TZ_MAX,
    deleted_marker_name,
    dumps_data,
    exec_entry_key,
    foreign_exec_row,
    history_from_name,
    refused_line,
    refused_reason,
    schedule_key,
)
from perfectschedd.vocabulary.history import HISTORY_COLUMNS
from perfectschedd.vocabulary.outcomes import Outcome

__all__ = ["CRON_MAX", "DATA_MAX", "KEY_MAX", "POLICY_MAX", "RUN_NOW_MARK", "TURN_LOST",
           "TURN_START", "TURN_WAIT", "TYPE_MAX", "TZ_MAX", "Advance", "Claimed", "Row",
           "Store", "TokenRow", "check_url", "dumps_data", "engine_url"]

F = TypeVar("F", bound=Callable[..., Any])

log = logging.getLogger("perfectschedd")

# Store.group_turn's answers: the member starts (it is the group's holder now), waits, or
# no longer holds its row.
TURN_START, TURN_WAIT, TURN_LOST = "start", "wait", "lost"


class RefusedRow(NamedTuple):
    """A row whose type names a schedules file's exec entry whose own row it is not
    (fields.foreign_exec_row): paused with `reason`, never run."""

    key: str
    type: str
    creator: int | None
    reason: str

    def line(self) -> str:
        return refused_line(self.key, self.type, self.creator, self.reason)


SA_MAJOR = int(sa.__version__.split(".")[0])


def _runs_of(column: Any, schedule: str) -> Any:
    """The SQL condition "`column` is `schedule` or one of its KEY@run-... keys"."""
    return sa.or_(column == schedule, _starts_with(column, f"{schedule}{RUN_NOW_MARK}"))


def _starts_with(column: Any, prefix: str) -> Any:
    """The SQL condition "`column` starts with `prefix`", exactly: LIKE ignores case on
    SQLite (and MariaDB), where "db" and "DB" are two keys; the comparison of the first
    characters does not (an index still serves the LIKE where it can)."""
    return sa.and_(column.startswith(prefix, autoescape=True),
                   sa.func.substr(column, 1, len(prefix)) == prefix)


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
    SQLite database (each process would have its own) or one in a directory that does
    not exist, a driver that is not installed.  Connects to nothing."""
    u = engine_url(url)
    if u.get_backend_name() == "sqlite" and (u.database or "") in ("", ":memory:"):
        raise ConfigError("url: the SQLite database must be a file (sqlite:///path)")
    if u.get_backend_name() == "sqlite" and (missing := missing_directory(u)):
        raise ConfigError(missing)
    try:
        dialect = u.get_dialect()
        load_dbapi = getattr(dialect, "import_dbapi", None) or dialect.dbapi
        load_dbapi()
    except Exception as exc:  # noqa: BLE001 - NoSuchModuleError, ImportError: one line
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise ConfigError(f"url: no driver for {u.drivername}: {first}") from None


def _retried(method: F) -> F:
    """Re-run a whole store operation when the database says "try again" (the
    backend's should_try_again: never shown to users), or a connection found dead (a server
    restart: the pool was invalidated; one retry on a fresh connection)."""

    @functools.wraps(method)
    def wrapper(self: Store, *args: Any, **kwargs: Any) -> Any:
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


class Store:
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

    # -- schema ---------------------------------------------------------------------------

    @_retried  # idempotent: a connection lost on the way (a deadline under load) retries
    def init(self) -> bool:
        """Bring the database to this version's schema (schemaversion.py): create what is
        missing, add the columns a newer version introduced to tables an older one made,
        and record the version; idempotent and safe to race.  SchemaError, before
        anything is written, when the database is newer than this version may use or not
        one it can use.  True if this call created the schedules table."""
        found = schemaversion.read(self.engine, self.backend.meta, self.t)
        schemaversion.refuse_unusable(found)
        self._refuse_missing_required()
        self._create_missing_tables()
        self._add_missing_columns()
        if 0 < found.version < schemaversion.SCHEMA_VERSION:
            # Rows an older release let any client write (0.1.0 stored any exec:KEY type):
            # paused before a worker can claim one (SPEC "Privilege model").
            for refused in self.refuse_foreign_exec_rows():
                log.warning("upgrade: %s", refused.line())
        schemaversion.record(self.engine, self.backend.meta, found)
        if found.version < schemaversion.SCHEMA_VERSION:
            self.backend.sync()
        self._initialized = True
        self.created_table = self.created_table or found.version == 0
        return found.version == 0

    def refusal(self) -> str | None:
        """Why this version can never use the database (init would raise SchemaError),
        read without writing anything; None when it can, or has nothing to refuse yet."""
        try:
            schemaversion.refuse_unusable(
                schemaversion.read(self.engine, self.backend.meta, self.t))
            self._refuse_missing_required()
        except SchemaError as exc:
            return first_line(exc)
        return None

    def _create_missing_tables(self) -> None:
        """Create each missing table on its own: hosts starting at once race between
        the existence check and the CREATE, and on MySQL each of several tables can be
        lost to a different process, so one retry of the whole set is not enough.  A
        failed CREATE is fine when the table now exists; otherwise (this role may not
        create tables) it is reported."""
        for table in self.metadata.sorted_tables:
            try:
                table.create(self.engine, checkfirst=True)
            except (IntegrityError, OperationalError, sa.exc.ProgrammingError) as exc:
                if not sa.inspect(self.engine).has_table(table.name):
                    raise SchemaError(f"cannot create the table {table.name}: "
                                      f"{first_line(exc.orig or exc)}") from None

    def _refuse_missing_required(self) -> None:
        """A table of ours that lacks a NOT NULL column was not made by any version of
        perfectsched: refuse it before anything is created beside it."""
        inspector = sa.inspect(self.engine)
        for table in self.metadata.sorted_tables:
            if not inspector.has_table(table.name):
                continue
            have = {c["name"] for c in inspector.get_columns(table.name)}
            missing = [c.name for c in table.columns if not c.nullable and c.name not in have]
            if missing:
                raise SchemaError(
                    f"table {table.name}: column {missing[0]} is missing; the table was not"
                    " made by perfectsched (or by an incompatible version); nothing was "
                    "changed")

    def _add_missing_columns(self) -> None:
        for table in self.metadata.sorted_tables:
            self._add_missing_columns_of(table)

    def _add_missing_columns_of(self, table: sa.Table) -> None:
        have = {c["name"] for c in sa.inspect(self.engine).get_columns(table.name)}
        for column in table.columns:
            if column.name in have:
                continue
            ddl = (f"ALTER TABLE {self.engine.dialect.identifier_preparer.format_table(table)}"
                   f" ADD COLUMN {self.engine.dialect.identifier_preparer.quote(column.name)}"
                   f" {column.type.compile(dialect=self.engine.dialect)}")
            try:
                with self.engine.begin() as conn:
                    conn.exec_driver_sql(ddl)
            except (OperationalError, sa.exc.ProgrammingError):
                # Another process added it at the same time.
                have = {c["name"] for c in sa.inspect(self.engine).get_columns(table.name)}
                if column.name not in have:
                    raise

    def ensure_initialized(self) -> None:
        if not self._initialized:
            self.init()

    # -- user-side writes -----------------------------------------------------------------

    @_retried
    def insert(self, row: Row) -> bool:
        """Insert a schedule; False if the key exists."""
        values = _new_row(row)
        try:
            with self._tx(durable=True) as conn:
                conn.execute(self.t.insert().values(**values))
                self._drop_deleted(conn, [row.key])
                self._mark_history_start(conn, [row.key])
        except IntegrityError:
            return False
        return True

    @_retried
    def insert_many(self, rows: Sequence[Row]) -> None:
        """Bulk insert; raises IntegrityError (nothing stored) if any key exists."""
        payload = [_new_row(r) for r in rows]
        with self._tx(durable=True) as conn:
            conn.execute(self.t.insert(), payload)
            self._drop_deleted(conn, [r.key for r in rows])
            self._mark_history_start(conn, [r.key for r in rows])

    def _mark_history_start(self, conn: Connection, keys: Sequence[str]) -> None:
        """Keys added again: the runs of the schedules they named before are not the new
        schedules' (its creator may be another user, who may not read them).  Where such
        runs exist, the newest history id is recorded (history_from_name): history's
        `after_id` shows a reader what follows it.  One key: its runs and its extra
        runs'; a batch: runs under the keys themselves, one query per 500 keys."""
        h, m = self.h, self.backend.meta
        keys = [k for k in keys if RUN_NOW_MARK not in k]
        if len(keys) == 1:
            found = [keys[0]] if conn.execute(
                sa.select(h.c.id).where(_runs_of(h.c.key, keys[0])).limit(1)).first() \
                else []
        else:
            found = [k for i in range(0, len(keys), 500) for (k,) in conn.execute(
                sa.select(h.c.key).where(h.c.key.in_(keys[i:i + 500])).distinct())]
        if not found:
            return
        newest = str(conn.execute(sa.select(sa.func.max(h.c.id))).scalar())
        names = [history_from_name(k) for k in found]
        for i in range(0, len(names), 500):
            conn.execute(m.delete().where(m.c.name.in_(names[i:i + 500])))
        conn.execute(m.insert(), [{"name": n, "value": newest} for n in names])

    @_retried
    def history_start(self, key: str) -> int | None:
        """The newest history id of the schedules `key` named before it was last added
        (_mark_history_start), or None."""
        m = self.backend.meta
        with self._tx(readonly=True) as conn:
            found = conn.execute(sa.select(m.c.value).where(
                m.c.name == history_from_name(key))).scalar()
        try:
            return None if found is None else int(found)
        except ValueError:
            return None

    def _drop_deleted(self, conn: Connection, keys: Sequence[str]) -> None:
        """A key added again, by whatever way, ends its forced delete's marker (delete)."""
        m = self.backend.meta
        names = [deleted_marker_name(k) for k in keys if RUN_NOW_MARK not in k]
        if len(names) > 1:
            # A batch: the few markers that exist are read in one query, and only theirs
            # deleted, instead of one DELETE per 500 keys that finds none.
            wanted = set(names)
            names = [n for (n,) in conn.execute(sa.select(m.c.name).where(
                m.c.name.startswith(DELETED_META))) if n in wanted]
        for i in range(0, len(names), 500):
            conn.execute(m.delete().where(m.c.name.in_(names[i:i + 500])))

    @_retried
    def delete(self, key: str, marker: Callable[[Row], str | None] | None = None) -> int:
        """Delete a schedule and its extra runs (`run`: KEY@run-..., queued or running:
        a running one loses its lease and is stopped); the rows deleted, 0 if none.
        `marker`: gives, from the row as it is deleted, the value of the meta row that
        records the delete as forced (a schedules file's schedule: deleted_markers), or
        None; written with it, in its transaction.  From the row read here, not before:
        an entry a convergence changed in between would otherwise be marked as it was,
        and come back."""
        t, m = self.t, self.backend.meta
        with self._tx(durable=True) as conn:
            if marker is None:
                row = conn.execute(sa.select(t.c.has_extra).where(t.c.key == key)).first()
            else:
                # Locked (PostgreSQL, MySQL; SQLite's write transaction holds the file):
                # no change commits between this read and the delete.
                row = conn.execute(
                    sa.select(t).where(t.c.key == key).with_for_update()).first()
            if row is None:
                return 0
            value = None if marker is None else marker(self._row(row))
            if value is not None:
                name = deleted_marker_name(key)
                conn.execute(m.delete().where(m.c.name == name))
                conn.execute(m.insert().values(name=name, value=value))
            keys = [key]
            if row.has_extra:
                prefix = f"{key}{RUN_NOW_MARK}"
                # LIKE ignores case on SQLite and MySQL: the exact prefix is checked here.
                keys += [k for (k,) in conn.execute(sa.select(t.c.key).where(
                    t.c.key.startswith(prefix, autoescape=True))) if k.startswith(prefix)]
            deleted = 0
            for i in range(0, len(keys), 500):
                deleted += conn.execute(t.delete().where(t.c.key.in_(keys[i:i + 500]))).rowcount
            return deleted

    @_retried
    def update(self, key: str, values: dict[str, Any], *, take_lease: bool) -> bool:
        """Change a schedule's fields; `take_lease` preempts a current holder."""
        if take_lease:
            values = {**values, "fence": self.t.c.fence + 1, "owner": None, "claimed_at": None}
        with self._tx(durable=True) as conn:
            res = conn.execute(self.t.update().where(self.t.c.key == key).values(**values))
            return res.rowcount > 0

    @_retried
    def deleted_markers(self) -> dict[str, str]:
        """The markers of forced deletes (delete's `marker`): meta row name -> value."""
        m = self.backend.meta
        with self._tx(readonly=True) as conn:
            # LIKE ignores case on SQLite and MySQL: the exact prefix is checked here.
            return {str(name): str(value) for name, value in conn.execute(
                sa.select(m.c.name, m.c.value).where(m.c.name.startswith(DELETED_META)))
                if str(name).startswith(DELETED_META)}

    @_retried
    def drop_deleted_markers(self, names: Sequence[str]) -> None:
        """Forget these markers of forced deletes (their entries may be added again)."""
        m = self.backend.meta
        with self._tx(durable=True) as conn:
            for i in range(0, len(names), 500):
                conn.execute(m.delete().where(m.c.name.in_(list(names[i:i + 500]))))

    # -- pausing: keys, and everything (pause --all) ---------------------------------------

    @_retried
    def set_paused(self, keys: Sequence[str], paused: bool,
                   moved: Mapping[str, tuple[int, dict[str, Any]]] | None = None, *,
                   sources: Mapping[str, str] | None = None) -> set[str]:
        """Pause or resume these schedules as a user does (paused_reason NULL: a schedule
        paused on its own), in one transaction.  `moved`: key -> (next_time read,
        new times) of schedules resumed without catching up, written only where the row
        is still paused, unheld and at that next_time; `sources`: key -> its new source.
        Returns the keys moved."""
        t = self.t
        with self._tx(durable=True) as conn:
            done = self._move(conn, moved or {}, t.c.paused == 1)
            for i in range(0, len(keys), 500):
                conn.execute(t.update().where(t.c.key.in_(list(keys[i:i + 500])))
                             .values(paused=int(paused), paused_reason=None))
            for key, source in (sources or {}).items():
                conn.execute(t.update().where(t.c.key == key).values(source=source))
        return done

    def _move(self, conn: Connection, moved: Mapping[str, tuple[int, dict[str, Any]]],
              still: Any) -> set[str]:
        t = self.t
        done = set()
        for key, (next_time, values) in moved.items():
            res = conn.execute(t.update().where(t.c.key == key, still, t.c.owner.is_(None),
                                                t.c.next_time == next_time).values(**values))
            if res.rowcount:
                done.add(key)
        return done

    @_retried
    def paused_all(self) -> str | None:
        """The meta row that says everything is paused (its text), None if nothing is."""
        m = self.backend.meta
        with self._tx(readonly=True) as conn:
            found = conn.execute(sa.select(m.c.value).where(m.c.name == PAUSED_ALL_META)
                                 ).scalar()
        return None if found is None else str(found)

    @_retried
    def pause_all(self, state: str) -> int:
        """Record that everything is paused (`state`: the meta row's text; an existing one
        is kept) and pause every schedule not paused yet, with PAUSED_ALL_REASON, in one
        transaction.  Returns how many it paused."""
        m, t = self.backend.meta, self.t
        for _ in range(3):
            try:
                with self._tx(durable=True) as conn:
                    paused = conn.execute(t.update().where(t.c.paused == 0).values(
                        paused=1, paused_reason=PAUSED_ALL_REASON)).rowcount
                    if conn.execute(sa.select(m.c.name).where(m.c.name == PAUSED_ALL_META)
                                    ).first() is None:
                        conn.execute(m.insert().values(name=PAUSED_ALL_META, value=state))
                return int(paused)
            except IntegrityError:
                continue  # another host's pause --all recorded it meanwhile: ours is done
        raise RuntimeError("pause --all: the meta row kept changing")  # pragma: no cover

    @_retried
    def join_pause_all(self, keys: Sequence[str]) -> int:
        """Pause these schedules, just added, with PAUSED_ALL_REASON if everything is
        paused (a pause --all recorded while they were being added)."""
        m, t = self.backend.meta, self.t
        everything = sa.select(m.c.name).where(m.c.name == PAUSED_ALL_META).exists()
        with self._tx(durable=True) as conn:
            return int(sum(conn.execute(t.update().where(
                t.c.key.in_(list(keys[i:i + 500])), t.c.paused == 0, everything).values(
                paused=1, paused_reason=PAUSED_ALL_REASON)).rowcount
                for i in range(0, len(keys), 500)))

    @_retried
    def paused_with_all(self) -> list[Row]:
        """The schedules pause --all paused (not those paused on their own)."""
        t = self.t
        with self._tx(readonly=True) as conn:
            return [self._row(r) for r in conn.execute(sa.select(t).where(
                t.c.paused == 1, t.c.paused_reason == PAUSED_ALL_REASON))]

    @_retried
    def resume_all(self, moved: Mapping[str, tuple[int, dict[str, Any]]] | None = None
                   ) -> tuple[int, set[str]]:
        """End the cluster-wide pause: delete its meta row and resume what pause --all
        paused, leaving schedules paused on their own paused, in one transaction.
        `moved`: as set_paused's.  Returns (how many it resumed, the keys moved)."""
        m, t = self.backend.meta, self.t
        marked = sa.and_(t.c.paused == 1, t.c.paused_reason == PAUSED_ALL_REASON)
        with self._tx(durable=True) as conn:
            conn.execute(m.delete().where(m.c.name == PAUSED_ALL_META))
            done = self._move(conn, moved or {}, marked)
            resumed = conn.execute(t.update().where(marked).values(
                paused=0, paused_reason=None)).rowcount
        return int(resumed), done

    @_retried
    def count_paused(self, with_all: bool) -> int:
        """How many schedules pause --all paused (`with_all`), or are paused on their own."""
        t = self.t
        reason = t.c.paused_reason
        which = reason == PAUSED_ALL_REASON if with_all else sa.or_(
            reason.is_(None), reason != PAUSED_ALL_REASON)
        with self._tx(readonly=True) as conn:
            return int(conn.execute(sa.select(sa.func.count()).select_from(t).where(
                t.c.paused == 1, which)).scalar() or 0)

    # -- rows refused: not their file entry's own ------------------------------------------

    @_retried
    def refuse_foreign_exec_rows(self, entry_sources: Mapping[str, str] | None = None
                                 ) -> list[RefusedRow]:
        """Pause, with the reason, every row whose type names a schedules file's exec
        entry (exec:K) and that is not that entry's own (fields.foreign_exec_row;
        `entry_sources`: K -> the file holding entry K on this host, where known).
        Returns the rows it refused now; those refused before stay so, unreported."""
        t = self.t
        q = sa.select(t.c.key, t.c.type, t.c.source, t.c.paused, t.c.paused_reason,
                      t.c.creator).where(_starts_with(t.c.type, EXEC_TYPE))
        with self._tx(readonly=True) as conn:
            rows = conn.execute(q).all()
        origin = {r.key: (r.type, r.source) for r in rows}
        sources = entry_sources or {}
        refused: list[RefusedRow] = []
        for r in rows:
            why = foreign_exec_row(r.key, r.type, origin.get(schedule_key(r.key)),
                                   sources.get(exec_entry_key(r.type) or ""))
            if why is None or (r.paused and (r.paused_reason or "").startswith(
                    REFUSED_ROW_REASON)):
                continue
            refused.append(RefusedRow(r.key, r.type, r.creator, refused_reason(why)))
        if not refused:
            return []
        done = []
        with self._tx(durable=True) as conn:
            for item in refused:
                if conn.execute(t.update().where(t.c.key == item.key, t.c.type == item.type)
                                .values(paused=1, paused_reason=item.reason)).rowcount:
                    done.append(item)
        return done

    @_retried
    def refused_rows(self, limit: int = 100) -> list[RefusedRow]:
        """Up to `limit` rows paused as refused (refuse_foreign_exec_rows, or a worker's
        refusal), by key."""
        t = self.t
        q = (sa.select(t.c.key, t.c.type, t.c.creator, t.c.paused_reason)
             .where(t.c.paused == 1, _starts_with(t.c.paused_reason, REFUSED_ROW_REASON))
             .order_by(t.c.key).limit(limit))
        with self._tx(readonly=True) as conn:
            return [RefusedRow(r.key, r.type, r.creator, r.paused_reason)
                    for r in conn.execute(q)]

    @_retried
    def series_rows(self, route_types: Collection[str], limit: int) -> tuple[list[Row], int]:
        """The schedules with series of their own on /metrics (docs/metrics.md): those
        whose policy says `metrics: true`, and those of `route_types` (their route's
        default) that do not say false.  Up to `limit` of them: files' first, then root's,
        then by key (a member's thousand cannot push root's out), and how many there are
        in all.  Extra runs' rows (KEY@run-...) are their schedule's, not listed."""
        t = self.t
        chosen = t.c.policy.like('%"metrics":true%')
        if route_types:
            chosen = sa.or_(chosen, sa.and_(
                t.c.type.in_(sorted(route_types)),
                sa.or_(t.c.policy.is_(None), sa.not_(t.c.policy.like('%"metrics":false%')))))
        chosen = sa.and_(chosen, sa.not_(t.c.key.contains(RUN_NOW_MARK, autoescape=True)))
        first = sa.case((t.c.source.isnot(None), 0), (t.c.creator == 0, 1), else_=2)
        with self._tx(readonly=True) as conn:
            total = int(conn.execute(sa.select(sa.func.count()).select_from(t)
                                     .where(chosen)).scalar() or 0)
            rows = conn.execute(sa.select(t).where(chosen).order_by(first, t.c.key)
                                .limit(limit)).all() if limit and total else []
        return [self._row(r) for r in rows], total

    @_retried
    def types_present(self, limit: int = 10_000) -> list[str]:
        """The task types schedules have (for routes whose type is a pattern)."""
        t = self.t
        with self._tx(readonly=True) as conn:
            return [r[0] for r in conn.execute(
                sa.select(t.c.type).distinct().order_by(t.c.type).limit(limit))]

    @_retried
    def type_counts(self, task_type: str | None = None) -> dict[str, int]:
        """Schedules by task type (one type's, or every type's), the extra runs of `run
        KEY` left out: one grouped count, in the database, at any size."""
        t = self.t
        query = sa.select(t.c.type, sa.func.count()).where(
            ~t.c.key.contains(RUN_NOW_MARK, autoescape=True)).group_by(t.c.type)
        if task_type is not None:
            query = query.where(t.c.type == task_type)
        with self._tx(readonly=True) as conn:
            return {str(ty): int(n) for ty, n in conn.execute(query)}

    @_retried
    def last_success_and_failure(self, keys: Sequence[str], chunk: int = 100
                                 ) -> dict[str, tuple[float | None, float | None]]:
        """For each schedule key: when its latest successful run and its latest failed
        one (outcomes.FAILURES) ended, its KEY@run-... runs included (None: none kept)."""
        h = self.h
        found: dict[str, list[float | None]] = {k: [None, None] for k in keys}
        wanted = (Outcome.SUCCESS.value, *outcomes.FAILURES)
        with self._tx(readonly=True) as conn:
            for i in range(0, len(keys), chunk):
                part = keys[i:i + chunk]
                q = (sa.select(h.c.key, h.c.outcome, sa.func.max(h.c.finished_at))
                     .where(sa.or_(*(_runs_of(h.c.key, k) for k in part)),
                            h.c.outcome.in_(wanted))
                     .group_by(h.c.key, h.c.outcome))
                for key, outcome, ended in conn.execute(q):
                    times = found.get(schedule_key(key))
                    if times is None or ended is None:
                        continue
                    slot = 0 if outcome == "success" else 1
                    if times[slot] is None or float(ended) > times[slot]:  # type: ignore[operator]
                        times[slot] = float(ended)
        return {k: (v[0], v[1]) for k, v in found.items()}

    # -- reads ----------------------------------------------------------------------------

    @_retried
    def rows_of(self, keys: Sequence[str] = (), sources: Sequence[str] = ()) -> list[Row]:
        """The rows with these keys or from these sources (schedules files), read in
        slices of IN lists."""
        t = self.t
        found: dict[str, Row] = {}
        with self._tx(readonly=True) as conn:
            for column, values in ((t.c.key, list(keys)), (t.c.source, list(sources))):
                for i in range(0, len(values), 500):
                    q = sa.select(t).where(column.in_(values[i:i + 500]))
                    for r in conn.execute(q):
                        found.setdefault(r._mapping["key"], self._row(r))
        return list(found.values())

    @_retried
    def file_sources(self) -> list[str]:
        """The sources of schedules that came from schedules files (file:NAME)."""
        t = self.t
        q = sa.select(t.c.source).where(t.c.source.startswith(SOURCE_FILE)).distinct()
        with self._tx(readonly=True) as conn:
            return [r[0] for r in conn.execute(q)]

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
            q = q.where(_starts_with(self.t.c.key, prefix))
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
        """Smallest next_run_time of an unpaused routed row: one index probe."""
        return self.backend.earliest_due()

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

    def next_due(self, limit: int) -> list[tuple[str, str, int]]:
        """(key, type, run time) of the `limit` unpaused schedules that run next, not
        taken: read in the claim's own index order, so as cheap at a million schedules as
        at ten (a second sort key would sort every unpaused row on each reading)."""
        t = self.t
        with self._tx(readonly=True) as conn:
            rows = conn.execute(sa.select(t.c.key, t.c.type, t.c.next_run_time)
                                .where(t.c.paused == 0, t.c.owner.is_(None))
                                .order_by(t.c.next_run_time).limit(limit)).all()
        return [(str(k), str(ty), int(n)) for k, ty, n in rows]

    def _last_run(self) -> tuple[sa.sql.FromClause, list[Any]]:
        """The schedules table outer-joined to each row's latest history row (its
        outcome, attempt, end and, where the history has one, error text; NULLs when the
        key has none), and those columns: one probe of the (key, id) index per schedule,
        one query for any number of them."""
        t, h = self.t, self.h
        h2 = h.alias("h_latest")
        last_id = (sa.select(sa.func.max(h2.c.id)).where(h2.c.key == t.c.key)
                   .correlate(t).scalar_subquery())
        columns = [h.c.outcome.label("last_outcome"), h.c.attempt.label("last_attempt"),
                   h.c.finished_at.label("last_finished_at")]
        # The history's error text, once a version that records it made the column.
        error = h.c.get("error")  # type: ignore[no-untyped-call]
        columns.append((error if error is not None else sa.null()).label("last_error"))
        return t.outerjoin(h, h.c.id == last_id), columns

    @staticmethod
    def _last_of(m: Any) -> dict[str, Any] | None:
        if m["last_outcome"] is None:
            return None
        return {"outcome": m["last_outcome"], "attempt": m["last_attempt"],
                "finished_at": m["last_finished_at"], "error": m["last_error"]}

    @_retried
    def rows_with_last_run(self, *, prefix: str | None = None, limit: int | None = None,
                           after_key: str | None = None
                           ) -> list[tuple[Row, dict[str, Any] | None]]:
        """rows(), each with its latest run (outcome, attempt, finished_at, error; None:
        no run recorded), in one query."""
        t = self.t
        joined, last = self._last_run()
        q = sa.select(t, *last).select_from(joined).order_by(t.c.key)
        if prefix:
            q = q.where(_starts_with(t.c.key, prefix))
        if after_key is not None:
            q = q.where(t.c.key > after_key)
        if limit is not None:
            q = q.limit(limit)
        with self._tx(readonly=True) as conn:
            return [(self._row(r), self._last_of(r._mapping)) for r in conn.execute(q)]

    @_retried
    def state_summary(self, now: int, problems: int = 1000, overdue: int = 500
                      ) -> dict[str, Any]:
        """What status and /metrics say of the schedules' states (states.py):
        `counts` by state; `problems`: up to `problems` rows retrying or whose latest run
        failed, by key, each with its latest run; `overdue`: up to `overdue` rows due and
        not held, oldest due first (the due index)."""
        t = self.t
        joined, last = self._last_run()
        outcome = last[0]
        retrying = sa.and_(t.c.attempt > 0, sa.or_(outcome.is_(None),
                                                     outcome != Outcome.LATER.value))
        failed = outcome.in_(outcomes.FAILURES)
        unheld = sa.and_(t.c.paused == 0, t.c.owner.is_(None))
        cases = {
            states.PAUSED: t.c.paused != 0,
            states.RUNNING: sa.and_(t.c.paused == 0, t.c.owner.isnot(None)),
            states.RETRYING: sa.and_(unheld, retrying),
            states.FAILED: sa.and_(unheld, sa.not_(retrying), failed),
        }
        sums = [sa.func.sum(sa.case((cond, 1), else_=0)).label(name)
                for name, cond in cases.items()]
        total = sa.func.count().label("total")
        with self._tx(readonly=True) as conn:
            r = conn.execute(sa.select(total, *sums).select_from(joined)).first()
            counts = {name: int(getattr(r, name) or 0) for name in cases}
            counts[states.OK] = int(r.total or 0) - sum(counts.values())
            bad = conn.execute(
                sa.select(t, *last).select_from(joined)
                .where(unheld, sa.or_(retrying, failed)).order_by(t.c.key)
                .limit(problems)).all()
        return {"counts": counts,
                "problems": [(self._row(r), self._last_of(r._mapping)) for r in bad],
                "overdue": self.overdue_rows(now, overdue) if overdue else []}

    @_retried
    def overdue_rows(self, now: int, limit: int = 500) -> list[Row]:
        """Up to `limit` rows due and not held, oldest due first (the due index: cheap at
        any size, unlike state_summary's states)."""
        t = self.t
        with self._tx(readonly=True) as conn:
            late = conn.execute(
                sa.select(t).where(t.c.paused == 0, t.c.owner.is_(None),
                                   t.c.next_run_time <= now)
                .order_by(t.c.next_run_time).limit(limit)).all()
        return [self._row(r) for r in late]

    @_retried
    def keys_matching(self, bad: Callable[[str], bool], limit: int = 100,
                      slice_rows: int = 1000) -> list[str]:
        """Up to `limit` schedule keys for which `bad(key)` is true, the table read in
        key order in slices of `slice_rows` (never all of it in memory).  Small slices:
        the objects of one slice are freed, but the allocator keeps the memory they took
        (slices of 10,000 left the master 2 MiB larger at 100,000 schedules)."""
        t = self.t
        found: list[str] = []
        after = ""
        while len(found) < limit:
            q = (sa.select(t.c.key).where(t.c.key > after).order_by(t.c.key)
                 .limit(slice_rows))
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
        values = {n: m.get(n) for n in ROW_FIELDS}
        for name, convert in _READ_AS.items():
            if values[name] is not None:
                values[name] = convert(values[name])
        return Row(**values)

    # -- holder-side: claim, heartbeat, finish, retry, release ----------------------------

    @_retried
    def claim(self, now: float, lease_seconds: int, owner: str, limit: int = 1) -> list[Claimed]:
        """Lease up to `limit` due rows, oldest first; one winner per row across all hosts."""
        return self.backend.finish_and_claim([], now, lease_seconds, owner, limit)[1]

    @_retried
    def finish_and_claim(self, finished: Sequence[Advance], now: float, lease_seconds: int,
                         owner: str, limit: int) -> tuple[set[str], list[Claimed]]:
        """advance() and claim() in one transaction: the worker's hot path.

        Returns the preempted keys of `finished` and the newly claimed rows.
        """
        finished, pauses = _split_pauses(finished)
        paused_lost = self.pause_exhausted(pauses) if pauses else set()
        lost, claimed = self.backend.finish_and_claim(finished, now, lease_seconds, owner,
                                                      limit)
        return lost | paused_lost, claimed

    def restrict_types(self, exact: Sequence[str], patterns: Sequence[str],
                       routed: Callable[[str], bool]) -> None:
        """Claim, and look for, only occurrences of types this process routes: `exact`
        names or `patterns` (Python regular expressions searched in the type, as routes'
        /re/ are), `routed` being the exact predicate.  Set once, by a worker, before its
        first claim (see Backend.restrict_types)."""
        self.backend.restrict_types(exact, patterns, routed)

    @_retried
    def warm_up(self) -> None:
        """Run the hot path once on nothing, so it is ready before the first burst."""
        self.backend.warm_up()

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
        return lost | self.backend.finish_and_claim(items, 0, 0, "", 0)[0]

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

    @_retried
    def mark_extra(self, key: str) -> bool:
        """`run KEY` is about to add an extra run: from now on, claims of KEY check that
        none of its extra runs is running (and the extra runs check KEY).  No fence
        change: a running occurrence keeps its lease."""
        t = self.t
        with self._tx(durable=True) as conn:
            return conn.execute(t.update().where(t.c.key == key)
                                .values(has_extra=1)).rowcount > 0

    @_retried
    def extra_runs(self, key: str) -> list[Row]:
        """The extra runs (`run KEY`) of `key` that have not ended."""
        t = self.t
        q = sa.select(t).where(_starts_with(t.c.key, f"{key}{RUN_NOW_MARK}"))
        with self._tx(readonly=True) as conn:
            return [self._row(r) for r in conn.execute(q.order_by(t.c.next_run_time))]

    @_retried
    def group_busy(self, key: str, base: str, now: int) -> bool:
        """Whether another member of `base`'s group (the schedule and its extra runs
        `base@run-...`) than `key` holds a live lease.  Read after the caller's own claim
        was committed, so of two members claimed at the same time at least one sees the
        other (and gives its occurrence back)."""
        t = self.t
        members = _runs_of(t.c.key, base)
        q = (sa.select(t.c.key).where(members, t.c.key != key, t.c.owner.isnot(None),
                                      t.c.next_run_time > now).limit(1))
        with self._tx(readonly=True) as conn:
            return conn.execute(q).first() is not None

    def _group_members(self, conn: Connection, base: str, *conds: Any) -> list[str]:
        """The extra-run rows of `base` (base@run-...) matching `conds`.  LIKE ignores case
        on SQLite and MySQL: the exact prefix is checked here."""
        t = self.t
        prefix = f"{base}{RUN_NOW_MARK}"
        return [k for (k,) in conn.execute(sa.select(t.c.key).where(
            t.c.key.startswith(prefix, autoescape=True), *conds)) if k.startswith(prefix)]

    @_retried
    def group_turn(self, key: str, base: str, now: int, *, fence: int | None = None,
                   replace: bool = False) -> str:
        """Whether `key`, a member of `base`'s group (the schedule and its rows
        `base@run-...`: extra runs, and occurrences of an allow or replace schedule),
        may start now: TURN_START (it becomes the group's holder), TURN_WAIT, or
        TURN_LOST (`fence` given: the caller's row no longer holds it).

        Decided under the base row's lock (one transaction), so of members claimed at the
        same time exactly one starts and the others wait: no overlap and no livelock.  A
        member waits while the holder's lease lives, and one of the extra runs waits
        while the base row is held (a base claimed before `run` marked it runs without
        asking).  The base's own occurrence also waits while an extra run is held or due:
        an extra run queued behind a running occurrence goes first.  `replace`: the held
        extra-run rows of the group are deleted first, so that their heartbeats find the
        leases gone and stop their runs (`preempted`)."""
        t = self.t
        with self._tx() as conn:
            row = conn.execute(
                sa.select(t.c.group_holder, t.c.owner, t.c.next_run_time)
                .where(t.c.key == base).with_for_update()).first()
            if fence is not None:
                own = conn.execute(sa.select(t.c.fence).where(t.c.key == key)).scalar()
                if own is None or int(own) != fence:
                    return TURN_LOST
            if row is None:
                return TURN_START  # the schedule is gone (delete took its extra runs)
            holder, base_owner, base_lease = row
            if replace:
                stopped = [k for k in self._group_members(conn, base, t.c.owner.isnot(None))
                           if k != key]
                for i in range(0, len(stopped), 500):
                    conn.execute(t.delete().where(t.c.key.in_(stopped[i:i + 500])))
            if key != base and base_owner is not None and base_lease > now:
                return TURN_WAIT
            if holder is not None and holder != key:
                live = conn.execute(sa.select(t.c.key).where(
                    t.c.key == holder, t.c.owner.isnot(None),
                    t.c.next_run_time > now)).first()
                if live is not None:
                    return TURN_WAIT
            if key == base and self._group_members(conn, base, t.c.paused == 0, sa.or_(
                    sa.and_(t.c.owner.isnot(None), t.c.next_run_time > now),
                    sa.and_(t.c.owner.is_(None), t.c.next_run_time <= now))):
                return TURN_WAIT
            if holder != key:
                conn.execute(t.update().where(t.c.key == base).values(group_holder=key))
            return TURN_START

    @_retried
    def group_holder(self, base: str) -> str | None:
        """The member of `base`'s group that runs now, or ran last (group_turn)."""
        t = self.t
        with self._tx(readonly=True) as conn:
            return conn.execute(sa.select(t.c.group_holder).where(t.c.key == base)).scalar()

    @_retried
    def group_holders(self, bases: Collection[str]) -> dict[str, str | None]:
        """group_holder of each of `bases` that exists, in one query."""
        if not bases:
            return {}
        t = self.t
        with self._tx(readonly=True) as conn:
            return dict(conn.execute(sa.select(t.c.key, t.c.group_holder)
                                     .where(t.c.key.in_(sorted(bases)))).all())

    @_retried
    def split_occurrence(self, advance: Advance, run: Row, due_time: int) -> bool:
        """An occurrence of an allow or replace schedule moves to a row of its own: in
        one transaction, the schedule's row (fenced: `advance` names the claim's fence)
        moves on to its next occurrence, and `run`, a one-off row held by the caller,
        takes the occurrence over with its lease.  False, and nothing written, when the
        lease was lost."""
        t = self.t
        values = {n: getattr(run, n) for n in ROW_FIELDS}
        values.update(paused=int(run.paused), due_time=due_time)
        with self._tx() as conn:
            moved = conn.execute(t.update().where(
                t.c.key == advance.key, t.c.fence == advance.fence).values(
                next_time=advance.next_time, next_run_time=advance.next_run_time, attempt=0,
                owner=None, claimed_at=None, fence=t.c.fence + 1, has_extra=1))
            if moved.rowcount != 1:
                return False
            conn.execute(t.insert().values(**values))
        return True

    @_retried
    def wake(self, key: str, fence: int, now: int) -> bool:
        """Make an unheld row that waits (given back to wait for its group) due at
        `now`; fenced on the fence the caller read, so a row claimed or changed meanwhile
        is left alone.  Whether it was woken."""
        t = self.t
        with self._tx() as conn:
            return conn.execute(t.update().where(
                t.c.key == key, t.c.fence == fence, t.c.owner.is_(None),
                t.c.next_run_time > now).values(next_run_time=now)).rowcount == 1

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
    def reclaim_owner(self, owner: str, now: float, error: str | None = None
                      ) -> list[dict[str, Any]]:
        """A worker died and its runs were killed: record each attempt it held as `lost`
        (`error`: what happened to it) and give the occurrences back to run now; the
        attempt counts.  One transaction.  The history rows written, each with the
        schedule's stored `policy` text and `creator` beside them (not columns: who is
        notified, in whose turn)."""
        t = self.t
        with self._tx() as conn:
            held = conn.execute(sa.select(t.c.key, t.c.type, t.c.next_time, t.c.attempt,
                                          t.c.claimed_at, t.c.fence, t.c.policy,
                                          t.c.creator)
                                .where(t.c.owner == owner)).all()
            if not held:
                return []
            rows = [{"key": r.key, "type": r.type, "scheduled_time": r.next_time,
                     "attempt": r.attempt, "started_at": r.claimed_at or now,
                     "finished_at": now, "outcome": "lost", "worker": owner, "unit": None,
                     # No duration: when the run ended inside the dead worker is unknown.
                     "error": (error or f"worker {owner} died")[:ERROR_MAX]}
                    for r in held]
            conn.execute(self.h.insert(), rows)
            stmt = t.update().where(t.c.key == sa.bindparam("k"),
                                    t.c.fence == sa.bindparam("f")).values(
                next_run_time=int(now), owner=None, claimed_at=None, fence=t.c.fence + 1)
            conn.execute(stmt, [{"k": r.key, "f": r.fence} for r in held])
        return [{**row, "policy": r.policy, "creator": r.creator}
                for row, r in zip(rows, held, strict=True)]

    # -- hosts ----------------------------------------------------------------------------

    @_retried
    def record_host(self, name: str, version: str, pid: int, started_at: float,
                    now: float) -> None:
        """This host uses the database now, running `version` (insert or update)."""
        hs = self.backend.hosts
        values = {"version": version, "schema_version": schemaversion.SCHEMA_VERSION,
                  "pid": pid, "started_at": started_at, "last_seen": now}
        with self._tx() as conn:
            if conn.execute(hs.update().where(hs.c.name == name).values(**values)).rowcount:
                return
        try:
            with self._tx() as conn:
                conn.execute(hs.insert().values(name=name, **values))
        except IntegrityError:  # a twin (same node_name) inserted it meanwhile
            with self._tx() as conn:
                conn.execute(hs.update().where(hs.c.name == name).values(**values))

    @_retried
    def forget_host(self, name: str, pid: int) -> None:
        """A clean stop: the host's row goes, unless another daemon of that name took it."""
        hs = self.backend.hosts
        with self._tx() as conn:
            conn.execute(hs.delete().where(hs.c.name == name, hs.c.pid == pid))

    @_retried
    def hosts(self, forget_before: float | None = None) -> list[dict[str, Any]]:
        """Every host recorded, by name; rows last seen before `forget_before` are
        deleted first (hosts gone for good)."""
        hs = self.backend.hosts
        if forget_before is not None:
            with self._tx() as conn:
                conn.execute(hs.delete().where(hs.c.last_seen < forget_before))
        with self._tx(readonly=True) as conn:
            return [dict(r._mapping) for r in conn.execute(sa.select(hs).order_by(hs.c.name))]

    @_retried
    def nodes_at_work(self, since: float, recent_runs: int = 2000) -> set[str]:
        """Names of the nodes that hold a lease now or recorded a run since `since` (among
        the newest `recent_runs`): hosts of every version, those that record themselves
        in the hosts table and those too old to (0.1.0)."""
        t, h = self.t, self.h
        with self._tx(readonly=True) as conn:
            owners = [r[0] for r in conn.execute(
                sa.select(t.c.owner).where(t.c.owner.isnot(None)).distinct())]
            recent = (sa.select(h.c.worker, h.c.finished_at).order_by(h.c.id.desc())
                      .limit(recent_runs).subquery())
            workers = [r[0] for r in conn.execute(
                sa.select(recent.c.worker).where(recent.c.finished_at >= since).distinct())]
        return {w.rsplit(":", 1)[0] for w in (*owners, *workers) if w}

    # -- API tokens (store/tokens.py) -------------------------------------------------------

    @_retried
    def add_token(self, name: str, role: str, created_by: str, expires_at: float | None,
                  now: float) -> tuple[int, str]:
        """Make an API token: (its id, its secret; shown once, only its hash is kept).
        AlreadyExistsError for a name any token has or had (revoked names too)."""
        try:
            with self._tx(durable=True) as conn:
                return token_sql.add(conn, self.backend.tokens, name, role, created_by,
                                     expires_at, now)
        except IntegrityError:  # another host made one of that name meanwhile
            raise token_sql.exists_error(name, revoked=False) from None

    @_retried
    def tokens(self) -> list[TokenRow]:
        """Every API token, revoked and expired ones too, by name."""
        with self._tx(readonly=True) as conn:
            return token_sql.listed(conn, self.backend.tokens)

    @_retried
    def revoke_token(self, name: str, now: float) -> bool:
        """Revoke the token `name` at `now` (its row stays): True.  NotFoundError for a
        name no token has; InvalidInputError for one revoked already."""
        with self._tx(durable=True) as conn:
            return token_sql.revoke(conn, self.backend.tokens, name, now)

    @_retried
    def token_by_id(self, token_id: int) -> TokenRow | None:
        """The token with this id (the one a secret names: tokens.token_id_of), or None."""
        with self._tx(readonly=True) as conn:
            return token_sql.by_id(conn, self.backend.tokens, token_id)

    # -- run history ----------------------------------------------------------------------

    @_retried
    def record_runs(self, runs: Iterable[dict[str, Any]]) -> None:
        """Append history rows (vocabulary/history.py) in one transaction.  A row may
        leave out the optional columns (HISTORY_OPTIONAL: a skipped occurrence has no
        exit code); the backends' statements bind every column, so they become None.  Keys
        that are not columns (what observers of the runs read) are left out."""
        payload = [r if r.keys() == _HISTORY_KEYS else {k: r.get(k) for k in _HISTORY_ORDER}
                   for r in runs]
        if not payload:
            return
        self.backend.record_runs(payload)

    @_retried
    def history(self, key: str, limit: int, attempt: int | None = None,
                after_id: int | None = None) -> list[dict[str, Any]]:
        """Newest runs of `key`, including its extra runs (`run`: keys KEY@run-...);
        with `attempt`, only the runs that were that attempt of their occurrence; with
        `after_id`, only those recorded after that row (history_start)."""
        h = self.h
        q = (sa.select(h).where(sa.or_(h.c.key == key,
                                       _starts_with(h.c.key, f"{key}{RUN_NOW_MARK}")))
             .order_by(h.c.id.desc()).limit(limit))
        if attempt is not None:
            q = q.where(h.c.attempt == attempt)
        if after_id is not None:
            q = q.where(h.c.id > after_id)
        with self._tx(readonly=True) as conn:
            return [dict(r._mapping) for r in conn.execute(q)]

    @_retried
    def last_outcome(self, key: str, before: float, outcomes: Iterable[str]) -> str | None:
        """The outcome of `key`'s latest run among `outcomes` that ended before `before`
        (Unix seconds), or None (notifications: was the run before this one a failure?).
        For a KEY@run-... key (an extra run, an occurrence on a row of its own), the
        latest run of its schedule: KEY's and those of every KEY@run-... row."""
        h = self.h
        runs = _runs_of(h.c.key, schedule_key(key)) if RUN_NOW_MARK in key else h.c.key == key
        q = (sa.select(h.c.outcome)
             .where(runs, h.c.finished_at < before, h.c.outcome.in_(list(outcomes)))
             .order_by(h.c.id.desc()).limit(1))
        with self._tx(readonly=True) as conn:
            found = conn.execute(q).scalar()
        return None if found is None else str(found)

    @_retried
    def last_outcomes(self, runs: Sequence[tuple[str, float]], outcomes: Iterable[str]
                      ) -> dict[str, str | None]:
        """last_outcome of many keys in one query: for each (key, before), the outcome of
        the key's latest run among `outcomes` that ended before `before`.  The three
        newest such rows of each key are read (the newest is usually the run itself);
        a key with none of them before `before` gets None."""
        keys = sorted({key for key, _ in runs})
        if not keys:
            return {}
        h = self.h
        rank = sa.func.row_number().over(partition_by=h.c.key,
                                         order_by=h.c.id.desc()).label("rank")
        newest = (sa.select(h.c.key, h.c.outcome, h.c.finished_at, rank)
                  .where(h.c.key.in_(keys), h.c.outcome.in_(list(outcomes))).subquery())
        q = (sa.select(newest.c.key, newest.c.outcome, newest.c.finished_at)
             .where(newest.c.rank <= 3).order_by(newest.c.key, newest.c.rank))
        by_key: dict[str, list[tuple[str, float]]] = {}
        with self._tx(readonly=True) as conn:
            for key, outcome, finished in conn.execute(q):
                by_key.setdefault(key, []).append((str(outcome), float(finished)))
        return {key: next((o for o, finished in by_key.get(key, ()) if finished < before),
                          None)
                for key, before in runs}

    @_retried
    def prune_history(self, keep_per_key: int) -> int:
        """Keep only the newest `keep_per_key` runs of each key (bounded history), and of
        each schedule whose runs have keys of their own (KEY@run-...: its extra runs, an
        allow or replace schedule's occurrences, one run per key) the newest
        `keep_per_key` of them all once they alone are more (`history KEY` lists them
        together; at most twice `keep_per_key` are kept until then)."""
        h = self.h
        removed = 0
        # One scan: the keys over the bound, and every KEY@run-... key with its count.
        over = (sa.select(h.c.key, sa.func.count()).group_by(h.c.key)
                .having(sa.or_(sa.func.count() > keep_per_key,
                               h.c.key.contains(RUN_NOW_MARK, autoescape=True))))
        with self._tx(readonly=True) as conn:
            found = [(str(k), int(n)) for k, n in conn.execute(over)]
        marked: dict[str, int] = {}  # schedule -> its KEY@run-... runs, once pruned per key
        for key, n in found:
            if RUN_NOW_MARK in key:
                base = schedule_key(key)
                marked[base] = marked.get(base, 0) + min(n, keep_per_key)
        bounded = [h.c.key == k for k, n in found if n > keep_per_key]
        bounded += [_runs_of(h.c.key, b) for b, n in marked.items() if n > keep_per_key]
        for runs in bounded:
            with self._tx() as conn:
                oldest_kept = conn.execute(
                    sa.select(h.c.id).where(runs).order_by(h.c.id.desc())
                    .limit(1).offset(max(keep_per_key - 1, 0))).scalar()
                if oldest_kept is None:
                    continue
                if keep_per_key == 0:
                    oldest_kept += 1
                removed += conn.execute(
                    h.delete().where(runs, h.c.id < oldest_kept)).rowcount
        return removed


    @_retried
    def prune_old_history(self, before: float, after_id: int, limit: int
                          ) -> tuple[int, int]:
        """Remove history rows that ended before `before` (Unix time), of every key,
        deleted schedules' too, except the newest run of each schedule that exists (its
        state in `list` and `status`).  Reads at most `limit` rows in id order (the order
        they were written in, so oldest first) from after id `after_id`: one bounded
        step.  Returns (rows removed, the id to go on from: the last old row read; it
        stays where it is once the rows read are recent)."""
        h, t = self.h, self.t
        with self._tx(readonly=True) as conn:
            read = conn.execute(sa.select(h.c.id, h.c.key, h.c.finished_at)
                                .where(h.c.id > after_id).order_by(h.c.id)
                                .limit(limit)).all()
        old = []
        for row in read:
            if row.finished_at is None or row.finished_at >= before:
                break  # the rest are as recent, but for a straggler (next time round)
            old.append(row)
        if not old:
            return 0, after_id
        keys = sorted({str(r.key) for r in old})
        kept: set[int] = set()
        with self._tx(readonly=True) as conn:
            for chunk in _chunks(keys, 500):
                live = [str(k) for (k,) in conn.execute(
                    sa.select(t.c.key).where(t.c.key.in_(chunk)))]
                if live:
                    kept.update(int(i) for (i,) in conn.execute(
                        sa.select(sa.func.max(h.c.id)).where(h.c.key.in_(live))
                        .group_by(h.c.key)))
        doomed = [int(r.id) for r in old if int(r.id) not in kept]
        removed = 0
        for chunk in _chunks(doomed, 500):
            with self._tx() as conn:
                removed += conn.execute(h.delete().where(h.c.id.in_(chunk))).rowcount
        return removed, int(old[-1].id)


def _chunks(items: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    for i in range(0, len(items), size):
        yield items[i:i + size]


_HISTORY_ORDER = tuple(HISTORY_COLUMNS)
# A worker's rows carry exactly these keys unless a schedule names its notifier: those
# pass as they are (one set comparison per run on the finish path, no copy).
_HISTORY_KEYS = frozenset(HISTORY_COLUMNS)


def _split_pauses(items: Sequence[Advance]) -> tuple[Sequence[Advance], list[Advance]]:
    """(advances, pauses): the rare exhausted schedules apart from the hot path."""
    pauses = [a for a in items if a.pause_reason is not None]
    if not pauses:
        return items, pauses
    return [a for a in items if a.pause_reason is None], pauses


def _read_as(field: str) -> Callable[[Any], Any] | None:
    """How a value of Row's `field` read from the database becomes the field's type (a
    driver may give 0/1 for a SMALLINT, a Decimal for a BIGINT); None: as it comes."""
    kind = SCHEDULE_FIELDS[field]
    return next((c for c in (bool, int) if kind in (c, c | None)), None)


_READ_AS = {n: c for n in ROW_FIELDS if (c := _read_as(n)) is not None}


def _new_row(row: Row) -> dict[str, Any]:
    """The values that insert a new schedule: the row's, not held by anyone."""
    values = {n: getattr(row, n) for n in ROW_FIELDS}
    values.update(paused=int(row.paused), fence=0, attempt=0, owner=None, claimed_at=None)
    return values
