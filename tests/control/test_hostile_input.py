"""Issue #19's findings, each tried against a real daemon: the attack, then the defence
(a clean one-line refusal, nothing stored, the daemon and its other clients unharmed,
memory and descriptors bounded)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import CTL, YEARLY, Daemon, lines, sh, wait_until

from perfectschedd.control import protocol

T2030 = 1893456000
END_OF_9999 = 253402214400  # 9999-12-31 00:00 UTC: a yearly cron's last occurrence


def call(d: Daemon, cmd: str, args: dict[str, Any] | None = None,
         raw: bytes | None = None) -> dict[str, Any]:
    """One request on a fresh connection; the whole answer as a dict."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(d.socket_path)
        s.sendall(raw if raw is not None else protocol.request(cmd, args))
        buf = bytearray()
        while not buf.endswith(b"\n"):
            chunk = s.recv(1 << 20)
            assert chunk, "the daemon closed the connection without answering"
            buf += chunk
    return json.loads(buf)


def refused(answer: dict[str, Any], type_: str, text: str) -> None:
    assert answer["ok"] is False, answer
    assert answer["error"]["type"] == type_, answer
    assert text in answer["error"]["message"], answer
    assert "\n" not in answer["error"]["message"]


def stored(d: Daemon) -> list[tuple[Any, ...]]:
    db = d.config["url"].removeprefix("sqlite:///")
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
        return con.execute("SELECT * FROM perfectsched ORDER BY key").fetchall()


def healthz(d: Daemon) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{d.metrics_port}/healthz",
                                    timeout=10) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


# -- finding 4: validation before any write -------------------------------------------------

