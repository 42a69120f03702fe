"""metrics/: Prometheus metrics summed over forked workers (counters.py, exposition.py,
multiproc.py, archive.py), /healthz, shipped rules."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from daemon_harness import Daemon, wait_until
from prometheus_client.parser import text_string_to_metric_families
from scrape import Samples, get, scrape, value

from perfectschedd import __version__
from perfectschedd.control import protocol
from perfectschedd.metrics import counters, exposition, multiproc

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "etc" / "prometheus" / "perfectsched.rules.yml"
RULES_TEST = ROOT / "etc" / "prometheus" / "perfectsched.rules.test.yml"
DASHBOARD = ROOT / "etc" / "grafana" / "perfectsched.json"
PROMTOOL = "/usr/bin/promtool"
ONCE = "0 0 1 1 *"  # with at=0: runs now, then not again for months

JOB = """
import os, time
import perfectschedd

class Job(perfectschedd.Application):
    def run(self):
        with open(os.environ["METRICS_TEST_PIDS"], "a") as f:
            f.write(f"{os.getpid()}\\n")
        time.sleep(0.3)
        self.task.finish()

class Fail(perfectschedd.Application):
    def run(self):
        raise RuntimeError("this job fails")
"""

def add_many(d: Daemon, schedules: list[dict[str, Any]]) -> None:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(d.socket_path)
        s.sendall(protocol.request("add_many", {"schedules": schedules}))
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(65536)
            assert chunk, "control socket closed"
            buf += chunk
    assert protocol.parse_response(buf) == {"added": len(schedules)}


def call(d: Daemon, cmd: str, args: dict[str, Any]) -> Any:
    """One request on the control socket (no perfectschedctl process: ~0.2 s of CPU less)."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(d.socket_path)
        s.sendall(protocol.request(cmd, args))
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(65536)
            assert chunk, "control socket closed"
            buf += chunk
    return protocol.parse_response(buf)


