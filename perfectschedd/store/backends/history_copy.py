"""PostgreSQL under psycopg 3: history rows as one binary COPY.

A worker writes one history row per run, thousands per flush in a burst.  As a JSON text
to INSERT ... SELECT FROM json_to_recordset (the psycopg2 way, backends/postgresql.py),
a row cost about 4.5 us of the worker's CPU, most of it json.dumps turning its floats
into decimal text; psycopg 3's binary COPY writes each row's values in C as they are in
memory: about 0.6 us a row.  The same transaction, the same rows and columns; COPY fires
the table's triggers and defaults (the id) as INSERT does.

Binary COPY takes each column in its exact type (no casts as INSERT has), so it is used
only where the table's columns have the types this version gives them: a table altered
by hand keeps the INSERT.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

from sqlalchemy.engine import Connection

from perfectschedd.vocabulary.history import HISTORY_COLUMNS

# What each column is written as, and the type OIDs the table's column may have for
# that: text columns are TEXT or VARCHAR(n) (both take text's binary form; VARCHAR
# still checks its length), the others exactly these.
_TEXT = ("text", {25, 1043})
_WRITTEN_AS = {
    "key": _TEXT, "type": _TEXT, "scheduled_time": ("int8", {20}),
    "attempt": ("int4", {23}), "started_at": ("float8", {701}),
    "finished_at": ("float8", {701}), "outcome": _TEXT, "worker": _TEXT, "unit": _TEXT,
    "exit_code": ("int4", {23}), "signal": ("int4", {23}), "duration": ("float8", {701}),
    "output": _TEXT, "error": _TEXT,
}


class HistoryCopy:
    """COPY ... FROM STDIN (FORMAT BINARY) of history rows, on a psycopg 3 connection."""

    def __init__(self, table: str) -> None:
        columns = ", ".join(HISTORY_COLUMNS)
        self.sql = f"COPY {table} ({columns}) FROM STDIN (FORMAT BINARY)"
        self._probe = f"SELECT {columns} FROM {table} WHERE false"
        self._types = [_WRITTEN_AS[c][0] for c in HISTORY_COLUMNS]
        self._values = operator.itemgetter(*HISTORY_COLUMNS)
        # Whether the table's columns have the expected types (None: not asked yet).
        self.usable: bool | None = None

    def write(self, conn: Connection, runs: Sequence[dict[str, Any]]) -> bool:
        """Append `runs` in `conn`'s transaction; False (nothing written) when the table's
        types rule COPY out.  Driver errors leave as SQLAlchemy's, through the same
        handling as any statement's (the deadline watchdog's cut, a server that is not
        the primary: the connection is invalidated)."""
        cur = conn.connection.driver_connection.cursor()  # type: ignore[union-attr]
        statement = self._probe
        try:
            if self.usable is None:
                cur.execute(statement)
                found = [d.type_code for d in cur.description or ()]
                self.usable = len(found) == len(HISTORY_COLUMNS) and all(
                    oid in _WRITTEN_AS[c][1]
                    for c, oid in zip(HISTORY_COLUMNS, found, strict=True))
            if not self.usable:
                return False
            statement = self.sql
            values = self._values
            with cur.copy(statement) as copy:
                copy.set_types(self._types)
                for run in runs:
                    copy.write_row(values(run))
        except conn.dialect.loaded_dbapi.Error as exc:  # type: ignore[attr-defined]
            # SQLAlchemy's own path for a failed statement (handle_error listeners,
            # invalidation on disconnect, the DBAPIError raised); private, but the same
            # in every SQLAlchemy 2.x, the only ones with a psycopg 3 dialect.
            conn._handle_dbapi_exception(exc, statement, None, cur, None)  # type: ignore[attr-defined]
            raise  # not reached: it raises
        finally:
            cur.close()
        return True
