"""Control socket: framing, hostile input, limits, socket file handling, wake-up.

In-process ControlServer tests (fake dispatch) cover the connection loop quickly; tests with
a real perfectschedd (daemon_factory) cover the socket as users meet it.
"""

from __future__ import annotations

import json
import logging
import os
import random
import socket
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import Daemon, wait_until

from perfectschedd import config
from perfectschedd.control import protocol
from perfectschedd.control.server import ControlServer
from perfectschedd.errors import NotFoundError

log = logging.getLogger("test-control")


# -- helpers ------------------------------------------------------------------------------

def connect(path: str, timeout: float = 10.0) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(path)
    return s


def read_all(s: socket.socket) -> bytes:
    buf = bytearray()
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        buf += chunk
    return bytes(buf)


def exchange(path: str, payload: bytes) -> list[dict[str, Any]]:
    """Send `payload`, close our side, return every answer until the server closes."""
    with connect(path) as s:
        try:
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass
        return [json.loads(line) for line in read_all(s).splitlines()]


def call(path: str, cmd: str, **args: Any) -> dict[str, Any]:
    answers = exchange(path, protocol.request(cmd, args))
    assert len(answers) == 1, answers
    return answers[0]


def error_of(answer: dict[str, Any]) -> tuple[str, str]:
    assert answer["ok"] is False, answer
    assert set(answer["error"]) == {"type", "message"}
    assert answer["error"]["message"] and "\n" not in answer["error"]["message"]
    return answer["error"]["type"], answer["error"]["message"]


# -- in-process server with a fake dispatch -----------------------------------------------

class FakeDispatch:
    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.lock = threading.Lock()

    def __call__(self, cmd: str, args: dict[str, Any], caller: Any) -> Any:
        with self.lock:
            self.calls.append((cmd, args))
        if cmd == "echo":
            return args
        if cmd == "slow":
            time.sleep(float(args.get("s", 0.2)))
            return args
        if cmd == "missing":
            raise NotFoundError("schedule 'x' not found")
        if cmd == "crash":
            raise RuntimeError("boom\nsecond line")
        return None


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[ControlServer, FakeDispatch]]:
    cfg = config.from_mapping({"type": "rdb_compat", "url": "sqlite:///unused.db",
                                   "control_socket": str(tmp_path / "run" / "ctl.sock")})
    fake = FakeDispatch()
    srv = ControlServer(cfg, fake, log=log, max_clients=4, idle_timeout=0.5)
    srv.start()
    yield srv, fake
    srv.stop()


def test_answers_in_order_on_one_connection(server: tuple[ControlServer, FakeDispatch]) -> None:
    srv, _ = server
    payload = (protocol.request("slow", {"n": 1, "s": 0.2}) + b"\n\n"
               + protocol.request("echo", {"n": 2}) + protocol.request("missing"))
    answers = exchange(srv.path, payload)
    assert [a.get("result") for a in answers[:2]] == [{"n": 1, "s": 0.2}, {"n": 2}]
    assert error_of(answers[2]) == ("NotFoundError", "schedule 'x' not found")


def test_internal_error_is_one_line_and_server_goes_on(
        server: tuple[ControlServer, FakeDispatch]) -> None:
    srv, _ = server
    kind, message = error_of(call(srv.path, "crash"))
    assert kind == "InternalError" and "boom" in message
    assert call(srv.path, "echo", x=1) == {"ok": True, "result": {"x": 1}}


def test_too_many_connections_get_busy_then_recover(
        server: tuple[ControlServer, FakeDispatch]) -> None:
    srv, _ = server
    idle = [connect(srv.path) for _ in range(4)]
    try:
        wait_until(lambda: len(srv.conns) == 4, 5, what="4 connections")
        with connect(srv.path) as extra:
            answer = json.loads(read_all(extra))
        assert error_of(answer)[0] == "Busy"
    finally:
        for s in idle:
            s.close()
    wait_until(lambda: not srv.conns, 5, what="connections closed")
    assert call(srv.path, "echo", ok=1)["result"] == {"ok": 1}


def test_idle_connection_is_closed(server: tuple[ControlServer, FakeDispatch]) -> None:
    srv, _ = server
    with connect(srv.path) as s:
        s.sendall(b'{"cmd": "echo", "args": {}')  # half a frame, then silence
        started = time.monotonic()
        assert read_all(s) == b""  # closed by the server, no answer to half a frame
        assert time.monotonic() - started < 5
    assert call(srv.path, "echo")["ok"] is True


