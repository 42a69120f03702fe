"""A job lives only as long as its lease (SPEC "Execution guarantees"): real daemons,
real exec jobs, real signals.  Each job writes its own log of start/end times and pids,
which is what the assertions read."""

from __future__ import annotations

import os
import signal
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import YEARLY, Daemon, lines, sh, wait_until

import perfectschedd

# Daemon-level: the PostgreSQL and MariaDB runs are make check's (test-slow).
pytestmark = pytest.mark.slow_on_servers


def running(pid: int) -> bool:
    """True while pid exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def owner_pid(d: Daemon, key: str) -> int:
    def held() -> int | None:
        for r in d.status()["running"]:
            if r["key"] == key and r["owner"]:
                return int(r["owner"].rsplit(":", 1)[1])
        return None
    return int(wait_until(held, what=f"{key} running"))


def history(d: Daemon, key: str) -> list[dict[str, Any]]:
    with perfectschedd.open(str(d.config_path)) as sc:
        return sc.store.history(key, 100)


def events(path: Path) -> list[list[str]]:
    return [line.split() for line in lines(path)]


# A job that logs "start ATTEMPT PID TIME", forks a grandchild that leaves the process
# group (setsid) and logs its pid, then, on attempt 1 only, sleeps for a long time.
# Attempt 2 logs which earlier processes still run when it starts.
TREE_JOB = """
out={out}
now() {{ date +%s.%N; }}
echo "start $PERFECTSCHED_ATTEMPT $$ $(now)" >> $out
if [ "$PERFECTSCHED_ATTEMPT" = 1 ]; then
  # Written by the escapee itself, once it has left the session (not $! right after
  # the fork: the test could look before setsid(2) had run).
  setsid sh -c 'echo "escapee $$" >> "$0"; exec sleep 120' "$out" \
    < /dev/null > /dev/null 2>&1 &
  sleep 120
else
  for p in $(awk '$1 == "start" || $1 == "escapee" {{print $3 == "" ? $2 : $3}}' $out); do
    [ "$p" = $$ ] && continue
    if [ -e /proc/$p ] && ! grep -q '^State:.*Z' /proc/$p/status 2>/dev/null; then
      echo "still-running $p" >> $out
    fi
  done
  echo "end $PERFECTSCHED_ATTEMPT $$ $(now)" >> $out
