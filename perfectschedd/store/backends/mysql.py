"""MySQL and MariaDB: many hosts on one server.

No UPDATE ... RETURNING: the claim reads the due rows and leases them in one transaction
that holds them (SELECT ... FOR UPDATE SKIP LOCKED, READ COMMITTED), and a finish first
reads (and locks) which rows still carry the caller's fence.  The statements' text is
hot_sql.py's; batches of finishes go to the driver as executemany.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError

from perfectschedd.store.backends.base import ServerBackend
from perfectschedd.store.deadline import CONNECT_TIMEOUT
from perfectschedd.store.schema import Advance, Claimed
from perfectschedd.vocabulary.fields import CLAIMED_FIELDS

# Deadlock found / lock wait timeout: the transaction was rolled back, run it again.
_TRY_AGAIN_ERRORS = frozenset({1213, 1205})
# The server runs read-only (--read-only, a replica; MariaDB's and MySQL's codes): not the
# primary, the connection is left for one to the primary.
_NOT_PRIMARY_ERRORS = frozenset({1290, 1836})
# What the claim reads of each due row, in Claimed's order: due_time is the next_run_time
# read (the UPDATE writes the same; the read is the row as it was).
_CLAIM_READ = tuple("next_run_time" if c == "due_time" else c for c in CLAIMED_FIELDS)


class MySQLBackend(ServerBackend):
    name = "mysql"

    def __init__(self, url: Any, table: str, deadline: float = 10.0) -> None:
        super().__init__(url, table, deadline)
        t = self.t
        self._fences_stmt = (sa.select(t.c.key, t.c.fence)
                             .where(t.c.key.in_(sa.bindparam("keys", expanding=True)))
                             .with_for_update())
        self._advance_one = self.sql.advance_one()
        self._delete_one = self.sql.delete_one()

    def create_engine(self) -> Engine:
        # No pre-ping (see postgresql.py).  PyMySQL's own socket timeouts are the
        # statement deadline (store/deadline.py): every read and write of the socket is
        # bounded, so a frozen server surfaces as "lost connection" (a disconnect: the
        # connection is abandoned) instead of a worker blocked for good.
        seconds = max(1, math.ceil(self.deadline))
        return sa.create_engine(
            self.url, pool_size=4, max_overflow=16, pool_recycle=3600,
            isolation_level="READ COMMITTED",
            connect_args={"connect_timeout": CONNECT_TIMEOUT, "read_timeout": seconds,
                          "write_timeout": seconds})

    def not_primary(self, orig: BaseException | None) -> bool:
        args = getattr(orig, "args", ())
        return bool(args) and isinstance(args[0], int) and args[0] in _NOT_PRIMARY_ERRORS

    def timed_out(self, orig: BaseException | None) -> bool:
        # PyMySQL turns a socket timeout into "lost connection" (2013: a read) or "gone
        # away" (2006: a write), raised while handling the TimeoutError.
        args = getattr(orig, "args", ())
        return bool(args) and args[0] in (2013, 2006) and \
            isinstance(getattr(orig, "__context__", None), TimeoutError)

    def data_type(self) -> sa.types.TypeEngine[Any]:
        """MySQL's TEXT stops at 65535 bytes.  Imported here: every dialect module loaded
        costs each process about a megabyte."""
        from sqlalchemy.dialects.mysql import MEDIUMTEXT

        return MEDIUMTEXT()

    def should_try_again(self, exc: DBAPIError) -> bool:
        args = getattr(exc.orig, "args", ())
        return bool(args) and isinstance(args[0], int) and args[0] in _TRY_AGAIN_ERRORS

    def build_claim(self, routed: str) -> None:
        """A locking read of the due rows (SKIP LOCKED: rows another host is leasing are
        passed over), then one UPDATE of the keys it read: no RETURNING on MySQL."""
        sql = self.sql
        quote = self.engine.dialect.identifier_preparer
        self._claim_select = (sql.due(", ".join(quote.quote(c) for c in _CLAIM_READ), routed)
                              + " FOR UPDATE SKIP LOCKED")
        # PyMySQL writes a tuple parameter as a parenthesised list of values.
        self._claim_update = (f"UPDATE {sql.table} SET {sql.claim_set()}"
                              f" WHERE {sql.key} IN %(keys)s")

    def claim_in(self, conn: Connection, params: dict[str, Any]) -> list[Claimed]:
        found = self.execute(conn, self._claim_select, {**self.routed_params, **params})
        if not found:
            return []
        self.execute(conn, self._claim_update,
                     {**params, "keys": tuple(r[0] for r in found)})
        # Already in cron order (the read's ORDER BY); the values as they are after it.
        return [Claimed(*r[:7], fence=r[7] + 1, attempt=r[8] + 1, due_time=r[9],
                        has_extra=r[10], policy=r[11], creator=r[12]) for r in found]

    def advance_in(self, conn: Connection, items: Sequence[Advance]) -> set[str]:
        """Which rows still carry the caller's fence, read (and locked) inside the
        transaction; the writes then match exactly those."""
        fences = {a.key: a.fence for a in items}
        held = {k for k, f in conn.execute(self._fences_stmt, {"keys": list(fences)})
                if fences.get(k) == f}
        moves = [{"k": a.key, "f": a.fence, "nt": a.next_time, "nrt": a.next_run_time}
                 for a in items if a.key in held and a.next_time is not None]
        oneoffs = [{"k": a.key, "f": a.fence} for a in items
                   if a.key in held and a.next_time is None]
        if moves:
            conn.exec_driver_sql(self._advance_one, moves)
        if oneoffs:
            conn.exec_driver_sql(self._delete_one, oneoffs)
        return set(fences) - held

    def warm_up(self) -> None:
        super().warm_up()
        with self.transaction() as conn:
            conn.execute(self._fences_stmt, {"keys": [""]}).all()
