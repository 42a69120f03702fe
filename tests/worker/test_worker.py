"""The worker loop, tested on real daemons: timely claims, wake-ups, heartbeats, handlers.

Exec routes are `/bin/sh -c SCRIPT sh` (the key is $1); python routes are modules written
into tmp_path and found through `-I`.
"""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path
from typing import Any

from daemon_harness import YEARLY, Daemon, lines, pid_alive, sh, wait_until

import perfectschedd

STAMP = 'echo "$1 $PERFECTSCHED_ATTEMPT $PERFECTSCHED_SCHEDULED_TIME $(date +%s.%N)"'




def runs(path: Path, key: str) -> list[tuple[int, int, float]]:
    """(attempt, scheduled_time, started) of each run of `key` logged with STAMP."""
    out = []
    for line in lines(path):
        k, attempt, scheduled, started = line.split()
        if k == key:
            out.append((int(attempt), int(scheduled), float(started)))
    return out


def info(d: Daemon, key: str) -> Any:
    with perfectschedd.open({"type": "rdb_compat", "url": d.config["url"]}) as sc:
        return sc[key].info()


# -- when tasks start -------------------------------------------------------------------


def test_due_occurrence_starts_on_time_not_on_a_poll_tick(daemon_factory: Any,
                                                          tmp_path: Path) -> None:
    out = tmp_path / "runs"
    # poll_interval is long: only sleeping until the earliest next_run_time is on time.
    d = daemon_factory({"poll_interval": 10, "routes": [sh("t", f"{STAMP} >> {out}")]})
    d.start()
    now = int(time.time())
    due = {f"k{i}": now + 2 + i for i in range(3)}
    # Due at `at`, or when its add returned if a loaded machine took longer than that.
    owed: dict[str, float] = {}
    for key, at in due.items():
        d.ctl("add", key, "t", YEARLY, "--at", str(at))
        owed[key] = max(at, time.time())
    wait_until(lambda: len(lines(out)) == 3, timeout=20, what="3 runs")
    lateness = {key: runs(out, key)[0][2] - owed[key] for key in due}
    # Milliseconds normally; the bound is for loaded 2-core test machines.
    assert all(-0.05 < late < 1.5 for late in lateness.values()), (lateness, d.log()[-4000:])
    assert d.stop() == 0


def test_control_change_wakes_workers_at_once(daemon_factory: Any, tmp_path: Path) -> None:
    out = tmp_path / "runs"
    d = daemon_factory({"poll_interval": 10, "routes": [sh("t", f"{STAMP} >> {out}")]})
    d.start()
    time.sleep(1)  # workers settle into their long sleep
    delays = []
    for i in range(3):
        key = f"k{i}"
        before = time.time()
        d.ctl("add", key, "t", YEARLY, "--at", "0")  # due at once
        added = time.time()
        wait_until(lambda key=key: runs(out, key), timeout=15, what=f"{key} ran")
        started = runs(out, key)[0][2]
        assert started >= before
        delays.append(started - added)
    # Without the wake-up a worker would sleep up to poll_interval (10 s).
    assert max(delays) < 2.5, (delays, d.log()[-4000:])
    # `run KEY` (a one-off occurrence of an existing schedule) wakes them too.
    before = time.time()
    run_key = d.ctl_json("run", "k0")["run_key"]
    added = time.time()
    wait_until(lambda: runs(out, run_key), timeout=15, what="run-now")
    assert before <= runs(out, run_key)[0][2] < added + 2.5
    assert d.stop() == 0


# -- heartbeat --------------------------------------------------------------------------