fi
"""


def test_killed_worker_takes_its_whole_job_tree_with_it(daemon_factory: Any,
                                                          tmp_path: Path) -> None:
    out = tmp_path / "runs"
    d = daemon_factory({"alive_time": 30, "routes": [sh("t", TREE_JOB.format(out=out))]}
                       ).start()
    d.ctl("add", "k", "t", YEARLY, "--at", "0")
    wait_until(lambda: any(e[0] == "escapee" for e in events(out)), what="first attempt")
    first = next(e for e in events(out) if e[0] == "start")
    escapee = int(next(e for e in events(out) if e[0] == "escapee")[1])
    job = int(first[2])
    assert running(job) and running(escapee)
    assert os.getsid(escapee) != os.getsid(job)  # it did leave the job's session
    victim = owner_pid(d, "k")
    killed_at = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    # The lease is given back once the tree is dead: the occurrence runs again long
    # before alive_time (30 s) would have expired.
    wait_until(lambda: any(e[0] == "end" for e in events(out)), timeout=20,
               what="second attempt")
    assert time.monotonic() - killed_at < 15
    ev = events(out)
    assert [e for e in ev if e[0] == "still-running"] == [], ev
    assert not running(job) and not running(escapee)
    starts = [e for e in ev if e[0] == "start"]
    assert [s[1] for s in starts] == ["1", "2"]
    d.wait_log(f"(pid {victim}) died (signal 9)")
    runs = wait_until(lambda: h if len(h := history(d, "k")) == 2 else None,
                      what="both attempts in history")
    assert sorted(r["outcome"] for r in runs) == ["lost", "success"], runs
    lost = next(r for r in runs if r["outcome"] == "lost")
    assert lost["attempt"] == 1 and lost["worker"].endswith(f":{victim}")
    assert d.stop() == 0


def test_killed_master_takes_jobs_and_workers_down(daemon_factory: Any,
                                                    tmp_path: Path) -> None:
    out = tmp_path / "runs"
    d = daemon_factory({"alive_time": 30, "shutdown_timeout": 30,
                        "routes": [sh("t", TREE_JOB.format(out=out))]}).start()
    d.ctl("add", "k", "t", YEARLY, "--at", "0")
    wait_until(lambda: any(e[0] == "escapee" for e in events(out)), what="job running")
    job = int(next(e for e in events(out) if e[0] == "start")[2])
    escapee = int(next(e for e in events(out) if e[0] == "escapee")[1])
    workers = d.children()
    os.kill(d.pid, signal.SIGKILL)
    # shutdown_timeout (30 s) is not waited for: without a master, runs stop at once.
    wait_until(lambda: not any(running(p) for p in (job, escapee, *workers)), timeout=8,
               what="jobs and workers gone")


def test_delete_while_running_stops_the_job(daemon_factory: Any, tmp_path: Path) -> None:
    out = tmp_path / "runs"
    script = (f'trap \'echo "term $(date +%s.%N)" >> {out}; exit 143\' TERM; '
              f'echo "start $(date +%s.%N)" >> {out}; sleep 120 & wait')
    alive_time = 6
    d = daemon_factory({"alive_time": alive_time, "routes": [sh("t", script)]}).start()
    d.ctl("add", "k", "t", YEARLY, "--at", "0")
    wait_until(lambda: events(out), what="job started")
    deleted_at = time.time()
    d.ctl("delete", "k")
    # Within one heartbeat (alive_time / 3), plus the time TERM takes.
    wait_until(lambda: any(e[0] == "term" for e in events(out)), timeout=alive_time,
               what="TERM")
    term_at = float(next(e for e in events(out) if e[0] == "term")[1])
    assert term_at - deleted_at < alive_time / 3 + 1.5
    d.wait_log("outcome=preempted")
    wait_until(lambda: [r["outcome"] for r in history(d, "k")] == ["preempted"],
               what="history of the stopped run")
    assert history(d, "k")[0]["error"].startswith("stopped: schedule deleted")
    assert d.log().count("key=k: schedule deleted; stopping its run") == 1
    assert "lease lost" not in d.log()
    assert d.stop() == 0


def test_delete_takes_the_extra_runs_with_it(daemon_factory: Any, tmp_path: Path) -> None:
    """`run KEY` queues an extra run (KEY@run-...); `delete KEY` deletes the schedule and
    its extra runs: the running one is stopped, a queued one never starts."""
    out = tmp_path / "runs"
    script = (f'trap \'echo "term $1 $(date +%s.%N)" >> {out}; exit 143\' TERM; '
              f'echo "start $1 $(date +%s.%N)" >> {out}; sleep 120 & wait')
    d = daemon_factory({"alive_time": 6, "routes": [sh("t", script)]}).start()
    d.ctl("add", "k", "t", YEARLY)
    d.ctl("add", "kk", "t", YEARLY)  # "k" is a prefix of its key, not one of its runs
    first = d.ctl_json("run", "k")["run_key"]
    second = d.ctl_json("run", "k")["run_key"]  # waits for the first to end
    other = d.ctl_json("run", "kk")["run_key"]
    wait_until(lambda: sorted(e[1] for e in events(out) if e[0] == "start")
               == sorted([first, other]), what="the first extra runs started")
    assert d.ctl("delete", "k").stdout.strip() == "deleted k and 2 extra run(s) of it"
    wait_until(lambda: any(e[:2] == ["term", first] for e in events(out)), timeout=6,
               what="TERM of the running extra run")
    d.wait_log("outcome=preempted")
    time.sleep(1.5)  # the queued one would have started by now
    assert [e[1] for e in events(out) if e[0] == "start"].count(second) == 0
    keys = [r["key"] for r in d.ctl_json("list")]
    assert keys == ["kk", other], keys
    assert not any(e[:2] == ["term", other] for e in events(out))  # kk's run goes on
    assert d.stop() == 0


def test_modify_while_running_stops_the_running_copy(daemon_factory: Any,
                                                     tmp_path: Path) -> None:
    out = tmp_path / "runs"
    script = (f'trap \'echo "term $$ $(date +%s.%N)" >> {out}; exit 143\' TERM; '
              f'echo "start $$ $(date +%s.%N)" >> {out}; sleep 120 & wait')
    d = daemon_factory({"alive_time": 6, "routes": [sh("t", script)]}).start()
    d.ctl("add", "k", "t", YEARLY, "--at", "0")
    wait_until(lambda: events(out), what="job started")
    d.ctl("modify", "k", "-d", "1")
    wait_until(lambda: any(e[0] == "term" for e in events(out)), timeout=6, what="TERM")
    d.wait_log("outcome=preempted")
    time.sleep(1)
    # The schedule moved on to its next (yearly) time: nothing ran beside or after it.
    assert [e[0] for e in events(out)] == ["start", "term"]
    assert d.stop() == 0


def test_lease_not_renewable_stops_the_job_before_it_expires(daemon_factory: Any,
                                                              tmp_path: Path) -> None:
    """Self-fencing: an outside writer holds SQLite's lock, so no heartbeat can renew the
    lease; the job is stopped before the lease expires for the others, and a second copy
    only starts after the first one ended."""
    out = tmp_path / "runs"
    script = (f'trap \'echo "term $$ $(date +%s.%N)" >> {out}; exit 143\' TERM; '
              f'echo "start $$ $(date +%s.%N)" >> {out}; sleep 120 & wait')
    alive_time = 4
    d = daemon_factory({"alive_time": alive_time, "kill_grace": 1, "poll_interval": 0.2,
                        "routes": [sh("t", script)]}).start()
    d.ctl("add", "k", "t", YEARLY, "--at", "0")
    wait_until(lambda: events(out), what="job started")
    db = d.config["url"].removeprefix("sqlite:///")
    hold = sqlite3.connect(db, isolation_level=None, timeout=30)
    hold.execute("BEGIN EXCLUSIVE")
    locked_at = time.time()
    row = hold.execute("SELECT next_run_time FROM perfectsched WHERE key = 'k'").fetchone()
    lease_until = int(row[0])
    try:
        wait_until(lambda: any(e[0] == "term" for e in events(out)), timeout=3 * alive_time,
                   what="self-fencing TERM")
    finally:
        hold.execute("COMMIT")
        hold.close()
    term_at = float(next(e for e in events(out) if e[0] == "term")[2])
    assert term_at < lease_until, (term_at, lease_until, locked_at)
    wait_until(lambda: sum(e[0] == "start" for e in events(out)) >= 2, timeout=30,
               what="the occurrence again, after its lease expired")
    second = [e for e in events(out) if e[0] == "start"][1]
    assert float(second[2]) > term_at
    d.wait_log("lease could not be renewed in time")
    assert d.stop() == 0


def test_always_releasing_handler_backs_off(daemon_factory: Any, tmp_path: Path) -> None:
    """release(): the first one runs again at once, repeated ones wait like retries and
    count attempts (it used to spin at ~880 runs a second)."""
    out = tmp_path / "runs"
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "releasing.py").write_text(f"""
from perfectschedd import Application

