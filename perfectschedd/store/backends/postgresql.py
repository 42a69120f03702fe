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
from collections.abc import Sequence
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
from perfectschedd.vocabulary.history import HISTORY_COLUMNS

# A transaction the server rolled back to break a deadlock or a serialization conflict:
# running it again is the documented remedy.  A worker's heartbeat and its finish touch
# the same rows from two connections.
_TRY_AGAIN_STATES = frozenset({"40P01", "40001"})


class PostgreSQLBackend(ServerBackend):
    name = "postgresql"
    partial_index_dialect = "postgresql"
    regexp_operator = "~"

    def __init__(self, url: Any, table: str, deadline: float = 10.0) -> None:
        super().__init__(url, table, deadline)
        # The driver's own SQL ("%" escaped for its paramstyle).
        quote = self.engine.dialect.identifier_preparer
        t = self.sql.table
        # A batch of finishes is one statement (a JSON text of the rows), not one per row
        # as on SQLite and MySQL: a round trip per row to a server is what a batch saves.
        moved = self.sql.advance_set(lambda name, _type: f"adv.{name}")
        self._advance_sql = (
            f"UPDATE {t} AS t SET {moved}"
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

    def param(self, name: str, sql_type: str | None) -> str:
        """psycopg's pyformat, cast to the SQL type the statement gives (as the claim's
        text always said: the server takes each parameter as that type)."""
        return f"%({name})s::{sql_type}" if sql_type else f"%({name})s"

    def build_claim(self, routed: str) -> None:
        """One UPDATE ... RETURNING that leases the rows its sub-select picked; SKIP
        LOCKED: rows another host is leasing are passed over, not waited for."""
        sql = self.sql
        self._claim_sql = (
            f"UPDATE {sql.table} SET {sql.claim_set()} WHERE {sql.key} IN"
            f" ({sql.due(sql.key, routed)} FOR UPDATE SKIP LOCKED) RETURNING {sql.returned}")

    def claim_in(self, conn: Connection, params: dict[str, Any]) -> list[Claimed]:
        return in_cron_order(self.execute(conn, self._claim_sql,
                                          {**self.routed_params, **params}))

    def advance_in(self, conn: Connection, items: Sequence[Advance]) -> set[str]:
        """One statement for all advances, one for all one-offs, whatever the batch size."""
        done: set[str] = set()
        # In key order: one lock order with heartbeats (no deadlock between them).
        moves = sorted(({"k": a.key, "f": a.fence, "nt": a.next_time, "nrt": a.next_run_time}
                        for a in items if a.next_time is not None), key=operator.itemgetter("k"))
        if moves:
            done.update(r[0] for r in self.execute(
                conn, self._advance_sql, {"rows": json.dumps(moves)}))
        oneoffs = [{"k": a.key, "f": a.fence} for a in items if a.next_time is None]
        if oneoffs:
            done.update(r[0] for r in self.execute(
                conn, self._delete_sql, {"rows": json.dumps(oneoffs)}))
        return {a.key for a in items} - done

    def record_runs(self, runs: list[dict[str, Any]]) -> None:
        with self.transaction() as conn:
            if self._history_copy is not None and self._history_copy.write(conn, runs):
                return
            conn.exec_driver_sql(self._history_sql, {"rows": json.dumps(runs)})
