"""executors/reaper.py: finding and killing what exec runs left behind.  Real processes
carrying PERFECTSCHED_RUN_ID (the variable the module's docstring names), real process
groups, SIGKILL; processes of other runs, and strangers, must survive."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_harness import wait_until

from perfectschedd.executors import reaper, runmarks

RUN_ID_ENV = "PERFECTSCHED_RUN_ID"
# Run ids no real worker has (pids are below 2**22): this test's only, even though
# kill_marked looks at every process of the machine.
_ids = itertools.count()


def new_run(worker: int = 4_000_000 + os.getpid()) -> str:
    return f"{worker}.{next(_ids)}"


def gone(pid: int) -> bool:
    """Dead: no longer in /proc, or a zombie waiting for its parent."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except OSError:
        return True


class Procs:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.started: list[subprocess.Popen[bytes]] = []
        self.pids: list[int] = []

    def spawn(self, script: str, run: str | None, *, session: bool = False
              ) -> subprocess.Popen[bytes]:
        env = {k: v for k, v in os.environ.items() if k != RUN_ID_ENV}
        if run is not None:
            env[RUN_ID_ENV] = run
        p = subprocess.Popen(["/bin/sh", "-c", script], env=env, start_new_session=session)
        self.started.append(p)
        self.pids.append(p.pid)
        return p

    def sleeper(self, run: str | None, *, session: bool = False) -> int:
        return self.spawn("exec sleep 30", run, session=session).pid

    def grandchild(self, script: str, run: str | None, *, session: bool = False
                   ) -> tuple[subprocess.Popen[bytes], int]:
        """`script` starts a process in the background and writes its pid to $1."""
        out = self.tmp / f"pid{len(self.started)}"
        p = self.spawn(script.replace("$OUT", str(out)), run, session=session)
        pid = int(wait_until(lambda: out.exists() and out.read_text().strip(), 5,
                             what="the grandchild's pid"))
        self.pids.append(pid)
        return p, pid

    def reap(self) -> None:
        for p in self.started:
            if p.poll() is None:
                p.kill()
            p.wait(5)

    def cleanup(self) -> None:
        for pid in self.pids:
            for send in (os.killpg, os.kill):
                try:
                    send(pid, signal.SIGKILL)
                except OSError:
                    pass
        self.reap()


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    yield p
    p.cleanup()


def env_ready(pid: int, run: str | None) -> None:
    """Wait until the process has exec'd with its final environment."""
    wait_until(lambda: runmarks.run_id(pid) == run and
               Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"sleep"), 5,
               what=f"process {pid} ready")


def test_run_id_parent_children_of_real_processes(procs: Procs) -> None:
    run = new_run()
    marked = procs.sleeper(run)
    plain = procs.sleeper(None)
    env_ready(marked, run)
    env_ready(plain, None)
    assert runmarks.run_id(marked) == run
    assert runmarks.run_id(plain) is None
    assert reaper.parent(marked) == os.getpid()
    kids = reaper.children(os.getpid())
    assert marked in kids and plain in kids
    assert reaper.children(marked) == []
    assert marked in runmarks.all_pids() and os.getpid() in runmarks.all_pids()
    # Gone, or never there: nothing, and no exception.
    assert runmarks.run_id(2**22 + 1) is None
    assert reaper.parent(2**22 + 1) is None
    assert reaper.children(2**22 + 1) == []
    # Another user's process (init): its environment is not ours to read, or has no mark.
    assert runmarks.run_id(1) is None


def test_kill_marked_kills_a_runs_processes_and_only_those(procs: Procs) -> None:
    worker = 4_100_000 + os.getpid() % 100_000
    doomed = [new_run(worker), new_run(worker)]
    other = new_run(worker + 1)
    victims = [procs.sleeper(doomed[0]), procs.sleeper(doomed[1])]
    # A process that left the run's group (setsid) is still marked and found.
    _, escaped = procs.grandchild("setsid sleep 30 & echo $! > $OUT; wait", doomed[0])
    survivors = [procs.sleeper(other), procs.sleeper(None)]
    for pid, run in [(victims[0], doomed[0]), (victims[1], doomed[1]),
                     (escaped, doomed[0]), (survivors[0], other), (survivors[1], None)]:
        env_ready(pid, run)
    assert os.getsid(escaped) == escaped  # its own session: not in any group of ours

    count = runmarks.kill_marked(lambda r: reaper.worker_of(r) == worker, me=os.getpid())
    # The three marked sleepers and the sh that started the escaped one (marked too).
    assert count == 4
    wait_until(lambda: all(gone(p) for p in [*victims, escaped]), 5, what="victims dead")
    assert not any(gone(p) for p in survivors)
    assert runmarks.run_id(survivors[0]) == other
    # Nothing left of the run: a second pass finds nothing.
    assert runmarks.kill_marked(lambda r: r in doomed, me=os.getpid()) == 0


