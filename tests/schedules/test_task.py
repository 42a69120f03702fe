"""schedules/task.py: a leased occurrence (Task) as the library gives it: its data a copy
of its own, and the due times its finish writes (policy.due_time: occurrence, delay, the
key's jitter)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import perfectschedd
from perfectschedd.schedules.collection import ScheduleCollection
from perfectschedd.schedules.policy import due_time, jitter_offset
from perfectschedd.schedules.task import Task

T0 = 1_700_002_800  # a whole hour (UTC)


@pytest.fixture
def sc(sqlite_url: str) -> Iterator[ScheduleCollection]:
    with perfectschedd.open({"type": "rdb_compat", "url": sqlite_url}) as collection:
        yield collection


def test_the_public_name_is_this_class() -> None:
    assert perfectschedd.Task is Task


def test_task_data_is_a_copy_per_task(sc: ScheduleCollection) -> None:
    sc.add("existing", "t", cron="0 * * * *", data={"keep": True}, now=T0 + 1)
    task = sc.poll(now=T0 + 3600)
    assert task is not None
    task.data["keep"] = False  # a handler mutating its data changes nothing stored
    task.finish()
    assert sc["existing"].info().data == {"keep": True}


def test_finish_moves_on_to_the_next_occurrences_due_time(sc: ScheduleCollection) -> None:
    sc.add("nightly", "t", cron="0 * * * *", delay=30, jitter=600, now=T0)
    shift = 30 + jitter_offset("nightly", 600)
    assert sc["nightly"].info().next_run_time == T0 + shift
    task = sc.poll(now=T0 + shift)
    assert task is not None and task.due_of(T0 + 3600) == T0 + 3600 + shift
    assert task.next_advance().next_run_time == due_time(T0 + 3600, "nightly", 30, 600)
    task.finish()
    info = sc["nightly"].info()
    assert (info.next_time, info.next_run_time) == (T0 + 3600, T0 + 3600 + shift)