def test_task_longer_than_alive_time_runs_once(daemon_factory: Any, tmp_path: Path) -> None:
    out = tmp_path / "runs"
    alive_time = 2
    d = daemon_factory({"alive_time": alive_time, "workers": 3, "poll_interval": 0.2,
                        "routes": [sh("t", f"{STAMP} >> {out}; sleep {3 * alive_time}")]})
    d.start()
    d.ctl("add", "k", "t", YEARLY, "--at", "0")
    wait_until(lambda: runs(out, "k"), what="started")
    claimed = time.time()
    # The lease keeps moving ahead while it runs, always well inside alive_time.
    time.sleep(alive_time + 1)
    row = info(d, "k")
    assert row.owner is not None and row.next_run_time > claimed + alive_time, row
    d.wait_log("outcome=success", timeout=30)
    time.sleep(alive_time)  # an expired lease would have been taken over by now
    assert len(runs(out, "k")) == 1
    assert "lease lost" not in d.log()
    row = info(d, "k")
    assert row.owner is None and row.next_time > time.time() + 86400
    assert d.stop() == 0


# -- exec routes ------------------------------------------------------------------------


def test_exec_exit_codes_timeouts_and_sched_later(daemon_factory: Any, tmp_path: Path) -> None:
    out = tmp_path / "runs"
    first = '[ "$PERFECTSCHED_ATTEMPT" = 1 ]'
    routes = [
        sh("ok", f"cat > {tmp_path}/$1.stdin; echo SigIgn $(grep SigIgn /proc/self/status"
                 f" | cut -f2) > {tmp_path}/$1.sig; {STAMP} >> {out}"),
        sh("/^fail-/", f"{STAMP} >> {out}; {first} && exit 3; exit 0"),
        sh("slow", f"{STAMP} >> {out}; {first} && {{ echo $$ > {tmp_path}/slow.pid; "
                   f"exec sleep 300; }}; exit 0", timeout=1),
        # Its first run only (a run after SCHED_LATER keeps its attempt number).
        sh("later", f"{STAMP} >> {out}; [ -e {tmp_path}/later.once ] || "
                    f"{{ touch {tmp_path}/later.once; echo SCHED_LATER 2; }}; exit 0"),
    ]
    d = daemon_factory({"retry_wait": 1, "kill_grace": 1, "routes": routes}).start()
    d.ctl("add", "ok", "ok", YEARLY, '{"n": 1, "s": "x"}', "--at", "0")
    d.ctl("add", "fail", "fail-x", YEARLY, "--at", "0")
    d.ctl("add", "slow", "slow", YEARLY, "--at", "0")
    d.ctl("add", "later", "later", YEARLY, "--at", "0")
    for key in ("fail", "slow", "later"):
        wait_until(lambda key=key: len(runs(out, key)) == 2, timeout=30, what=f"{key} retried")
    # The first attempts' end lines were logged a second before, but by a log writer
    # thread that a loaded machine may hold up longer.
    for end in ("end key=ok ", "outcome=failed exit=3", "outcome=timeout", "outcome=later"):
        d.wait_log(end)
    log = d.log()

    # exit 0: finished once, data on stdin, signals not left ignored, schedule advanced.
    assert [r[0] for r in runs(out, "ok")] == [1]
    assert json.loads((tmp_path / "ok.stdin").read_text()) == {"n": 1, "s": "x"}
    ignored = int((tmp_path / "ok.sig").read_text().split()[1], 16)
    hup_int_usr1 = (1 << (signal.SIGHUP - 1)) | (1 << (signal.SIGINT - 1)) | \
        (1 << (signal.SIGUSR1 - 1))
    assert ignored & hup_int_usr1 == 0, f"job started with signals ignored: {ignored:#x}"
    scheduled = runs(out, "ok")[0][1]
    assert re.search(rf"start key=ok type=ok scheduled={scheduled} attempt=1 ", log)
    assert re.search(rf"end key=ok scheduled={scheduled} attempt=1 duration=[\d.]+s "
                     rf"outcome=success exit=0", log)
    assert info(d, "ok").next_time > scheduled

    # non-zero: retried after retry_wait, the same occurrence, attempt counted.
    (a1, s1, t1), (a2, s2, t2) = runs(out, "fail")
    assert (a1, a2) == (1, 2) and s1 == s2 and t2 - t1 >= 0.9
    assert "key=fail scheduled" in log and "outcome=failed exit=3" in log

    # timeout: the command is killed, the task retried.
    assert "outcome=timeout" in log
    assert not pid_alive(int((tmp_path / "slow.pid").read_text()))
    (a1, s1, t1), (a2, s2, t2) = runs(out, "slow")
    assert (a1, a2) == (1, 2) and s1 == s2 and t2 - t1 >= 1.0

    # SCHED_LATER 2: the same occurrence again in 2 s, not after retry_wait, and the
    # same attempt (it did not fail).
    (a1, s1, t1), (a2, s2, t2) = runs(out, "later")
    assert s1 == s2 and t2 - t1 >= 1.9 and (a1, a2) == (1, 1)
    assert "outcome=later" in log
    for key in ("fail", "slow"):
        d.wait_log(f"end key={key} scheduled={runs(out, key)[0][1]} attempt=2")
    d.wait_log(f"end key=later scheduled={s1} attempt=1", count=2)
    assert d.stop() == 0


