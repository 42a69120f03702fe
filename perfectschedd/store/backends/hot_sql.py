"""The worker's hot path in SQL text, written once for the three databases: they agree on
what a claim writes, which rows are due, what a finish writes and the "next due" probe.
What must differ stays in each backend, which says why there: how the due rows are
leased (UPDATE ... RETURNING over a sub-select on SQLite and PostgreSQL, a locking read
then an UPDATE on MySQL, which has no RETURNING), the lock taken (SKIP LOCKED on the
servers; SQLite's writer holds the file), how a batch of finishes travels, and how a
driver writes a parameter (`param`).

Text, not SQLAlchemy Core: each backend runs these on the driver's own cursor (the
backends' docstrings say what SQLAlchemy's statement path cost there).
"""

from __future__ import annotations

from collections.abc import Callable

import sqlalchemy as sa
from sqlalchemy.sql.compiler import IdentifierPreparer

from perfectschedd.vocabulary.fields import CLAIMED_FIELDS

# How a driver writes the parameter `name` of SQL type `sql_type` (None: as the database
# infers it): SQLite ":name", PyMySQL "%(name)s", psycopg "%(name)s::type".
Param = Callable[[str, str | None], str]


class HotPathSQL:
    """The shared text of the claim, the finish and the "next due" probe on one table."""

    def __init__(self, quote: IdentifierPreparer, table: sa.Table, param: Param,
                 pyformat: bool) -> None:
        """`pyformat`: the driver reads "%" as a parameter's start (psycopg, PyMySQL), so
        one in a table's name is doubled."""
        name = quote.format_table(table)
        self.table = name.replace("%", "%%") if pyformat else name
        self.key = quote.quote("key")
        self.param = param
        # Claimed's fields, in its order: the rows a claim returns become Claimed(*row).
        self.returned = ", ".join(quote.quote(c) for c in CLAIMED_FIELDS)

    def claim_set(self) -> str:
        """What a claim writes: the lease (next_run_time is its end while held), a new
        fence, the attempt, who holds it and since when, and due_time, the next_run_time
        the row had.  due_time comes first: MySQL assigns SET values left to right, each
        seeing those before it, so after next_run_time it would read the lease's end;
        SQLite and PostgreSQL read the row as it was, in any order."""
        p = self.param
        return (f"due_time = next_run_time, next_run_time = {p('lease_until', 'bigint')},"
                f" fence = fence + 1, attempt = attempt + 1, owner = {p('holder', 'varchar')},"
                f" claimed_at = {p('claim_ts', 'double precision')}")

    def due(self, columns: str, routed: str) -> str:
        """The `columns` of up to `batch` due rows of the routed types, oldest due first:
        the walk of the due index (schema.py) every claim makes."""
        p = self.param
        return (f"SELECT {columns} FROM {self.table} WHERE paused = 0"
                f" AND next_run_time <= {p('due_by', 'bigint')} AND {routed}"
                f" ORDER BY next_run_time LIMIT {p('batch', 'integer')}")

    def earliest(self, routed: str) -> str:
        """The smallest next_run_time of an unpaused routed row: one index probe."""
        return (f"SELECT next_run_time FROM {self.table} WHERE paused = 0 AND {routed}"
                " ORDER BY next_run_time LIMIT 1")

    def advance_set(self, value: Param | None = None) -> str:
        """What a finish writes to a schedule that goes on: its next occurrence (`nt`,
        `nrt`), unheld, a new fence.  `value`: where the new times come from (by default
        parameters of those names)."""
        v = value or self.param
        return (f"next_time = {v('nt', 'bigint')}, next_run_time = {v('nrt', 'bigint')},"
                " attempt = 0, owner = NULL, claimed_at = NULL, fence = fence + 1")

    def fenced(self) -> str:
        """Every holder-side write names the fence it was given (`k`, `f`): a row that
        moved on (lease lost, modified, deleted) matches nothing, and rowcount says so."""
        p = self.param
        return f"{self.key} = {p('k', None)} AND fence = {p('f', None)}"

    def advance_one(self) -> str:
        """One finished row moved on to its next occurrence, fenced."""
        return f"UPDATE {self.table} SET {self.advance_set()} WHERE {self.fenced()}"

    def delete_one(self) -> str:
        """One finished one-off row deleted, fenced."""
        return f"DELETE FROM {self.table} WHERE {self.fenced()}"
