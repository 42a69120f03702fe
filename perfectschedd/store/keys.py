"""SQL conditions on keys, exact on every database: a prefix, and "a schedule and its
KEY@run-... rows" (its extra runs and split occurrences, whose runs are the schedule's);
and the slices in which long key lists go to the database."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import sqlalchemy as sa

from perfectschedd.vocabulary.fields import RUN_NOW_MARK


def runs_of(column: Any, schedule: str) -> Any:
    """The SQL condition "`column` is `schedule` or one of its KEY@run-... keys"."""
    return sa.or_(column == schedule, starts_with(column, f"{schedule}{RUN_NOW_MARK}"))


def starts_with(column: Any, prefix: str) -> Any:
    """The SQL condition "`column` starts with `prefix`", exactly: LIKE ignores case on
    SQLite (and MariaDB), where "db" and "DB" are two keys; the comparison of the first
    characters does not (an index still serves the LIKE where it can)."""
    return sa.and_(column.startswith(prefix, autoescape=True),
                   sa.func.substr(column, 1, len(prefix)) == prefix)


def chunks(items: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    """`items` in slices of `size` (IN lists of a bounded length)."""
    for i in range(0, len(items), size):
        yield items[i:i + size]
