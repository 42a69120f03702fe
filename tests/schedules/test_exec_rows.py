"""The one rule that says whether a stored exec:K row is entry K's own
(fields.foreign_exec_row; SPEC "Privilege model"), as the upgrade, the daemon's
convergence and the worker ask it."""

from __future__ import annotations

import pytest

from perfectschedd.vocabulary.fields import (
    PAUSED_REASON_MAX,
    REFUSED_ROW_REASON,
    foreign_exec_row,
    refused_reason,
)

OWN = ("exec:rootjob", "file:root.yml")


@pytest.mark.parametrize("key, task_type, schedule, entry_source", [
    ("rootjob", "exec:rootjob", OWN, "file:root.yml"),
    ("rootjob", "exec:rootjob", OWN, None),                     # file unknown on this host
    ("rootjob@run-1795811446-a1b2c3", "exec:rootjob", OWN, "file:root.yml"),  # an extra run
    ("rootjob", "exec:rootjob", ("exec:rootjob", "forced:file:root.yml"), "file:root.yml"),
    ("alice", "t", None, None),                                  # not an exec type
])
def test_an_entrys_own_rows_run(key: str, task_type: str,
                                schedule: tuple[str, str | None] | None,
                                entry_source: str | None) -> None:
    assert foreign_exec_row(key, task_type, schedule, entry_source) is None


@pytest.mark.parametrize("key, schedule, entry_source, says", [
    # Another key with the entry's type (0.1.0's `add`).
    ("alice-planted", OWN, "file:root.yml", "not that entry's row"),
    ("alice-planted@run-1-abc", OWN, None, "not that entry's row"),
    ("rootjobx", OWN, None, "not that entry's row"),
    # The entry's key from another file, or made with add (0.1.0's `apply` or `add`).
    ("rootjob", ("exec:rootjob", "file:evil.yml"), "file:root.yml", "file:evil.yml"),
    ("rootjob", ("exec:rootjob", None), None, "came from api"),
    ("rootjob", ("exec:rootjob", "forced:file:evil.yml"), "file:root.yml", "file:evil.yml"),
    # An extra run whose schedule is not the entry's own, or is gone.
    ("rootjob@run-1-abc", ("exec:rootjob", "file:evil.yml"), "file:root.yml", "evil"),
    ("rootjob@run-1-abc", ("t", "file:root.yml"), "file:root.yml", "no row 'rootjob'"),
    ("rootjob@run-1-abc", None, None, "no row 'rootjob'"),
])
def test_any_other_row_is_refused(key: str, schedule: tuple[str, str | None] | None,
                                  entry_source: str | None, says: str) -> None:
    why = foreign_exec_row(key, "exec:rootjob", schedule, entry_source)
    assert why is not None and says in why, why


def test_the_stored_reason_fits_its_column() -> None:
    why = foreign_exec_row("k" * 256, "exec:" + "r" * 251, None)
    assert why is not None
    reason = refused_reason(why)
    assert reason.startswith(REFUSED_ROW_REASON) and len(reason) <= PAUSED_REASON_MAX
