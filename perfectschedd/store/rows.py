"""A schedule's row between Python and the database: the values that insert a new one,
and a row read back as a schema.Row with its fields' types."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from perfectschedd.store.schema import Row
from perfectschedd.vocabulary.fields import ROW_FIELDS, SCHEDULE_FIELDS


def _read_as(field: str) -> Callable[[Any], Any] | None:
    """How a value of Row's `field` read from the database becomes the field's type (a
    driver may give 0/1 for a SMALLINT, a Decimal for a BIGINT); None: as it comes."""
    kind = SCHEDULE_FIELDS[field]
    return next((c for c in (bool, int) if kind in (c, c | None)), None)


_READ_AS = {n: c for n in ROW_FIELDS if (c := _read_as(n)) is not None}


def row_of(r: Any) -> Row:
    """The schedule of a result row that has the schedules table's columns."""
    m = r._mapping
    values = {n: m.get(n) for n in ROW_FIELDS}
    for name, convert in _READ_AS.items():
        if values[name] is not None:
            values[name] = convert(values[name])
    return Row(**values)


def new_row_values(row: Row) -> dict[str, Any]:
    """The values that insert a new schedule: the row's, not held by anyone."""
    values = {n: getattr(row, n) for n in ROW_FIELDS}
    values.update(paused=int(row.paused), fence=0, attempt=0, owner=None, claimed_at=None)
    return values
