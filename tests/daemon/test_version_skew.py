"""A client and a daemon of different versions (a CLI upgraded before its daemon
restarted, or the other way round): the commands both know work; a command or argument
one end does not know is refused in one line naming both versions."""

from __future__ import annotations

import json
import socket
from typing import Any

import pytest
from daemon_harness import Daemon

import perfectschedd

VERSION = perfectschedd.__version__


def raw(d: Daemon, request: dict[str, Any]) -> dict[str, Any]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(d.socket_path)
        s.sendall(json.dumps(request).encode() + b"\n")
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(65536)
            assert chunk, "closed without answering"
            buf += chunk
    return dict(json.loads(buf))


@pytest.fixture
def daemon(daemon_factory: Any) -> Daemon:
    return daemon_factory().start()  # type: ignore[no-any-return]


def test_a_newer_client_naming_an_unknown_command_gets_both_versions(daemon: Daemon) -> None:
    answer = raw(daemon, {"cmd": "frobnicate", "args": {}, "client": "0.9.0"})
    assert answer["ok"] is False and answer["daemon"] == VERSION
    message = answer["error"]["message"]
    assert "unknown command 'frobnicate'" in message
    assert f"perfectschedctl 0.9.0, perfectschedd {VERSION}" in message
    answer = raw(daemon, {"cmd": "add", "args": {"key": "k", "type": "t", "cron": "@daily",
                                                 "colour": "red"}, "client": "0.9.0"})
    assert "unknown argument(s) for add: colour" in answer["error"]["message"]
    assert "perfectschedctl 0.9.0" in answer["error"]["message"]
    assert daemon.ctl("list", "--json").stdout.strip() == "[]"  # nothing was added


def test_a_client_older_than_versions_is_told_so(daemon: Daemon) -> None:
    """0.1.0's perfectschedctl sends no version: what it knows works, the rest names
    this daemon's version."""
    answer = raw(daemon, {"cmd": "add", "args": {"key": "k", "type": "t", "cron": "@daily"}})
    assert answer["ok"] is True
    answer = raw(daemon, {"cmd": "frobnicate", "args": {}})
    assert f"perfectschedctl older than 0.2.0, perfectschedd {VERSION}" in \
        answer["error"]["message"]


def test_the_same_versions_add_no_note(daemon: Daemon) -> None:
    answer = raw(daemon, {"cmd": "frobnicate", "args": {}, "client": VERSION})
    assert answer["error"]["message"] == "command: unknown command 'frobnicate'"
    res = daemon.ctl("show", "nope", check=False)
    assert res.returncode == 1 and "perfectsched" not in res.stderr.split(":", 1)[1]


def test_a_bad_client_field_is_a_protocol_error(daemon: Daemon) -> None:
    for bad in (12, "", "x" * 41):
        answer = raw(daemon, {"cmd": "status", "args": {}, "client": bad})
        assert answer["error"]["type"] == "ProtocolError", bad
    assert daemon.alive()


def test_this_client_with_a_0_1_0_daemon(daemon_factory: Any, old_release: Any) -> None:
    """A CLI upgraded before its daemon restarted: 0.1.0 refuses the client's version
    field, so the client asks again without it and what both know works; a command
    0.1.0 does not know is refused in one line naming both versions."""
    old: Daemon = daemon_factory(command=old_release.daemon_command).start()
    old.wait_log("perfectschedd 0.1.0 starting")
    old.ctl("add", "k", "t", "@daily")
    assert [s["key"] for s in old.ctl_json("list")] == ["k"]
    assert old.ctl_json("status")["version"] == "0.1.0"
    # `status` is known to both; a command only this client knows, sent as it would be:
    from perfectschedctl.client import SocketClient

    client = SocketClient(old.socket_path)
    with pytest.raises(Exception) as caught:
        client.call("frobnicate", {})
    message = str(caught.value)
    assert "unknown command 'frobnicate'" in message
    assert f"(perfectschedctl {VERSION}, perfectschedd older than 0.2.0" in message
    assert "\n" not in message
    assert client.client is None  # it learnt the daemon takes no version field


def test_a_0_1_0_client_with_this_daemon(daemon: Daemon, old_release: Any) -> None:
    """A daemon upgraded before the CLI: 0.1.0's perfectschedctl works against it."""
    res = old_release.ctl("--socket", daemon.socket_path, "add", "k", "t", "@daily")
    assert res.returncode == 0, res
    res = old_release.ctl("--socket", daemon.socket_path, "--json", "list")
    assert [s["key"] for s in json.loads(res.stdout)] == ["k"]
    res = old_release.ctl("--socket", daemon.socket_path, "status")
    assert res.returncode == 0 and f"perfectschedd {VERSION}" in res.stdout