def test_an_idle_control_server_sleeps_until_something_happens(
        server: tuple[ControlServer, FakeDispatch]) -> None:
    """No polling: with no connection open, the loop thread does not wake on its own."""
    srv, _ = server
    assert call(srv.path, "echo")["ok"] is True
    wait_until(lambda: not srv.conns, 5, what="connections closed")
    time.sleep(0.2)
    status = Path(f"/proc/self/task/{srv.thread.native_id}/status")

    def wakeups() -> int:
        return int(status.read_text().split("voluntary_ctxt_switches:")[1].split()[0])

    before = wakeups()
    time.sleep(2.5)
    assert wakeups() - before <= 1
    assert call(srv.path, "echo", n=1)["result"] == {"n": 1}  # and still answers


def test_client_that_never_reads_does_not_grow_the_server(
        server: tuple[ControlServer, FakeDispatch]) -> None:
    srv, fake = server
    s = connect(srv.path)
    s.setblocking(False)
    sent = 0
    frame = protocol.request("echo", {"pad": "x" * 1000})
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        try:
            sent += s.send(frame)
        except BlockingIOError:
            break  # the server stopped reading: back-pressure, not an unbounded buffer
    assert sent < 50 * 1024 * 1024
    # Others are still served meanwhile.
    assert call(srv.path, "echo", other=1)["result"] == {"other": 1}
    s.close()
    assert len(fake.calls) < sent // len(frame) + 2


def test_stop_removes_socket_and_restart_works(tmp_path: Path) -> None:
    cfg = config.from_mapping({"type": "rdb_compat", "url": "sqlite:///unused.db",
                                   "control_socket": str(tmp_path / "ctl.sock")})
    for _ in range(2):
        srv = ControlServer(cfg, FakeDispatch(), log=log)
        srv.start()
        st = os.stat(srv.path)
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o660
        assert st.st_gid == os.getegid()
        assert call(srv.path, "echo", a=1)["result"] == {"a": 1}
        srv.stop()
        assert not os.path.exists(srv.path)
    assert sorted(os.listdir(tmp_path)) == ["ctl.sock.lock"]


# -- a real daemon --------------------------------------------------------------------------

@pytest.fixture
def daemon(daemon_factory: Any) -> Daemon:
    return daemon_factory().start()


def test_socket_file_mode_group_and_directory(daemon_factory: Any, tmp_path: Path) -> None:
    path = tmp_path / "new" / "deeper" / "ctl.sock"
    d = daemon_factory({"control_socket": str(path)}).start()
    st = os.stat(path)
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o660
    assert st.st_gid == os.getegid()
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o755
    assert call(str(path), "list") == {"ok": True, "result": []}
    assert d.stop() == 0
    assert not path.exists()


def test_hostile_input_daemon_stays_up(daemon: Daemon) -> None:
    path = daemon.socket_path
    daemon.ctl("add", "keep", "t", "@hourly", '{"v": 1}')
    before = daemon.ctl_json("list")
    rng = random.Random(4)

    # random bytes, with and without a newline
    for _ in range(5):
        junk = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 3000)))
        junk = junk.replace(b"\n", b"") + b"\n"
        answers = exchange(path, junk)
        assert len(answers) == 1 and error_of(answers[0])[0] == "ProtocolError"
    exchange(path, bytes(rng.randrange(256) for _ in range(5000)).replace(b"\n", b""))

    cases = [
        (b"{not json\n", "ProtocolError", "invalid JSON"),
        (b"[1, 2]\n", "ProtocolError", "JSON object"),
        (b'{"cmd": 5}\n', "ProtocolError", "cmd"),
        (b'{"cmd": "list", "args": []}\n', "ProtocolError", "args"),
        (b'{"cmd": "list", "extra": 1}\n', "ProtocolError", "extra"),
        (b'{"cmd": "add", "args": {"key": "n", "type": "t", "cron": "@hourly", '
         b'"delay": NaN}}\n', "ProtocolError", "NaN"),
        (b'{"cmd": "list", "args": ' + b"[" * 100000 + b"]" * 100000 + b"}\n",
         "ProtocolError", "nested"),
        (b'{"cmd": "frobnicate"}\n', "InvalidInputError", "unknown command 'frobnicate'"),
        (b'{"cmd": "init"}\n', "InvalidInputError", "perfectschedctl -c"),
        (b'{"cmd": "list", "args": {"prefx": "a"}}\n', "InvalidInputError", "prefx"),
        (b'{"cmd": "add", "args": {"key": "k2", "type": "t", "cron": "61 * * * *"}}\n',
         "InvalidInputError", "cron"),
        (b'{"cmd": "add", "args": {"key": "k3", "type": "t", "cron": "@hourly", '
         b'"data": [1]}}\n', "InvalidInputError", "data"),
        (b'{"cmd": "add", "args": {"key": "keep", "type": "t", "cron": "@daily"}}\n',
         "AlreadyExistsError", "keep"),
        (b'{"cmd": "delete", "args": {"key": "absent"}}\n', "NotFoundError", "absent"),
        (b'{"cmd": "history", "args": {"key": "keep", "limit": -1}}\n',
         "InvalidInputError", "limit"),
        (b'{"cmd": "modify", "args": {"key": "keep", "timezone": "Mars/Base"}}\n',
         "InvalidInputError", "Mars/Base"),
    ]
    for payload, kind, text in cases:
        answers = exchange(path, payload)
        assert len(answers) == 1, payload[:80]
        got_kind, message = error_of(answers[0])
        assert (got_kind, text in message) == (kind, True), (payload[:80], message)

    # a frame above the limit: refused, connection closed, nothing read past it
    big = b'{"cmd": "list", "args": {"prefix": "' + b"a" * (protocol.MAX_FRAME + 10) + b'"}}\n'
    answers = exchange(path, big + protocol.request("list"))
    assert len(answers) == 1 and error_of(answers[0]) == (
        "ProtocolError", f"request larger than {protocol.MAX_FRAME} bytes")
    # ... also when it never ends with a newline
    with connect(path) as s:
        try:
            s.sendall(b"x" * (protocol.MAX_FRAME + 70000))
        except (BrokenPipeError, ConnectionResetError):
            pass
        assert error_of(json.loads(read_all(s)))[0] == "ProtocolError"

    # a half-written frame, then the client drops the connection
    with connect(path) as s:
        s.sendall(b'{"cmd": "add", "args": {"key": "half", "type": "t", "cr')
    # a request answered although the client closed its side right after sending
    assert call(path, "show", key="keep")["result"]["data"] == {"v": 1}

    assert daemon.alive()
    assert daemon.ctl_json("list") == before  # nothing stored changed
    assert daemon.status()["state"] == "running"


