"""The master's loop never waits on the database (SPEC "perfectschedd"): a real
PostgreSQL frozen with SIGSTOP, a real SQLite file held by an outside writer, and worker
starts while clients hammer the control socket."""

from __future__ import annotations

import json
import re
import socket
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import YEARLY, Daemon, lines, log_stamp, sh, wait_until
from dbservers import PostgresServer

from perfectschedd.control import protocol

# Fault injection (a frozen server, a held database file, a flood of clients) and latency
# measured alone: the fault suite's (make test-faults), one test at a time.
pytestmark = pytest.mark.faults

WATCHDOG_USEC = 2_000_000



def timed_status(d: Daemon) -> tuple[float, dict[str, Any]]:
    t0 = time.monotonic()
    st = d.status()
    return time.monotonic() - t0, st


def watchdog_times(d: Daemon) -> list[float]:
    assert d.notify is not None
    return [t for t, m in d.notify.timed() if "WATCHDOG=1" in m]


def ride_out_hang(d: Daemon, seconds: float) -> list[dict[str, Any]]:
    """Ask for status every half second during a hang: each answer within 1 s."""
    answers = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        took, st = timed_status(d)
        assert took < 1.0, f"status took {took:.2f}s during the hang"
        answers.append(st)
        time.sleep(0.5)
    return answers


def check_survived(d: Daemon, workers: list[int], hang_start: float, hang_end: float,
                   out: Path) -> None:
    # No worker was replaced for waiting on the database.
    assert sorted(d.children()) == workers, d.log()[-3000:]
    assert "silent" not in d.log() and "killing it" not in d.log()
    # The watchdog was fed all along (gaps well inside WATCHDOG_USEC).
    times = [t for t in watchdog_times(d) if hang_start - 2 <= t <= hang_end + 2]
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert times and max(gaps, default=0) < WATCHDOG_USEC / 1e6, gaps
    # The occurrence that came due during the hang runs once it ends: once.
    wait_until(lambda: lines(out), timeout=60, what="the occurrence due during the hang")
    time.sleep(2)
    assert len(lines(out)) == 1, lines(out)


@pytest.mark.postgresql
def test_frozen_postgresql(daemon_factory: Any, pg_url: str,
                           postgres_server: PostgresServer, tmp_path: Path) -> None:
    out = tmp_path / "runs"
    d = daemon_factory({"worker_timeout": 4, "alive_time": 60, "poll_interval": 0.5,
                        "routes": [sh("t", f'echo "$1" >> {out}')]},
                       url=pg_url, watchdog_usec=WATCHDOG_USEC).start()
    d.ctl("add", "k", "t", YEARLY, "--at", str(int(time.time()) + 4))
    workers = sorted(d.children())
    postgres_server.pause_server()
    hang_start = time.monotonic()
    try:
        answers = ride_out_hang(d, 12)  # > worker_timeout, > the watchdog interval
        # A command that needs the database: one line, exit 1, well before it answers.
        t0 = time.monotonic()
        res = d.ctl("list", check=False)
        assert time.monotonic() - t0 < 12
        assert res.returncode == 1 and "database unreachable" in res.stderr
        assert len(res.stderr.strip().splitlines()) == 1, res.stderr
        human = d.ctl("status").stdout
        assert "database: unreachable since" in human, human
    finally:
        postgres_server.resume_server()
    hang_end = time.monotonic()
    last = answers[-1]
    assert last["database_ok"] is False
    assert last["database"]["unreachable_since"] <= time.time() - 5
    check_survived(d, workers, hang_start, hang_end, out)
    wait_until(lambda: d.status()["database_ok"], timeout=30, what="database ok again")
    assert d.stop() == 0


def test_sqlite_held_by_an_outside_writer(daemon_factory: Any, tmp_path: Path) -> None:
    out = tmp_path / "runs"
    d = daemon_factory({"worker_timeout": 4, "alive_time": 60, "poll_interval": 0.5,
                        "routes": [sh("t", f'echo "$1" >> {out}')]},
                       watchdog_usec=WATCHDOG_USEC).start()
    d.ctl("add", "k", "t", YEARLY, "--at", str(int(time.time()) + 3))
    workers = sorted(d.children())
    db = d.config["url"].removeprefix("sqlite:///")
    hold = sqlite3.connect(db, isolation_level=None, timeout=30)
    hold.execute("BEGIN EXCLUSIVE")
    hang_start = time.monotonic()
    try:
        ride_out_hang(d, 12)  # three times worker_timeout: long enough to be mistaken
    finally:
        hold.execute("COMMIT")
        hold.close()
    hang_end = time.monotonic()
    check_survived(d, workers, hang_start, hang_end, out)
    assert d.stop() == 0


