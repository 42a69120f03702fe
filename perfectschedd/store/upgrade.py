"""Opening a database: bring it to this version's schema (create what is missing, add
the columns a newer version introduced, record the version), or say why this version
can never use it.  The version record and its rules are version.py's; the tables are
schema.py's."""

from __future__ import annotations

import logging

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError, OperationalError

from perfectschedd.errors import SchemaError, first_line
from perfectschedd.store import version
from perfectschedd.store.base import retried
from perfectschedd.store.refused import RefusedRows

log = logging.getLogger("perfectschedd")


class SchemaUpgrade(RefusedRows):
    """Opening: the schema brought up to date (init), or refused (refusal).  A
    RefusedRows: an upgrade from an older release pauses the rows it refuses."""

    @retried  # idempotent: a connection lost on the way (a deadline under load) retries
    def init(self) -> bool:
        """Bring the database to this version's schema (version.py): create what is
        missing, add the columns a newer version introduced to tables an older one made,
        and record the version; idempotent and safe to race.  SchemaError, before
        anything is written, when the database is newer than this version may use or not
        one it can use.  True if this call created the schedules table."""
        found = version.read(self.engine, self.backend.meta, self.t)
        version.refuse_unusable(found)
        self._refuse_missing_required()
        self._create_missing_tables()
        self._add_missing_columns()
        if 0 < found.version < version.SCHEMA_VERSION:
            # Rows an older release let any client write (0.1.0 stored any exec:KEY type):
            # paused before a worker can claim one (SPEC "Privilege model").
            for refused in self.refuse_foreign_exec_rows():
                log.warning("upgrade: %s", refused.line())
        version.record(self.engine, self.backend.meta, found)
        if found.version < version.SCHEMA_VERSION:
            self.backend.sync()
        self._initialized = True
        self.created_table = self.created_table or found.version == 0
        return found.version == 0

    def refusal(self) -> str | None:
        """Why this version can never use the database (init would raise SchemaError),
        read without writing anything; None when it can, or has nothing to refuse yet."""
        try:
            version.refuse_unusable(
                version.read(self.engine, self.backend.meta, self.t))
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
