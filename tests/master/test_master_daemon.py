"""The master process, tested on real daemons: sd_notify, signals, worker supervision.

Every test starts `perfectschedd` with a temp config and a NOTIFY_SOCKET it binds
(tests/daemon_harness.py), sends real signals and looks at processes in /proc.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import DAEMON, YEARLY, Daemon, is_guard, lines, pid_alive, sh, wait_until

import perfectschedd


def row(d: Daemon, key: str) -> Any:
    with perfectschedd.open({"type": "rdb_compat", "url": d.config["url"]}) as sc:
        return sc[key].info()


def owner_pid(d: Daemon, key: str) -> int:
    def find() -> int | None:
        owner = d.ctl_json("show", key).get("owner")
        return int(owner.rsplit(":", 1)[1]) if owner else None
    return int(wait_until(find, what=f"{key} leased"))


def all_dead(pids: list[int], timeout: float = 10.0) -> None:
    wait_until(lambda: not [p for p in pids if pid_alive(p)], timeout,
               what=f"processes {pids} gone")


def stop_keep_messages(d: Daemon, sig: int | None = signal.SIGTERM, timeout: float = 30.0,
                       descendants: list[int] | None = None) -> tuple[int, list[str]]:
    """Signal the daemon (unless sig is None), wait for its exit, check that nothing it
    started survives, and return (exit code, notify messages)."""
    assert d.proc is not None
    descendants = d.descendants() if descendants is None else descendants
    if sig is not None:
        d.send_signal(sig)
    guards = [p for p in descendants if is_guard(p)]
    code = d.proc.wait(timeout)
    msgs = d.messages()
    # The job guard ends by itself once master and workers are gone (one /proc scan).
    all_dead(guards, timeout=5.0)
    survivors = [p for p in descendants if pid_alive(p)]
    d.kill()
    assert not survivors, f"processes outlived the daemon: {survivors}"
    return code, msgs


# -- sd_notify --------------------------------------------------------------------------


def test_ready_after_workers_run_and_status_kept_current(daemon_factory: Any,
                                                         tmp_path: Path) -> None:
    d = daemon_factory({"workers": 3, "routes": [sh("t", "sleep 4")]})
    d.start()
    msgs = d.messages()
    ready = next(m for m in msgs if "READY=1" in m)
    assert f"MAINPID={d.pid}" in ready
    # READY only once every worker proved it runs.  Each process logs through its own
    # writer thread: wait for the lines, and compare their times, not their places.
    d.wait_log(" ready")
    d.wait_log("started", count=3)
    (ready_at,) = d.logged_at(r": ready$")
    started = d.logged_at(r"worker \d started")
    assert len(started) == 3 and max(started) <= ready_at, d.log()
    assert len(d.children()) == 3
    # No WATCHDOG=1 without WATCHDOG_USEC.
    assert not any("WATCHDOG=1" in m for m in msgs)
    statuses = [m for m in msgs if m.startswith("STATUS=")]
    assert statuses and all("\n" not in m and len(m) < 120 for m in statuses), statuses
    # The STATUS sent with READY counts them (one sent before the forks, which wait for
    # the store to open, says 0 workers).
    d.wait_notify(lambda m: m.startswith("STATUS=3 workers, 0 running"),
                  after=msgs.index(ready), what="STATUS with the 3 workers")

    # STATUS follows what runs: a running task shows up, then goes away.
    n = len(d.messages())
    d.ctl("add", "k", "t", YEARLY, "--at", "0")
    d.wait_notify(lambda m: m.startswith("STATUS=3 workers, 1 running"), after=n,
                  what="STATUS with 1 running")
    n = len(d.messages())
    d.wait_notify(lambda m: m.startswith("STATUS=3 workers, 0 running"), after=n,
                  timeout=30, what="STATUS with 0 running")
    code, msgs = stop_keep_messages(d)
    assert code == 0
    assert any("STOPPING=1" in m for m in msgs)


def test_runs_silently_without_notify_socket(daemon_factory: Any, tmp_path: Path) -> None:
    d = daemon_factory({"routes": [sh("t", f"echo ran >> {tmp_path}/out")]})
    env = {k: v for k, v in os.environ.items()
           if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC") and not k.startswith("PERFECTSCHED_")}
    env["WATCHDOG_USEC"] = "1000000"  # set, but with nowhere to send to
    with d.log_path.open("ab") as out:
        proc = subprocess.Popen([*DAEMON, "-c", str(d.config_path)], stdout=out,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
    d.proc = proc  # so that the fixture kills it whatever happens
    try:
        wait_until(lambda: os.path.exists(d.socket_path) and
                   d.ctl("status", check=False).returncode == 0, what="control socket")
        d.ctl("add", "k", "t", YEARLY, "--at", "0")
        wait_until(lambda: lines(tmp_path / "out") == ["ran"], what="task ran")
        time.sleep(1.5)  # several watchdog periods with nowhere to send them
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        d.kill()
    log = d.log()
    assert "Traceback" not in log and "ERROR" not in log and "notify" not in log.lower(), log


def test_watchdog_cadence(daemon_factory: Any) -> None:
    usec = 2_000_000
    d = daemon_factory(watchdog_usec=usec).start()
    t0 = time.monotonic()
    wait_until(lambda: sum("WATCHDOG=1" in m for _, m in d.notify.timed()) >= 6, timeout=30,
               what="6 WATCHDOG=1")
    stamps = [t for t, m in d.notify.timed() if "WATCHDOG=1" in m and t >= t0]
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    # Sent at half of WATCHDOG_USEC: never late enough for systemd to kill us, not spammed.
    assert max(gaps) < usec / 1e6, gaps
    assert sum(gaps) / len(gaps) > 0.35 * usec / 1e6, gaps
    assert d.stop() == 0


# -- stop -------------------------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGQUIT],
                         ids=["TERM", "INT", "QUIT"])
def test_graceful_stop_lets_running_task_finish(daemon_factory: Any, tmp_path: Path,
                                                sig: int) -> None:
    out = tmp_path / "out"
    # The job leaves a grandchild in its own session: only the subreaper can find it.
    script = (f"setsid sleep 300 & echo $! > {out}.orphan; "
              f"echo started >> {out}; sleep 2; echo done >> {out}")
    d = daemon_factory({"routes": [sh("t", script)]}).start()
    d.ctl("add", "k", "t", YEARLY, "--at", "0")
    wait_until(lambda: lines(out) == ["started"], what="task started")
    orphan = int(wait_until(lambda: lines(Path(f"{out}.orphan")), what="orphan pid")[0])
    workers = d.children()
    descendants = d.descendants()
    d.send_signal(sig)
    d.wait_log("stopping")
    # Due while stopping: an idle worker would take it within poll_interval, a stopping
    # one must not.
    with perfectschedd.open({"type": "rdb_compat", "url": d.config["url"]}) as sc:
        sc.add("late", "t", YEARLY, at=0)
    code, msgs = stop_keep_messages(d, None, descendants=descendants)
    assert code == 0
    assert lines(out) == ["started", "done"]  # finished, not killed
    assert "start key=late" not in d.log()
    late = row(d, "late")
    assert late.owner is None and late.attempt == 0 and late.next_run_time == 0
    assert "outcome=success" in d.log()
    assert any("STOPPING=1" in m for m in msgs)
    assert not pid_alive(orphan)
    assert not [p for p in workers if pid_alive(p)]
    info = row(d, "k")
    assert info.owner is None and info.next_time > time.time() + 86400  # advanced


def test_stop_is_bounded_and_releases_unfinished_task(daemon_factory: Any,
                                                      tmp_path: Path) -> None:
    out = tmp_path / "out"
    d = daemon_factory({"shutdown_timeout": 1, "kill_grace": 1,
                        "routes": [sh("t", f"echo $$ >> {out}; exec sleep 300")]}).start()
    d.ctl("add", "k", "t", YEARLY, "--at", "0")
    job = int(wait_until(lambda: lines(out), what="task started")[0])
    t0 = time.monotonic()
    code, _ = stop_keep_messages(d)
    took = time.monotonic() - t0
    assert code == 0
    assert took < 15, took  # shutdown_timeout + kill_grace + slack, not 300 s
    assert not pid_alive(job)
    info = row(d, "k")
    # Given back untried: due now, no owner, attempt not counted.
    assert info.owner is None
    assert info.next_run_time <= time.time()
    assert info.attempt == 0
    assert "stopped" in d.log()


# -- reload -----------------------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGUSR1], ids=["HUP", "USR1"])
def test_reload_starts_new_workers_before_retiring_old(daemon_factory: Any, tmp_path: Path,
                                                       sig: int) -> None:
    out = tmp_path / "out"
    d = daemon_factory({"routes": [sh("old", f"echo old >> {out}")]}).start()
    old_workers = sorted(d.children())
    assert len(old_workers) == 2
    d.config["routes"] = [sh("new", f"echo new >> {out}")]
    d.config["workers"] = 3
    d.write_config()
    n = len(d.messages())
    before = time.clock_gettime(time.CLOCK_MONOTONIC)
    d.send_signal(sig)
    reloading = d.wait_notify(lambda m: "RELOADING=1" in m, after=n, what="RELOADING=1")
    usec = int(re.search(r"MONOTONIC_USEC=(\d+)", reloading).group(1))  # type: ignore[union-attr]
    assert before - 1 <= usec / 1e6 <= time.clock_gettime(time.CLOCK_MONOTONIC) + 1
    after = d.messages().index(reloading) + 1
    d.wait_notify(lambda m: "READY=1" in m, after=after, what="READY=1 after reload")
    all_dead(old_workers)
    assert d.alive()  # same process: no re-exec, systemd keeps its MAINPID
    new_workers = wait_until(lambda: len(d.children()) == 3 and d.children(),
                             what="3 new workers")
    assert not set(new_workers) & set(old_workers)
    # New workers were up (logged "started") before any old one exited.  (A worker is
    # gone from /proc once reaped, a moment before the master logs its exit.)
    wait_until(lambda: all(f"(pid {p}) exited" in d.log() for p in old_workers),
               what="the old workers' exits in the log")
    for p in new_workers:
        d.wait_log(f"[{p}]: worker {_index(d.log(), p)} started")
    last_new_start = max(max(d.logged_at(rf"\[{p}\]: worker \d+ started"))
                         for p in new_workers)
    first_old_exit = min(min(d.logged_at(rf"\(pid {p}\) exited")) for p in old_workers)
    assert last_new_start <= first_old_exit
    log = d.log()
    assert "died" not in log
    # The new configuration is in force.
    d.ctl("add", "k", "new", YEARLY, "--at", "0")
    wait_until(lambda: lines(out) == ["new"], what="task of the new route")
    assert d.stop() == 0


def _index(log: str, pid: int) -> int:
    m = re.search(rf"worker (\d+) spawned \(pid {pid},", log)
    assert m, f"no spawn line for {pid}"
    return int(m.group(1))


@pytest.mark.parametrize("broken", ["routes: [\n", "type: rdb_compat\nworkers: 0\n"],
                         ids=["yaml", "invalid"])
def test_reload_with_broken_config_keeps_running(daemon_factory: Any, tmp_path: Path,
                                                 broken: str) -> None:
    out = tmp_path / "out"
    d = daemon_factory({"routes": [sh("t", f"echo $1 >> {out}")]}).start()
    workers = sorted(d.children())
    d.write_config(raw=broken)
    n = len(d.messages())
    d.send_signal(signal.SIGHUP)
    d.wait_notify(lambda m: "RELOADING=1" in m, after=n, what="RELOADING=1")
    d.wait_notify(lambda m: "READY=1" in m, after=n, what="READY=1 after failed reload")
    d.wait_log("reload failed")
    assert d.alive()
    # The old configuration goes on: same workers, same routes.
    d.ctl("add", "k1", "t", YEARLY, "--at", "0")
    wait_until(lambda: lines(out) == ["k1"], what="task after failed reload")
    assert sorted(d.children()) == workers
    # A fixed config is then taken as usual.
    d.write_config()
    d.send_signal(signal.SIGHUP)
    d.wait_log("reloaded")
    all_dead(workers)
    assert d.stop() == 0


# -- logs -------------------------------------------------------------------------------


def _fd_targets(pid: int) -> set[str]:
    out = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                out.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
            except OSError:
                pass
    except OSError:
        pass
    return out


def test_usr2_reopens_log_files_in_master_and_workers(daemon_factory: Any,
                                                      tmp_path: Path) -> None:
    logfile = tmp_path / "perfectschedd.log"
    d = daemon_factory({"log": str(logfile), "routes": [sh("t", "true")]}).start()
    procs = [d.pid, *d.children()]
    wait_until(lambda: all(str(logfile) in _fd_targets(p) for p in procs), what="log open")
    rotated = tmp_path / "perfectschedd.log.1"
    os.rename(logfile, rotated)
    d.send_signal(signal.SIGUSR2)
    wait_until(lambda: all(str(logfile) in _fd_targets(p) and str(rotated) not in
                           _fd_targets(p) for p in procs), what="every process reopened")
    d.ctl("add", "k", "t", YEARLY, "--at", "0")
    wait_until(lambda: "outcome=success" in logfile.read_text(), what="worker line in new log")
    assert d.stop() == 0
    new = logfile.read_text()
    assert "start key=k" in new and "] stopped" not in rotated.read_text()
    assert re.search(r"master\[\d+\]: stopped", new)


# -- supervision ------------------------------------------------------------------------


def test_killed_worker_is_replaced_and_its_task_runs_again(daemon_factory: Any,
                                                           tmp_path: Path) -> None:
    out = tmp_path / "runs"
    alive_time = 4
    script = (f'echo "$PERFECTSCHED_ATTEMPT $$" >> {out}; '
              f'if [ "$PERFECTSCHED_ATTEMPT" = 1 ]; then sleep 300; fi')
    d = daemon_factory({"alive_time": alive_time, "shutdown_timeout": 1,
                        "routes": [sh("t", script)]}).start()
    d.ctl("add", "k", "t", YEARLY, "--at", "0")
    wait_until(lambda: len(lines(out)) == 1, what="first attempt")
    victim = owner_pid(d, "k")
    assert victim in d.children()
    killed_at = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    wait_until(lambda: len(d.children()) == 2 and victim not in d.children(),
               what="worker replaced")
    wait_until(lambda: len(lines(out)) == 2, timeout=alive_time + 20, what="second attempt")
    # The dead worker's job was killed and its lease given back: the occurrence ran
    # again without waiting for the lease to expire, and never beside the first copy.
    rerun_after = time.monotonic() - killed_at
    assert rerun_after < alive_time, rerun_after
    first_job = int(lines(out)[0].split()[1])
    assert not pid_alive(first_job)
    assert lines(out)[1].split()[0] == "2"
    d.wait_log("attempt=2 duration")
    wait_until(lambda: re.search(rf"worker \d \(pid {victim}\) died \(signal 9\)", d.log()),
               what="the master's line on the death")
    code, _ = stop_keep_messages(d)
    assert code == 0


def test_silent_worker_is_killed_and_replaced(daemon_factory: Any) -> None:
    d = daemon_factory({"worker_timeout": 3}, watchdog_usec=2_000_000).start()
    victim, other = d.children()
    os.kill(victim, signal.SIGSTOP)
    d.wait_log(f"(pid {victim}) silent", timeout=30)
    wait_until(lambda: not pid_alive(victim), what="silent worker killed")
    wait_until(lambda: len(d.children()) == 2 and victim not in d.children(),
               what="replacement")
    assert other in d.children()
    # The master stayed healthy throughout: the watchdog kept going.
    n = len(d.messages())
    d.wait_notify(lambda m: "WATCHDOG=1" in m, after=n, what="WATCHDOG after replacement")
    assert d.stop() == 0


def test_workers_exit_when_master_dies(daemon_factory: Any) -> None:
    d = daemon_factory().start()
    workers = d.children()
    os.kill(d.pid, signal.SIGKILL)
    all_dead(workers, timeout=15)
