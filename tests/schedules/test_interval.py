"""CRON `@every DURATION` (schedules/interval.py, through cron.py and catchup.py): the
durations taken and refused, the grid anchored at the schedule's start, next times that
advance from the occurrence that ran (never from the clock), catch-up by arithmetic, and
modify re-anchoring as a new schedule would."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from perfectschedd import InvalidInputError
from perfectschedd.schedules import catchup, cron, interval
from perfectschedd.schedules.collection import ScheduleCollection
from perfectschedd.schedules.collection import open as open_schedules
from perfectschedd.schedules.task import Task

T0 = 1_700_000_000


@pytest.fixture
def sc(tmp_path: Path) -> Iterator[ScheduleCollection]:
    config = {"type": "rdb_compat", "url": f"sqlite:///{tmp_path / 's.db'}"}
    with open_schedules(config) as collection:
        yield collection


@pytest.mark.parametrize("text, seconds", [
    ("@every 90s", 90), ("@every 5m", 300), ("@every 2h", 7200), ("@every 1d", 86400),
    ("@every 1h30m", 5400), ("@every 1d12h", 129600), ("@every 1s", 1),
    ("@EVERY 5M", 300), ("  @every   10s ", 10), ("@every 36500d", 36500 * 86400),
])
def test_durations_taken(text: str, seconds: int) -> None:
    assert cron.period(text) == seconds
    assert cron.check(text) == f"@every {text.split()[1].lower()}"


@pytest.mark.parametrize("text, why", [
    ("@every", "takes one duration"), ("@every 5", "cannot read duration '5'"),
    ("@every 0s", "shorter than 1s"), ("@every 0m0s", "shorter than 1s"),
    ("@every 36501d", "longer than 36500d"), ("@every 30m1h", "cannot read"),
    ("@every 1h 30m", "takes one duration"), ("@every 1w", "cannot read"),
    ("@every -5s", "cannot read"), ("@every 1.5h", "cannot read"),
])
def test_durations_refused_in_one_line(text: str, why: str) -> None:
    with pytest.raises(InvalidInputError) as refused:
        cron.check(text)
    message = str(refused.value)
    assert message.startswith("cron: ") and why in message and "\n" not in message


def test_the_grid_is_anchored_at_the_start_and_ignores_the_zone() -> None:
    start = T0 + 7  # not a multiple of anything
    assert cron.first_at_or_after("@every 5m", "UTC", start) == start
    for tz in ("UTC", "Europe/Berlin", "Australia/Lord_Howe"):
        assert cron.next_after("@every 5m", tz, start) == start + 300
        # From any time, through an anchor on the grid.
        assert cron.next_after("@every 5m", tz, start + 1, anchor=start) == start + 300
        assert cron.next_after("@every 5m", tz, start + 300, anchor=start) == start + 600
        assert cron.first_at_or_after("@every 5m", tz, start + 300, anchor=start) == \
            start + 300
        assert cron.latest_at_or_before("@every 5m", tz, start + 599, anchor=start) == \
            start + 300
    # Seconds, not wall time: across Berlin's spring-forward night, still 1 h apart.
    night = 1774746000  # 2026-03-29 01:00 UTC
    assert cron.next_after("@every 1h", "Europe/Berlin", night) == night + 3600
    assert cron.occurrences_back("@every 5s", "UTC", start + 31, start, 100) == \
        [start + 30, start + 25, start + 20, start + 15, start + 10, start + 5, start]
    assert cron.occurrences_back("@every 5s", "UTC", start + 31, start, 2) == \
        [start + 30, start + 25]


def test_no_occurrence_past_the_calendar() -> None:
    with pytest.raises(cron.NoNextOccurrence):
        cron.next_after("@every 36500d", "UTC", 253402300799 - 86400)


def test_add_runs_from_the_start_and_finish_advances_from_the_occurrence(
        sc: ScheduleCollection) -> None:
    sc.add("k", "t", "@every 90s", now=T0)  # --start: now
    assert sc["k"].info().next_time == T0
    sc.add("s", "t", "@every 90s", start=T0 + 13, delay=4, now=T0)
    assert (sc["s"].info().next_time, sc["s"].info().next_run_time) == (T0 + 13, T0 + 17)
    task = sc.poll(now=T0 + 1000)  # claimed long after: the next time is still on the grid
    assert task is not None and task.key == "k" and task.scheduled_time == T0
    task.finish()
    assert sc["k"].info().next_time == T0 + 90
    assert sc["k"].info().cron == "@every 90s"


def test_modify_re_anchors_as_a_new_schedule_would(sc: ScheduleCollection) -> None:
    sc.add("k", "t", "0 * * * *", now=T0)
    sc["k"].modify(cron="@every 10m", now=T0 + 123)
    assert sc["k"].info().next_time == T0 + 123
    sc["k"].modify(delay=5, now=T0 + 500)  # not the cron: the grid stays
    assert (sc["k"].info().next_time, sc["k"].info().next_run_time) == (T0 + 123, T0 + 128)
    sc["k"].modify(cron="@every 1m", now=T0 + 700)
    assert sc["k"].info().next_time == T0 + 700


def claimed(sc: ScheduleCollection, now: float, **options: Any) -> Task:
    sc.add("k", "t", "@every 10s", start=T0, now=T0, **options)
    task = sc.poll(now=now)
    assert task is not None and task.scheduled_time == T0
    return task


def test_catch_up_all_runs_every_missed_interval_oldest_first(
        sc: ScheduleCollection) -> None:
    task = claimed(sc, T0 + 65)
    assert catchup.plan(task, T0 + 65) is None  # this one runs; then T0+10, +20, ...
    assert task.next_advance().next_time == T0 + 10


def test_catch_up_latest_and_skip(sc: ScheduleCollection) -> None:
    task = claimed(sc, T0 + 65, misfire="latest")
    plan = catchup.plan(task, T0 + 65)
    assert plan is not None
    assert (plan.run, plan.skipped) == (T0 + 60, [T0 + 50, T0 + 40, T0 + 30, T0 + 20,
                                                  T0 + 10, T0])
    task.release(now=T0 + 65)
    sc["k"].delete()
    task = claimed(sc, T0 + 75, misfire="skip", grace=3)  # the newest is 5 s late
    plan = catchup.plan(task, T0 + 75)
    assert plan is not None and plan.run is None and plan.next_time == T0 + 80
    assert plan.skipped[0] == T0 + 70 and plan.skipped[-1] == T0


def test_catch_up_all_with_a_grace(sc: ScheduleCollection) -> None:
    task = claimed(sc, T0 + 65, grace=12)
    plan = catchup.plan(task, T0 + 65)
    assert plan is not None  # +53 and later can still start within 12 s
    assert (plan.run, plan.skipped) == (T0 + 60, [T0 + 50, T0 + 40, T0 + 30, T0 + 20,
                                                  T0 + 10, T0])


def test_delay_and_jitter_shift_the_runs_not_the_grid(sc: ScheduleCollection) -> None:
    sc.add("j", "t", "@every 1h", start=T0, delay=30, jitter=600, now=T0)
    info = sc["j"].info()
    offset = info.policy.offset("j")
    assert info.next_time == T0 and info.next_run_time == T0 + 30 + offset
    task = sc.poll(now=T0 + 30 + offset)
    assert task is not None
    task.finish()
    info = sc["j"].info()
    assert (info.next_time, info.next_run_time) == (T0 + 3600, T0 + 3630 + offset)


def test_interval_module_grid_arithmetic() -> None:
    assert interval.first_at_or_after(5, 100, 100) == 100
    assert interval.first_at_or_after(5, 100, 101) == 105
    assert interval.first_at_or_after(5, 100, 96) == 100
    assert interval.first_at_or_after(5, 100, 94) == 95
    assert interval.latest_at_or_before(5, 100, 104) == 100
    assert interval.latest_at_or_before(5, 100, 99) == 95