def test_deep_or_odd_data_is_refused_before_anything_is_stored(daemon_factory: Any) -> None:
    d: Daemon = daemon_factory().start()
    d.ctl("add", "keep", "t", YEARLY, '{"a": 1}')
    before = stored(d)
    deep_text = "[" * 100_000 + "]" * 100_000  # as a JSON *string*: skipped the limit once
    cases = [
        ({"key": "k", "type": "t", "cron": YEARLY, "data": deep_text}, "data:"),
        ({"key": "k", "type": "t", "cron": YEARLY,
          "data": json.dumps({"a": json.loads("[" * 70 + "]" * 70)})}, "nested deeper"),
        ({"key": "k", "type": "t", "cron": YEARLY, "data": '{"a": NaN}'}, "not valid JSON"),
        ({"key": "k", "type": "t", "cron": YEARLY, "data": '{"a": "\\ud800"}'},
         "lone surrogates"),
        ({"key": "k", "type": "t", "cron": YEARLY, "at": 2 ** 70}, "at:"),
        ({"key": "k", "type": "t", "cron": YEARLY, "delay": 2 ** 64}, "delay:"),
        ({"key": "k", "type": "t\ud800", "cron": YEARLY}, "surrogates"),
        ({"key": "k", "type": "t", "cron": YEARLY, "timezone": "Asia"}, "unknown time zone"),
        ({"key": "k", "type": "t", "cron": "R R * * *"}, "random (R)"),
        ({"key": "k", "type": "t", "cron": "H * * * *"}, "hashed (H)"),
        ({"key": "k", "type": "t", "cron": "0 0 1 1 *", "start": END_OF_9999 + 3600},
         "no occurrence after"),
    ]
    for args, text in cases:
        refused(call(d, "add", args), "InvalidInputError", text)
    # a deep `modify` and an add_many with one bad member change nothing either
    refused(call(d, "modify", {"key": "keep", "data": deep_text}), "InvalidInputError", "data")
    refused(call(d, "add_many", {"schedules": [
        {"key": "fine", "type": "t", "cron": YEARLY},
        {"key": "bad", "type": "t", "cron": YEARLY, "data": deep_text}]}),
        "InvalidInputError", "data")
    # data one level past the limit is refused naming data, not the request around it
    refused(call(d, "add", {"key": "k", "type": "t", "cron": YEARLY,
                            "data": json.loads('{"a": ' + "[" * 64 + "]" * 64 + "}")}),
            "InvalidInputError", "data: nested deeper than 64 levels")
    # a request nested past the limit is refused as a frame
    refused(call(d, "", raw=b'{"cmd":"add","args":' + b"[" * 5000 + b"]" * 5000 + b"}\n"),
            "ProtocolError", "nested deeper")
    assert stored(d) == before
    assert [s["key"] for s in d.ctl_json("list")] == ["keep"]
    assert "Traceback" not in d.log()
    # and direct mode (-c) refuses the same way, with one line
    deep_arg = json.dumps({"a": json.loads("[" * 70 + "]" * 70)})
    for via in (["-c", str(d.config_path)], ["--socket", d.socket_path]):
        res = subprocess.run([*CTL, *via, "add", "k", "t", YEARLY, deep_arg],
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 1 and res.stderr.strip().splitlines() == [
            "perfectschedctl: DATA: nested deeper than 64 levels"], res
    assert stored(d) == before


def test_a_row_stored_too_deep_by_an_older_version_is_shown_not_fatal(
        daemon_factory: Any) -> None:
    d: Daemon = daemon_factory().start()
    d.ctl("add", "old", "t", YEARLY)
    db = d.config["url"].removeprefix("sqlite:///")
    with sqlite3.connect(db) as con:
        con.execute("UPDATE perfectsched SET data = ? WHERE key = 'old'",
                    ('{"a":' + "[" * 3000 + "]" * 3000 + "}",))
    shown = d.ctl_json("show", "old")
    assert "nested deeper" in shown["data"]["unreadable"]
    assert [s["key"] for s in d.ctl_json("list")] == ["old"]
    assert "Traceback" not in d.log()


# -- finding 5: the calendar ends ------------------------------------------------------------

def test_a_schedule_past_year_9999_is_paused_and_the_worker_lives(
        daemon_factory: Any, tmp_path: Path) -> None:
    out = tmp_path / "ran"
    d: Daemon = daemon_factory({"workers": 1, "routes": [
        sh("t", f'echo "$1" >> {out}')]}).start()
    worker = d.children()
    now = int(time.time())
    # Both due now, claimed (and finished) in one batch: the good one must not be lost.
    d.ctl("add", "last", "t", "0 0 31 12 *", "-s", str(END_OF_9999), "-a", str(now))
    d.ctl("add", "fine", "t", YEARLY, "-a", str(now))
    wait_until(lambda: sorted(lines(out)) == ["fine", "last"], 20, what="both to run")
    wait_until(lambda: d.ctl_json("show", "last")["paused"], 20, what="the pause")
    shown = d.ctl_json("show", "last")
    assert "year 9999" in shown["paused_reason"] and shown["owner"] is None, shown
    assert shown["next_time"] == END_OF_9999
    wait_until(lambda: d.ctl_json("history", "last"), 20, what="the history row")
    assert [r["outcome"] for r in d.ctl_json("history", "last")] == ["failed"]
    fine = d.ctl_json("show", "fine")
    assert fine["next_time"] > now and not fine["paused"]  # its finish was written
    assert d.children() == worker  # no worker died of it
    time.sleep(2)
    assert lines(out).count("last") == 1  # paused: not run again
    assert d.children() == worker and "Traceback" not in d.log()
    # a user's resume clears the reason (it pauses again on its next finish)
    d.ctl("pause", "last")
    assert d.ctl_json("show", "last")["paused_reason"] is None


# -- finding 7: list pages, bounded answers, slow readers -------------------------------------

def test_list_comes_in_pages_and_the_cli_follows_them(daemon_factory: Any) -> None:
    d: Daemon = daemon_factory().start()
    n = 2 * protocol.LIST_PAGE + 345
    answer = call(d, "add_many", {"schedules": [
        {"key": f"k{i:05d}", "type": "t", "cron": YEARLY} for i in range(n)]})
    assert answer["result"] == {"added": n}
    first = call(d, "list")
    assert len(first["result"]) == protocol.LIST_PAGE
    assert first["more"] == {"after": first["result"][-1]["key"]}
    second = call(d, "list", {"after": first["more"]["after"]})
    assert second["result"][0]["key"] == f"k{protocol.LIST_PAGE:05d}"
    small = call(d, "list", {"limit": 10})
    assert len(small["result"]) == 10 and "more" not in small
    keys = [s["key"] for s in d.ctl_json("list")]
    assert keys == [f"k{i:05d}" for i in range(n)]
    assert len(d.ctl_json("list", "-n", "1500")) == 1500
    assert len(d.ctl("list").stdout.splitlines()) == n + 2  # header, rows, "N entries."


def test_clients_that_never_read_cannot_grow_the_master(daemon_factory: Any) -> None:
    d: Daemon = daemon_factory().start()
    big = {"blob": "x" * 60_000}
    for chunk in range(0, 300, 10):  # a request frame holds at most 1 MiB
        call(d, "add_many", {"schedules": [
            {"key": f"big{i:03d}", "type": "t", "cron": YEARLY, "data": big}
            for i in range(chunk, chunk + 10)]})
    page = call(d, "list")  # 18 MB of schedules: the answer is cut by size, not count
    assert len(json.dumps(page)) < 2 * protocol.LIST_PAGE_BYTES and page["more"]
    base = rss_kib(d.pid)
    hogs = []
    for _ in range(8):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(d.socket_path)
        s.sendall(protocol.request("list"))
        hogs.append(s)
    asked = time.monotonic()
    time.sleep(3)
    assert d.status()["state"] == "running"  # others are served meanwhile
    grown = rss_kib(d.pid) - base
    assert grown < 40_000, f"master grew {grown} KiB with 8 clients that never read"
    # an answer not read within the deadline frees its slot (2 s after the deadline of the
    # last request, counted from when it was sent, not from the end of the checks above)
    time.sleep(max(0.0, asked + protocol_deadline() + 2 - time.monotonic()))
    for s in hogs:
        s.settimeout(5)
        got = b""
        try:
            while chunk := s.recv(1 << 20):
                got += chunk
        except (ConnectionResetError, TimeoutError):
            pass
        assert len(got) < 2 * protocol.LIST_PAGE_BYTES
        s.close()
    assert d.alive()


def protocol_deadline() -> float:
    from perfectschedd.control.server import REQUEST_DEADLINE
    return REQUEST_DEADLINE


def test_a_trickling_client_loses_its_slot(daemon_factory: Any) -> None:
    d: Daemon = daemon_factory().start()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(d.socket_path)
    started = time.monotonic()
    closed_after = None
    for byte in b'{"cmd":"status","args":{}' * 10:
        try:
            s.sendall(bytes([byte]))
        except (BrokenPipeError, ConnectionResetError):
            closed_after = time.monotonic() - started
            break
        time.sleep(0.5)
    s.close()
    assert closed_after is not None, "a client sending a byte every 0.5 s was never cut off"
    assert protocol_deadline() <= closed_after < protocol_deadline() + 5
    assert d.status()["state"] == "running"


# -- finding 6: a read-only database file -----------------------------------------------------

@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("chattr") is None,
                    reason="needs root and chattr")