class Releases(Application):
    def run(self):
        with open({str(out)!r}, "a") as f:
            f.write(f"{{self.task.attempt}}\\n")
        self.task.release()
""")
    d = daemon_factory({"retry_wait": 3, "routes": [
        {"type": "rel", "python": "releasing:Releases", "user": "root"}]},
        extra_args=["-I", str(mods)]).start()
    d.ctl("add", "k", "rel", YEARLY, "--at", "0")
    wait_until(lambda: len(lines(out)) >= 2, what="first release and its immediate rerun")
    time.sleep(2)
    assert lines(out) == ["1", "2"]  # the second release waits retry_wait (3 s)
    wait_until(lambda: len(lines(out)) >= 3, timeout=10, what="the third attempt")
    assert lines(out)[:3] == ["1", "2", "3"]
    assert d.stop() == 0


def test_run_now_while_running_starts_after_it_ends(daemon_factory: Any, db_url: str,
                                                     tmp_path: Path) -> None:
    """`run KEY` while KEY runs, three times: the extra runs start only after the running
    one ended, one after the other (the job's own start/end times).  Extra runs claimed
    together used to give way to each other's leases, again and again (a livelock)."""
    out = tmp_path / "runs"
    script = (f'echo "start $1 $(date +%s.%N)" >> {out}; sleep 2; '
              f'echo "end $1 $(date +%s.%N)" >> {out}')
    d = daemon_factory({"workers": 2, "concurrency": 4, "poll_interval": 0.2,
                        "routes": [sh("t", script)]}, url=db_url).start()
    d.ctl("add", "k", "t", YEARLY, "--at", "0")
    wait_until(lambda: events(out), what="the occurrence running")
    first = d.ctl("run", "k").stdout
    assert "once its running occurrence has ended" in first, first
    runs = {d.ctl_json("run", "k")["run_key"] for _ in range(2)} | {
        first.split("(as ")[1].rstrip(")\n")}
    shown = d.ctl_json("show", "k")
    # Each one is shown until it has ended (the first may have ended by now).
    ended = {e[1] for e in events(out) if e[0] == "end"}
    assert {r["run_key"] for r in shown["extra_runs"]} | ended >= runs, (shown, ended)
    wait_until(lambda: sum(e[0] == "end" for e in events(out)) == 4, timeout=40,
               what="four runs")
    spans = []
    open_runs: dict[str, float] = {}
    for what, key, at in events(out):
        if what == "start":
            open_runs[key] = float(at)
        else:
            spans.append((open_runs.pop(key), float(at)))
    spans.sort()
    for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
        assert start >= end, spans  # never two at once
    wait_until(lambda: d.ctl_json("show", "k")["extra_runs"] == [], what="extra runs gone")
    assert d.stop() == 0
