"""workertable.py: the master's decisions, in-process, time passed in."""

from __future__ import annotations

from perfectschedd.master.workertable import (
    BACKOFF_MAX,
    DRAIN_ROOM,
    QUICK_DEATH,
    WorkerProc,
    WorkerTable,
)


def proc(pid: int, index: int, generation: int = 0, at: float = 0.0) -> WorkerProc:
    return WorkerProc(pid, index, generation, -1, -1, started=at, last_seen=at)


def test_missing_workers_are_started_and_surplus_drained() -> None:
    t = WorkerTable(3, 30)
    assert t.missing(0) == [0, 1, 2]
    t.add(proc(10, 0))
    t.add(proc(12, 2))
    assert t.missing(0) == [1]
    assert t.begin_reload(1, 30, now=1)
    assert t.missing(1) == [0]  # the new generation starts from scratch
    t.add(proc(20, 0, generation=1, at=1))
    t.add(proc(21, 1, generation=1, at=1))  # e.g. spawned before `workers` went down
    assert [p.pid for p in t.surplus(2)] == [21]
    assert t.procs[21].draining_since == 2  # drained, not stopped: its jobs run on
    assert t.surplus(3) == []  # marked once
    assert t.missing(3) == []  # a draining worker is not replaced


def test_quick_deaths_back_off_doubling_to_a_cap_and_a_long_life_resets_it() -> None:
    t = WorkerTable(1, 30)
    now = 0.0
    delays = []
    for pid in range(100, 110):
        t.add(proc(pid, 0, at=now))
        ended = t.exited(pid, now + 1, stopping=False)
        assert ended is not None and ended.unexpected
        delays.append(ended.backoff)
        assert t.missing(now + 1) == []  # not before the back-off
        now = t.next_spawn
        assert t.missing(now) == [0]
    assert delays[:4] == [0.5, 1.0, 2.0, 4.0] and delays[-1] == BACKOFF_MAX
    t.add(proc(200, 0, at=now))
    ended = t.exited(200, now + QUICK_DEATH + 1, stopping=False)
    assert ended is not None and ended.backoff is None and t.spawn_failures == 0
    assert t.restarts == 11


def test_draining_and_stopping_exits_are_not_deaths() -> None:
    t = WorkerTable(2, 30)
    t.add(proc(1, 0))
    t.add(proc(2, 1))
    t.procs[1].draining_since = 0.5
    a = t.exited(1, 1, stopping=False)
    b = t.exited(2, 1, stopping=True)
    assert a is not None and b is not None and not a.unexpected and not b.unexpected
    assert t.restarts == 0 and t.exited(3, 1, stopping=False) is None  # not a worker


def test_silent_and_wedged_workers_are_killed_but_not_those_waiting_on_the_database() -> None:
    t = WorkerTable(4, 10)
    t.add(proc(1, 0))              # never heard from again: silent
    t.add(proc(2, 1))              # pings, but its loop stopped outside the database
    t.add(proc(3, 2))              # pings, its loop waits on the database
    t.add(proc(4, 3))              # healthy
    t.procs[2].report(b"0 1 11.0 0", now=20)
    t.procs[3].report(b"0 1 60.0 1", now=20)
    t.procs[4].report(b"0 1 0.5 0", now=20)
    found = {p.pid: why for p, why in t.unresponsive(20.5)}
    assert set(found) == {1, 2}
    assert found[1].startswith("silent") and "outside a database call" in found[2]
    assert t.unresponsive(21) == []  # one kill per timeout period


def test_reports_track_runs_and_ignore_cut_lines() -> None:
    p = proc(1, 0)
    for line in (b"s 1.2.3", b"g 1.2.3 4242", b"s 1.2.4", b"g 1.2", b"", b"\xff\xfe 1", b"3 0"):
        p.report(line, now=5)
    assert p.runs == {"1.2.3": 4242, "1.2.4": None}
    assert (p.running, p.db_ok, p.pinged, p.last_seen) == (3, False, True, 5)
    p.report(b"e 1.2.3", now=6)
    assert p.runs == {"1.2.4": None}


def test_reload_retires_the_old_generation_once_the_new_one_is_up() -> None:
    t = WorkerTable(2, 10)
    t.add(proc(1, 0))
    t.add(proc(2, 1))
    t.begin_reload(2, 10, now=100)
    assert t.finish_reload(101) is None
    t.add(proc(3, 0, generation=1, at=101))
    t.add(proc(4, 1, generation=1, at=101))
    assert t.finish_reload(102) is None  # not pinged yet
    for pid in (3, 4):
        t.procs[pid].report(b"0 1", now=102)
    assert sorted(p.pid for p in t.finish_reload(102) or []) == [1, 2]
    assert t.finish_reload(103) is None


