"""The HTTP listener itself (web/server.py): /healthz follows the health callable, an
idle listener sleeps, a full listener makes room by closing the oldest client that has
not sent a request, a request has a deadline that trickling does not stretch, a local
user with a loop cannot exhaust the master's descriptors, and 1,000 idle connections and
a slow-loris client are harmless to the other clients and to the control socket."""

from __future__ import annotations

import os
import resource
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from api_client import call, make_token
from daemon_harness import Daemon, foreign_python, wait_until
from scrape import get

from perfectschedd.metrics import exposition
from perfectschedd.web import server as web_server
from perfectschedd.web.app import WebApp
from perfectschedd.web.credentials import Credentials


def listener(healthy: Callable[[], bool] = lambda: True) -> web_server.HttpListener:
    app = WebApp(lambda cmd, args, caller: None, Credentials(lambda: []),
                 exposition.render_with_type, healthy, listen_host="127.0.0.1", tls=False,
                 insecure=False, metrics_token=False, group_gid=0, routes=tuple)
    return web_server.HttpListener(("127.0.0.1", 0), app)


@pytest.fixture
def served() -> Iterator[web_server.HttpListener]:
    server = listener()
    try:
        yield server
    finally:
        server.stop()


def test_healthz_follows_the_health_callable_and_stop_frees_the_port() -> None:
    state = {"healthy": True}

    def healthy() -> bool:
        if state["healthy"] is None:
            raise RuntimeError("dictionary changed size during iteration")
        return bool(state["healthy"])

    server = listener(healthy)
    try:
        port = server.port
        assert get(port, "/healthz")[::2] == (200, "ok\n")
        state["healthy"] = False
        assert get(port, "/healthz")[::2] == (503, "unhealthy\n")
        state["healthy"] = None  # keeps failing: not healthy, not a server error
        assert get(port, "/healthz")[0] == 503
        assert get(port, "/nope")[0] == 404
        # The listener and open connections (a forked worker closes them all).
        assert server.fds()[0] == server.sock.fileno()
        wait_until(lambda: not server.conns, timeout=5, what="the connection closed")
        reserve = server.guard.reserve  # kept for running out of descriptors
        assert server.fds() == [server.sock.fileno(),
                                *([reserve] if reserve is not None else [])]
    finally:
        server.stop()
    with pytest.raises(ConnectionRefusedError), socket.create_connection(
            ("127.0.0.1", port), timeout=5):
        pass


def thread_wakeups(thread: threading.Thread) -> int:
    status = Path(f"/proc/self/task/{thread.native_id}/status").read_text()
    return int(status.split("voluntary_ctxt_switches:")[1].split()[0])


def test_an_idle_listener_sleeps_until_a_client_comes(served: web_server.HttpListener
                                                      ) -> None:
    """No polling: an idle daemon's threads must not wake up on their own."""
    assert get(served.port, "/healthz")[0] == 200
    time.sleep(0.3)
    before = thread_wakeups(served.thread)
    time.sleep(1.5)
    assert thread_wakeups(served.thread) - before <= 1
    assert get(served.port, "/healthz")[0] == 200  # and still serves
    started = time.monotonic()
    served.stop()
    assert time.monotonic() - started < 1 and not served.thread.is_alive()


