"""The Supervisor in-process: its process layer replaced by one that records instead of
forking (gunicorn tests its Arbiter the same way).  Real pipes, a real process group for
the run that must be killed; no worker processes."""

from __future__ import annotations

import contextlib
import math
import os
import selectors
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import perfectschedd
from perfectschedd import config
from perfectschedd.master import supervisor
from perfectschedd.master.cleanup import UnitStopper
from perfectschedd.master.processes import Processes
from perfectschedd.master.supervisor import Supervisor
from perfectschedd.schedules.collection import ScheduleCollection
from perfectschedd.settings import unit_props


class RecordingProcesses(Processes):
    """Forks nothing: each 'worker' is a pair of real pipes and a made-up pid."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int, int]] = []
        self.exits: list[tuple[int, int]] = []
        self.alive_w: dict[int, int] = {}
        self.next_pid = 900_000
        self.before_fork: Callable[[], None] | None = None  # called at each fork

    def fork(self, child: Callable[[int, int], int]) -> tuple[int, int, int]:
        if self.before_fork is not None:
            self.before_fork()
        self.next_pid += 1
        wake_r, wake_w = os.pipe()
        alive_r, alive_w = os.pipe()
        os.close(wake_r)
        os.set_blocking(alive_r, False)
        self.alive_w[self.next_pid] = alive_w
        self.events.append(("fork", self.next_pid, 0))
        return self.next_pid, wake_w, alive_r

    def kill(self, pid: int, sig: int) -> None:
        self.events.append(("kill", pid, sig))

    def drain(self, pid: int, fd: int) -> bool:
        self.events.append(("drain", pid, 0))
        return True

    def reap(self) -> list[tuple[int, int]]:
        done, self.exits = self.exits, []
        return done

    def say(self, pid: int, *lines: str) -> None:
        os.write(self.alive_w[pid], "".join(f"{line}\n" for line in lines).encode())

    def die(self, pid: int, code: int) -> None:
        os.close(self.alive_w.pop(pid))
        self.exits.append((pid, code))

    def forks(self) -> list[int]:
        return [pid for what, pid, _ in self.events if what == "fork"]


@pytest.fixture
def sup(tmp_path: Path) -> Iterator[tuple[Supervisor, RecordingProcesses]]:
    cfg = config.load({"type": "rdb_compat", "url": f"sqlite:///{tmp_path / 'db'}",
                           "workers": 2, "worker_timeout": 5,
                           "control_socket": str(tmp_path / "s.sock")})
    procs = RecordingProcesses()
    s = Supervisor(cfg, str(tmp_path / "cfg.yml"), None, processes=procs)
    # The master here is the test process: a sweep for orphans would kill its children
    # (the test database servers).  tests/master/test_orphan_sweep.py covers the sweep.
    s.cleanup.next_sweep = math.inf
    yield s, procs
    s.db.stop(timeout=1)


def test_starts_the_configured_workers_and_replaces_a_dead_one(
        sup: tuple[Supervisor, RecordingProcesses]) -> None:
    s, procs = sup
    s.manage_workers()
    first = procs.forks()
    assert len(first) == 2
    for pid in first:
        procs.say(pid, "0 1 0.1 0")
        s.read_alive(pid)
    assert s.table.all_pinged()
    procs.die(first[0], -9)
    s.reap()
    s.manage_workers()
    assert len(procs.forks()) == 2  # a quick death: not before the back-off
    s.table.next_spawn = 0.0
    s.manage_workers()
    assert len(procs.forks()) == 3 and s.table.restarts == 1


def test_a_dead_workers_runs_are_killed_before_its_replacement_starts(
        sup: tuple[Supervisor, RecordingProcesses]) -> None:
    s, procs = sup
    s.manage_workers()
    victim = procs.forks()[0]
    job = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        procs.say(victim, "s 1.1.1", f"g 1.1.1 {job.pid}")
        procs.die(victim, -9)
        s.reap()
        assert job.wait(5) == -signal.SIGKILL  # killed inside reap(), before any fork
        assert len(procs.forks()) == 2
        s.table.next_spawn = 0.0  # past the back-off
        s.manage_workers()
        assert len(procs.forks()) == 3
    finally:
        if job.poll() is None:
            job.kill()


class RecordingSelector(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
    """The real selector, noting how long each select() may wait."""

    def __init__(self) -> None:
        super().__init__()
        self.timeouts: list[float | None] = []

    def select(self, timeout: float | None = None) -> list[Any]:
        self.timeouts.append(timeout)
        return super().select(timeout)


def test_pings_read_in_a_turn_put_off_make_the_daemon_ready_at_turn_min(
        sup: tuple[Supervisor, RecordingProcesses], monkeypatch: pytest.MonkeyPatch) -> None:
    """The workers' first pings arrive within TURN_MIN of the last whole turn: the turn
    that reads them puts off the rest (readiness included), and the next one comes after
    what is left of TURN_MIN, not when something next wakes the loop (up to 0.5 s)."""
    # A TURN_MIN long enough that a loaded machine cannot stall past it between the two
    # turns below, and still shorter than the loop's 0.5 s wait.
    monkeypatch.setattr(supervisor, "TURN_MIN", 0.4)
    s, procs = sup
    s.sel.close()
    s.sel = RecordingSelector()
    s.db.first_open.set()  # the first try to open the database has ended
    s.manage_workers()
    pids = procs.forks()
    assert len(pids) == 2
    for pid in pids:
        procs.say(pid, "0 1 0.1 0")
    s.last_turn = time.monotonic()  # a whole turn just ran
    s._loop_once()
    assert s.table.all_pinged() and not s.ready  # read; the rest of the turn put off
    s._loop_once()
    assert s.ready
    assert s.sel.timeouts[-1] is not None and s.sel.timeouts[-1] <= 0.4


def test_a_silent_worker_is_killed_and_a_database_wait_is_not(
        sup: tuple[Supervisor, RecordingProcesses]) -> None:
    s, procs = sup
    s.manage_workers()
    silent, waiting = procs.forks()
    procs.say(waiting, "0 1 30.0 1")
    s.read_alive(waiting)
    s.table.procs[silent].last_seen = time.monotonic() - 6
    s.manage_workers()
    assert ("kill", silent, signal.SIGKILL) in procs.events
    assert not any(e[0] == "kill" and e[1] == waiting for e in procs.events)


def test_reload_starts_a_generation_then_drains_the_old_one(
        sup: tuple[Supervisor, RecordingProcesses]) -> None:
    s, procs = sup
    s.manage_workers()
    old = procs.forks()
    s.table.begin_reload(2, 5, time.monotonic())
    s.manage_workers()
    new = procs.forks()[2:]
    assert len(new) == 2
    s._finish_reload()
    assert not any(e[0] in ("kill", "drain") for e in procs.events)  # new ones not up yet
    for pid in new:
        procs.say(pid, "0 1")
        s.read_alive(pid)
    s._finish_reload()
    # Told to drain, never signalled: their jobs run on.
    assert sorted(pid for what, pid, _ in procs.events if what == "drain") == sorted(old)
    assert not any(e[0] == "kill" for e in procs.events)
    s._finish_reload()
    assert len([e for e in procs.events if e[0] == "drain"]) == 2  # once each
    # A draining worker that gives back queued work wakes the others at once.
    procs.say(old[0], "b")
    s.read_alive(old[0])
    assert s.wake_pending
    # Its exit is no death: nothing replaces it.
    procs.die(old[0], 0)
    s.reap()
    s.table.next_spawn = 0.0
    s.manage_workers()
    assert len(procs.forks()) == 4 and s.table.restarts == 0


def test_no_fork_while_a_master_database_call_is_in_flight(
        sup: tuple[Supervisor, RecordingProcesses]) -> None:
    s, procs = sup
    with s.db._gate():  # as a control thread inside a query
        s.manage_workers()
        assert procs.forks() == [] and s.spawn_postponed
    s.manage_workers()
    assert len(procs.forks()) == 2 and not s.spawn_postponed


def test_a_dead_workers_units_stop_off_the_loop_and_hold_its_replacement_and_give_back(
        tmp_path: Path) -> None:
    """systemd (or the bus) slow to stop a dead worker's unit: reap() returns at once (the
    loop, its watchdog and `status` go on), but the worker's index gets no replacement and
    its lease stays held until the unit has stopped; then both happen."""
    systemd_done = threading.Event()
    asked: list[tuple[list[str], bool, bool]] = []

    def slow_systemd(belongs: Callable[[str, str], bool], names: list[str]) -> list[str]:
        mark = f"(worker {cfg.node}:{victim})"
        ours = unit_props.daemon_tag(cfg.control_socket)
        another = unit_props.daemon_tag(cfg.control_socket + ".other")
        asked.append((names, belongs("perfectsched-k-1.service", f"PerfectSched job k {mark}")
                      and belongs("perfectsched-k-1.service",
                                  f"PerfectSched job k {ours} {mark}"),
                      belongs("perfectsched-k-1.service", "PerfectSched job k (worker x:1)")
                      # Another daemon of this host whose worker had the same pid.
                      or belongs("perfectsched-k-1.service",
                                 f"PerfectSched job k {another} {mark}")))
        systemd_done.wait(10)
        return names

    s, procs = units_supervisor(tmp_path, 2, slow_systemd)
    cfg = s.config
    try:
        victim, other = procs.forks()
        with unit_run_of_a_dying_worker(s, procs, victim) as sc:
            began = time.monotonic()
            s.reap()
            assert time.monotonic() - began < 1.0  # not waiting on systemd
            wait_until(lambda: bool(asked), "systemd asked to stop the unit")
            assert asked[0] == (["perfectsched-k-1.service"], True, False)
            s.table.next_spawn = 0.0  # past the back-off
            s.manage_workers()
            time.sleep(1.0)  # a give-back, were it not held, would be written by now
            assert procs.forks() == [victim, other]
            assert sc["k"].info().owner == f"{cfg.node}:{victim}"

            systemd_done.set()
            wait_until(lambda: sc["k"].info().owner is None, "the lease given back")
            assert [r["outcome"] for r in sc.store.history("k", 10)] == ["lost"]
            wait_until(lambda: (s.manage_workers(), len(procs.forks()) == 3)[1],
                       "the replacement forked")
    finally:
        systemd_done.set()
        s.unit_cleanups.join(5)
        s.db.stop(timeout=1)



def test_units_that_could_not_be_stopped_keep_their_leases(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """systemd does not answer: the worker is replaced (its units are systemd's to bound,
    RuntimeMaxSec=), but its leases are not given back early; they expire after
    alive_time, as they would were the whole host gone."""
    from perfectschedd.executors.systemd.bus import SystemdError

    def dead_systemd(belongs: Callable[[str, str], bool], names: list[str]) -> list[str]:
        raise SystemdError("no answer from systemd within 20s")

    s, procs = units_supervisor(tmp_path, 1, dead_systemd)
    cfg = s.config
    try:
        victim = procs.forks()[0]
        with unit_run_of_a_dying_worker(s, procs, victim) as sc:
            s.reap()
            s.unit_cleanups.join(5)
            s.table.next_spawn = 0.0
            wait_until(lambda: (s.manage_workers(), len(procs.forks()) == 2)[1],
                       "the replacement forked")
            time.sleep(1.0)  # a give-back would be written by now
            assert sc["k"].info().owner == f"{cfg.node}:{victim}"
            assert sc.store.history("k", 10) == []
        assert (f"cannot stop the systemd units of worker 0 (pid {victim}): no answer from "
                "systemd within 20s; their leases expire after alive_time") in caplog.text
    finally:
        s.unit_cleanups.join(5)
        s.db.stop(timeout=1)

def units_supervisor(tmp_path: Path, workers: int, stopper: UnitStopper
                     ) -> tuple[Supervisor, RecordingProcesses]:
    """A Supervisor whose routes run systemd units, its database open, workers forked."""
    cfg = config.load({"type": "rdb_compat", "url": f"sqlite:///{tmp_path / 'db'}",
                           "workers": workers, "worker_timeout": 5,
                           "control_socket": str(tmp_path / "s.sock"),
                           "routes": [{"type": "u", "exec": ["/bin/true"],
                                       "executor": "systemd"}]})
    procs = RecordingProcesses()
    s = Supervisor(cfg, str(tmp_path / "cfg.yml"), None, processes=procs,
                   unit_stopper=stopper)
    s.db.start()
    wait_until(lambda: (s.manage_workers(), len(procs.forks()) == workers)[1],
               "the workers forked (after the master's first query)")
    return s, procs


@contextlib.contextmanager
def unit_run_of_a_dying_worker(s: Supervisor, procs: RecordingProcesses, victim: int
                               ) -> Iterator[ScheduleCollection]:
    """Schedule "k" leased by worker `victim`, which reported its unit and then died of
    SIGKILL (not reaped yet)."""
    with perfectschedd.open({"type": "rdb_compat", "url": s.config.url}) as sc:
        sc.owner = f"{s.config.node}:{victim}"
        due = int(time.time()) // 60 * 60
        sc.add("k", "u", cron="* * * * *", next_time=due, now=due)
        assert sc.poll(now=due + 1) is not None
        procs.say(victim, "u 1.1.1 perfectsched-k-1.service")
        procs.die(victim, -9)
        yield sc


def wait_until(cond: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_workers_are_forked_once_the_store_is_open(tmp_path: Path) -> None:
    """The master opens its store before the first fork: the workers share what opening
    built, and each is handed that store (store_for_worker) instead of opening one."""
    cfg = config.load({"type": "rdb_compat", "url": f"sqlite:///{tmp_path / 'db'}",
                           "workers": 2, "worker_timeout": 5,
                           "control_socket": str(tmp_path / "s.sock")})
    procs = RecordingProcesses()
    s = Supervisor(cfg, str(tmp_path / "cfg.yml"), None, processes=procs)
    at_fork: list[tuple[bool, bool]] = []
    procs.before_fork = lambda: at_fork.append(
        (s.db.first_open.is_set(), s.db.store_for_worker(s.config) is s.db.store))
    try:
        s.db.start()
        s.manage_workers()  # at once, while the store is (most likely) still opening
        wait_until(lambda: (s.manage_workers(), len(procs.forks()) == 2)[1],
                   "the workers forked")
        assert at_fork == [(True, True), (True, True)]
    finally:
        s.db.stop(timeout=1)
