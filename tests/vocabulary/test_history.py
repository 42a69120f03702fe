"""The one builder of a history row (vocabulary/history.py): every column set, in the
columns' order, optional ones NULL, `error` cut, the outcome a plain string."""

from __future__ import annotations

import sqlalchemy as sa

from perfectschedd.store.schema import history_table
from perfectschedd.vocabulary.fields import ERROR_MAX
from perfectschedd.vocabulary.history import HISTORY_COLUMNS, HISTORY_OPTIONAL, history_row
from perfectschedd.vocabulary.outcomes import Outcome


def lost(**extra: object) -> dict[str, object]:
    return history_row(key="k", type="t", scheduled_time=100, attempt=2, started_at=101.5,
                       finished_at=160.0, outcome=Outcome.LOST, worker="h:w1", **extra)


def test_a_row_has_every_column_in_the_table_s_order() -> None:
    row = lost()
    assert tuple(row) == HISTORY_COLUMNS
    table = history_table(sa.MetaData(), "s")
    assert [c.name for c in table.columns if c.name != "id"] == list(HISTORY_COLUMNS)


def test_what_a_run_leaves_out_is_null_and_only_that() -> None:
    row = lost()
    assert {c for c, v in row.items() if v is None} == set(HISTORY_OPTIONAL)
    assert set(HISTORY_OPTIONAL) < set(HISTORY_COLUMNS)
    # The optional columns are the nullable ones: a row without them can be inserted.
    table = history_table(sa.MetaData(), "s")
    assert {c.name for c in table.columns if c.nullable} == set(HISTORY_OPTIONAL)


def test_the_outcome_is_bound_as_its_plain_string() -> None:
    row = lost()
    assert row["outcome"] == "lost" and type(row["outcome"]) is str
    assert history_row(key="k", type="t", scheduled_time=0, attempt=1, started_at=0,
                       finished_at=0, outcome="success", worker="w")["outcome"] == "success"


def test_the_error_is_cut_to_its_column_and_the_rest_kept_as_given() -> None:
    row = lost(error="x" * (ERROR_MAX + 50), exit_code=3, signal=9, duration=1.5,
               output="tail", unit="u.service")
    assert row["error"] == "x" * ERROR_MAX
    assert (row["exit_code"], row["signal"], row["duration"], row["output"], row["unit"]) \
        == (3, 9, 1.5, "tail", "u.service")
    assert lost(error="")["error"] == ""  # empty is not NULL