def test_hundred_clients_at_once(daemon: Daemon) -> None:
    path = daemon.socket_path
    results: list[Any] = [None] * 100
    go = threading.Event()

    def client(i: int) -> None:
        go.wait()
        with connect(path, timeout=30) as s:
            s.sendall(protocol.request("add", {"key": f"c{i:03d}", "type": "t",
                                               "cron": "@daily"})
                      + protocol.request("show", {"key": f"c{i:03d}"}))
            f = s.makefile("rb")
            results[i] = [json.loads(f.readline()), json.loads(f.readline())]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(100)]
    for t in threads:
        t.start()
    go.set()
    for t in threads:
        t.join(60)
    assert all(r is not None and r[0]["ok"] and r[1]["ok"] for r in results), results
    assert [r[1]["result"]["key"] for r in results] == [f"c{i:03d}" for i in range(100)]
    listed = daemon.ctl("list").stdout
    assert listed.rstrip().endswith("100 entries.")
    assert daemon.alive()


def test_idle_connections_do_not_block_others(daemon: Daemon) -> None:
    idle = [connect(daemon.socket_path) for _ in range(80)]
    try:
        started = time.monotonic()
        assert call(daemon.socket_path, "list")["ok"] is True
        assert time.monotonic() - started < 3
    finally:
        for s in idle:
            s.close()


def test_stale_socket_from_a_crash_is_replaced(daemon_factory: Any) -> None:
    d = daemon_factory()
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(d.socket_path)  # bound, never listening: what a crashed daemon leaves
    stale.close()
    assert stat.S_ISSOCK(os.lstat(d.socket_path).st_mode)
    d.start()
    assert call(d.socket_path, "list") == {"ok": True, "result": []}
    d.wait_log("removing stale control socket")


def test_a_file_at_the_socket_path_is_left_alone(daemon_factory: Any) -> None:
    d = daemon_factory()
    Path(d.socket_path).write_text("precious")
    d.start(wait_ready=False)
    assert d.proc is not None and d.proc.wait(30) == 1
    assert Path(d.socket_path).read_text() == "precious"
    assert "exists and is not a socket" in d.log()


def test_second_daemon_on_the_same_socket_is_refused(daemon_factory: Any) -> None:
    first = daemon_factory().start()
    first.ctl("add", "mine", "t", "@daily")
    second = daemon_factory({"control_socket": first.socket_path})
    second.start(wait_ready=False)
    assert second.proc is not None and second.proc.wait(30) == 1
    assert "another perfectschedd uses" in second.log()
    assert [s["key"] for s in first.ctl_json("list")] == ["mine"]


def test_a_change_wakes_the_workers(daemon_factory: Any, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    d = daemon_factory({
        "poll_interval": 60,  # without a wake-up nothing would run for a minute
        "routes": [{"type": "mark", "exec": ["sh", "-c", f'echo "$0" >> {marker}'],
                    "user": "root"}],
    }).start()
    time.sleep(1.0)  # let the workers go to sleep on their poll interval
    started = time.monotonic()
    d.ctl("add", "now", "mark", "* * * * *", "-a", str(int(time.time()) - 1))
    wait_until(marker.exists, 10, what="the task to run")
    assert time.monotonic() - started < 5
    assert marker.read_text().split() == ["now"]