# -- python routes ----------------------------------------------------------------------


def test_python_routes_and_handler_exceptions(daemon_factory: Any, tmp_path: Path) -> None:
    out = tmp_path / "runs"
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "jobs_mod.py").write_text(f"""
import os, time
from perfectschedd import Application

def note(task, what):
    with open({str(out)!r}, "a") as f:
        f.write(f"{{task.key}} {{task.attempt}} {{what}} {{os.getpid()}}\\n")

class Finish(Application):
    def run(self):
        note(self.task, "finish:" + self.task.data.get("v", ""))
        self.task.finish()

class Boom(Application):
    def run(self):
        note(self.task, "boom")
        if self.task.attempt == 1:
            raise RuntimeError("kaboom")
""")
    (mods / "preload_mod.py").write_text(
        f"import os\nopen({str(tmp_path / 'preloaded')!r}, 'w').write(str(os.getpid()))\n")
    routes = [
        {"type": "py-exact", "python": "jobs_mod:Finish", "user": "root"},
        {"type": "/^py-.*$/", "python": "jobs_mod:Boom", "user": "root"},
    ]
    d = daemon_factory({"retry_wait": 1, "routes": routes},
                       extra_args=["-I", str(mods), "-r", "preload_mod"]).start()
    # -r imports at start, in the master, before any task.
    assert (tmp_path / "preloaded").read_text() == str(d.pid)
    workers = sorted(d.children())
    d.ctl("add", "a", "py-exact", YEARLY, '{"v": "hello"}', "--at", "0")
    d.ctl("add", "b", "py-other", YEARLY, "--at", "0")
    wait_until(lambda: len(lines(out)) == 3, timeout=20, what="3 python runs")
    got = sorted(" ".join(line.split()[:3]) for line in lines(out))
    # First matching route wins; the exception retried the task...
    assert got == ["a 1 finish:hello", "b 1 boom", "b 2 boom"]
    d.wait_log("end key=b scheduled", count=2)
    log = d.log()
    assert "kaboom" in log
    # ...and killed no worker.
    assert sorted(d.children()) == workers and "died" not in log
    assert all(int(line.split()[3]) in workers for line in lines(out))
    assert d.stop() == 0


def test_type_without_route_waits_untried_until_a_route_exists(daemon_factory: Any,
                                                               tmp_path: Path) -> None:
    out = tmp_path / "runs"
    d = daemon_factory({"retry_wait": 1}).start()
    workers = sorted(d.children())
    for key in ("x1", "x2"):
        d.ctl("add", key, "nowhere", YEARLY, "--at", "0")
    time.sleep(3)
    # Never claimed (claims ask for routed types only): no attempt, nothing logged per try.
    assert info(d, "x1").attempt == 0 and info(d, "x2").attempt == 0
    log = d.log()
    assert "no route" not in log
    assert sorted(d.children()) == workers and "died" not in log
    # A route added by reload picks the waiting tasks up.
    d.config["routes"] = [sh("nowhere", f"{STAMP} >> {out}")]
    d.write_config()
    d.ctl("reload")
    wait_until(lambda: runs(out, "x1") and runs(out, "x2"), timeout=30, what="both ran")
    assert d.stop() == 0