def promtool(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    if not os.access(PROMTOOL, os.X_OK):
        pytest.fail("promtool missing: run tests/install-test-deps.sh (package prometheus)")
    return subprocess.run([PROMTOOL, *args], input=stdin, capture_output=True, text=True,
                          timeout=60)


def test_metrics_summed_over_workers_and_kept_across_worker_replacement(
        daemon_factory: Callable[..., Daemon], tmp_path: Path) -> None:
    (tmp_path / "metricsjob.py").write_text(JOB)
    pids_file, env_file = tmp_path / "pids.txt", tmp_path / "env.txt"
    runtime = tmp_path / "runtime"
    multiproc = runtime / "metrics"
    multiproc.mkdir(parents=True)
    (multiproc / "counter_1.db").write_bytes(b"stale garbage of a previous run")
    d = daemon_factory({
        "workers": 2, "concurrency": 2, "retry_wait": 3600,
        # Series of their own for job and fail schedules (test_schedule_series.py): the
        # rules and the dashboard use them.
        "routes": [{"type": "job", "python": "metricsjob:Job", "user": "root", "metrics": True},
                   {"type": "fail", "python": "metricsjob:Fail", "user": "root",
                    "metrics": True},
                   {"type": "envdump", "exec": ["/bin/sh", "-c", 'env > "$0"', str(env_file)],
                    "user": "root"}],
    }, extra_args=["-I", str(tmp_path)],
        env={"METRICS_TEST_PIDS": str(pids_file), "RUNTIME_DIRECTORY": str(runtime)})
    t0 = time.time()
    d.start()
    assert not (multiproc / "counter_1.db").exists(), "the directory is cleared at start"
    workers = set(d.children())
    assert len(workers) == 2

    n = 10
    add_many(d, [{"key": f"job-{i}", "type": "job", "cron": ONCE, "at": 0} for i in range(n)]
             + [{"key": f"fail-{i}", "type": "fail", "cron": ONCE, "at": 0} for i in range(2)]
             + [{"key": "env", "type": "envdump", "cron": ONCE, "at": 0},
                {"key": "lost", "type": "unrouted", "cron": ONCE, "at": 0}])

    def settled() -> Samples | None:
        _, s = scrape(d.metrics_port)
        done = value(s, "perfectsched_tasks_finished_total")
        return s if done == n + 3 else None
    wait_until(settled, timeout=20, what="all tasks finished in /metrics")
    wait_until(lambda: d.ctl_json("history", "fail-1") and d.ctl_json("history", "job-9"),
               what="the runs' history written")
    d.ctl("status")  # refreshes the cached schedule counts now instead of within 15 s
    text, s = scrape(d.metrics_port)

    ran_in = [int(p) for p in pids_file.read_text().split()]
    assert len(ran_in) == n
    assert set(ran_in) == workers, "both workers ran jobs: the totals are sums"
    started = "perfectsched_tasks_started_total"
    finished = "perfectsched_tasks_finished_total"
    assert value(s, started, type="job") == n
    assert value(s, started, type="fail") == 2
    assert value(s, started, type="envdump") == 1
    assert value(s, started, type="unrouted") is None  # never started
    assert value(s, finished, type="job", outcome="success") == n
    assert value(s, finished, type="fail", outcome="failed") == 2
    assert value(s, finished, type="envdump", outcome="success") == 1
    # No worker routes it, so none claims it: it waits, and the master shows it.
    assert value(s, finished, type="unrouted", outcome="no_route") is None
    assert value(s, "perfectsched_occurrences_unclaimed", type="unrouted") == 1
    for hist in ("perfectsched_task_duration_seconds", "perfectsched_task_lateness_seconds"):
        assert value(s, f"{hist}_count", type="job") == n
        assert value(s, f"{hist}_bucket", type="job", le="+Inf") == n
        assert value(s, f"{hist}_bucket", type="job", le="0.001") is not None
        assert value(s, f"{hist}_bucket", type="job", le="86400.0") == n
    assert value(s, "perfectsched_task_duration_seconds_sum", type="job") >= 0.3 * n
    assert value(s, "perfectsched_task_duration_seconds_bucket", type="job", le="0.1") == 0
    assert value(s, "perfectsched_task_duration_seconds_count", type="unrouted") is None
    last = value(s, "perfectsched_last_success_timestamp_seconds", type="job")
    assert last is not None and t0 <= last <= time.time()
    assert value(s, "perfectsched_last_success_timestamp_seconds", type="fail") in (None, 0)
    assert value(s, "perfectsched_leases_lost_total") in (None, 0)
    assert value(s, "perfectsched_database_errors_total") == 0
    assert value(s, "perfectsched_database_up") == 1
    assert value(s, "perfectsched_workers_configured") == 2
    assert value(s, "perfectsched_workers_alive") == 2
    assert value(s, "perfectsched_worker_restarts_total") == 0
    assert value(s, "perfectsched_schedules_registered") == n + 4
    assert value(s, "perfectsched_schedules_paused") == 0
    assert value(s, "perfectsched_schedules_overdue") == 1  # the unrouted one waits
    assert value(s, "perfectsched_schedule_counts_timestamp_seconds") >= t0
    assert value(s, "perfectsched_build_info", version=__version__) == 1
    assert value(s, "perfectsched_schedule_state", key="fail-1", state="retrying") == 1
    assert value(s, "perfectsched_schedule_last_failure_timestamp_seconds", key="fail-1") >= t0
    assert value(s, "perfectsched_schedule_last_success_timestamp_seconds", key="job-9") >= t0
    assert value(s, "perfectsched_schedule_state", key="env") is None  # its route: none

    # Exec jobs must not write prometheus_client files into the daemon's directory.
    assert "PROMETHEUS_MULTIPROC_DIR" not in env_file.read_text()

    # promtool lints a real scrape; the rules and the dashboard use only real metric names.
    res = promtool("check", "metrics", stdin=text)
    assert (res.returncode, res.stdout + res.stderr) == (0, "")
    exported = {name for name, _ in s} | {f.name for f in text_string_to_metric_families(text)}
    exported.add("perfectsched_leases_lost_total")  # by type: appears with the first loss
    used = set(re.findall(r"perfectsched_[a-z_]+", RULES.read_text() + DASHBOARD.read_text()))
    assert used and used <= exported, f"not exported: {sorted(used - exported)}"

    code, _, body = get(d.metrics_port, "/healthz")
    assert (code, body) == (200, "ok\n")

    # SIGKILL a worker that counted tasks: replaced, restart counted, its counts kept.
    victim = ran_in[0]
    os.kill(victim, signal.SIGKILL)
    wait_until(lambda: len(set(d.children()) - {victim}) == 2 and victim not in d.children(),
               timeout=15, what="the killed worker replaced")

    def replaced() -> Samples | None:
        _, s = scrape(d.metrics_port)
        ok = value(s, "perfectsched_worker_restarts_total") == 1 and \
            value(s, "perfectsched_workers_alive") == 2
        return s if ok else None
    s = wait_until(replaced, timeout=15, what="restart counted, 2 workers alive")
    assert value(s, started, type="job") == n
    assert value(s, finished, type="job", outcome="success") == n
    assert value(s, "perfectsched_task_duration_seconds_count", type="job") == n
    assert value(s, "perfectsched_database_up") == 1
    assert not (multiproc / f"gauge_livemin_{victim}.db").exists(), "mark_process_dead"
    # Its counters were folded into the archive: the totals above still include them.
    assert not (multiproc / f"counter_{victim}.db").exists()
    assert (multiproc / "counter_archive.db").exists()
    assert d.stop() == 0


def test_metrics_listen_off_serves_nothing(daemon_factory: Callable[..., Daemon]) -> None:
    d = daemon_factory({"metrics_listen": "off"}).start()
    with pytest.raises(ConnectionRefusedError), socket.create_connection(
            ("127.0.0.1", d.metrics_port), timeout=5):
        pass
    assert _listening_tcp(d.pid) == set()
    assert "metrics on" not in d.log()
    assert d.stop() == 0


def test_alive_time_follows_a_reload_that_changes_it_alone(
        daemon_factory: Callable[..., Daemon]) -> None:
    """perfectsched_alive_time_seconds (what the shipped alert rules compare with) is the
    running configuration's: a reload on the same database that changes only alive_time
    shows at the next scrape."""
    d = daemon_factory({"alive_time": 30}).start()
    assert value(scrape(d.metrics_port)[1], "perfectsched_alive_time_seconds") == 30
    d.write_config({**d.config, "alive_time": 90})
    assert d.ctl("reload", check=False).returncode == 0
    wait_until(lambda: value(scrape(d.metrics_port)[1],
                             "perfectsched_alive_time_seconds") == 90, 10,
               what="alive_time 90 in /metrics")
    assert d.stop() == 0


def _listening_tcp(pid: int) -> set[int]:
    """Inodes of the TCP sockets in LISTEN state that `pid` holds."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    listening = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":
                listening.add(int(fields[9]))
    return inodes & listening


def test_calls_before_setup_are_cheap_no_ops() -> None:
    code = ("import sys; from perfectschedd.metrics import counters, exposition\n"
            "counters.task_started('t', 1.0); counters.task_finished('t', 'success', 2.0)\n"
            "counters.lease_lost('t'); counters.db_error(); counters.set_db_up(False)\n"
            "counters.after_fork_in_worker()\n"
            "exposition.worker_exited(1); exposition.worker_restarted()\n"
            "exposition.set_workers(2, 1); exposition.set_schedule_counts({'schedules': 1})\n"
            "assert 'prometheus_client' not in sys.modules, 'imported before setup'\n"
            "assert 'PROMETHEUS_MULTIPROC_DIR' not in __import__('os').environ\n")
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=30)
    assert res.returncode == 0, res.stderr


def test_shipped_alert_rules_pass_promtool() -> None:
    res = promtool("check", "rules", str(RULES))
    assert res.returncode == 0, res.stdout + res.stderr
    alerts = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"]
              for r in g["rules"] if "alert" in r}
    assert {"PerfectSchedScheduleOverdue", "PerfectSchedScheduleStalled",
            "PerfectSchedScheduleNoRecentSuccess",
            "PerfectSchedTaskFailureRate",
            "PerfectSchedNoWorkerAlive", "PerfectSchedDatabaseErrors"} <= alerts
    # Unit tests of the alerts: each fires on the series meant to trigger it, only then.
    res = promtool("test", "rules", str(RULES_TEST))
    assert res.returncode == 0, res.stdout + res.stderr


def test_grafana_dashboard_is_importable_json() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["title"] and dash["uid"]
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert exprs and all("perfectsched_" in e for e in exprs)


def test_scrape_while_a_worker_creates_its_files(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # A starting worker's file exists, still empty, for an instant: no failed scrape.
    (tmp_path / "counter_4242.db").write_bytes(b"")
    monkeypatch.setattr(multiproc, "_dir", str(tmp_path))
    assert exposition.render() == b""


def test_dead_workers_files_are_folded_and_totals_never_go_down(
        daemon_factory: Callable[..., Daemon], tmp_path: Path) -> None:
    """60 worker exits (reloads, and a kill -9), each generation after running a task:
    the metrics directory stays at one file per live worker and kind plus the archives,
    and the task counters only ever grow, to the number of tasks run."""
    runtime = tmp_path / "runtime"
    # 4 workers: a reload (~0.5 s, most of an iteration) retires 4 at once, so 60 exits
    # take 15 reloads, not 30 (and 4 dead workers' files are folded at the same time).
    workers = 4
    d = daemon_factory({"workers": workers, "poll_interval": 0.2,
                        "routes": [{"type": "t", "exec": ["/bin/true"], "user": "root"}]},
                       env={"RUNTIME_DIRECTORY": str(runtime)}).start()
    multiproc = runtime / "metrics"
    d.ctl("add", "k", "t", "0 0 1 1 *")
    finished = "perfectsched_tasks_finished_total"
    last = 0.0
    exits = 0
    runs = 0
    while exits < 60:
        call(d, "run", {"key": "k"})  # the socket itself: each exit costs a reload only
        runs += 1
        wait_until(lambda r=runs: (value(scrape(d.metrics_port)[1], finished, type="t",
                                  outcome="success") or 0) >= r, timeout=20,
                   what=f"run {runs} counted")
        if runs == 7:  # one death among the retirements
            victim = d.children()[0]
            os.kill(victim, signal.SIGKILL)
            wait_until(lambda v=victim: v not in d.children() and
                       len(d.children()) == workers, timeout=30, what="a replacement")
            exits += 1
        before = d.log().count("]: reloaded")
        d.send_signal(signal.SIGHUP)
        wait_until(lambda b=before: d.log().count("]: reloaded") > b, timeout=30,
                   what="reload")
        exits += workers
        now = value(scrape(d.metrics_port)[1], finished, type="t", outcome="success") or 0
        assert now >= last, (now, last)  # never down
        last = now
    # The last reload's old generation may still be exiting: wait for it, then its folds.
    wait_until(lambda: len(d.children()) == workers, what="the old generation to exit")
    wait_until(lambda: not any(f.name.startswith(("counter_", "histogram_"))
                               and not f.name.endswith("_archive.db")
                               and int(f.name.split("_")[1].split(".")[0]) not in d.children()
                               for f in multiproc.glob("*.db")), what="the last folds")
    files = sorted(f.name for f in multiproc.glob("*.db"))
    for kind in ("counter", "histogram", "gauge_max"):
        mine = [f for f in files if f.startswith(f"{kind}_")]
        assert len(mine) <= workers + 1, files  # the live workers' files and the archive
    _, s = scrape(d.metrics_port)
    assert value(s, finished, type="t", outcome="success") == runs
    assert value(s, "perfectsched_task_duration_seconds_count", type="t") == runs
    assert (value(s, "perfectsched_last_success_timestamp_seconds", type="t") or 0) > 0
    assert d.stop() == 0


def test_a_worker_that_died_before_writing_a_value_is_folded_quietly(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A worker stopped as it started leaves an empty metric file: it holds nothing to
    fold, and must not be reported as an error (a failed start's one line is the
    database's, tests/store/test_version.py)."""
    from perfectschedd.metrics import archive

    (tmp_path / "counter_4242.db").write_bytes(b"")
    (tmp_path / "histogram_4242.db").write_bytes(b"\0\0")
    with caplog.at_level("ERROR", logger="perfectschedd"):
        archive.fold_dead(str(tmp_path), 4242)
    assert caplog.records == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["counter_archive.db",
                                                         "histogram_archive.db"]


FLUSH_RACE = '''
import sys, threading
from types import SimpleNamespace
from perfectschedd.metrics import counters, exposition
exposition.setup_master(SimpleNamespace(control_socket=sys.argv[1]))
counters.after_fork_in_worker()
stop = threading.Event()
def flusher():
    while not stop.is_set():
        counters.flush_tasks()
def run(n):
    for i in range(n):
        counters.task_started("t", (i % 3) * 0.004)
        counters.task_finished("t", "success" if i % 4 else "failed", 0.02)
flushers = [threading.Thread(target=flusher) for _ in range(2)]
runners = [threading.Thread(target=run, args=(5000,)) for _ in range(4)]
for t in flushers + runners:
    t.start()
for t in runners:
    t.join()
stop.set()
for t in flushers:
    t.join()
counters.flush_tasks()
sys.stdout.write(exposition.render().decode())
'''


def test_task_counts_queued_by_threads_are_exact_once_flushed(tmp_path: Path) -> None:
    """Task threads queue their starts and ends and flushes run meanwhile (from two
    threads at once): every event is counted exactly once, none lost or doubled."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PROMETHEUS_MULTIPROC_DIR", "RUNTIME_DIRECTORY")}
    res = subprocess.run([sys.executable, "-c", FLUSH_RACE, str(tmp_path / "ctl.sock")],
                         capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    s: Samples = {(x.name, frozenset(x.labels.items())): x.value
                  for family in text_string_to_metric_families(res.stdout)
                  for x in family.samples}
    assert value(s, "perfectsched_tasks_started_total", type="t") == 20_000
    assert value(s, "perfectsched_tasks_finished_total", type="t", outcome="success") == 15_000
    assert value(s, "perfectsched_tasks_finished_total", type="t", outcome="failed") == 5_000
    late = "perfectsched_task_lateness_seconds"
    assert value(s, f"{late}_bucket", type="t", le="0.001") == 4 * 1667  # i % 3 == 0
    assert value(s, f"{late}_bucket", type="t", le="0.005") == 4 * 3334
    assert value(s, f"{late}_bucket", type="t", le="0.01") == 20_000
    assert value(s, f"{late}_sum", type="t") == pytest.approx(4 * (1667 * 0.004 + 1666 * 0.008))
    assert value(s, "perfectsched_task_duration_seconds_count", type="t") == 20_000
    assert value(s, "perfectsched_task_duration_seconds_bucket", type="t", le="0.01") == 0
    assert (value(s, "perfectsched_last_success_timestamp_seconds", type="t") or 0) > 0


def test_observe_many_is_observe_per_amount() -> None:
    """The workers' batched histogram update gives the buckets, count and sum that
    observe() per amount gives, on bucket bounds too."""
    from prometheus_client import Histogram

    amounts = [0.0, 0.001, 0.0011, 0.005, 0.3, 1.0, 99.0, 86400.0, 90000.0, 1e-9]
    one = Histogram("one", "h", buckets=counters.BUCKETS, registry=None)
    many = Histogram("many", "h", buckets=counters.BUCKETS, registry=None)
    for a in amounts:
        one.observe(a)
    counters._observe_many(many, amounts)

    def samples(h: Any) -> dict[tuple[str, str], float]:
        return {(x.name.split("_", 1)[1], x.labels.get("le", "")): x.value
                for x in h.collect()[0].samples if not x.name.endswith("_created")}

    got, want = samples(many), samples(one)
    assert got.keys() == want.keys()
    assert {k: v for k, v in got.items() if k[0] != "sum"} == \
        {k: v for k, v in want.items() if k[0] != "sum"}
    assert got["sum", ""] == pytest.approx(want["sum", ""])