def test_kill_marked_spares_the_caller_and_matches_nothing_unwanted(procs: Procs) -> None:
    run = new_run()
    pid = procs.sleeper(run)
    env_ready(pid, run)
    assert runmarks.kill_marked(lambda r: r == run, me=pid) == 0  # `me` is never signalled
    assert not gone(pid)
    assert runmarks.kill_marked(lambda r: False, me=os.getpid()) == 0
    assert not gone(pid)


def test_kill_groups_kills_a_dead_workers_run_groups(procs: Procs) -> None:
    run = new_run()
    # The run's command leads its group and has a child in it.
    leader, member = procs.grandchild("sleep 30 & echo $! > $OUT; wait", run, session=True)
    env_ready(member, run)
    assert os.getpgid(member) == leader.pid
    assert reaper.kill_groups([leader.pid], master=os.getpid()) == 1
    leader.wait(5)
    wait_until(lambda: gone(member), 5, what="the group's member dead")


def test_kill_groups_whose_leader_is_gone(procs: Procs) -> None:
    # The leader exited; a member of its group (unmarked) remains: the group id cannot
    # have been reused, so it is the run's.
    leader, member = procs.grandchild("sleep 30 & echo $! > $OUT", None, session=True)
    leader.wait(5)
    env_ready(member, None)
    assert gone(leader.pid) and os.getpgid(member) == leader.pid
    assert reaper.kill_groups([leader.pid], master=os.getpid()) == 1
    wait_until(lambda: gone(member), 5, what="the orphaned member dead")


def test_kill_groups_never_signals_a_strangers_group(procs: Procs) -> None:
    # A group led by a live process that is neither the master's child nor marked: a pid
    # recycled by someone else.
    outer, stranger = procs.grandchild("setsid sleep 30 & echo $! > $OUT; wait", None)
    env_ready(stranger, None)
    assert os.getpgid(stranger) == stranger and reaper.parent(stranger) == outer.pid
    assert reaper.kill_groups([stranger], master=os.getpid()) == 0
    time.sleep(0.1)
    assert not gone(stranger)
    # The same group, the leader marked: it is a run's, and goes.
    run = new_run()
    _, marked = procs.grandchild("setsid sleep 30 & echo $! > $OUT; wait", run)
    env_ready(marked, run)
    assert reaper.kill_groups([marked], master=os.getpid()) == 1
    wait_until(lambda: gone(marked), 5, what="the marked leader dead")
    # The leader the master's own child (re-parented to it): goes too.
    own = procs.sleeper(None, session=True)
    env_ready(own, None)
    assert reaper.kill_groups([own, 2**22 + 7], master=os.getpid()) == 1
    wait_until(lambda: gone(own), 5, what="the master's child dead")
    assert not gone(stranger)


def test_kill_signals_the_process_and_the_group_it_leads(procs: Procs) -> None:
    leader, member = procs.grandchild("sleep 30 & echo $! > $OUT; wait", None, session=True)
    env_ready(member, None)
    runmarks.kill(leader.pid)
    assert leader.wait(5) == -signal.SIGKILL
    wait_until(lambda: gone(member), 5, what="the member dead")
    runmarks.kill(2**22 + 3)  # gone: no exception


@pytest.mark.parametrize(("run", "worker"), [("1234.5", 1234), ("77.0", 77), ("77", 77),
                                             ("abc.1", None), ("", None), (".3", None),
                                             ("-5.1", None)])
def test_worker_of(run: str, worker: int | None) -> None:
    assert reaper.worker_of(run) == worker
