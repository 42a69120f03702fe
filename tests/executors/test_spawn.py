"""spawn.py: an exec run's command started by fork_exec directly (where its signature is
known) behaves as one started by Popen: session, environment, descriptors, signals,
exit status, exec errors.  Each test runs both ways (`direct` and `popen`)."""

from __future__ import annotations

import errno
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from perfectschedd.executors import spawn

# `cwd` forces Popen (as a change of user does) and changes nothing for these commands.
WAYS = {"direct": {}, "popen": {"cwd": "/"}}


@pytest.fixture(params=list(WAYS))
def way(request: pytest.FixtureRequest) -> dict[str, Any]:
    return WAYS[request.param]


@pytest.fixture
def null() -> Iterator[int]:
    fd = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    yield fd
    os.close(fd)


def run(argv: list[str], env: dict[bytes, bytes], way: dict[str, Any], null: int
        ) -> tuple[int, bytes]:
    """Start `argv`, return its exit status and what it wrote on stdout."""
    r, w = os.pipe()
    try:
        child = spawn.spawn(argv, env, null, w, null, way)
    finally:
        os.close(w)
    out = b""
    while chunk := os.read(r, 65536):
        out += chunk
    os.close(r)
    return child.wait(), out


def test_this_python_takes_the_direct_way() -> None:
    # The versions the direct call is written for: a newer one must be checked (its
    # fork_exec arguments) before it is added.
    written_for = (3, 11) <= sys.version_info[:2] <= (3, 13)
    assert spawn._DIRECT is written_for


def test_a_session_of_its_own_and_exactly_the_environment(way: dict[str, Any],
                                                          null: int) -> None:
    env = {b"PATH": os.environ["PATH"].encode(), b"ONLY_THIS": b"x=1"}
    code, out = run(["sh", "-c", 'echo "$$ $(ps -o sid= -p $$) $ONLY_THIS"; env'], env, way,
                    null)
    assert code == 0
    first, *rest = out.decode().splitlines()
    pid, sid, value = first.split()
    assert pid == sid.strip() and value == "x=1"
    assert {line.split("=", 1)[0] for line in rest} <= {"PATH", "ONLY_THIS", "PWD",
                                                         "SHLVL", "_", "OLDPWD"}


def test_no_descriptor_of_ours_and_sigpipe_default(way: dict[str, Any], null: int,
                                                    tmp_path: Path) -> None:
    high = os.dup2(null, 201, inheritable=True)  # what a python job may leave open
    try:
        code, out = run(["sh", "-c", "ls /proc/self/fd; echo --; grep SigIgn /proc/self/status"],
                        {b"PATH": os.environ["PATH"].encode()}, way, null)
    finally:
        os.close(high)
    assert code == 0
    lines = out.decode().split()
    # Only ls's lines: the SigIgn mask may be all digits too (under nohup: 80000007).
    fds = {int(x) for x in lines[:lines.index("--")]}
    assert {0, 1, 2} <= fds <= {0, 1, 2, 3}  # 3: ls's own directory
    ignored = int(lines[lines.index("SigIgn:") + 1], 16)
    assert not ignored & (1 << (signal.SIGPIPE - 1))  # Python ignores it; jobs must not


def test_exit_status_and_signal(way: dict[str, Any], null: int) -> None:
    env = {b"PATH": os.environ["PATH"].encode()}
    assert run(["sh", "-c", "exit 3"], env, way, null)[0] == 3
    assert run(["sh", "-c", "kill -KILL $$"], env, way, null)[0] == -signal.SIGKILL


def test_a_command_that_cannot_start(way: dict[str, Any], null: int, tmp_path: Path) -> None:
    env = {b"PATH": str(tmp_path).encode()}
    with pytest.raises(OSError) as missing:
        spawn.spawn(["no-such-command"], env, null, null, null, way)
    assert missing.value.errno == errno.ENOENT
    plain = tmp_path / "plain"
    plain.write_text("not a program\n")
    with pytest.raises(OSError) as denied:
        spawn.spawn([str(plain)], env, null, null, null, way)
    assert denied.value.errno == errno.EACCES and denied.value.filename == str(plain)
    me = os.getpid()  # the failed children were reaped: no zombie of ours
    for pid in Path(f"/proc/{me}/task/{me}/children").read_text().split():
        assert Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
