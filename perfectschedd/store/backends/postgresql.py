"""PostgreSQL: many hosts on one server.

The claim is one UPDATE ... RETURNING over a SKIP LOCKED sub-select.  A batch of finishes
travels as one JSON text to a fixed statement: json.dumps is C, where psycopg dumps array
items one by one in Python, and nothing is compiled per call (a VALUES list built per
batch cost half a worker's time in SQL compilation).  History rows go the same way under
psycopg2; under psycopg 3 they are a binary COPY (history_copy.py).
"""

from __future__ import annotations

import json
import operator
from collections.abc import Callable, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError

from perfectschedd.store.backends.base import ServerBackend, in_cron_order
from perfectschedd.store.backends.history_copy import HistoryCopy
from perfectschedd.store.deadline import (
    CONNECT_TIMEOUT,
    PG_NOT_PRIMARY,
    StatementWatch,
    pg_sqlstate,
)
from perfectschedd.store.schema import Advance, Claimed
from perfectschedd.vocabulary.fields import CLAIMED_FIELDS
from perfectschedd.vocabulary.history import HISTORY_COLUMNS

# A transaction the server rolled back to break a deadlock or a serialization conflict:
# running it again is the documented remedy.  A worker's heartbeat and its finish touch
# the same rows from two connections.
_TRY_AGAIN_STATES = frozenset({"40P01", "40001"})


