"""Leases across a database gap (SPEC "Database failover"): an outage or a hung server
shorter than alive_time kills no running job and restarts no worker; a hung server is
left at the statement deadline, `status` keeps answering at once and says so, and work
resumes within the deadline once the server is back."""

from __future__ import annotations

import math
import re
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import Daemon, pid_alive, wait_until
from dbservers import MariaDBServer, PostgresServer
from faultlib import metric, now_boot, workers

import perfectschedd
from perfectschedctl.client import SocketClient
from perfectschedd.store.deadline import statement_deadline

pytestmark = [pytest.mark.faults]

# Appends "S|E <key> <scheduled_time> <attempt> <pid> <uptime>" to $JOB_LOG, sleeping
# $1 seconds in between.
JOB = r"""#!/bin/sh
log() { read up _ < /proc/uptime
  echo "$1 $PERFECTSCHED_KEY $PERFECTSCHED_SCHEDULED_TIME $PERFECTSCHED_ATTEMPT $$ $up" \
    >> "$JOB_LOG"; }
log S
sleep "$1"
log E
"""


@pytest.fixture
def private_pg() -> Iterator[PostgresServer]:
    """A server of this test's own: it is stopped and frozen."""
    with PostgresServer() as pg:
        yield pg


@pytest.fixture(params=[
    pytest.param(PostgresServer, id="postgresql", marks=pytest.mark.postgresql),
    pytest.param(MariaDBServer, id="mysql", marks=pytest.mark.mysql)])
def private_db(request: pytest.FixtureRequest) -> Iterator[PostgresServer | MariaDBServer]:
    """A server of this test's own, of each kind that has a statement deadline of its own
    (frozen, a server enforces none: store/deadline.py)."""
    with request.param() as server:
        yield server


def _daemon(make: Any, tmp_path: Path, url: str, alive_time: int, long_job: float
            ) -> Daemon:
    """`make`: the daemon_factory fixture, which kills the daemon's tree at teardown."""
    script = tmp_path / "job.sh"
    script.write_text(JOB)
    script.chmod(0o755)
    log = tmp_path / "jobs.log"
    log.touch()
    d: Daemon = make({
        "alive_time": alive_time, "workers": 2, "kill_grace": 1, "worker_timeout": 10,
        "retry_wait": 1, "routes": [
            {"type": "long", "exec": ["/bin/sh", str(script), str(long_job)],
             "user": "root", "env": {"JOB_LOG": str(log)}},
            {"type": "quick", "exec": ["/bin/sh", str(script), "0"],
             "user": "root", "env": {"JOB_LOG": str(log)}}]},
        url=url)
    return d


def _runs(tmp_path: Path, kind: str, key: str) -> list[list[str]]:
    text = (tmp_path / "jobs.log").read_text()
    return [p for p in (line.split() for line in text.splitlines())
            if len(p) == 6 and p[0] == kind and p[1] == key]


