"""A reload drains, never kills (SPEC "Execution guarantees"): real daemons, real jobs,
real signals.  Each job stamps its own start and end (with its pid) in a file: a job
killed by a reload would have no end stamp, and a second copy a second start stamp.

shutdown_timeout is 2 s everywhere: the old reload (TERM to the old generation, a kill
after shutdown_timeout) would certainly have stopped every job here."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import YEARLY, Daemon, pid_alive, sh, wait_until

import perfectschedd

BASE = {"shutdown_timeout": 2, "kill_grace": 1, "alive_time": 6, "poll_interval": 0.5}


def stamped(task_type: str, stamps: Path, seconds: int) -> dict[str, Any]:
    """An exec route: `start KEY PID TIME`, sleep, `end KEY PID TIME`."""
    return sh(task_type, f'echo "start $1 $$ $(date +%s)" >> {stamps}; sleep {seconds}; '
                         f'echo "end $1 $$ $(date +%s)" >> {stamps}')


def stamps_of(path: Path) -> list[tuple[str, str, int, int]]:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    return [(w[0], w[1], int(w[2]), int(w[3])) for w in
            (line.split() for line in text.splitlines()) if len(w) == 4]


def history(d: Daemon, key: str) -> list[Any]:
    with perfectschedd.open(str(d.config_path)) as sc:
        return sc.store.history(key, 100)


def reloaded(d: Daemon, how: str) -> None:
    """One reload, the three documented ways; returns once its new generation is up."""
    before = d.log().count("]: reloaded")
    if how == "HUP":
        d.send_signal(signal.SIGHUP)
    elif how == "USR1":
        d.send_signal(signal.SIGUSR1)
    else:
        assert d.ctl("reload").returncode == 0
    d.wait_log("]: reloaded", count=before + 1, timeout=30)


def draining(d: Daemon) -> list[dict[str, Any]]:
    return list(d.status().get("draining") or [])


def workers_of_master(d: Daemon) -> list[int]:
    return d.children()


@pytest.fixture(params=["sqlite", "postgresql"])
def sql_url(request: pytest.FixtureRequest) -> str:
    """SQLite and PostgreSQL (what a drain touches is the same on MySQL)."""
    return str(request.getfixturevalue("sqlite_url" if request.param == "sqlite"
                                       else "pg_url"))


def _survives_three_reloads(d: Daemon, stamps: Path, key: str) -> None:
    d.ctl("add", key, "long", YEARLY, "--at", "0")
    first = wait_until(lambda: stamps_of(stamps), timeout=30, what="the job's start")
    started = first[0][3]
    for how in ("HUP", "ctl", "USR1"):
        reloaded(d, how)
    assert time.time() - started < 60, "three reloads within the job's first minute"
    # While it drains, status names its worker and its key.
    keys = wait_until(lambda: [k for w in draining(d) for k in w["keys"]], what="drain keys")
    assert keys == [key]
    ends = wait_until(lambda: [s for s in stamps_of(stamps) if s[0] == "end"],
                      timeout=150, what="the job's natural end")
    assert [s[:2] for s in stamps_of(stamps)] == [("start", key), ("end", key)]
    assert ends[0][3] - started >= 119  # it ran its whole course
    wait_until(lambda: not draining(d), timeout=20, what="no draining worker left")
    runs = wait_until(lambda: history(d, key), what="its history row")
    assert len(runs) == 1
    assert (runs[0]["outcome"], runs[0]["attempt"]) == ("success", 1)
    assert "lease lost" not in d.log() and "died" not in d.log()
    assert d.stop() == 0


@pytest.mark.slow
def test_a_long_exec_job_survives_three_reloads(daemon_factory: Any, sql_url: str,
                                                tmp_path: Path) -> None:
    stamps = tmp_path / "stamps"
    d = daemon_factory({**BASE, "routes": [stamped("long", stamps, 120)]},
                       url=sql_url).start()
    _survives_three_reloads(d, stamps, "backup")


@pytest.mark.slow
def test_a_long_python_job_survives_three_reloads(daemon_factory: Any,
                                                  tmp_path: Path) -> None:
    stamps = tmp_path / "stamps"
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "longjob.py").write_text(f"""
import os, time
from perfectschedd import Application

class Long(Application):
    def run(self):
        with open({str(stamps)!r}, "a") as f:
            f.write(f"start {{self.task.key}} {{os.getpid()}} {{int(time.time())}}\\n")
        time.sleep(120)
        with open({str(stamps)!r}, "a") as f:
            f.write(f"end {{self.task.key}} {{os.getpid()}} {{int(time.time())}}\\n")
