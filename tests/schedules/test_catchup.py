"""schedules/catchup.py: what a worker does with an occurrence claimed late, by policy.
Real tasks (claimed from a real SQLite file at a given time); every time is passed in."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import perfectschedd
from perfectschedd.schedules import catchup
from perfectschedd.schedules.catchup import COUNT_CAP, CatchUp, plan
from perfectschedd.schedules.collection import ScheduleCollection
from perfectschedd.schedules.task import Task

T0 = 1_700_002_800  # a whole hour (UTC)
MIN = 60


@pytest.fixture
def sc(sqlite_url: str) -> Iterator[ScheduleCollection]:
    with perfectschedd.open({"type": "rdb_compat", "url": sqlite_url}) as c:
        yield c


def claimed(sc: ScheduleCollection, cron: str = "* * * * *", *, at: float = T0 + 600,
            key: str = "k", **options: Any) -> Task:
    """The first occurrence (T0, or the cron's first after it), claimed at `at`."""
    sc.add(key, "t", cron, start=T0, now=T0, **options)
    task = sc.poll(now=at)
    assert task is not None and task.key == key and task.attempt == 1
    return task


def rel(c: CatchUp | None) -> tuple[list[int], int | None, int | None] | None:
    if c is None:
        return None
    return ([s - T0 for s in c.skipped], None if c.run is None else c.run - T0,
            None if c.next_time is None else c.next_time - T0)


EVERY_MINUTE_BEFORE_600 = [540, 480, 420, 360, 300, 240, 180, 120, 60, 0]


def test_default_policy_runs_every_occurrence_as_claimed(sc: ScheduleCollection) -> None:
    task = claimed(sc)
    assert plan(task, T0 + 5) is None
    assert plan(task, T0 + 86400) is None  # however late


def test_on_time_occurrence_is_run_as_it_is_whatever_the_policy(
        sc: ScheduleCollection) -> None:
    for i, options in enumerate(({"misfire": "latest"}, {"misfire": "skip"},
                                 {"grace": 30}, {"misfire": "latest", "grace": 30})):
        task = claimed(sc, key=f"k{i}", **options)
        assert plan(task, T0 + 5) is None, options


def test_latest_runs_the_newest_due_occurrence_and_skips_the_rest(
        sc: ScheduleCollection) -> None:
    task = claimed(sc, misfire="latest")
    assert rel(plan(task, T0 + 600)) == (EVERY_MINUTE_BEFORE_600, 600, None)
    # However late within the minute: still the newest, no grace to miss.
    assert rel(plan(task, T0 + 659)) == (EVERY_MINUTE_BEFORE_600, 600, None)


def test_skip_runs_the_newest_only_within_its_grace(sc: ScheduleCollection) -> None:
    task = claimed(sc, misfire="skip")
    assert rel(plan(task, T0 + 600)) == (EVERY_MINUTE_BEFORE_600, 600, None)
    assert rel(plan(task, T0 + 610)) == (EVERY_MINUTE_BEFORE_600, 600, None)  # grace 10
    # 10.5 s late: the newest is missed too, the schedule moves on to the next minute.
    assert rel(plan(task, T0 + 610.5)) == ([600, *EVERY_MINUTE_BEFORE_600], None, 660)


def test_skip_with_a_late_first_occurrence_and_nothing_newer(sc: ScheduleCollection) -> None:
    task = claimed(sc, "0 * * * *", misfire="skip")  # hourly, first at T0
    assert plan(task, T0 + 9) is None
    assert rel(plan(task, T0 + 30)) == ([0], None, 3600)


def test_latest_with_a_grace(sc: ScheduleCollection) -> None:
    task = claimed(sc, misfire="latest", grace=30)
    assert rel(plan(task, T0 + 630)) == (EVERY_MINUTE_BEFORE_600, 600, None)
    assert rel(plan(task, T0 + 645)) == ([600, *EVERY_MINUTE_BEFORE_600], None, 660)


def test_all_with_a_grace_runs_the_first_that_can_still_start(
        sc: ScheduleCollection) -> None:
    task = claimed(sc, grace=120)
    assert plan(task, T0 + 120) is None  # exactly at the deadline: on time
    # At +600 the occurrences before +480 can no longer start within 120 s.
    assert rel(plan(task, T0 + 600)) == ([420, 360, 300, 240, 180, 120, 60, 0], 480, None)
    assert rel(plan(task, T0 + 610.5)) == ([480, 420, 360, 300, 240, 180, 120, 60, 0],
                                           540, None)


def test_all_with_a_grace_whose_next_occurrence_is_not_due_yet(
        sc: ScheduleCollection) -> None:
    task = claimed(sc, "0 * * * *", grace=60)  # hourly; +1800 is past the first's grace
    assert rel(plan(task, T0 + 1800)) == ([0], None, 3600)


def test_delay_shifts_the_due_times(sc: ScheduleCollection) -> None:
    task = claimed(sc, misfire="skip", delay=100)
    # Due at occurrence + 100: at +105 the first is only 5 s late, at +115 15 s.
    assert plan(task, T0 + 105) is None
    assert rel(plan(task, T0 + 115)) == ([0], None, 60)


def test_jitter_shifts_the_due_times(sc: ScheduleCollection) -> None:
    task = claimed(sc, "0 * * * *", key="j", at=T0 + 3500, misfire="skip", jitter=3000)
    off = task.policy.offset("j")
    assert 0 <= off < 3000
    assert plan(task, T0 + off + 5) is None
    assert rel(plan(task, T0 + off + 20)) == ([0], None, 3600)


def test_retries_one_shots_are_never_caught_up(sc: ScheduleCollection) -> None:
    task = claimed(sc, misfire="skip")
    task.retry(wait=0, now=T0 + 600)
    again = sc.poll(now=T0 + 601)
    assert again is not None and again.attempt == 2
    assert plan(again, T0 + 3600) is None  # a retry is not a misfire
    sc.add("once", "t", "@once", at=T0, now=T0, misfire="skip")
    one = sc.poll(now=T0 + 3600)
    assert one is not None and one.key == "once"
    assert plan(one, T0 + 3600) is None


def test_skipped_are_counted_up_to_the_cap(sc: ScheduleCollection) -> None:
    # Weeks of missed minutes: the plan is bounded, newest first.
    late = T0 + 30 * 86400
    task = claimed(sc, misfire="latest", at=late)
    got = plan(task, late)
    assert got is not None and got.run == late
    assert len(got.skipped) == COUNT_CAP == catchup.COUNT_CAP
    assert got.skipped[0] == late - MIN
    assert got.skipped == sorted(got.skipped, reverse=True)