def _add_due(url: str, key: str, task_type: str, in_seconds: float = 0.0) -> int:
    """A `* * * * *` schedule whose current minute's occurrence is due `in_seconds` from
    now (by its delay); returns that occurrence's scheduled time."""
    now = time.time()
    minute = int(now // 60 * 60)
    with perfectschedd.open({"type": "rdb_compat", "url": url}) as sc:
        sc.init()
        sc.add(key, task_type, "* * * * *", start=minute,
               delay=max(0, math.ceil(now + in_seconds - minute)))
    return minute


def _history(url: str, key: str) -> list[dict[str, Any]]:
    with perfectschedd.open({"type": "rdb_compat", "url": url}) as sc:
        return [dict(r) for r in sc.history(key, 20)]


@pytest.mark.postgresql
def test_job_keeps_running_through_a_10s_outage(tmp_path: Path, private_pg: PostgresServer,
                                                daemon_factory: Any) -> None:
    """PostgreSQL stopped for 10 s, alive_time 30: the running job is neither fenced nor
    stopped, its lease is renewed once the server is back, and its one attempt succeeds;
    no worker is replaced."""
    url = private_pg.create_database("outage")
    d = _daemon(daemon_factory, tmp_path, url, alive_time=30, long_job=25)
    scheduled = _add_due(url, "long1", "long")
    d.start(timeout=60)
    wait_until(lambda: _runs(tmp_path, "S", "long1"), 30, what="the long job to start")
    job_pid = int(_runs(tmp_path, "S", "long1")[0][4])
    pids = sorted(workers(d))
    time.sleep(1)
    private_pg.stop_server()
    try:
        time.sleep(10)
        assert pid_alive(job_pid), "the job died during the outage"
    finally:
        private_pg.start_server()
    wait_until(lambda: _runs(tmp_path, "E", "long1"), 60, what="the long job to end")
    wait_until(lambda: any(h["scheduled_time"] == scheduled for h in _history(url, "long1")),
               30, what="the run to be recorded")
    runs = [h for h in _history(url, "long1") if h["scheduled_time"] == scheduled]
    assert [(h["outcome"], h["attempt"]) for h in runs] == [("success", 1)], runs
    assert len(_runs(tmp_path, "S", "long1")) == 1
    assert d.alive()
    assert sorted(workers(d)) == pids, "a worker was replaced"
    d.wait_log("database reachable again")
    log = d.log()
    assert not re.search(r"fenc|lease lost", log), log[-3000:]


def test_hung_server_status_answers_jobs_live_work_resumes(
        tmp_path: Path, private_db: PostgresServer | MariaDBServer, daemon_factory: Any
) -> None:
    """The only PostgreSQL or MariaDB server frozen (SIGSTOP of its process tree, no
    failover) for 20 s, alive_time 60: `status` answers within 1 s throughout and says the
    database is hung or unreachable and since when; the running job lives on and succeeds once; an
    occurrence that fell due meanwhile starts within the statement deadline of SIGCONT;
    no worker is replaced."""
    url = private_db.create_database("hung")
    alive_time = 60
    deadline = statement_deadline(alive_time)
    d = _daemon(daemon_factory, tmp_path, url, alive_time=alive_time, long_job=35)
    scheduled = _add_due(url, "long1", "long")
    d.start(timeout=60)
    wait_until(lambda: _runs(tmp_path, "S", "long1"), 30, what="the long job to start")
    job_pid = int(_runs(tmp_path, "S", "long1")[0][4])
    _add_due(url, "later", "quick", in_seconds=6)
    pids = sorted(workers(d))
    client = SocketClient(d.socket_path, timeout=10)
    client.call("status")  # warm: the first call loads what answering needs

    t0_wall = time.time()
    private_db.pause_server()
    took: list[float] = []
    said: dict[str, Any] = {}
    unreachable_for: float | None = None
    try:
        end = time.monotonic() + 20
        while time.monotonic() < end:
            t = time.monotonic()
            st = client.call("status")
            took.append(time.monotonic() - t)
            db = st["database"]
            if db["ok"] is False and db.get("unreachable_since") is not None:
                said = db
                unreachable_for = metric(d, "perfectsched_database_unreachable_seconds")
            time.sleep(0.5)
        assert pid_alive(job_pid), "the job died while the database hung"
    finally:
        private_db.resume_server()
    thawed = now_boot()
    slowest, middle = max(took), statistics.median(took)
    print(f"\nstatus while hung: slowest {slowest:.3f}s, median {middle:.3f}s; said {said}")
    assert slowest < 1.0, f"status took {slowest:.2f}s while the database hung"
    # Once the database is known not to answer, status does not wait for figures it
    # cannot give (STATUS_FRESH_WAIT, 0.5 s, on every call before).
    assert middle < 0.25, took
    assert said, "status never said the database is unreachable"
    assert re.search(r"hung|no answer", said.get("error") or ""), said
    assert t0_wall - 1 <= said["unreachable_since"] <= t0_wall + 15, (t0_wall, said)
    assert unreachable_for is not None and unreachable_for > 0, unreachable_for

    wait_until(lambda: _runs(tmp_path, "S", "later"), deadline + 30,
               what="the occurrence due during the hang to start")
    resumed = float(_runs(tmp_path, "S", "later")[0][5]) - thawed
    print(f"work resumed {resumed:.1f}s after SIGCONT (deadline {deadline:g}s)")
    assert resumed < deadline + 5, f"work resumed only {resumed:.1f}s after SIGCONT"

    wait_until(lambda: _runs(tmp_path, "E", "long1"), 60, what="the long job to end")
    wait_until(lambda: any(h["scheduled_time"] == scheduled for h in _history(url, "long1")),
               30, what="the long run to be recorded")
    runs = [h for h in _history(url, "long1") if h["scheduled_time"] == scheduled]
    assert [(h["outcome"], h["attempt"]) for h in runs] == [("success", 1)], runs
    assert len(_runs(tmp_path, "S", "long1")) == 1
    assert d.alive()
    assert sorted(workers(d)) == pids, "a worker was replaced"
    wait_until(lambda: client.call("status")["database"]["ok"], 30, what="database ok")
    # /metrics: the workers' statements cut at the deadline, their connections abandoned,
    # and each worker connected again.
    for name in ("perfectsched_database_deadline_expiries_total",
                 "perfectsched_database_connections_abandoned_total",
                 "perfectsched_database_reconnects_total"):
        assert (metric(d, name) or 0) >= 1, name
    assert metric(d, "perfectsched_database_unreachable_seconds") == 0
    assert metric(d, "perfectsched_alive_time_seconds") == alive_time