class PostgreSQLBackend(ServerBackend):
    name = "postgresql"
    partial_index_dialect = "postgresql"

    def __init__(self, url: Any, table: str, deadline: float = 10.0) -> None:
        super().__init__(url, table, deadline)
        dialect = self.engine.dialect
        self._driver_error = (getattr(dialect, "loaded_dbapi", None) or dialect.dbapi).Error
        # The driver's own SQL ("%" escaped for its paramstyle).
        quote = self.engine.dialect.identifier_preparer
        t = quote.format_table(self.t).replace("%", "%%")
        self._advance_sql = (
            f"UPDATE {t} AS t SET next_time = adv.nt, next_run_time = adv.nrt,"
            " attempt = 0, owner = NULL, claimed_at = NULL, fence = t.fence + 1"
            " FROM json_to_recordset(%(rows)s::json) AS adv(k text, f bigint, nt bigint,"
            " nrt bigint) WHERE t.key = adv.k AND t.fence = adv.f RETURNING t.key")
        self._delete_sql = (
            f"DELETE FROM {t} AS t USING json_to_recordset(%(rows)s::json)"
            " AS d(k text, f bigint) WHERE t.key = d.k AND t.fence = d.f RETURNING t.key")
        history = quote.format_table(self.h).replace("%", "%%")
        columns = ", ".join(HISTORY_COLUMNS)
        typed = ", ".join(f"{c} {pg_type}" for c, pg_type in zip(
            HISTORY_COLUMNS, ("text", "text", "bigint", "integer", "double precision",
                              "double precision", "text", "text", "text", "integer", "integer",
                              "double precision", "text", "text"), strict=True))
        self._history_sql = (f"INSERT INTO {history} ({columns}) SELECT {columns}"
                             f" FROM json_to_recordset(%(rows)s::json) AS r({typed})")
        self._history_copy = (HistoryCopy(quote.format_table(self.h))
                              if self.engine.dialect.driver == "psycopg" else None)

    def create_engine(self) -> Engine:
        # No pre-ping: it costs a round trip per transaction; a dead connection is caught
        # by the store's retry instead (the pool is invalidated and the operation re-run).
        # A server that stops answering must surface as an error (and a retry), never as
        # a worker blocked for good: connects bounded per host of the URL (libpq's
        # connect_timeout), keepalives and tcp_user_timeout for a peer that is gone (they
        # do not fire on a frozen server, whose kernel still acknowledges), and the
        # statement watchdog for that one (deadline.py).  libpq parameters; keepalives
        # are ignored on Unix sockets.
        self.watch = StatementWatch(self.deadline, self.socket_of)
        return sa.create_engine(
            self.url, pool_size=4, max_overflow=16, pool_recycle=3600,
            connect_args={"connect_timeout": CONNECT_TIMEOUT, "keepalives": 1,
                          "keepalives_idle": 30, "keepalives_interval": 10,
                          "keepalives_count": 3,
                          "tcp_user_timeout": int(self.deadline * 3000)})

    def not_primary(self, orig: BaseException | None) -> bool:
        return pg_sqlstate(orig) in PG_NOT_PRIMARY

    def _listen(self) -> None:
        super()._listen()
        self._prefer_last_primary()

    def _prefer_last_primary(self) -> None:
        """A multi-host URL's hosts are tried from the one that was primary last.  libpq
        tries them in the URL's order, each for up to connect_timeout: with a frozen host
        listed before the new primary, every new connection (each thread's, each pool
        slot's) paid that wait again for as long as the host stayed frozen.  The order
        rotates (every host is still tried), and only a connection that libpq accepted
        (read-write, with target_session_attrs=read-write) moves the start."""
        last: list[tuple[str, str]] = []

        def connecting(dialect: Any, record: Any, cargs: Any, cparams: dict[str, Any]
                       ) -> None:
            hosts, ports = cparams.get("host"), cparams.get("port")
            if not last or not isinstance(hosts, str) or "," not in hosts:
                return
            hs = hosts.split(",")
            ps = str(ports).split(",") if ports not in (None, "") else [""] * len(hs)
            if len(ps) == 1:
                ps = ps * len(hs)
            if len(ps) != len(hs) or last[0] not in zip(hs, ps, strict=True):
                return
            i = list(zip(hs, ps, strict=True)).index(last[0])
            cparams["host"] = ",".join(hs[i:] + hs[:i])
            cparams["port"] = ",".join(ps[i:] + ps[:i])

        def connected(dbapi_conn: Any, record: Any) -> None:
            info = getattr(dbapi_conn, "info", None)  # psycopg 3, psycopg2 >= 2.8
            host, port = getattr(info, "host", None), getattr(info, "port", None)
            if host is not None:
                last[:] = [(str(host), str(port or ""))]

        event.listen(self.engine, "do_connect", connecting)
        event.listen(self.engine, "connect", connected)

    def should_try_again(self, exc: DBAPIError) -> bool:
        orig = exc.orig
        state = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
        return state in _TRY_AGAIN_STATES

    # -- the hot path, on the driver's cursor --------------------------------------------

    def restrict_types(self, exact: Sequence[str], patterns: Sequence[str],
                       routed: Callable[[str], bool] | None) -> None:
        """The claim and the "next due" probe in PostgreSQL's SQL, types as parameters:
        exact names an IN list, patterns `~` (as SQLAlchemy's regexp_match writes it)."""
        if routed is None:
            self.build_claim("true", {})
            return
        quote = self.engine.dialect.identifier_preparer
        column = quote.quote("type")
        conds = []
        params: dict[str, Any] = {}
        if exact:
            params.update({f"route_{i}": name for i, name in enumerate(exact)})
            conds.append(f"{column} IN ({', '.join(f'%(route_{i})s' for i in range(len(exact)))})")
        for i, pattern in enumerate(patterns):
            params[f"pattern_{i}"] = pattern
            conds.append(f"{column} ~ %(pattern_{i})s")
        self.build_claim(f"({' OR '.join(conds)})" if conds else "false", params)

    def build_claim(self, routed: Any, params: dict[str, Any] | None = None) -> None:
        quote = self.engine.dialect.identifier_preparer
        t = quote.format_table(self.t).replace("%", "%%")
        key = quote.quote("key")
        returned = ", ".join(quote.quote(c) for c in CLAIMED_FIELDS)
        self._routed_params = params or {}
        # due_time = next_run_time: SET reads the row as it was before the UPDATE.
        self._claim_sql = (
            f"UPDATE {t} SET next_run_time = %(lease_until)s::bigint, fence = fence + 1,"
            " attempt = attempt + 1, owner = %(holder)s::varchar,"
            " claimed_at = %(claim_ts)s::double precision, due_time = next_run_time"
            f" WHERE {key} IN (SELECT {key} FROM {t} WHERE paused = 0"
            f" AND next_run_time <= %(due_by)s::bigint AND {routed}"
            " ORDER BY next_run_time LIMIT %(batch)s::integer FOR UPDATE SKIP LOCKED)"
            f" RETURNING {returned}")
        self._earliest_sql = (f"SELECT next_run_time FROM {t} WHERE paused = 0 AND {routed}"
                              " ORDER BY next_run_time LIMIT 1")

    def _execute(self, conn: Connection, sql: str, params: dict[str, Any]
                 ) -> list[tuple[Any, ...]]:
        """One statement of the hot path on the driver's cursor, in `conn`'s transaction;
        its rows (each of these statements returns rows: no look at `description`, which
        psycopg 3 builds anew, a Column per column, at each look).  Through SQLAlchemy
        (compiled-cache look-up, execution context, a Row and a fetchone() per row) the
        claim of a batch cost more client CPU than the driver's round trip.  The
        transaction, the pool and the deadline watchdog are still SQLAlchemy's; a driver
        error goes through SQLAlchemy's own handling of a failed statement (the
        handle_error listeners: deadline, not the primary; invalidation on disconnect) and
        leaves as its DBAPIError, as before."""
        cur = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
        try:
            cur.execute(sql, params)
            return cur.fetchall()
        except self._driver_error as exc:
            # Private, but the same in SQLAlchemy 1.4 and 2.x; it raises.
            conn._handle_dbapi_exception(exc, sql, params, cur, None)  # type: ignore[attr-defined]
            raise
        finally:
            cur.close()

    def earliest_due(self) -> int | None:
        with self.transaction(readonly=True) as conn:
            rows = self._execute(conn, self._earliest_sql, self._routed_params)
        return None if not rows else int(rows[0][0])

    def claim_in(self, conn: Connection, params: dict[str, Any]) -> list[Claimed]:
        return in_cron_order(self._execute(conn, self._claim_sql,
                                           {**self._routed_params, **params}))

    def advance_in(self, conn: Connection, items: Sequence[Advance]) -> set[str]:
        """One statement for all advances, one for all one-offs, whatever the batch size."""
        done: set[str] = set()
        # In key order: one lock order with heartbeats (no deadlock between them).
        moves = sorted(({"k": a.key, "f": a.fence, "nt": a.next_time, "nrt": a.next_run_time}
                        for a in items if a.next_time is not None), key=operator.itemgetter("k"))
        if moves:
            done.update(r[0] for r in self._execute(
                conn, self._advance_sql, {"rows": json.dumps(moves)}))
        oneoffs = [{"k": a.key, "f": a.fence} for a in items if a.next_time is None]
        if oneoffs:
            done.update(r[0] for r in self._execute(
                conn, self._delete_sql, {"rows": json.dumps(oneoffs)}))
        return {a.key for a in items} - done

    def record_runs(self, runs: list[dict[str, Any]]) -> None:
        with self.transaction() as conn:
            if self._history_copy is not None and self._history_copy.write(conn, runs):
                return
            conn.exec_driver_sql(self._history_sql, {"rows": json.dumps(runs)})