def test_workers_recover_from_a_database_made_read_only(daemon_factory: Any,
                                                        tmp_path: Path) -> None:
    out = tmp_path / "ran"
    d: Daemon = daemon_factory({"workers": 1, "poll_interval": 0.2, "routes": [
        sh("t", f'echo x >> {out}; echo "SCHED_LATER 1"')]}).start()
    db = d.config["url"].removeprefix("sqlite:///")
    d.ctl("add", "tick", "t", YEARLY, "-a", "0")
    wait_until(lambda: len(lines(out)) >= 2, 20, what="the job to run")
    # Immutable: even root opens it read-only, as a worker would a file chmod'ed 0444.
    subprocess.run(["chattr", "+i", db], check=True)
    try:
        for pid in d.children():
            os.kill(pid, signal.SIGKILL)  # replacements open the file while it is read-only
        wait_until(lambda: not d.status()["database_ok"], 30, what="status to say so")
        assert healthz(d) == 503
    finally:
        subprocess.run(["chattr", "-i", db], check=True)
    restored = time.monotonic()
    wait_until(lambda: d.status()["database_ok"], 30, what="status to recover")
    wait_until(lambda: healthz(d) == 200, 10, what="/healthz to recover")
    count = len(lines(out))
    wait_until(lambda: len(lines(out)) >= count + 2, 30, what="runs to go on")
    print(f"recovered {time.monotonic() - restored:.1f}s after the file became writable")
    assert d.alive() and "Traceback" not in d.log()


