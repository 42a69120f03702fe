"""When the whole daemon dies at once (master and workers killed together, outside
systemd), its jobs die within seconds (SPEC "Execution guarantees"): the job guard
(executors/guard.py) kills them, and if it was killed too, the next start does.  A
second daemon on the same database, which runs the occurrence again once the lease
expires, never runs it while the first copy lives."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

from daemon_harness import Daemon, sh, wait_until

# The job leaves a grandchild (`sleep`) that outlives its shell: what cron + kill -9
# leaves behind.  Its pid goes into a file named after the host that ran it.
JOB = 'sleep 120 & echo $! > "$JOBDIR/$HOST.pid"; wait'


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def host(daemon_factory: Any, url: str, name: str, jobdir: Path) -> Daemon:
    return daemon_factory({"node_name": name, "alive_time": 4, "poll_interval": 0.2,
                           "routes": [sh("job", JOB,
                                         env={"JOBDIR": str(jobdir), "HOST": name})]},
                          url=url)


def kill_together(d: Daemon, *, guard_too: bool = False) -> None:
    # The guard first: killed last, it could see the others gone and do its work before
    # its own KILL arrived (it did, on a loaded machine).
    victims = [*([d.guard()] if guard_too else []), d.pid, *d.children()]
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    assert d.proc is not None
    d.proc.wait(10)


def first_run(d: Daemon, jobdir: Path, name: str) -> int:
    now = int(time.time())
    d.ctl("add", "nightly", "job", "@once", "--at", str(now))
    pidfile = jobdir / f"{name}.pid"
    wait_until(lambda: pidfile.exists() and pidfile.read_text().strip(), timeout=20,
               what="the job's grandchild")
    return int(pidfile.read_text())


def test_jobs_die_with_the_daemon_and_a_second_host_never_runs_beside_them(
        daemon_factory: Any, tmp_path: Path) -> None:
    jobdir = tmp_path / "jobs"
    jobdir.mkdir()
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    first = host(daemon_factory, url, "h0", jobdir).start()
    orphan = first_run(first, jobdir, "h0")
    second = host(daemon_factory, url, "h1", jobdir).start()
    try:
        kill_together(first)
        killed_at = time.monotonic()
        died_after = None
        second_copy = jobdir / "h1.pid"
        # Until the second host runs the occurrence again (once the 4 s lease expires).
        while not second_copy.exists():
            assert time.monotonic() < killed_at + 60, "the second host never ran it"
            if died_after is None and not alive(orphan):
                died_after = time.monotonic() - killed_at
            time.sleep(0.02)
        assert died_after is not None, "the second host ran it beside the first copy"
        assert died_after < 5, f"the first copy outlived its daemon by {died_after:.1f} s"
    finally:
        if alive(orphan):
            os.kill(orphan, signal.SIGKILL)
    first.wait_log("the job guard killed")
    assert second.stop() == 0


def test_a_restart_kills_what_a_daemon_killed_with_its_guard_left(
        daemon_factory: Any, tmp_path: Path) -> None:
    jobdir = tmp_path / "jobs"
    jobdir.mkdir()
    d = host(daemon_factory, f"sqlite:///{tmp_path / 'sched.db'}", "h0", jobdir).start()
    orphan = first_run(d, jobdir, "h0")
    try:
        kill_together(d, guard_too=True)
        time.sleep(1.0)
        assert alive(orphan), "nothing should have been left to kill it"
        d.start()  # the same daemon (its control socket), a new master
        assert not alive(orphan), "the restarted daemon left its predecessor's job running"
        d.wait_log("left running by an earlier start of this daemon")
    finally:
        if alive(orphan):
            os.kill(orphan, signal.SIGKILL)
    assert d.stop() == 0
