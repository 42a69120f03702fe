"""Store + schedules API lifecycle on every backend (SQLite file, PostgreSQL, MariaDB).

Times are passed in (`now=`); nothing sleeps.  T0 is a round hour, so "0 * * * *" is due
at T0, T0+3600, ...
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

import perfectschedd
from perfectschedd import (
    AlreadyExistsError,
    AlreadyFinishedError,
    NotFoundError,
    PreemptedError,
    ScheduleCollection,
    ScheduleError,
)
from perfectschedd.store.groups import TURN_LOST, TURN_START, TURN_WAIT
from perfectschedd.store.sql import Store

T0 = 1_700_002_800  # 2023-11-14 23:00:00 UTC, a round hour
H = 3600
ALIVE = 300
RETRY = 120


def utc(text: str) -> int:
    return int(datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp())


def open_sc(url: str, **extra: Any) -> ScheduleCollection:
    return perfectschedd.open({"type": "rdb_compat", "url": url, "alive_time": ALIVE,
                               "retry_wait": RETRY, **extra})


@pytest.fixture
def sc(db_url: str) -> Iterator[ScheduleCollection]:
    with open_sc(db_url) as c:
        yield c


def row(sc: ScheduleCollection, key: str) -> dict[str, Any]:
    return sc[key].info().as_dict()


def test_add_list_exists_delete(sc: ScheduleCollection) -> None:
    sc.add("b-job", "type1", cron="0 * * * *", delay=30, timezone="Asia/Tokyo",
           next_time=T0 - 10, data={"k": "v", "n": [1, 2], "ü": "☃"}, now=T0)
    sc.add("a-job", "type2", cron="@daily", now=T0)
    assert sc["b-job"].exists() and not sc["nope"].exists()
    listed = sc.list()
    assert [s.key for s in listed] == ["a-job", "b-job"]
    b = listed[1]
    assert (b.type, b.cron, b.delay, b.timezone) == ("type1", "0 * * * *", 30, "Asia/Tokyo")
    assert b.next_time == T0 and b.next_run_time == T0 + 30  # first cron time >= start
    assert b.data == {"k": "v", "n": [1, 2], "ü": "☃"}
    a = listed[0]
    assert a.timezone == "UTC" and a.data == {}
    assert a.next_time == T0 + H and a.next_run_time == T0 + H  # next midnight UTC
    assert [s.key for s in sc.list(prefix="a-")] == ["a-job"]
    with pytest.raises(AlreadyExistsError):
        sc.add("a-job", "other", cron="* * * * *", now=T0)
    assert row(sc, "a-job")["type"] == "type2"  # the refused add changed nothing
    sc["a-job"].delete()
    assert not sc["a-job"].exists()
    with pytest.raises(NotFoundError):
        sc["a-job"].delete()
    with pytest.raises(NotFoundError):
        sc["a-job"].info()
    assert [s.key for s in sc.list()] == ["b-job"]


def test_at_option_sets_next_run_time(sc: ScheduleCollection) -> None:
    sc.add("k", "t", cron="0 * * * *", next_time=T0, at=T0 + 5000, now=T0)
    info = row(sc, "k")
    assert (info["next_time"], info["next_run_time"]) == (T0, T0 + 5000)
    assert sc.poll(now=T0 + 4999) is None
    task = sc.poll(now=T0 + 5000)
    assert task is not None and task.scheduled_time == T0


def test_poll_finish_advances_from_the_occurrence_not_the_clock(sc: ScheduleCollection) -> None:
    sc.add("k", "t", cron="0 * * * *", delay=60, next_time=T0, data={"x": 1}, now=T0)
    assert sc.poll(now=T0 + 59) is None  # delay: not before next_time + 60
    task = sc.poll(now=T0 + 60)
    assert task is not None
    assert (task.key, task.type, task.scheduled_time, task.attempt) == ("k", "t", T0, 1)
    assert task.data == {"x": 1}
    held = row(sc, "k")
    assert held["owner"] == sc.owner and held["next_run_time"] == T0 + 60 + ALIVE
    assert sc.poll(now=T0 + 60) is None  # leased: nobody else gets it
    # Finished much later (10 h): the next occurrence is still T0+1h, not "now + 1h".
    task.finish()
    info = row(sc, "k")
    assert (info["next_time"], info["next_run_time"]) == (T0 + H, T0 + H + 60)
    assert info["owner"] is None and info["attempt"] == 0
    with pytest.raises(AlreadyFinishedError):
        task.finish()
    with pytest.raises(AlreadyFinishedError):
        task.retry(now=T0)


def test_catch_up_runs_every_missed_occurrence_oldest_first(sc: ScheduleCollection) -> None:
    sc.add("hourly", "t", cron="0 * * * *", next_time=T0, now=T0)
    sc.add("half", "t", cron="30 * * * *", next_time=T0, now=T0)
    now = T0 + 3 * H + 1  # down for three hours
    seen = []
    while (task := sc.poll(now=now)) is not None:
        seen.append((task.scheduled_time, task.key))
        task.finish()
    assert seen == sorted(seen)  # globally oldest first
    assert seen == [(T0, "hourly"), (T0 + 1800, "half"), (T0 + H, "hourly"),
                    (T0 + H + 1800, "half"), (T0 + 2 * H, "hourly"),
                    (T0 + 2 * H + 1800, "half"), (T0 + 3 * H, "hourly")]
    assert row(sc, "hourly")["next_time"] == T0 + 4 * H
    assert row(sc, "half")["next_time"] == T0 + 3 * H + 1800


def test_poll_many_and_finish_many(sc: ScheduleCollection) -> None:
    for i in range(10):
        sc.add(f"k{i}", "t", cron="0 * * * *", next_time=T0, at=T0 + i, now=T0)
    tasks = sc.poll_many(4, now=T0 + 100)
    assert sorted(t.key for t in tasks) == ["k0", "k1", "k2", "k3"]  # earliest run times
    more = sc.poll_many(100, now=T0 + 100)
    assert sorted(t.key for t in more) == [f"k{i}" for i in range(4, 10)]
    assert sc.poll_many(10, now=T0 + 100) == []
    sc["k5"].delete()  # preempts one of them
    lost = sc.finish_many(tasks + more)
    assert lost == {"k5"}
    infos = sc.list()
    assert len(infos) == 9
    assert all(i.next_time == T0 + H and i.owner is None for i in infos)


def test_claims_and_next_due_see_only_the_routed_types(sc: ScheduleCollection) -> None:
    """A worker claims, and looks for, only the types it routes: exact names and /re/
    patterns, which each backend writes into its own SQL."""
    for i, type_ in enumerate(["alpha", "beta", "report-1", "reporter"]):
        sc.add(f"k{i}", type_, cron="0 * * * *", next_time=T0, at=T0 + i, now=T0)
    sc.store.restrict_types(["alpha"], ["^report-"],
                            lambda t: t == "alpha" or t.startswith("report-"))
    assert sc.store.earliest_due() == T0
    assert sorted(t.type for t in sc.poll_many(10, now=T0 + 100)) == ["alpha", "report-1"]
    # Left: beta (T0 + 1) and reporter (T0 + 3), neither routed; the two leases.
    assert sc.store.earliest_due() > T0 + 100
    assert sc.poll_many(10, now=T0 + 100) == []
    sc.store.restrict_types([], [], lambda t: False)
    assert sc.store.earliest_due() is None
    sc.store.restrict_types((), (), None)  # every type
    assert sc.store.earliest_due() == T0 + 1
    assert sorted(t.type for t in sc.poll_many(10, now=T0 + 100)) == ["beta", "reporter"]


def test_a_claim_records_the_due_time_it_leased(sc: ScheduleCollection) -> None:
    """The claimed row's due_time is the next_run_time it had when claimed (the lateness
    the worker reports), in the row itself too, on every database: MySQL's claim, written
    apart, once left it unwritten (and its SET, which assigns left to right, would read
    the lease's end after next_run_time was set)."""
    sc.add("k", "t", cron="0 * * * *", delay=30, next_time=T0, now=T0)
    (claimed,) = sc.store.claim(T0 + 40, ALIVE, "w1", 1)
    assert claimed.due_time == T0 + 30
    t = sc.store.t
    with sc.store.engine.connect() as conn:
        stored = conn.execute(sa.select(t.c.due_time, t.c.next_run_time)
                              .where(t.c.key == "k")).one()
    assert tuple(stored) == (T0 + 30, T0 + 40 + ALIVE)
    # Given back to run again later: the next claim records that time, not the first.
    assert sc.store.reschedule("k", claimed.fence, T0 + 100, count_attempt=True)
    (again,) = sc.store.claim(T0 + 120, ALIVE, "w1", 1)
    with sc.store.engine.connect() as conn:
        due = conn.execute(sa.select(t.c.due_time).where(t.c.key == "k")).scalar()
    assert again.due_time == due == T0 + 100


def test_finish_many_writes_only_rows_still_held(sc: ScheduleCollection) -> None:
    """A batch finish with cron and one-off rows, where some leases were lost by a delete
    or a modify (the row is still there with a newer fence): exactly the held rows move."""
    for key in ("a", "b", "c"):
        sc.add(key, "t", cron="0 * * * *", next_time=T0, now=T0)
    once1 = sc["a"].run_now(now=T0 - 5)  # one-off rows (perfectschedctl run)
    once2 = sc["c"].run_now(now=T0 - 5)
    tasks = sc.poll_many(10, now=T0)
    assert len(tasks) == 5
    sc["b"].modify(data={"x": 1}, now=T0 + 1)  # fence moves on, the row stays
    sc[once2].delete()
    lost = sc.finish_many(tasks)
    assert lost == {"b", once2}
    assert row(sc, "a")["next_time"] == T0 + H and row(sc, "c")["next_time"] == T0 + H
    b = row(sc, "b")
    assert b["next_time"] == T0 and b["owner"] is None and b["data"] == {"x": 1}
    assert not sc[once1].exists()  # a one-off is deleted when it finishes


def test_retry_timing_and_attempts(sc: ScheduleCollection) -> None:
    sc.add("k", "t", cron="0 * * * *", next_time=T0, now=T0)
    task = sc.poll(now=T0 + 5)
    assert task is not None
    task.retry(now=T0 + 5)  # default wait: retry_wait
    info = row(sc, "k")
    assert info["next_run_time"] == T0 + 5 + RETRY and info["next_time"] == T0
    assert info["owner"] is None
    assert sc.poll(now=T0 + 5 + RETRY - 1) is None
    again = sc.poll(now=T0 + 5 + RETRY)
    assert again is not None and again.scheduled_time == T0 and again.attempt == 2
    again.retry(wait=7.5, now=T0 + 200)  # fractional wait rounds up, never early
    assert row(sc, "k")["next_run_time"] == T0 + 208
    assert sc.poll(now=T0 + 207) is None
    third = sc.poll(now=T0 + 208)
    assert third is not None and third.attempt == 3
    third.finish()
    assert row(sc, "k")["attempt"] == 0 and row(sc, "k")["next_time"] == T0 + H


def test_give_back_returns_the_occurrence_untried(sc: ScheduleCollection) -> None:
    """The daemon's own release (it stops): runs again now, the attempt does not count."""
    sc.add("k", "t", cron="0 * * * *", next_time=T0, now=T0)
    task = sc.poll(now=T0 + 5)
    assert task is not None and task.attempt == 1
    task.give_back(now=T0 + 6)
    info = row(sc, "k")
    assert info["next_run_time"] == T0 + 6 and info["owner"] is None and info["attempt"] == 0
    again = sc.poll(now=T0 + 6)
    assert again is not None and again.scheduled_time == T0 and again.attempt == 1
    with pytest.raises(AlreadyFinishedError):
        task.give_back(now=T0 + 7)


def test_release_first_at_once_then_backs_off_like_a_retry(sc: ScheduleCollection) -> None:
    sc.add("k", "t", cron="0 * * * *", next_time=T0, now=T0)
    task = sc.poll(now=T0 + 5)
    assert task is not None and task.attempt == 1
    task.release(now=T0 + 6)
    info = row(sc, "k")
    assert info["next_run_time"] == T0 + 6 and info["owner"] is None and info["attempt"] == 1
    again = sc.poll(now=T0 + 6)
    assert again is not None and again.scheduled_time == T0 and again.attempt == 2
    again.release(now=T0 + 7)
    assert row(sc, "k")["next_run_time"] == T0 + 7 + sc.config.retry_wait
    assert sc.poll(now=T0 + 8) is None
    with pytest.raises(AlreadyFinishedError):
        task.release(now=T0 + 7)


@pytest.mark.parametrize("fraction", [0.01, 0.5, 0.99])
def test_a_first_release_is_due_at_once_within_the_second(sc: ScheduleCollection,
                                                           fraction: float) -> None:
    """SPEC: the first release runs again at once.  Rounding the release time up held the
    occurrence for up to a second: the next poll, in the same second, found nothing."""
    sc.add("k", "t", cron="0 * * * *", next_time=T0, now=T0)
    task = sc.poll(now=T0 + 5 + fraction)
    assert task is not None
    task.release(now=T0 + 5 + fraction)
    again = sc.poll(now=T0 + 5 + fraction)
    assert again is not None and again.key == "k" and again.scheduled_time == T0
    # A retry without wait (retry_wait: 0, SCHED_LATER 0) waits for the next second, so
    # that a job failing at once does not spin: at most one attempt a second.
    again.retry(wait=0, now=T0 + 6 + fraction)
    assert sc.poll(now=T0 + 6.999) is None
    third = sc.poll(now=T0 + 7)
    assert third is not None and third.attempt == 3
    third.finish()
    # So does a repeated release, also with retry_wait 0.
    sc.add("r", "t", cron="0 * * * *", next_time=T0, now=T0, retry_wait=0)
    first = sc.poll(now=T0 + 7 + fraction)
    assert first is not None and first.key == "r"
    first.release(now=T0 + 7 + fraction)
    second = sc.poll(now=T0 + 7 + fraction)
    assert second is not None and second.key == "r" and second.attempt == 2
    second.release(now=T0 + 7 + fraction)
    assert sc.poll(now=T0 + 7.999) is None
    assert sc.poll(now=T0 + 8) is not None


def test_a_first_release_is_due_at_once_on_the_real_clock(sc: ScheduleCollection) -> None:
    minute = int(time.time()) // 60 * 60
    sc.add("k", "t", cron="* * * * *", next_time=minute, now=minute)
    task = sc.poll()
    assert task is not None
    task.release()
    again = sc.poll()
    assert again is not None and again.key == "k" and again.attempt == 2


def test_expired_lease_is_taken_over_and_the_old_holder_changes_nothing(db_url: str) -> None:
    with open_sc(db_url) as a, open_sc(db_url) as b:
        a.owner, b.owner = "host-a:1", "host-b:2"
        a.add("k", "t", cron="0 * * * *", next_time=T0, now=T0)
        old = a.poll(now=T0)
        assert old is not None
        old.heartbeat(now=T0 + 200)  # renewed: the lease now ends at T0+200+ALIVE
        assert b.poll(now=T0 + ALIVE + 1) is None
        new = b.poll(now=T0 + 200 + ALIVE)
        assert new is not None and new.scheduled_time == T0 and new.attempt == 2
        taken = row(b, "k")
        assert taken["owner"] == "host-b:2"
        for end in (old.finish, lambda: old.retry(now=T0), lambda: old.release(now=T0)):
            with pytest.raises(PreemptedError):
                end()
            old.done = False  # try every holder-side write with the stale fence
        with pytest.raises(PreemptedError):
            old.heartbeat(now=T0 + 600)
        assert row(b, "k") == taken  # the new holder's state is intact
        new.finish()
        assert row(a, "k")["next_time"] == T0 + H


@pytest.mark.parametrize("action", ["delete", "modify"])
def test_delete_or_modify_preempts_the_holder(sc: ScheduleCollection, action: str) -> None:
    sc.add("k", "t", cron="0 * * * *", next_time=T0, now=T0)
    task = sc.poll(now=T0)
    assert task is not None
    if action == "delete":
        sc["k"].delete()
    else:
        sc["k"].modify(cron="30 * * * *", now=T0 + 10)
    with pytest.raises(PreemptedError):
        task.finish()
    if action == "delete":
        assert not sc["k"].exists()
    else:
        info = row(sc, "k")
        assert info["cron"] == "30 * * * *" and info["next_time"] == T0 + 1800
        assert info["owner"] is None


def test_modify_recomputes_times(sc: ScheduleCollection) -> None:
    sc.add("k", "t", cron="0 * * * *", next_time=T0, data={"a": 1}, now=T0)
    sc["k"].modify(delay=90, data={"b": 2}, type="t2")
    info = row(sc, "k")
    assert (info["type"], info["delay"], info["data"]) == ("t2", 90, {"b": 2})
    assert (info["next_time"], info["next_run_time"]) == (T0, T0 + 90)
    sc["k"].modify(timezone="Asia/Kolkata", cron="0 9 * * *", now=T0)
    # 09:00 IST = 03:30 UTC; T0 is 23:00 UTC, so the next is 04:30 hours later.
    assert row(sc, "k")["next_time"] == T0 + 4 * H + 1800
    with pytest.raises(NotFoundError):
        sc["missing"].modify(delay=1)


def test_pause_and_resume(sc: ScheduleCollection) -> None:
    sc.add("k", "t", cron="0 * * * *", next_time=T0, now=T0)
    sc["k"].pause()
    assert row(sc, "k")["paused"] is True
    assert sc.poll(now=T0 + 10 * H) is None
    sc["k"].resume()
    task = sc.poll(now=T0 + 10 * H)
    assert task is not None and task.scheduled_time == T0  # missed ones still run


def test_run_now_is_a_one_off_that_leaves_the_schedule_alone(sc: ScheduleCollection) -> None:
    sc.add("k", "t", cron="0 * * * *", next_time=T0 + H, data={"d": 1}, now=T0)
    run_key = sc["k"].run_now(now=T0 + 10)
    task = sc.poll(now=T0 + 10)
    assert task is not None and task.key == run_key and task.type == "t"
    assert task.data == {"d": 1} and task.scheduled_time == T0 + 10
    task.finish()
    assert not sc[run_key].exists()
    assert row(sc, "k")["next_time"] == T0 + H


def test_an_extra_run_ends_as_its_schedule_says(sc: ScheduleCollection) -> None:
    """`run KEY` keeps the schedule's timeout, max_attempts, retry_wait, notify and
    concurrency (0.2.0 kept only the concurrency: an extra run of a max_attempts 1
    schedule that failed was retried without end), not its misfire, grace or jitter."""
    sc.add("k", "t", cron="0 * * * *", next_time=T0 + H, now=T0, max_attempts=1,
           retry_wait=7, timeout=3.5, notify="ops", concurrency="allow", misfire="skip",
           grace=60, jitter=30)
    run_key = sc["k"].run_now(now=T0 + 10)
    shown = sc[run_key].info()
    assert (shown.max_attempts, shown.retry_wait, shown.timeout, shown.notify,
            shown.concurrency) == (1, 7, 3.5, "ops", "allow")
    assert (shown.misfire, shown.grace, shown.jitter) == ("all", None, 0)
    task = sc.poll(now=T0 + 10)
    assert task is not None and task.key == run_key
    task.retry(now=T0 + 11)  # its first failed attempt is its last
    assert task.gave_up and not sc[run_key].exists()
    assert row(sc, "k")["next_time"] == T0 + H
    sc["k"].modify(max_attempts=2)
    run_key = sc["k"].run_now(now=T0 + 20)
    task = sc.poll(now=T0 + 20)
    assert task is not None and task.key == run_key
    task.retry(now=T0 + 21)  # retried after the schedule's retry_wait
    assert not task.gave_up and sc.poll(now=T0 + 27) is None
    again = sc.poll(now=T0 + 28)
    assert again is not None and again.key == run_key and again.attempt == 2


def test_group_members_take_turns(sc: ScheduleCollection) -> None:
    """A schedule and its extra runs (`run KEY`): of members claimed at the same time
    exactly one may start; the others may once it no longer holds a live lease, the extra
    runs before the schedule's own occurrence."""
    sc.add("k", "t", cron="* * * * *", next_time=T0 + 60, now=T0)
    extra = [sc["k"].run_now(now=T0) for _ in range(8)]
    claimed = sc.poll_many(limit=20, now=T0)
    assert sorted(t.key for t in claimed) == sorted(extra)
    store = sc.store
    results: dict[str, str] = {}

    def ask(key: str) -> None:
        with open_sc(sc.config.url) as other:
            results[key] = other.store.group_turn(key, "k", T0)

    threads = [threading.Thread(target=ask, args=(k,)) for k in extra]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    winners = [k for k, turn in results.items() if turn == TURN_START]
    assert len(winners) == 1 and set(results.values()) == {TURN_START, TURN_WAIT}, results
    assert store.group_turn(winners[0], "k", T0) == TURN_START  # the holder may ask again
    assert store.group_holder("k") == winners[0] and store.group_holder("none") is None
    waiting = next(k for k in extra if k != winners[0])
    for task in claimed:
        if task.key not in (winners[0], waiting):
            task.give_back(now=T0)
    # The schedule's own occurrence waits for the running extra run ...
    again = sc.poll_many(limit=20, now=T0 + 60)
    base = next(t for t in again if t.key == "k")
    assert store.group_turn("k", "k", T0 + 60) == TURN_WAIT
    next(t for t in claimed if t.key == winners[0]).finish()
    # ... and, once it ended, for the extra runs still held or due: they go first.
    assert store.group_turn("k", "k", T0 + 60) == TURN_WAIT
    base.give_back(now=T0 + 60, wait=ALIVE)  # as a worker does
    held = next(t for t in claimed if t.key == waiting)
    assert store.group_turn(waiting, "k", T0 + 60, fence=held.fence) == TURN_START
    held.finish()
    for task in again:
        if task.key != "k":
            assert store.group_turn(task.key, "k", T0 + 60) == TURN_START
            task.finish()
    sc.wake_group("k", now=T0 + 60)
    base = sc.poll(now=T0 + 60)
    assert base is not None and base.key == "k"
    assert store.group_turn("k", "k", T0 + 60) == TURN_START
    # An extra run waits for the schedule's running occurrence.
    late = sc["k"].run_now(now=T0 + 61)
    assert store.group_turn(late, "k", T0 + 61) == TURN_WAIT
    base.finish()
    assert store.group_turn(late, "k", T0 + 61) == TURN_START


def test_group_turn_of_a_lost_lease_and_replace(sc: ScheduleCollection) -> None:
    """A member whose row no longer holds its fence is told TURN_LOST; `replace` deletes
    the group's other held rows (their heartbeats then find their leases gone)."""
    sc.add("k", "t", cron="0 * * * *", next_time=T0 + H, now=T0, concurrency="replace")
    first, second = sc["k"].run_now(now=T0), sc["k"].run_now(now=T0)
    a, b = sc.poll_many(limit=5, now=T0)
    assert {a.key, b.key} == {first, second}
    store = sc.store
    assert store.group_turn(a.key, "k", T0, fence=a.fence + 1) == TURN_LOST
    assert store.group_turn(a.key, "k", T0, fence=a.fence) == TURN_START
    assert store.group_turn(b.key, "k", T0, fence=b.fence, replace=True) == TURN_START
    assert not sc[a.key].exists() and sc[b.key].exists()
    assert store.heartbeat([(a.key, a.fence), (b.key, b.fence)], T0 + ALIVE) == {a.key}
    assert store.group_turn(a.key, "k", T0, fence=a.fence) == TURN_LOST
    assert sc["k"].exists()  # the schedule itself is never deleted


def test_split_occurrence_moves_the_schedule_on(sc: ScheduleCollection) -> None:
    """allow/replace: the claimed occurrence moves to a one-off row holding the lease,
    the schedule's row to its next occurrence (fenced), in one transaction."""
    sc.add("k", "t", cron="0 * * * *", next_time=T0, data={"d": 1}, now=T0,
           concurrency="allow", timeout=5)
    task = sc.poll(now=T0)
    assert task is not None and task.group is None
    fence = task.fence
    assert task.split_off(sc.owner, ALIVE)
    assert task.key.startswith("k@run-") and task.fence == 1 and task.cron is None
    base = sc.store.get("k")
    assert base is not None and base.owner is None and base.fence == fence + 1
    assert (base.next_time, base.next_run_time) == (T0 + H, T0 + H)
    run = sc.store.get(task.key)
    assert run is not None and run.owner == sc.owner and run.next_time == T0
    assert run.next_run_time == T0 + ALIVE and run.data == '{"d":1}'
    assert sc[task.key].info().timeout == 5  # the schedule's policies go with it
    # The next occurrence is due while this one runs, and is split off in turn.
    assert sc.store.heartbeat([(task.key, 1)], T0 + H + ALIVE) == set()
    nxt = sc.poll(now=T0 + H)
    assert nxt is not None and nxt.key == "k" and nxt.split_off(sc.owner, ALIVE)
    task.finish()
    assert not sc[task.key].exists() and sc[nxt.key].exists()
    assert sc["k"].info().next_time == T0 + 2 * H
    # Fenced: a holder that lost the schedule's row splits nothing.
    stale = next(t for t in sc.poll_many(5, now=T0 + 2 * H) if t.key == "k")
    sc["k"].modify(data={"d": 2}, now=T0 + 2 * H)
    assert not stale.split_off(sc.owner, ALIVE)
    assert [r.key for r in sc.extra_runs("k")] == [nxt.key]


def test_wake_makes_a_waiting_occurrence_due(sc: ScheduleCollection) -> None:
    """A schedule's occurrence given back to wait for its group is made due again when
    a run of the group ends; one in its retry wait, or not due yet, is left alone."""
    sc.add("k", "t", cron="0 * * * *", next_time=T0, now=T0)
    task = sc.poll(now=T0)
    assert task is not None
    task.give_back(now=T0, wait=ALIVE)
    assert sc.store.get("k").next_run_time == T0 + ALIVE
    sc.wake_group("k", now=T0 + 5)
    assert sc.store.get("k").next_run_time == T0 + 5
    stale_fence = sc.store.get("k").fence
    assert not sc.store.wake("k", stale_fence + 1, T0 + 5)
    task = sc.poll(now=T0 + 5)
    assert task is not None
    task.retry(wait=600, now=T0 + 5)  # a failed attempt waits its retry wait
    sc.wake_group("k", now=T0 + 6)
    assert sc.store.get("k").next_run_time == T0 + 605
    sc.add("later", "t", cron="0 * * * *", next_time=T0 + H, now=T0)
    sc.wake_group("later", now=T0 + 6)
    assert sc.store.get("later").next_run_time == T0 + H


def test_add_many_is_all_or_nothing(sc: ScheduleCollection) -> None:
    sc.add("taken", "t", cron="* * * * *", now=T0)
    reqs = [{"key": f"m{i}", "type": "t", "cron": "0 * * * *", "now": T0} for i in range(50)]
    with pytest.raises(AlreadyExistsError):
        sc.add_many(reqs + [{"key": "taken", "type": "t", "cron": "0 * * * *"}])
    assert [s.key for s in sc.list()] == ["taken"]
    assert sc.add_many(reqs) == 50
    assert len(sc.list()) == 51


def test_dst_schedule_runs_through_the_store(sc: ScheduleCollection) -> None:
    """Los Angeles, 2015-11-01: the 01:30 job runs twice; 2015-03-08: 02:30 is skipped."""
    la = "America/Los_Angeles"
    fall = utc("2015-11-01T08:30")  # 01:30 PDT
    sc.add("fall", "t", cron="30 1 * * *", timezone=la, next_time=fall - 60, now=fall - 60)
    runs = []
    now = fall + 2 * H  # 2015-11-01 ~02:30 PST: both 01:30s are due
    while (task := sc.poll(now=now)) is not None:
        runs.append(task.scheduled_time)
        task.finish()
    assert runs == [fall, fall + H]
    assert row(sc, "fall")["next_time"] == fall + 24 * H + H  # 11-02 01:30 PST
    spring = utc("2015-03-07T10:00")  # 02:00 PST
    sc.add("spring", "t", cron="30 2 * * *", timezone=la, next_time=spring, now=spring)
    assert row(sc, "spring")["next_time"] == spring + 1800  # 03-07 02:30 PST
    task = sc.poll(now=spring + 3 * 24 * H)
    assert task is not None and task.scheduled_time == spring + 1800
    task.finish()
    # 03-08 02:30 does not exist: next is 03-09 02:30 PDT (09:30 UTC), 47 real hours later.
    assert row(sc, "spring")["next_time"] == spring + 1800 + 47 * H


def test_table_name_and_two_tables_are_independent(db_url: str) -> None:
    with open_sc(db_url, table="jobs_a") as a, open_sc(db_url, table="jobs_b") as b:
        a.add("k", "t", cron="* * * * *", now=T0)
        assert a["k"].exists() and not b["k"].exists()
        assert b.poll(now=T0 + H) is None


def test_init_is_idempotent_and_data_survives_reopen(db_url: str) -> None:
    with open_sc(db_url) as sc:
        sc.add("k", "t", cron="0 * * * *", now=T0, data={"x": "y" * 1000})
        sc.init()
    with open_sc(db_url) as sc:
        sc.init()
        assert row(sc, "k")["data"] == {"x": "y" * 1000}


def test_times_keep_sub_second_precision(sc: ScheduleCollection) -> None:
    now = T0 + 0.25
    sc.add("k", "t", cron="0 * * * *", next_time=T0, now=T0)
    task = sc.poll(now=now)
    assert task is not None
    assert row(sc, "k")["claimed_at"] == pytest.approx(now, abs=0.001)
    running = sc.store.running()
    assert [r.key for r in running] == ["k"]
    sc.store.record_runs([{"key": "k", "type": "t", "scheduled_time": T0, "attempt": 1,
                           "started_at": now, "finished_at": now + 1.5, "outcome": "ok",
                           "worker": "w"}])
    (run,) = sc.store.history("k", 10)
    assert run["finished_at"] - run["started_at"] == pytest.approx(1.5, abs=0.001)


def test_store_release_owner_hands_back_every_lease(sc: ScheduleCollection) -> None:
    for i in range(3):
        sc.add(f"k{i}", "t", cron="0 * * * *", next_time=T0, now=T0)
    tasks = sc.poll_many(3, now=T0)
    assert len(tasks) == 3
    assert sc.store.release_owner(sc.owner, T0 + 1) == 3
    for t in tasks:
        with pytest.raises(PreemptedError):
            t.finish()
    again = sc.poll_many(3, now=T0 + 1)
    assert sorted(t.key for t in again) == ["k0", "k1", "k2"]
    assert all(t.attempt == 1 for t in again)


def test_counts_and_earliest_due(sc: ScheduleCollection) -> None:
    assert sc.earliest_due() is None
    sc.add("a", "t", cron="0 * * * *", next_time=T0, now=T0)
    sc.add("b", "t", cron="0 * * * *", next_time=T0 + H, now=T0)
    sc.add("c", "t", cron="0 * * * *", next_time=T0, now=T0)
    sc["c"].pause()
    assert sc.earliest_due() == T0
    task = sc.poll(now=T0)
    assert task is not None
    assert sc.store.counts(T0) == {"schedules": 3, "paused": 1, "due": 0, "running": 1}
    assert sc.earliest_due() == min(T0 + H, T0 + ALIVE)


def test_url_forms(tmp_path: Any) -> None:
    store = Store(f"sqlite:///{tmp_path}/x.db")
    assert store.dialect == "sqlite"
    store.close()
    with pytest.raises(perfectschedd.ConfigError, match="^url: "):
        Store("sqlite://")
    with pytest.raises(perfectschedd.ConfigError, match="^url: "):
        Store("mssql://u:p@h/db")


def test_task_knows_when_it_was_due(sc: ScheduleCollection) -> None:
    """Lateness counts from the due time of this claim: --at, delay, or a retry's time."""
    sc.add("late", "t", cron="0 * * * *", start=T0, at=T0 + 500, now=T0)
    sc.add("delayed", "t", cron="0 * * * *", start=T0, delay=30, now=T0)
    tasks = {t.key: t for t in sc.poll_many(10, now=T0 + 600)}
    assert tasks["late"].due_time == T0 + 500
    assert tasks["delayed"].due_time == T0 + 30
    assert tasks["late"].scheduled_time == tasks["delayed"].scheduled_time == T0
    tasks["late"].retry(now=T0 + 700)
    again = sc.poll(now=T0 + 700 + RETRY + 5)
    assert again is not None and again.key == "late"
    assert again.due_time == T0 + 700 + RETRY


def test_init_adds_columns_a_newer_version_introduced(db_url: str) -> None:
    with open_sc(db_url) as old:
        old.add("k", "t", cron="0 * * * *", start=T0, now=T0)
        with old.store.engine.begin() as conn:  # a table made before due_time existed
            conn.exec_driver_sql("ALTER TABLE perfectsched DROP COLUMN due_time")
    with open_sc(db_url) as sc:
        task = sc.poll(now=T0 + 5)
        assert task is not None and task.due_time == T0
        task.finish()
        assert row(sc, "k")["next_time"] == T0 + H


def test_init_adds_the_unit_column_to_an_older_history_table(db_url: str) -> None:
    """A history table made before runs could be systemd units gets `unit`; its rows stay
    and read as runs without a unit."""
    past = {"key": "k", "type": "t", "scheduled_time": T0, "attempt": 1,
            "started_at": T0 + 1.0, "finished_at": T0 + 2.0, "outcome": "success",
            "worker": "host:1"}
    with open_sc(db_url) as old:
        old.add("k", "t", cron="0 * * * *", start=T0, now=T0)
        old.store.record_runs([past])
        with old.store.engine.begin() as conn:
            conn.exec_driver_sql("ALTER TABLE perfectsched_history DROP COLUMN unit")
    with open_sc(db_url) as sc:
        unit = "perfectsched-k-1357003600.service"
        sc.store.record_runs([{**past, "scheduled_time": T0 + H, "unit": unit}])
        assert [r["unit"] for r in sc.store.history("k", 10)] == [unit, None]


def test_a_sqlite_store_loads_no_other_dialect(tmp_path: Path) -> None:
    """Each dialect module costs every process about a megabyte of RSS."""
    code = ("import sys, perfectschedd\n"
            f"sc = perfectschedd.open({{'type': 'rdb_compat', 'url': 'sqlite:///{tmp_path}/x.db'}})\n"
            "sc.init(); sc.add('k', 't', cron='@daily'); sc.list(); sc.close()\n"
            "print(sorted(m for m in sys.modules if m.startswith(\n"
            "    ('sqlalchemy.dialects.', 'perfectschedd.store.backends.'))))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert "sqlalchemy.dialects.sqlite" in out and "perfectschedd.store.backends.sqlite" in out
    assert "postgresql" not in out and "mysql" not in out


def test_each_database_has_its_own_backend(sc: ScheduleCollection) -> None:
    """One class per database: its hot path, its "try again" errors, its engine."""
    backend = sc.store.backend
    assert backend.name == sc.store.url.get_backend_name()
    assert type(backend).__module__ == f"perfectschedd.store.backends.{backend.name}"
    assert (backend.write_lock is not None) == (backend.name == "sqlite")


def test_run_history_is_recorded_in_batches_newest_first(sc: ScheduleCollection) -> None:
    def run(key: str, n: int) -> dict[str, Any]:
        return {"key": key, "type": "t", "scheduled_time": T0 + n, "attempt": 1,
                "started_at": T0 + n + 0.25, "finished_at": T0 + n + 1.5,
                "outcome": "success" if n % 2 else "failed", "worker": "host:1:w0"}

    sc.store.record_runs([run("k", i) for i in range(3)] + [run("other", 9)])
    unit = "perfectsched-k-1357000004.service"  # a run of executor systemd names its unit
    sc.store.record_runs([run("k", 3), {**run("k@run-1-ab", 4), "unit": unit}])
    got = sc.store.history("k", 10)
    assert [r["scheduled_time"] - T0 for r in got] == [4, 3, 2, 1, 0]
    # Columns a row leaves out (0.1.0's, and a skipped occurrence's) are NULL.
    assert {k: v for k, v in got[1].items() if k != "id"} == {
        **run("k", 3), "unit": None, "exit_code": None, "signal": None, "duration": None,
        "output": None, "error": None}
    assert got[0]["unit"] == unit
    assert [r["scheduled_time"] - T0 for r in sc.store.history("k", 2)] == [4, 3]
    sc.store.record_runs([])
    assert len(sc.store.history("other", 10)) == 1


def test_history_keeps_what_each_run_did(sc: ScheduleCollection) -> None:
    """Exit status, signal, duration, output and error (schema 3) round-trip on every
    database: text beyond ASCII, a long output (MySQL's TEXT stops at 64 KiB), and the
    filter of one attempt."""
    from perfectschedd.config import OUTPUT_LIMIT_MAX

    output = "é€😀 line\n" * (OUTPUT_LIMIT_MAX // 16)
    assert 65536 < len(output.encode()) <= OUTPUT_LIMIT_MAX
    base = {"key": "k", "type": "t", "scheduled_time": T0, "started_at": T0 + 0.5,
            "finished_at": T0 + 2.75, "worker": "host:1", "unit": None}
    runs = [
        {**base, "attempt": 1, "outcome": "failed", "exit_code": 3, "signal": None,
         "duration": 2.25, "output": output, "error": "exit status 3: ça a échoué"},
        {**base, "attempt": 2, "outcome": "timeout", "exit_code": None, "signal": 15,
         "duration": 1.5, "output": None, "error": "timed out after 1.5 s"},
        {**base, "attempt": 3, "outcome": "success", "exit_code": 0, "signal": None,
         "duration": 0.125, "output": "", "error": None},
    ]
    sc.store.record_runs(runs)
    got = [{k: v for k, v in r.items() if k != "id"} for r in sc.store.history("k", 10)]
    assert got == list(reversed(runs))
    second = sc.store.history("k", 10, attempt=2)
    assert [(r["attempt"], r["signal"], r["error"]) for r in second] == [
        (2, 15, "timed out after 1.5 s")]
    assert sc.store.history("k", 10, attempt=4) == []


def test_warm_up_claims_and_changes_nothing(sc: ScheduleCollection) -> None:
    sc.add("due", "t", cron="0 * * * *", next_time=T0, now=T0)
    before = row(sc, "due")
    sc.store.warm_up()
    assert row(sc, "due") == before  # still due, unleased, same fence
    (task,) = sc.poll_many(10, now=T0)
    assert task.key == "due" and task.attempt == 1


@pytest.mark.postgresql
def test_a_deadlock_is_run_again_not_reported(pg_url: str) -> None:
    """A heartbeat caught in a real deadlock (PostgreSQL picks it as the victim) is run
    again by the store instead of surfacing as a database error."""
    with open_sc(pg_url) as c:
        c.init()
        for key in ("k1", "k2"):
            c.add(key, "t", cron="0 * * * *", next_time=T0, now=T0)
        held = [(t.key, t.fence) for t in c.poll_many(2, now=T0)]
        other = sa.create_engine(c.store.url)
        result: list[Any] = []
        with other.connect() as conn:
            tx = conn.begin()
            conn.exec_driver_sql("UPDATE perfectsched SET delay = 1 WHERE key = 'k2'")
            beat = threading.Thread(
                target=lambda: result.append(c.store.heartbeat(held, T0 + 999)))
            beat.start()
            # The heartbeat holds k1 and waits for k2; it waits longer than we will, so
            # PostgreSQL's deadlock check (after deadlock_timeout, 1 s) aborts it.
            time.sleep(0.5)
            conn.exec_driver_sql("UPDATE perfectsched SET delay = 1 WHERE key = 'k1'")
            tx.commit()
            beat.join(30)
        other.dispose()
        assert result == [set()]  # both renewed, after PostgreSQL broke the deadlock
        assert row(c, "k1")["next_run_time"] == T0 + 999


def test_last_outcomes_of_many_keys_in_one_query(sc: ScheduleCollection) -> None:
    """Notifications ask the run before a first success of many keys at once (a window
    function on every database): the latest state outcome that ended before each time."""
    def run(key: str, outcome: str, at: float) -> dict[str, object]:
        return {"key": key, "type": "t", "scheduled_time": 0, "attempt": 1,
                "started_at": at, "finished_at": at + 1, "outcome": outcome, "worker": "w"}

    sc.store.record_runs([run("a", "failed", 100), run("a", "success", 110),
                          run("a", "skipped", 120), run("b", "timeout", 100),
                          run("b", "success", 200)])
    states = ("success", "failed", "timeout", "lost")
    assert sc.store.last_outcomes([("a", 105.0), ("b", 150.0), ("c", 500.0)], states) == {
        "a": "failed", "b": "timeout", "c": None}
    assert sc.store.last_outcomes([("a", 100.5)], states) == {"a": None}
    assert sc.store.last_outcomes([("a", 500.0), ("b", 500.0)], states) == {
        "a": "success", "b": "success"}
    assert sc.store.last_outcomes([], states) == {}


def test_a_forced_delete_records_its_marker_until_the_key_is_added_again(
        sc: ScheduleCollection) -> None:
    """The marker of a forced delete (schedules/deletions.py) is written in the delete's
    transaction, only when a row was deleted, and any insert of the key ends it."""
    from perfectschedd.vocabulary.fields import deleted_marker_name

    long_key = "k" * 256
    for key in ("nightly", long_key, "bulk"):
        sc.add(key, "t", cron="@daily", source="file:backup.yml", now=T0)
    value = "d" * 64 + " file:backup.yml"
    assert sc["nightly"].delete(marker=lambda info: value) == 0
    assert sc[long_key].delete(marker=lambda info: "e" * 64 + " file:" + "n" * 185) == 0
    sc["bulk"].delete(marker=lambda info: "f" * 64 + " file:backup.yml")
    markers = sc.deleted_markers()
    assert markers == {deleted_marker_name("nightly"): value,
                       deleted_marker_name(long_key): "e" * 64 + " file:" + "n" * 185,
                       deleted_marker_name("bulk"): "f" * 64 + " file:backup.yml"}
    assert sc.store.paused_all() is None  # the pause --all row is no marker, nor the reverse
    # No row, no delete, no marker: a second forced delete of the key changes nothing.
    with pytest.raises(NotFoundError):
        sc["gone"].delete(marker=lambda info: "0" * 64 + " file:x.yml")
    assert deleted_marker_name("gone") not in sc.deleted_markers()
    # Added again, by add (insert) or in bulk (insert_many): the marker goes with it.
    sc.add("nightly", "t", cron="@hourly", now=T0)
    sc.add_many([{"key": "bulk", "type": "t", "cron": "@daily", "now": T0},
                 {"key": "other", "type": "t", "cron": "@daily", "now": T0}])
    assert sc.deleted_markers() == {deleted_marker_name(long_key): markers[
        deleted_marker_name(long_key)]}
    # drop_deleted_markers ends them (names without a marker are no error).
    sc.drop_deleted_markers([deleted_marker_name(long_key), deleted_marker_name("none")])
    assert sc.deleted_markers() == {}
    # A delete with no marker writes none.
    sc["other"].delete()
    assert sc.deleted_markers() == {}


def test_a_forced_delete_s_marker_is_made_from_the_row_as_it_is_deleted(
        sc: ScheduleCollection) -> None:
    """The marker is computed in the delete's transaction, from the row deleted: an entry
    changed since the caller read it (a convergence) is marked as it is, or it would come
    back at the next apply.  A marker that refuses (raises) deletes nothing and marks
    nothing; one that gives None marks nothing."""
    from perfectschedd.vocabulary.fields import deleted_marker_name

    sc.add("nightly", "t", cron="@daily", source="file:backup.yml", now=T0)
    read_before = sc["nightly"].info()
    sc["nightly"].modify(cron="@hourly", file_entry=True, now=T0)  # a convergence, meanwhile
    seen: list[Any] = []
    with pytest.raises(ScheduleError, match="changed"):
        sc["nightly"].delete(marker=lambda info: seen.append(info) or _refuse("changed"))
    assert sc["nightly"].info().cron == "@hourly" and sc.deleted_markers() == {}
    assert seen[0].cron == "@hourly" and read_before.cron == "@daily"
    sc["nightly"].delete(marker=lambda info: f"{info.cron:>64} {info.source}")
    assert sc.deleted_markers() == {
        deleted_marker_name("nightly"): f"{'@hourly':>64} file:backup.yml"}
    assert not sc["nightly"].exists()
    sc.add("plain", "t", cron="@daily", now=T0)
    sc["plain"].delete(marker=lambda info: None)
    assert not sc["plain"].exists() and deleted_marker_name("plain") not in sc.deleted_markers()


def _refuse(why: str) -> str:
    raise ScheduleError(why)


def test_a_batch_add_ends_the_markers_of_its_own_keys_only(sc: ScheduleCollection) -> None:
    """add_many reads the markers of forced deletes once for the whole batch: those of its
    keys end, wherever in a batch of more than 500 they are; the others stay."""
    from perfectschedd.vocabulary.fields import deleted_marker_name

    for key in ("j3", "j1100", "elsewhere"):
        sc.add(key, "t", cron="@daily", source="file:a.yml", now=T0)
        sc[key].delete(marker=lambda info: "a" * 64 + " file:a.yml")
    assert len(sc.deleted_markers()) == 3
    sc.add_many([{"key": f"j{i}", "type": "t", "cron": "@daily", "now": T0}
                 for i in range(1200)])
    assert set(sc.deleted_markers()) == {deleted_marker_name("elsewhere")}
    assert len(sc.list()) == 1200


def test_keys_matching_reads_every_slice_and_stops_at_the_limit(sc: ScheduleCollection
                                                                  ) -> None:
    """The master's check for keys stored before today's rules reads the table in slices:
    the keys it wants may be in any of them, and it stops once it has `limit`."""
    keys = [f"k{i:02d}" for i in range(11)]
    sc.add_many([{"key": k, "type": "t", "cron": "@daily", "now": T0} for k in keys])
    wanted = {"k00", "k04", "k05", "k10"}  # the first slice, two in the middle, the last
    seen: list[str] = []

    def bad(key: str) -> bool:
        seen.append(key)
        return key in wanted

    assert sc.store.keys_matching(bad, slice_rows=3) == sorted(wanted)
    assert seen == keys  # each key once, in key order, across four slices
    assert sc.store.keys_matching(lambda k: k in wanted, limit=2, slice_rows=3) == [
        "k00", "k04"]


def test_last_outcome_of_a_run_on_a_row_of_its_own_is_its_schedules(
        sc: ScheduleCollection) -> None:
    """Notifications ask what came before a run; for a KEY@run-... run (an extra run, an
    allow schedule's occurrence), the latest run of KEY itself or of any of its rows
    before it, never of another schedule's (on SQLite and PostgreSQL, one whose key
    differs in case only, which LIKE matches on SQLite; MariaDB's keys compare without
    case: one schedule there)."""
    def run(key: str, outcome: str, at: float) -> dict[str, Any]:
        return {"key": key, "type": "t", "scheduled_time": T0, "attempt": 1,
                "started_at": at, "finished_at": at + 1, "outcome": outcome,
                "worker": "w", "unit": None}

    sc.store.record_runs([run("k", "success", 100.0), run("k@run-110-aa", "failed", 110.0),
                          run("kk@run-130-cc", "success", 130.0),
                          run("k@run-140-dd", "skipped", 140.0)])
    if sc.store.dialect != "mysql":
        sc.store.record_runs([run("K@run-120-bb", "success", 120.0)])
    outcomes = ("success", "failed", "timeout", "lost")
    assert sc.store.last_outcome("k@run-200-ee", 200.0, outcomes) == "failed"
    assert sc.store.last_outcome("k@run-200-ee", 105.0, outcomes) == "success"
    assert sc.store.last_outcome("k@run-200-ee", 100.0, outcomes) is None
    assert sc.store.last_outcome("k", 200.0, outcomes) == "success"  # its own rows only


def test_keys_differing_in_case_only_are_apart(sc: ScheduleCollection) -> None:
    """On SQLite (as on PostgreSQL) "db" and "DB" are two schedules: a key prefix reads
    the keys that start with it exactly, although LIKE ignores case there: `list
    --prefix`, a schedule's extra runs (`show`), its history (with its extra runs') and
    whether its group is busy (`run`)."""
    if sc.store.dialect == "mysql":
        pytest.skip("MariaDB's keys compare without case (its collation): one schedule")
    for key in ("db", "DB", "db2", "DBx"):
        sc.add(key, "t", cron="0 * * * *", next_time=T0 + H, now=T0)
    other = sc["DB"].run_now(now=T0 + 10)
    task = sc.poll(now=T0 + 10)  # DB's extra run is running: its lease is live
    assert task is not None and task.key == other
    sc.store.record_runs([{"key": k, "type": "t", "scheduled_time": T0, "attempt": 1,
                           "started_at": T0 + 1, "finished_at": T0 + 2, "outcome": "success",
                           "worker": "w", "unit": None}
                          for k in ("db", "DB", "db@run-1-aa", "DB@run-1-bb")])
    assert [s.key for s in sc.list(prefix="db")] == ["db", "db2"]
    assert sc.extra_runs("db") == [] and [r.key for r in sc.extra_runs("DB")] == [other]
    assert sorted(r["key"] for r in sc.history("db", 10)) == ["db", "db@run-1-aa"]
    assert not sc.store.group_busy("db@run-9-cc", "db", T0 + 10)
    assert sc.store.group_busy("DB@run-9-cc", "DB", T0 + 10)


def test_history_is_bounded_per_schedule_also_for_rows_of_their_own(
        sc: ScheduleCollection) -> None:
    """prune_history keeps the newest runs of each key; an allow schedule's occurrences
    and its extra runs each have a key of their own (KEY@run-...), one run each, so per
    key nothing was ever pruned: such a schedule's history grew by a row per occurrence
    for good.  Its runs are bounded together, as `history KEY` lists them."""
    def run(key: str, at: float) -> dict[str, Any]:
        return {"key": key, "type": "t", "scheduled_time": T0, "attempt": 1,
                "started_at": at, "finished_at": at + 1, "outcome": "success",
                "worker": "w", "unit": None}

    sc.store.record_runs([run("k", 100.0), run("k", 110.0)]
                         + [run(f"k@run-{i}-ab", 200.0 + i) for i in range(6)]
                         + [run("few", 100.0), run("few@run-1-ab", 110.0)]
                         + [run("solo", 100.0 + i) for i in range(5)])
    sc.store.prune_history(3)
    assert [r["key"] for r in sc.history("k", 100)] == [f"k@run-{i}-ab" for i in (5, 4, 3)]
    assert len(sc.history("few", 100)) == 2  # within the bound: untouched
    assert len(sc.history("solo", 100)) == 3
    sc.store.prune_history(3)  # nothing more to do
    assert len(sc.history("k", 100)) == 3


def test_series_rows_and_their_last_success_and_failure(sc: ScheduleCollection) -> None:
    """The schedules with series of their own (metrics/schedule_series.py), on every backend:
    asked by policy or by a route's default and not refused, files' first, then root's,
    bounded; their latest success and failure, extra runs' included."""
    sc.add("m-member", "t", cron="@daily", now=T0, metrics=True, creator=1000)
    sc.add("a-member", "t", cron="@daily", now=T0, metrics=True, creator=1000)
    sc.add("z-root", "t", cron="@daily", now=T0, metrics=True, creator=0)
    sc.add("routed", "chatty", cron="@daily", now=T0, creator=1000)
    sc.add("refuses", "chatty", cron="@daily", now=T0, metrics=False, creator=1000)
    sc.add("plain", "t", cron="@daily", now=T0, creator=1000)
    rows, total = sc.store.series_rows({"chatty"}, 10)
    assert [r.key for r in rows] == ["z-root", "a-member", "m-member", "routed"]
    assert total == 4
    rows, total = sc.store.series_rows(set(), 2)
    assert ([r.key for r in rows], total) == (["z-root", "a-member"], 3)
    assert sc.store.series_rows(set(), 0) == ([], 3)

    def run(key: str, outcome: str, ended: float) -> dict[str, Any]:
        return {"key": key, "type": "t", "scheduled_time": T0, "attempt": 1,
                "started_at": ended - 1, "finished_at": ended, "outcome": outcome,
                "worker": "w"}
    sc.store.record_runs([run("z-root", "success", T0 + 10), run("z-root", "failed", T0 + 20),
                          run("z-root@run-1-ab", "success", T0 + 30),
                          run("a-member", "timeout", T0 + 5), run("a-member", "later", T0 + 9),
                          run("z-rooted", "success", T0 + 99)])  # another key's
    assert sc.store.last_success_and_failure(["z-root", "a-member", "m-member"]) == {
        "z-root": (T0 + 30, T0 + 20), "a-member": (None, T0 + 5), "m-member": (None, None)}