# -- the configuration as an attacker writes it ------------------------------------------------

def _alias_bomb() -> str:
    """A YAML value of 9 ** 9 strings in a few hundred bytes (shared, not copied, until
    something walks it: repr() would)."""
    levels = ['&a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for prev, name in zip("abcdefgh", "bcdefghi", strict=True):
        levels.append(f"&{name} [" + ",".join([f"*{prev}"] * 9) + "]")
    return "[" + ", ".join(levels) + "]"


@pytest.mark.parametrize(("change", "text"), [
    ("poll_interval: .nan", "finite"),
    ("alive_time: .inf", "finite"),
    ("retry_wait: 1.0e+400", "finite"),
    ("routes: " + "[" * 20_000 + "]" * 20_000, "nested too deeply"),
    ("table: " + _alias_bomb(), "table: must be an SQL identifier, got a list"),
    ("timezone: " + _alias_bomb(), "timezone: unknown time zone a list"),
    ("url: 'sqlite:///:memory:'", "url: the SQLite database must be a file"),
    ("url: postgresql://h:notaport/db", "url: cannot parse it"),
    ("url: mysql+nosuchdriver://h/db", "url: no driver for mysql+nosuchdriver"),
])
def test_a_bad_reload_is_refused_quickly_with_one_line(daemon_factory: Any, change: str,
                                                       text: str) -> None:
    d: Daemon = daemon_factory().start()
    d.ctl("add", "keep", "t", YEARLY)
    good = d.config_path.read_text()
    key = change.split(":", 1)[0]
    kept = "\n".join(line for line in good.splitlines() if not line.startswith(f"{key}:"))
    d.write_config(raw=kept + "\n" + change + "\n")
    started = time.monotonic()
    res = d.ctl("reload", check=False, timeout=60)
    took = time.monotonic() - started
    assert res.returncode == 1, res
    message = res.stderr.strip()
    assert len(message.splitlines()) == 1 and len(message) < 1000, message
    assert "reload rejected" in message and text in message, message
    assert took < 10, f"reload answer took {took:.1f}s"
    assert d.alive() and [s["key"] for s in d.ctl_json("list")] == ["keep"]


# -- low: second daemon, deleted socket -----------------------------------------------------

def test_a_second_daemon_on_the_same_runtime_directory_leaves_the_first_alone(
        daemon_factory: Any, tmp_path: Path) -> None:
    runtime = tmp_path / "run"
    runtime.mkdir()
    first: Daemon = daemon_factory({"routes": [sh("t", "true")]},
                                   env={"RUNTIME_DIRECTORY": str(runtime)}).start()
    first.ctl("add", "k", "t", YEARLY, "-a", "0")
    wait_until(lambda: first.ctl_json("history", "k"), 20, what="a run")
    files = sorted(p.name for p in (runtime / "metrics").iterdir())
    assert any(f.endswith(".db") for f in files), files
    second: Daemon = daemon_factory(env={"RUNTIME_DIRECTORY": str(runtime)})
    second.start(wait_ready=False)
    assert second.proc is not None and second.proc.wait(30) == 1
    assert "in use by another perfectschedd" in second.log()
    assert sorted(p.name for p in (runtime / "metrics").iterdir()) == files
    assert first.status()["state"] == "running"


def test_reload_brings_back_a_deleted_socket(daemon_factory: Any) -> None:
    d: Daemon = daemon_factory().start()
    os.unlink(d.socket_path)
    d.send_signal(signal.SIGHUP)
    wait_until(lambda: os.path.exists(d.socket_path), 20, what="the socket to come back")
    assert d.status()["state"] == "running"