def test_a_full_listener_closes_the_oldest_idle_client_and_trickling_meets_the_deadline(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(web_server, "HEAD_DEADLINE", 3.0)
    monkeypatch.setattr(web_server, "CONNECTIONS_MAX", 20)
    server = listener()
    held: list[socket.socket] = []
    try:
        for _ in range(20):
            s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
            s.send(b"GE")  # a request begun, never finished
            held.append(s)
        wait_until(lambda: len(server.conns) == 20, what="every place taken")
        # One more client is served: the oldest idle one made room.
        assert get(server.port, "/healthz")[0] == 200
        assert held[0].recv(100) == b""  # closed, unanswered
        t0 = time.monotonic()
        for s in held[1:]:  # trickling does not help: the whole head has a deadline
            s.send(b"T")
        wait_until(lambda: not server.conns, timeout=5, what="late connections cut")
        assert time.monotonic() - t0 < 4.5
        assert get(server.port, "/healthz")[0] == 200
    finally:
        for s in held:
            s.close()
        server.stop()


def test_bad_heads_get_one_line_and_the_listener_goes_on(served: web_server.HttpListener
                                                         ) -> None:
    for raw, status in ((b"GARBAGE\r\n\r\n", 400),
                        (b"GET / HTTP/1.1\r\n" + b"X-A: b\r\n" * 70 + b"\r\n", 431),
                        (b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\n\r\n", 431),
                        (b"POST /api/v1/schedules HTTP/1.1\r\nTransfer-Encoding: chunked"
                         b"\r\n\r\n", 411),
                        (b"POST /api/v1/schedules HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
                         400)):
        with socket.create_connection(("127.0.0.1", served.port), timeout=10) as s:
            s.sendall(raw)
            head = b""
            while chunk := s.recv(65536):  # the answer, then the end: the listener closes
                head += chunk
            head = head.decode()
        assert head.startswith(f"HTTP/1.1 {status} "), (raw[:40], head)
        assert head.rstrip().endswith("}") and head.count('"error"') == 1
    assert get(served.port, "/healthz")[0] == 200


def test_a_kept_alive_connection_serves_several_requests(served: web_server.HttpListener
                                                         ) -> None:
    with socket.create_connection(("127.0.0.1", served.port), timeout=10) as s:
        # Each answer goes out at once, not after the client's delayed ACK (40 ms).
        wait_until(lambda: served.conns, timeout=5, what="the connection taken")
        (server_side,) = list(served.conns)
        assert server_side.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n" * 3)
        data = b""
        while data.count(b"ok\n") < 3:
            chunk = s.recv(65536)
            assert chunk, data
            data += chunk
    assert data.count(b"HTTP/1.1 200 ") == 3


ATTACK = """
import socket, sys, time
port, seconds = int(sys.argv[1]), float(sys.argv[2])
held = []
connects = 0
end = time.monotonic() + seconds
while time.monotonic() < end:
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=1)
        s.send(b"G")
        held.append(s)
        connects += 1
    except OSError:
        time.sleep(0.01)
    if len(held) >= 900:  # our own descriptors: drop those the server closed
        for s in held[:450]:
            s.close()
        del held[:450]
    if connects % 50 == 0:
        for s in held:  # trickle: one byte now and then, never a whole request
            try:
                s.send(b"E")
            except OSError:
                pass
print(connects)
"""


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv")
                    or not shutil.which("prlimit"), reason="needs root, setpriv, prlimit")
def test_a_local_user_cannot_exhaust_the_masters_descriptors(
        daemon_factory: Callable[..., Daemon]) -> None:
    d = daemon_factory().start()
    subprocess.run(["prlimit", f"--pid={d.pid}", "--nofile=1024:1024"], check=True)
    workers = sorted(d.children())
    viewer = make_token(d, "v", "viewer")
    attacker = subprocess.Popen(
        ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
         *foreign_python(), "-c", ATTACK, str(d.metrics_port), "12"],
        stdout=subprocess.PIPE, text=True, cwd="/")
    cap = web_server.CONNECTIONS_MAX
    try:
        peak = 0
        end = time.monotonic() + 11
        while time.monotonic() < end:
            t0 = time.monotonic()
            assert d.status()["state"] == "running"  # the control socket still answers
            assert time.monotonic() - t0 < 3
            peak = max(peak, len(os.listdir(f"/proc/{d.pid}/fd")))
            time.sleep(0.3)
        opened = int(attacker.communicate(timeout=30)[0].strip() or 0)
    finally:
        attacker.kill()
    # The attack got far more connections through than the cap (each one kept, a
    # descriptor of the master's for good); the master stayed within the cap.
    assert opened > 2 * cap, opened
    assert peak < cap + 80, peak
    # And once it stops, the API answers at once.
    assert call(d.metrics_port, "GET", "/api/v1/status", viewer).status == 200
    assert get(d.metrics_port, "/metrics")[0] == 200
    assert sorted(d.children()) == workers and d.alive()
    assert d.stop() == 0


def test_a_thousand_idle_connections_and_a_slow_loris(
        daemon_factory: Callable[..., Daemon]) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2000:  # this test's own sockets
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(4096, hard), hard))
    d = daemon_factory().start()
    viewer = make_token(d, "v", "viewer")
    idle: list[socket.socket] = []
    try:
        for _ in range(1000):
            idle.append(socket.create_connection(("127.0.0.1", d.metrics_port), timeout=5))
        loris = socket.create_connection(("127.0.0.1", d.metrics_port), timeout=5)
        idle.append(loris)
        loris.send(b"GET /api/v1/status HTTP/1.1\r\n")
        for _ in range(5):
            t0 = time.monotonic()
            loris.send(b"X-Slow: 1\r\n")
            assert call(d.metrics_port, "GET", "/api/v1/status", viewer).status == 200
            assert d.status()["state"] == "running"
            assert time.monotonic() - t0 < 2
            time.sleep(0.3)
    finally:
        for s in idle:
            s.close()
    assert d.stop() == 0
