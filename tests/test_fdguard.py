"""fdguard.py: accept() when the process is out of file descriptors.  The exhaustion is
real (a child process with a low RLIMIT_NOFILE, every descriptor taken), and so are the
listening socket and the clients, who must see a closed connection rather than a hang."""

from __future__ import annotations

import errno
import json
import logging
import os
import select
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from perfectschedd import fdguard
from perfectschedd.fdguard import AcceptGuard

# The child: a listener, a guard, then every descriptor taken.  It says "full" on stdout,
# waits for "go" on stdin (the test's clients have connected), and reports in JSON.
CHILD = textwrap.dedent("""
    import errno, json, logging, os, resource, select, socket, sys, time
    from perfectschedd.fdguard import AcceptGuard

    path, clients, reserve_first = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    logging.basicConfig(stream=sys.stderr, format="%(message)s")
    log = logging.getLogger("guardtest")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    listener.setblocking(False)  # as in the daemon's selector loops
    guard = AcceptGuard("test socket", log) if reserve_first else None
    hog = []
    while True:
        try:
            hog.append(os.open("/dev/null", os.O_RDONLY))
        except OSError as exc:
            assert exc.errno == errno.EMFILE, exc
            break
    if guard is None:
        guard = AcceptGuard("test socket", log)
    report = {"reserve_at_start": guard.reserve is not None}
    print("full", flush=True)
    sys.stdin.readline()
    results, errnos = [], []
    began = time.monotonic()
    for _ in range(clients):
        try:
            listener.accept()
            results.append("accepted")
        except OSError as exc:
            errnos.append(exc.errno)
            results.append(guard.exhausted(listener, exc))
    report["elapsed"] = time.monotonic() - began
    report["results"] = results
    report["errnos"] = errnos
    report["reserve_after"] = guard.reserve is not None
    # Nobody is left in the backlog: the listener is no longer readable (no spin).
    report["still_readable"] = bool(select.select([listener], [], [], 0)[0])
    # Once descriptors free up, accept works again.
    os.close(hog.pop())
    os.close(hog.pop())
    print(json.dumps(report), flush=True)
    sys.stdin.readline()
    select.select([listener], [], [], 5)
    conn, _ = listener.accept()
    conn.setblocking(True)
    conn.sendall(b"served\\n")
    conn.close()
    guard.close()
    print(json.dumps({"closed_reserve": guard.reserve is None}), flush=True)
""")


def run_child(tmp_path: Path, clients: int, reserve_first: bool = True
              ) -> tuple[subprocess.Popen[str], Path]:
    path = tmp_path / "guard.sock"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(path), str(clients),
                              "1" if reserve_first else "0"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    assert child.stdout is not None
    line = child.stdout.readline()
    assert line == "full\n", (line, child.stderr.read() if child.stderr else "")
    return child, path


def connect(path: Path) -> socket.socket:
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    c.settimeout(5)
    c.connect(str(path))
    return c


def report(child: subprocess.Popen[str]) -> dict[str, object]:
    assert child.stdout is not None and child.stdin is not None
    child.stdin.write("go\n")
    child.stdin.flush()
    line = child.stdout.readline()
    assert line, child.stderr.read() if child.stderr else ""
    result: dict[str, object] = json.loads(line)
    return result


def finish(child: subprocess.Popen[str]) -> tuple[str, str]:
    assert child.stdin is not None
    out, err = child.communicate("go\n", timeout=10)
    assert child.returncode == 0, err
    return out, err