""")
    d = daemon_factory({**BASE, "routes": [{"type": "long", "python": "longjob:Long",
                                                     "user": "root"}]},
                       extra_args=["-I", str(mods)]).start()
    _survives_three_reloads(d, stamps, "pyjob")


def test_status_shows_the_draining_worker_and_its_job_until_it_ends(
        daemon_factory: Any, tmp_path: Path) -> None:
    stamps = tmp_path / "stamps"
    d = daemon_factory({**BASE, "routes": [stamped("t", stamps, 12)]}).start()
    old = sorted(workers_of_master(d))
    assert len(old) == 2
    d.ctl("add", "k", "t", YEARLY, "--at", "0")
    (_, _, job_pid, _), = wait_until(lambda: stamps_of(stamps), what="the job's start")
    owner = wait_until(lambda: [r["owner"] for r in d.status()["running"] if r["key"] == "k"],
                       what="its lease")[0]
    busy = int(owner.rsplit(":", 1)[1])
    idle = next(p for p in old if p != busy)
    reloaded(d, "ctl")
    # The worker with nothing running drains at once; the busy one stays with its job.
    wait_until(lambda: not pid_alive(idle), timeout=15, what="the idle old worker's exit")
    assert pid_alive(busy) and pid_alive(job_pid)
    (entry,) = wait_until(lambda: [w for w in draining(d) if w["keys"]], what="drain keys")
    assert (entry["pid"], entry["generation"], entry["keys"]) == (busy, 0, ["k"])
    assert time.time() - 30 < entry["since"] <= time.time()
    # A worker's count of runs reaches the master with its next ping (every second or so).
    status = wait_until(lambda: next((s for s in [d.status()] for w in s["workers"]
                                      if w["pid"] == busy and w["running"] == 1), None),
                        what="the draining worker's ping counting its run")
    (worker,) = [w for w in status["workers"] if w["pid"] == busy]
    assert worker["draining"] and worker["running"] == 1
    assert status["workers_alive"] == 2  # the new generation; drains are not counted
    text = d.ctl("status").stdout
    assert re.search(rf"draining since .*: worker pid {busy} \(generation 0\), running: k$",
                     text, re.M), text
    # Its natural end: finish and history written, then the worker exits.
    wait_until(lambda: any(s[0] == "end" for s in stamps_of(stamps)), timeout=30,
               what="the job's end")
    wait_until(lambda: not pid_alive(busy), timeout=15, what="the drained worker's exit")
    wait_until(lambda: not draining(d), what="no draining worker in status")
    assert "draining since" not in d.ctl("status").stdout
    (run,) = history(d, "k")
    assert run["outcome"] == "success"
    assert d.status()["running"] == []  # its finish was written: the lease is free
    assert sorted(workers_of_master(d)) != old and len(workers_of_master(d)) == 2
    assert re.search(rf"\[{busy}\]: worker \d drained", d.log())
    assert d.stop() == 0


def test_a_stop_during_a_drain_stops_the_draining_job_in_the_usual_bound(
        daemon_factory: Any, tmp_path: Path) -> None:
    stamps = tmp_path / "stamps"
    d = daemon_factory({**BASE, "routes": [stamped("t", stamps, 120)]}).start()
    d.ctl("add", "k", "t", YEARLY, "--at", "0")
    (_, _, job_pid, _), = wait_until(lambda: stamps_of(stamps), what="the job's start")
    reloaded(d, "HUP")
    wait_until(lambda: [w for w in draining(d) if w["keys"] == ["k"]], what="the drain")
    began = time.monotonic()
    # shutdown_timeout 2 + kill_grace 1, and the master's own margin (5 s): as today.
    assert d.stop(signal.SIGTERM, timeout=30) == 0
    took = time.monotonic() - began
    assert took < 2 + 1 + 5 + 10, took
    assert not pid_alive(job_pid)
    assert [s[0] for s in stamps_of(stamps)] == ["start"]  # stopped, not run to its end
    (run,) = history(d, "k")
    assert (run["outcome"], run["signal"]) == ("stopped", signal.SIGTERM), run


@pytest.mark.slow
def test_reloads_in_a_row_stay_within_the_bound_and_given_back_work_starts_at_once(
        daemon_factory: Any, tmp_path: Path) -> None:
    """One worker, one thread: each generation keeps one job, the jobs it claimed but did
    not start go to the next generation at once.  Two drains run side by side; a third
    reload waits until one ends: at most 3 x workers worker processes, ever."""
    stamps = tmp_path / "stamps"
    d = daemon_factory({**BASE, "workers": 1, "concurrency": 1,
                        "routes": [stamped("t", stamps, 20)]}).start()
    most = [len(workers_of_master(d))]
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.is_set():
            most[0] = max(most[0], len(workers_of_master(d)),
                          len(d.status()["workers"]))
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        for key in ("a", "b", "c", "d"):
            d.ctl("add", key, "t", YEARLY, "--at", "0")

        def started() -> list[str]:
            return [s[1] for s in stamps_of(stamps) if s[0] == "start"]

        wait_until(lambda: len(started()) == 1, what="the first job")
        reloaded(d, "HUP")
        wait_until(lambda: len(started()) == 2, timeout=10,
                   what="a given-back job started by the new generation")
        reloaded(d, "HUP")
        wait_until(lambda: len(started()) == 3, timeout=10, what="the third job")
        first_end = [s for s in stamps_of(stamps) if s[0] == "end"]
        assert first_end == [], "given-back work did not wait for the drains"
        # A third reload: two generations drain, a third would pass 3 x 1 worker.
        n = len(d.messages())
        answer = d.ctl("reload").stdout
        assert "starting once fewer workers drain (2 now)" in answer, answer
        d.wait_log("start once fewer workers run")
        d.wait_notify(lambda m: "READY=1" in m, after=n, what="READY=1 (systemd not held)")
        assert d.status()["reload_pending"] is True
        assert "reload pending" in d.ctl("status").stdout
        # The first job's end makes room: the pending generation starts.
        d.wait_log("drains made room", timeout=40)
        wait_until(lambda: d.status()["reload_pending"] is False, what="pending over")
        wait_until(lambda: len([s for s in stamps_of(stamps) if s[0] == "end"]) == 4,
                   timeout=90, what="every job's end")
        wait_until(lambda: not draining(d), timeout=20, what="every drain's end")
    finally:
        sampling.set()
        sampler.join()
    assert most[0] <= 3, most[0]
    assert most[0] == 3  # two drains side by side did happen
    starts = [s[1] for s in stamps_of(stamps) if s[0] == "start"]
    assert sorted(starts) == ["a", "b", "c", "d"]  # each once
    for key in "abcd":
        # The current generation writes history in batches (within HISTORY_FLUSH).
        runs = wait_until(lambda key=key: history(d, key), timeout=5, what=f"{key}'s run")
        assert [(r["outcome"], r["attempt"]) for r in runs] == [("success", 1)], (key, runs)
    assert re.search(r"drains \(a reload\): 1 running task\(s\) go on to their end, "
                     r"[1-9]\d* queued given back", d.log())
    assert d.stop() == 0


def test_a_silent_draining_worker_is_killed_with_its_job_and_not_replaced(
        daemon_factory: Any, tmp_path: Path) -> None:
    """A draining worker is watched like any other: frozen, it is killed after
    worker_timeout, its job's process group with it, the occurrence runs again on the new
    generation, and no worker replaces it."""
    stamps = tmp_path / "stamps"
    d = daemon_factory({**BASE, "worker_timeout": 4,
                        "routes": [stamped("t", stamps, 120)]}).start()
    d.ctl("add", "k", "t", YEARLY, "--at", "0")
    (_, _, job_pid, _), = wait_until(lambda: stamps_of(stamps), what="the job's start")
    reloaded(d, "USR1")
    (entry,) = wait_until(lambda: [w for w in draining(d) if w["keys"] == ["k"]],
                          what="the drain")
    frozen = entry["pid"]
    new = sorted(p for p in workers_of_master(d) if p != frozen)
    assert len(new) == 2
    os.kill(frozen, signal.SIGSTOP)
    # Silent, or its loop seen stopped (the pings' loop age plus the silence): either way.
    wait_until(lambda: re.search(rf"\(pid {frozen}\) (silent|main loop stopped) for \d+s"
                                 r".*; killing it", d.log()), timeout=30,
               what="the frozen worker killed as unresponsive")
    wait_until(lambda: not pid_alive(frozen), timeout=15, what="the frozen worker's end")
    wait_until(lambda: not pid_alive(job_pid), timeout=15, what="its job killed")
    second = wait_until(lambda: [s for s in stamps_of(stamps)[1:] if s[0] == "start"],
                        timeout=30, what="the occurrence run again")
    assert second[0][2] != job_pid
    owner = wait_until(lambda: [r["owner"] for r in d.status()["running"]
                                if r["key"] == "k"], what="its new lease")[0]
    assert int(owner.rsplit(":", 1)[1]) in new
    assert sorted(workers_of_master(d)) == new  # not replaced
    assert not draining(d)
    runs = history(d, "k")
    assert [r["outcome"] for r in runs] == ["lost"], runs
    assert d.stop() == 0