def test_worker_starts_while_clients_hammer_the_socket(daemon_factory: Any) -> None:
    """Forks happen only between the master's database calls: 500 worker starts while 4
    clients add and list, and each worker is up within 2 s of its fork.  8 workers a
    generation: 63 reloads, not 125 (each costs a generation's start), and more forks
    at once between the master's database calls."""
    workers = 8
    d = daemon_factory({"workers": workers, "worker_timeout": 10}).start()
    stop = threading.Event()
    errors: list[str] = []

    def hammer(n: int) -> None:
        i = 0
        with socket.socket(socket.AF_UNIX) as sock:
            sock.connect(d.socket_path)
            replies = sock.makefile("rb")
            while not stop.is_set():
                i += 1
                for cmd, args in (("add", {"key": f"h{n}-{i}", "type": "t", "cron": YEARLY}),
                                  ("list", {"prefix": f"h{n}-", "limit": 50})):
                    sock.sendall(protocol.request(cmd, args))
                    answer = json.loads(replies.readline())
                    if not answer.get("ok"):
                        errors.append(str(answer))

    clients = [threading.Thread(target=hammer, args=(n,)) for n in range(4)]
    for c in clients:
        c.start()
    try:
        for _ in range(500 // workers):
            before = d.log().count("]: reloaded")
            d.send_signal(1)  # SIGHUP: a new generation of workers
            wait_until(lambda b=before: d.log().count("]: reloaded") > b, timeout=30,
                       what="reload")
    finally:
        stop.set()
        for c in clients:
            c.join()
    # The workers of the last generation may have lines still queued in their log
    # writers: they are written when the workers exit.
    assert d.stop() == 0
    log = d.log()
    spawned = {int(pid): log_stamp(t) for t, pid in
               re.findall(r"^(\S+ \S+) INFO master\[\d+\]: worker \d+ spawned \(pid (\d+)",
                          log, re.M)}
    started = {int(pid): log_stamp(t) for t, pid in
               re.findall(r"^(\S+ \S+) INFO worker-\d+\[(\d+)\]: worker \d+ started", log,
                          re.M)}
    assert len(spawned) >= 500
    assert set(spawned) <= set(started), "every worker forked reached its loop"
    slowest = max(started[p] - spawned[p] for p in spawned)
    print(f"{len(spawned)} workers started, the slowest in {slowest:.2f} s")
    assert slowest < 2.0, slowest
    assert not errors, errors[:3]
    assert "silent" not in log


def test_http_answers_inside_its_deadline_while_postgresql_is_frozen(
        daemon_factory: Any, pg_url: str, postgres_server: PostgresServer) -> None:
    """A hung database: every HTTP client gets an answer (an error, one JSON line)
    inside its own deadline, and neither the control socket nor /healthz waits."""
    from api_client import call, make_token

    from perfectschedd.web import server

    d = daemon_factory({"routes": [sh("t", "true")], "poll_interval": 0.5},
                       url=pg_url).start()
    d.ctl("add", "k", "t", YEARLY)
    token = make_token(d, "ops", "admin")
    assert call(d.metrics_port, "GET", "/api/v1/schedules", token).status == 200
    postgres_server.pause_server()
    try:
        for method, path, body in (("GET", "/api/v1/schedules", None),
                                   ("GET", "/api/v1/schedules/k", None),
                                   ("POST", "/api/v1/schedules/k/run", None),
                                   ("POST", "/api/v1/schedules",
                                    {"key": "k2", "type": "t", "cron": YEARLY})):
            t0 = time.monotonic()
            a = call(d.metrics_port, method, path, token, body)
            took = time.monotonic() - t0
            assert a.status == 503, (path, a.status, a.body)
            assert took < server.ANSWER_DEADLINE + 2, (path, took)
            assert "\n" not in a.error
        # Meanwhile: the socket answers status at once, and /metrics too.
        t0 = time.monotonic()
        assert d.status()["database_ok"] in (True, False)
        assert call(d.metrics_port, "GET", "/metrics").status == 200
        assert time.monotonic() - t0 < 3
    finally:
        postgres_server.resume_server()
    wait_until(lambda: call(d.metrics_port, "GET", "/api/v1/schedules/k", token).status
               == 200, timeout=30, what="the API back with the database")
    assert d.stop() == 0
