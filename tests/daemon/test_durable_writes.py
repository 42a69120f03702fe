"""An acknowledged change is on stable storage before its reply (SQLite, the embedded
default): strace follows every process of a real daemon while perfectschedctl talks to
it over the real socket, and between reading each request and sending its reply the
daemon must have written the change to the WAL and then synced the WAL.

A power cut loses exactly what was written but not synced, so "synced before the reply"
is the property that makes an acknowledged change survive one.  The claim/finish path
may defer its syncs (docs/ha.md); the last test shows it does, so that the first tests
cannot pass merely because every commit is synced.
"""

from __future__ import annotations

import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from daemon_harness import Daemon, wait_until

# strace slows what it follows: measured alone, not beside the parallel tests.
pytestmark = [pytest.mark.serial,
              pytest.mark.skipif(shutil.which("strace") is None,
                                 reason="strace is not installed (tests/install-test-deps.sh)")]

# strace -f -tt -yy: "PID HH:MM:SS.ffffff syscall(fd<path>, ...) = ret".
LINE = re.compile(r"^(\d+)\s+\S+\s+(\w+)\((\d+)<(.*?)>(?:, |\))(.*)$")
SYNCS = ("fsync", "fdatasync")


class Traced:
    """strace attached to every process of a daemon, writing to a file."""

    def __init__(self, daemon: Daemon, out: Path) -> None:
        self.out = out
        pids = [daemon.pid, *daemon.descendants()]
        args = ["strace", "-f", "-tt", "-yy", "-s", "256", "-o", str(out),
                "-e", "trace=fsync,fdatasync,write,pwrite64,writev,sendto,sendmsg,read,"
                      "recvfrom,recvmsg"]
        for pid in pids:
            args += ["-p", str(pid)]
        self.proc = subprocess.Popen(args, stderr=subprocess.PIPE, text=True)
        # strace says "Process N attached" for each, on stderr, once it traces it.
        assert self.proc.stderr is not None
        attached = 0
        deadline = time.monotonic() + 20
        while attached < len(pids) and time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                break
            attached += "attached" in line
        assert attached >= len(pids), f"strace attached to {attached} of {len(pids)}"
        # What strace says from now on (one line per tracee as it detaches) is drained, so
        # that a full pipe can never hold it up.
        self.said: list[str] = []
        self.drain = threading.Thread(target=lambda: self.said.extend(self.proc.stderr or ()),
                                      daemon=True)
        self.drain.start()

    def stop(self) -> list[tuple[str, str, str]]:
        """(syscall, fd path, rest of the line) in the order they happened."""
        self.proc.send_signal(signal.SIGINT)
        # Detaching waits for every traced thread to reach a stop: on a loaded machine
        # that has taken more than 20 s (CI); what it wrote before is complete either way.
        self.proc.wait(90)
        self.drain.join(10)
        calls = []
        for line in self.out.read_text(errors="replace").splitlines():
            m = LINE.match(line)
            if m:
                calls.append((m.group(2), m.group(4), m.group(5)))
        return calls


def window(calls: list[tuple[str, str, str]], request: str) -> list[tuple[str, str, str]]:
    """The calls between reading the request holding `request` on the control socket
    and writing its reply."""
    start = next((i for i, (name, path, rest) in enumerate(calls)
                  if name in ("read", "recvfrom", "recvmsg") and "ctl.sock" in path
                  and request in rest), None)
    assert start is not None, f"no request {request!r} seen"
    end = next((i for i in range(start + 1, len(calls))
                if calls[i][0] in ("write", "sendto", "sendmsg", "writev")
                and "ctl.sock" in calls[i][1] and '\\"ok\\":' in calls[i][2]), None)
    assert end is not None, f"no reply to {request!r} seen"
    return calls[start:end]


def synced_before_reply(calls: list[tuple[str, str, str]]) -> bool:
    """Frames written to the WAL, then the WAL synced, inside one request's window."""
    wrote = False
    for name, path, _ in calls:
        if path.endswith("sched.db-wal"):
            if name in ("write", "pwrite64", "writev"):
                wrote = True
            elif name in SYNCS and wrote:
                return True
    return False


@pytest.mark.parametrize("change", ["add", "modify", "pause", "resume", "run", "delete"])
def test_an_acknowledged_change_is_synced_before_the_reply(
        daemon_factory: object, tmp_path: Path, change: str) -> None:
    d: Daemon = daemon_factory(  # type: ignore[operator]
        {"routes": [{"type": "t", "exec": ["/bin/sleep", "30"], "user": "root"}]}).start()
    if change != "add":
        d.ctl("add", "k1", "t", "0 0 1 1 *", "--at", str(int(time.time()) + 86400))
    if change == "resume":
        d.ctl("pause", "k1")
    argv = {"add": ["add", "k1", "t", "0 0 1 1 *"],
            "modify": ["modify", "k1", "--cron", "0 1 1 1 *"],
            "pause": ["pause", "k1"], "resume": ["resume", "k1"],
            "run": ["run", "k1"], "delete": ["delete", "k1"]}[change]
    traced = Traced(d, tmp_path / "strace.out")
    try:
        d.ctl(*argv)
        if change == "run":
            # strace cannot detach from a worker thread inside vfork (see below): let the
            # run end first (it fails at once: sleep is given the key as an argument).
            d.wait_log("end key=k1@run-")
    finally:
        calls = traced.stop()
    between = window(calls, f'\\"cmd\\":\\"{argv[0]}\\"')
    assert synced_before_reply(between), (
        f"{change}: answered without syncing the WAL; calls in between:\n"
        + "\n".join(f"{n} {p}" for n, p, _ in between if "sched.db" in p))
    d.ctl("status")  # still serving


def test_a_refused_change_writes_nothing(daemon_factory: object, tmp_path: Path) -> None:
    d: Daemon = daemon_factory().start()  # type: ignore[operator]
    traced = Traced(d, tmp_path / "strace.out")
    try:
        res = d.ctl("add", "k1", "t", "not a cron", check=False)
    finally:
        calls = traced.stop()
    assert res.returncode == 1 and "cron" in res.stderr
    between = window(calls, '\\"cmd\\":\\"add\\"')
    assert not [c for c in between if c[1].endswith("sched.db-wal") and c[0] != "read"]


def test_finishing_occurrences_defers_its_syncs(daemon_factory: object,
                                                tmp_path: Path) -> None:
    """The hot path keeps synchronous=NORMAL: a burst of finished occurrences writes the
    WAL many times and syncs it (at checkpoints) far fewer times."""
    d: Daemon = daemon_factory(  # type: ignore[operator]
        {"routes": [{"type": "t", "exec": ["/bin/true"], "user": "root"}], "workers": 1}).start()
    traced = Traced(d, tmp_path / "strace.out")
    try:
        start = int(time.time()) - 200 * 60
        d.ctl("add", "burst", "t", "* * * * *", "--start", str(start))
        wait_until(lambda: d.ctl_json("history", "burst", "-n", "150").__len__() >= 150,
                   timeout=60, what="150 runs")
        # No job may be starting when strace detaches: a worker thread inside vfork does
        # not stop for it while strace holds the child stopped (they wait on each other).
        d.ctl("pause", "burst")
        wait_until(lambda: not d.status()["running"], what="the last run's end")
    finally:
        calls = traced.stop()
    wal = [name for name, path, _ in calls if path.endswith("sched.db-wal")]
    writes = sum(name in ("write", "pwrite64", "writev") for name in wal)
    syncs = sum(name in SYNCS for name in wal)
    assert writes >= 150, writes
    assert syncs * 10 < writes, (writes, syncs)
