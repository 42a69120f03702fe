"""One list of a schedule's fields (vocabulary/fields.py): the table's columns, Row,
Claimed and ScheduleInfo all follow it."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import sqlalchemy as sa

from perfectschedd.schedules import policy
from perfectschedd.schedules.collection import ScheduleInfo
from perfectschedd.store.schema import Claimed, Row, schedules_table
from perfectschedd.vocabulary import fields


def test_the_table_has_a_column_for_each_field_in_order() -> None:
    t = schedules_table(sa.MetaData(), "s", sa.Text(), None)
    assert tuple(c.name for c in t.columns) == tuple(fields.SCHEDULE_FIELDS)


def test_row_claimed_and_info_are_made_from_the_list() -> None:
    assert tuple(f.name for f in dataclasses.fields(Row)) == fields.ROW_FIELDS
    assert Claimed._fields == fields.CLAIMED_FIELDS
    shown = [f.name for f in dataclasses.fields(ScheduleInfo)]
    at = fields.INFO_FIELDS.index("policy")
    assert shown == [*fields.INFO_FIELDS[:at], *policy.OPTIONS, *fields.INFO_FIELDS[at + 1:]]
    assert isinstance(Claimed(*range(11)), tuple)  # a named tuple: cheap to build per fire


def test_the_list_loads_no_sqlalchemy() -> None:
    code = "import sys, perfectschedd.vocabulary.fields; print('sqlalchemy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "False"
