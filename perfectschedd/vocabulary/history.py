"""A run's history row: its columns and the one function that builds one, so that the
worker (a run, a skip), the library API (a skip) and the store (a run lost with its
worker) write the same row."""

from __future__ import annotations

from typing import Any

from perfectschedd.vocabulary.fields import ERROR_MAX
from perfectschedd.vocabulary.outcomes import Outcome

HISTORY_COLUMNS = ("key", "type", "scheduled_time", "attempt", "started_at", "finished_at",
                   "outcome", "worker", "unit", "exit_code", "signal", "duration", "output",
                   "error")
# The columns a run may leave out (NULL): every one schema 1 did not have.
HISTORY_OPTIONAL = ("unit", "exit_code", "signal", "duration", "output", "error")


def history_row(*, key: str, type: str, scheduled_time: int, attempt: int,
                started_at: float, finished_at: float, outcome: Outcome | str, worker: str,
                unit: str | None = None, exit_code: int | None = None,
                signal: int | None = None, duration: float | None = None,
                output: str | None = None, error: str | None = None) -> dict[str, Any]:
    """One history row, every column set (None: NULL); `error` cut to ERROR_MAX."""
    return {"key": key, "type": type, "scheduled_time": scheduled_time, "attempt": attempt,
            "started_at": started_at, "finished_at": finished_at, "outcome": str(outcome),
            "worker": worker, "unit": unit, "exit_code": exit_code, "signal": signal,
            "duration": duration, "output": output,
            "error": None if error is None else error[:ERROR_MAX]}