def test_out_of_descriptors_the_waiting_clients_are_closed_and_the_reserve_comes_back(
        tmp_path: Path) -> None:
    child, path = run_child(tmp_path, clients=3)
    try:
        clients = [connect(path) for _ in range(3)]
        got = report(child)
        assert got["reserve_at_start"] is True
        assert got["errnos"] == [errno.EMFILE] * 3
        assert got["results"] == [True, True, True]
        assert got["reserve_after"] is True
        assert got["still_readable"] is False
        # Each pause is short: three shed clients take about 3 * PAUSE, not seconds.
        assert 3 * fdguard.PAUSE * 0.9 <= float(got["elapsed"]) < 2.0  # type: ignore[arg-type]
        for c in clients:  # a closed connection, not a hang (recv would time out)
            assert c.recv(10) == b""
            c.close()
        # Descriptors freed: the next client is served.
        served = connect(path)
        out, err = finish(child)
        assert served.recv(100) == b"served\n"
        served.close()
        assert json.loads(out) == {"closed_reserve": True}
        # Logged once (at most once a second), with what happened.
        lines = [x for x in err.splitlines() if "out of file descriptors" in x]
        assert len(lines) == 1, err
        assert lines[0].startswith("test socket: out of file descriptors (")
        assert "closed 1 waiting connection(s) unserved" in lines[0]
    finally:
        child.kill()
        child.wait()


def test_without_a_reserve_the_guard_still_handles_exhaustion(tmp_path: Path) -> None:
    """A guard made when no descriptor was free has no reserve: accept() still fails, it
    says so (True, no exception, a pause), and takes a reserve once one is free."""
    child, path = run_child(tmp_path, clients=1, reserve_first=False)
    try:
        c = connect(path)
        got = report(child)
        assert got["reserve_at_start"] is False
        assert got["errnos"] == [errno.EMFILE]
        assert got["results"] == [True]
        assert got["reserve_after"] is False  # nothing free to take it with
        finish(child)
        c.close()
    finally:
        child.kill()
        child.wait()


@pytest.fixture
def listener(tmp_path: Path) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(tmp_path / "l.sock"))
    s.listen(8)
    s.setblocking(False)  # as in the daemon's selector loops
    return s


def test_other_errors_are_not_handled_and_leave_the_client_waiting(
        listener: socket.socket, caplog: pytest.LogCaptureFixture) -> None:
    guard = AcceptGuard("x", logging.getLogger("guardtest"))
    try:
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.connect(listener.getsockname())
        for code in (errno.EAGAIN, errno.ECONNABORTED, errno.EINTR, errno.EBADF):
            assert guard.exhausted(listener, OSError(code, os.strerror(code))) is False
        assert select.select([listener], [], [], 0)[0]  # still waiting, not closed
        conn, _ = listener.accept()
        conn.close()
        client.close()
        assert guard.shed == 0 and caplog.records == []
    finally:
        guard.close()
        listener.close()


def test_log_lines_are_rate_limited_and_count_the_shed_clients(
        listener: socket.socket, caplog: pytest.LogCaptureFixture) -> None:
    """(The errno is given, the listener and the clients are real.)"""
    caplog.set_level(logging.ERROR, "guardtest")
    guard = AcceptGuard("metrics_listen", logging.getLogger("guardtest"))
    held = guard.reserve
    assert held is not None and os.fstat(held)  # a real open descriptor
    clients = []
    try:
        for code in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.settimeout(5)
            c.connect(listener.getsockname())
            clients.append(c)
            assert guard.exhausted(listener, OSError(code, os.strerror(code))) is True
        assert all(c.recv(1) == b"" for c in clients)
        assert len(caplog.records) == 1  # four within a second: one line
        assert "closed 1 waiting connection(s)" in caplog.records[0].getMessage()
        assert guard.shed == 3
        # Nobody waiting: nothing to close (and no wait for one), still handled.
        assert guard.exhausted(listener, OSError(errno.EMFILE, "x")) is True
        assert guard.shed == 3
        guard.last_log = time.monotonic() - fdguard.LOG_EVERY
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.connect(listener.getsockname())
        clients.append(c)
        assert guard.exhausted(listener, OSError(errno.EMFILE, "x")) is True
        assert len(caplog.records) == 2
        assert "closed 4 waiting connection(s)" in caplog.records[1].getMessage()
        assert guard.shed == 0
        assert guard.reserve is not None
    finally:
        for c in clients:
            c.close()
        guard.close()
        listener.close()
    assert guard.reserve is None
    guard.close()  # twice: harmless
