"""MySQL and MariaDB: many hosts on one server.

No UPDATE ... RETURNING: the claim reads the due rows and leases them in one transaction
that holds them (SELECT ... FOR UPDATE SKIP LOCKED, READ COMMITTED), and a finish first
reads (and locks) which rows still carry the caller's fence.  Batches go to the driver as
executemany of SQL compiled once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError

from perfectschedd.store.backends.base import DriverStatement, ServerBackend
from perfectschedd.store.deadline import CONNECT_TIMEOUT
from perfectschedd.store.schema import Advance, Claimed

# Deadlock found / lock wait timeout: the transaction was rolled back, run it again.
_TRY_AGAIN_ERRORS = frozenset({1213, 1205})
# The server runs read-only (--read-only, a replica; MariaDB's and MySQL's codes): not the
# primary, the connection is left for one to the primary.
_NOT_PRIMARY_ERRORS = frozenset({1290, 1836})


class MySQLBackend(ServerBackend):
    name = "mysql"

    def __init__(self, url: Any, table: str, deadline: float = 10.0) -> None:
        super().__init__(url, table, deadline)
        t = self.t
        self._fences_stmt = (sa.select(t.c.key, t.c.fence)
                             .where(t.c.key.in_(sa.bindparam("keys", expanding=True)))
                             .with_for_update())
        self._advance_many = DriverStatement(self.advance_stmt, self.engine.dialect)
        self._delete_many = DriverStatement(self.delete_fenced_stmt, self.engine.dialect)

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

    def build_claim(self, routed: Any) -> None:
        t = self.t
        batch = sa.bindparam("batch", type_=sa.Integer)
        # MySQL assigns SET values left to right, so due_time comes from the read.
        self._claim_select = (
            sa.select(t.c.key, t.c.type, t.c.cron, t.c.delay, t.c.timezone, t.c.data,
                      t.c.next_time, t.c.fence, t.c.attempt, t.c.next_run_time,
                      t.c.has_extra, t.c.policy, t.c.creator)
            .where(t.c.paused == 0, t.c.next_run_time <= sa.bindparam("due_by"), routed)
            .order_by(t.c.next_run_time).limit(batch).with_for_update(skip_locked=True))
        self._claim_update = (
            t.update().where(t.c.key.in_(sa.bindparam("keys", expanding=True)))
            .values(next_run_time=sa.bindparam("lease_until"), fence=t.c.fence + 1,
                    attempt=t.c.attempt + 1, owner=sa.bindparam("holder"),
                    claimed_at=sa.bindparam("claim_ts")))

    def claim_in(self, conn: Connection, params: dict[str, Any]) -> list[Claimed]:
        found = conn.execute(self._claim_select, params).all()
        if not found:
            return []
        conn.execute(self._claim_update, {**params, "keys": [r[0] for r in found]})
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
            self._advance_many.executemany(conn, moves)
        if oneoffs:
            self._delete_many.executemany(conn, oneoffs)
        return set(fences) - held

    def warm_up(self) -> None:
        super().warm_up()
        with self.transaction() as conn:
            conn.execute(self._fences_stmt, {"keys": [""]}).all()
