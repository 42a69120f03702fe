"""The Ruby PerfectSched's table, read for perfectschedctl import-legacy.

The gem's rdb_compat backend keeps one row per schedule: `id` (the key), `timeout` (when
it may run next: next_time + delay, or a worker's lease), `next_time` (the occurrence),
`cron`, `delay`, `data` (JSON in a BLOB; `type` inside it) and `timezone` (NULL: UTC).
The type is data['type'], else the key's prefix before its first '.'; data that does not
parse is {} - both as the gem reads them.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from perfectschedd.errors import (
    ConfigError,
    DatabaseUnavailableError,
    InvalidInputError,
    ScheduleError,
    first_line,
)
from perfectschedd.schedules.validate import (
    check_cron,
    check_data,
    check_int,
    check_key,
    check_timezone,
    check_type,
)
from perfectschedd.store import deadline
from perfectschedd.store.urls import engine_url

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
LEGACY_COLUMNS = ("id", "timeout", "next_time", "cron", "delay", "data", "timezone")


@dataclass(frozen=True)
class LegacySchedule:
    key: str
    type: str
    cron: str
    delay: int
    timezone: str
    data: dict[str, Any]
    next_time: int
    next_run_time: int
    data_note: str | None = None  # why data became {}

    def request(self) -> dict[str, Any]:
        """An add_many item: the times kept (start at the occurrence, run at timeout)."""
        return {"key": self.key, "type": self.type, "cron": self.cron, "delay": self.delay,
                "timezone": self.timezone, "data": self.data, "start": self.next_time,
                "at": self.next_run_time}


def _data(raw: Any) -> tuple[dict[str, Any], str | None]:
    if raw is None:
        return {}, "NULL"
    if isinstance(raw, memoryview):
        raw = raw.tobytes()
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError:
            return {}, "not UTF-8"
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        return {}, "not JSON"
    if not isinstance(value, dict):
        return {}, "not a JSON object"
    return value, None


def convert(row: Any) -> LegacySchedule:
    """One legacy row, checked as `add` checks; InvalidInputError names the field."""
    key = check_key(row.id)
    data, note = _data(row.data)
    kind = data.pop("type", None)
    if not isinstance(kind, str) or not kind:
        kind = key.split(".", 1)[0]
    check_type(kind)
    check_data(data)
    return LegacySchedule(
        key=key, type=kind, cron=check_cron(row.cron), delay=check_int("delay", row.delay),
        timezone=check_timezone(row.timezone or "UTC"), data=data,
        next_time=check_int("next_time", row.next_time),
        next_run_time=check_int("timeout", row.timeout), data_note=note)


def _why(exc: sa.exc.DBAPIError) -> str:
    """The driver's reason in one line, without its error number (PyMySQL's (2003, "...")
    shows as its text)."""
    args = getattr(exc.orig, "args", ())
    if len(args) == 2 and isinstance(args[0], int) and isinstance(args[1], str):
        return first_line(Exception(args[1]))
    return deadline.describe(exc)


def read(url: str, table: str) -> tuple[list[LegacySchedule], list[str]]:
    """Every schedule of the legacy table, and one line per row that cannot be carried
    over.  Reads only.  A database that cannot be reached is a DatabaseUnavailableError,
    one that refuses the reading a ScheduleError: one line naming it, password hidden."""
    if not _IDENTIFIER.match(table):
        raise ConfigError(f"--table: must be an SQL identifier, got {table!r}")
    legacy = engine_url(url)
    if legacy.get_backend_name() == "sqlite" and not os.path.isfile(legacy.database or ""):
        # SQLite would create an empty file, and report the table missing from it.
        raise ConfigError(f"{legacy.database or url}: no such SQLite database file")
    engine = sa.create_engine(legacy)
    t = sa.table(table, *(sa.column(c) for c in LEGACY_COLUMNS))
    found: list[LegacySchedule] = []
    problems: list[str] = []
    # The URL as given (engine_url names the driver), its password hidden.
    where = f"legacy database {sa.engine.make_url(url).render_as_string(hide_password=True)}"
    try:
        try:
            conn = engine.connect()
        except sa.exc.DBAPIError as exc:
            raise DatabaseUnavailableError(f"{where} unreachable: {_why(exc)}") from None
        with conn:
            inspector = sa.inspect(conn)
            if not inspector.has_table(table):  # SQLAlchemy 1.4 on SQLite: no error below
                raise ConfigError(f"table {table} not found")
            have = {c["name"].lower() for c in inspector.get_columns(table)}
            missing = [c for c in LEGACY_COLUMNS if c not in have]
            if missing:
                raise ConfigError(f"table {table}: not a PerfectSched table (no column "
                                  f"{', '.join(missing)})")
            for row in conn.execute(sa.select(t).order_by(t.c.id)):
                try:
                    found.append(convert(row))
                except InvalidInputError as exc:
                    problems.append(f"{str(row.id)[:300]!r}: {exc}")
    except sa.exc.NoSuchTableError:
        raise ConfigError(f"table {table} not found") from None
    except sa.exc.DBAPIError as exc:
        if deadline.unavailable(exc):
            raise DatabaseUnavailableError(f"{where} unreachable: {_why(exc)}") from None
        raise ScheduleError(f"{where}: {_why(exc)}") from None
    finally:
        engine.dispose()
    return found, problems