def test_reload_that_never_comes_up_still_retires_after_worker_timeout() -> None:
    t = WorkerTable(1, 10)
    t.add(proc(1, 0))
    t.begin_reload(1, 10, now=0)
    assert t.finish_reload(5) is None
    assert [p.pid for p in t.finish_reload(10.5) or []] == [1]


# -- reload: drains ---------------------------------------------------------------------


def up(t: WorkerTable, *pids: int, now: float) -> None:
    for pid in pids:
        t.procs[pid].report(b"0 1 0.1 0", now=now)


def test_reload_drains_the_old_generation_once_the_new_one_is_up() -> None:
    t = WorkerTable(2, 30)
    t.add(proc(1, 0))
    t.add(proc(2, 1))
    up(t, 1, 2, now=0)
    assert t.begin_reload(2, 30, now=1)
    assert t.generation == 1 and t.missing(1) == [0, 1]
    t.add(proc(11, 0, generation=1, at=1))
    t.add(proc(12, 1, generation=1, at=1))
    assert t.finish_reload(2) is None  # not up yet: the old ones go on claiming
    assert [p.pid for p in t.active()] == [1, 2, 11, 12]
    up(t, 11, 12, now=2)
    old = t.finish_reload(3)
    assert old is not None and sorted(p.pid for p in old) == [1, 2]
    assert [p.draining_since for p in old] == [3, 3]
    assert sorted(p.pid for p in t.drains_to_send()) == [1, 2]
    t.procs[1].drain_sent = True
    assert [p.pid for p in t.drains_to_send()] == [2]  # its pipe was full: again
    assert sorted(p.pid for p in t.active()) == [11, 12]
    assert sorted(p.pid for p in t.draining()) == [1, 2]
    assert t.finish_reload(4) is None  # said once
    assert t.missing(4) == []
    # A draining worker that dies is not replaced, and is no death (no back-off).
    ended = t.exited(1, 4, stopping=False)
    assert ended is not None and not ended.unexpected and t.restarts == 0
    assert t.missing(4) == []


def test_a_new_generation_that_does_not_come_up_still_drains_the_old_one_in_time() -> None:
    t = WorkerTable(1, 10)
    t.add(proc(1, 0))
    assert t.begin_reload(1, 10, now=0)
    t.add(proc(2, 0, generation=1))
    assert t.finish_reload(10) is None
    old = t.finish_reload(10.5)
    assert old is not None and [p.pid for p in old] == [1]


def test_draining_workers_are_still_watched_for_silence() -> None:
    t = WorkerTable(1, 10)
    t.add(proc(1, 0))
    t.procs[1].draining_since = 0
    t.procs[1].drain_sent = True
    assert [p.pid for p, _ in t.unresponsive(11)] == [1]


def test_reloads_in_a_row_drain_side_by_side_within_the_bound() -> None:
    """Each generation keeps one long job per worker: two drains run side by side, a third
    reload waits (reload_pending) until one of them ends, then starts at once."""
    workers = 2
    t = WorkerTable(workers, 30)
    pid = iter(range(100, 200))
    now = 0.0

    def generation() -> list[int]:
        pids = [next(pid) for _ in range(workers)]
        for i, p in enumerate(pids):
            t.add(proc(p, i, generation=t.generation, at=now))
        up(t, *pids, now=now)
        return pids

    gens = [generation()]
    for _ in range(DRAIN_ROOM):
        now += 1
        assert t.begin_reload(workers, 30, now)
        gens.append(generation())
        old = t.finish_reload(now)
        assert old is not None and {p.pid for p in old} == set(gens[-2])
        assert len(t) <= (1 + DRAIN_ROOM) * workers
    assert len(t) == (1 + DRAIN_ROOM) * workers  # two generations drain side by side
    now += 1
    assert not t.begin_reload(workers, 30, now)  # a third: no room
    assert t.reload_pending == (workers, 30) and t.missing(now) == []
    assert not t.start_pending(now + 1) and t.generation == DRAIN_ROOM
    t.exited(gens[0][0], now + 2, stopping=False)  # one drain ends: still no room
    assert not t.start_pending(now + 2)
    t.exited(gens[0][1], now + 3, stopping=False)  # the other: room
    assert t.start_pending(now + 3) and t.reload_pending is None
    assert t.generation == DRAIN_ROOM + 1 and t.missing(now + 3) == [0, 1]


def test_a_later_reload_replaces_a_pending_one_and_the_bound_follows_workers() -> None:
    t = WorkerTable(1, 30)
    for p in range(1, 4):
        t.add(proc(p, 0))
        t.procs[p].draining_since = 0
    assert not t.begin_reload(1, 30, 1)  # 3 workers > DRAIN_ROOM x 1
    assert t.size == 1 and t.generation == 0
    assert t.begin_reload(2, 20, 2)  # 3 <= DRAIN_ROOM x 2: starts, with its own figures
    assert (t.size, t.worker_timeout, t.generation, t.reload_pending) == (2, 20, 1, None)
