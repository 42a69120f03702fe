"""Which schema a database holds, and bringing an older one up to date.

The database records its schema version in `<table>_meta` (name/value rows):
- `schema_version`: the newest schema any host has brought it to;
- `compatible_from`: the oldest schema whose code may still use it.  Every change so far
  is expand-only (new tables, new nullable columns: nothing an older version reads or
  writes is dropped, renamed or made NOT NULL), so a host of an older release keeps
  working beside a newer one during a rolling upgrade, and may even restart on the
  database a newer host has updated.  A future change that breaks older code raises it;
- `written_by`: the release that last raised `schema_version`.
0.1.0 made no such table: a database with the schedules table and no meta table is
schema 1.

Why a version record of our own, not Alembic: the table names are the user's (`table`
in the config, several installations may share one database), every change so far is
"add a table or a nullable column", which SQLAlchemy's create_all and one ALTER TABLE
express on the three databases and both SQLAlchemy lines we support (1.4 on Debian 12, 2.x),
and the package then needs no migration tool, no script directory and no second version
table.  A change that needs more (a data migration, a type change) will be a step of its
own here, run once by the host that raises the version.

Several hosts may start at once on one database: every step is idempotent and each
tolerates a concurrent twin (the table or column created meanwhile; the version row
inserted meanwhile), and the version only ever moves up (a conditional UPDATE).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError

from perfectschedd import __version__
from perfectschedd.errors import SchemaError

log = logging.getLogger("perfectschedd")

# 2: the meta and hosts tables, schedules' creator.  3: what each run did (history's
# exit_code, signal, duration, output, error): nullable columns, so COMPATIBLE_FROM stays.
# 4: the API tokens table, which older hosts never read: COMPATIBLE_FROM stays.
SCHEMA_VERSION = 4
COMPATIBLE_FROM = 1
# The first release of each schema version, for messages.
RELEASES = {1: "0.1.0", 2: "0.2.0", 3: "0.2.0", 4: "0.3.0"}


@dataclass(frozen=True)
class Recorded:
    """What a database says of its schema before this version touches it."""

    version: int  # 0: no schedules table yet (a new database)
    compatible_from: int
    written_by: str | None

    def release(self) -> str:
        return self.written_by or RELEASES.get(self.version, "unknown")


def read(engine: Engine, meta: sa.Table, schedules: sa.Table) -> Recorded:
    """The recorded schema of the database; writes nothing."""
    inspector = sa.inspect(engine)
    if not inspector.has_table(meta.name):
        return Recorded(1 if inspector.has_table(schedules.name) else 0, 0, None)
    with engine.connect() as conn:
        rows = dict(conn.execute(sa.select(meta.c.name, meta.c.value)).all())
    try:
        version = int(rows.get("schema_version", 1))
        compatible = int(rows.get("compatible_from", version))
    except ValueError:
        raise SchemaError(f"table {meta.name}: schema_version {rows.get('schema_version')!r}"
                          " is not a number; the table was not made by perfectsched"
                          ) from None
    return Recorded(version, compatible, rows.get("written_by"))


def refuse_unusable(found: Recorded) -> None:
    """SchemaError, naming both versions, when this version may not use the database."""
    if found.compatible_from > SCHEMA_VERSION:
        raise SchemaError(
            f"the database has schema {found.version} (perfectsched {found.release()}), "
            f"newer than this perfectsched {__version__} understands (schema "
            f"{SCHEMA_VERSION}); upgrade this host to perfectsched {found.release()} or "
            "later; nothing was changed")
    if found.version > SCHEMA_VERSION:
        log.info("the database has schema %d (perfectsched %s), newer than this host's %d; "
                 "it is compatible with this version", found.version, found.release(),
                 SCHEMA_VERSION)


def record(engine: Engine, meta: sa.Table, found: Recorded) -> None:
    """Record that the database is at SCHEMA_VERSION (never lowering what is there)."""
    if found.version >= SCHEMA_VERSION:
        return
    values = {"schema_version": str(SCHEMA_VERSION), "compatible_from": str(COMPATIBLE_FROM),
              "written_by": __version__}
    for name, value in values.items():
        try:
            with engine.begin() as conn:
                conn.execute(meta.insert().values(name=name, value=value))
            continue
        except IntegrityError:
            pass  # there already, or another host inserted it meanwhile
        with engine.begin() as conn:
            current = conn.execute(sa.select(meta.c.value).where(meta.c.name == name)
                                   ).scalar()
            if name == "written_by":
                newer = _int(conn.execute(sa.select(meta.c.value).where(
                    meta.c.name == "schema_version")).scalar()) > SCHEMA_VERSION
                if newer:
                    continue
            elif _int(current) >= int(value):
                continue
            conn.execute(meta.update().where(meta.c.name == name, meta.c.value == current)
                         .values(value=value))
    if found.version == 0:
        log.info("database created at schema %d", SCHEMA_VERSION)
    else:
        log.info("database schema updated from %d (perfectsched %s) to %d (perfectsched %s)",
                 found.version, found.release(), SCHEMA_VERSION, __version__)


def _int(text: str | None) -> int:
    try:
        return int(text or 0)
    except ValueError:
        return 0
