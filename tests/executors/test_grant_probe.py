"""The grant probe fails closed (issue 38): when systemd does not answer in time whether
this daemon may start units, the grant is taken as held (no job runs as the daemon's
user) and one line says so.

A real probe, as a daemon that is not root makes it (user nobody), against a system bus
that accepts the connection and never answers (a real socket, silent).  The host need
not run systemd: the probe is told where its marker is (as
tests/settings/test_unit_props.py does).
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_harness import foreign_python

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                                reason="needs root (to probe as nobody) and setpriv")

PROBE = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="LOG %(message)s")
from perfectschedd.executors.systemd import grant
from perfectschedd.settings import unit_props
unit_props.SYSTEMD_MARKER = sys.argv[1]
state = grant.grant_state()
print("HELD", state[0] if isinstance(state, tuple) else state)
"""


@pytest.fixture
def silent_bus() -> Iterator[Path]:
    """A Unix socket nobody may connect to, which accepts and never says a word."""
    where = Path(tempfile.mkdtemp(prefix="psched-silentbus-"))
    os.chmod(where, 0o755)
    path = where / "bus"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    os.chmod(path, 0o777)
    server.listen(8)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])  # kept open, never answered
            except TimeoutError:
                continue
            except OSError:
                return

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield path
    stop.set()
    thread.join(2)
    for s in [server, *held]:
        s.close()
    shutil.rmtree(where, ignore_errors=True)


def test_a_probe_without_an_answer_takes_the_grant_as_held(silent_bus: Path) -> None:
    marker = Path(tempfile.mkdtemp(prefix="psched-systemd-marker-"))
    try:
        nobody = pwd.getpwnam("nobody")
        env = {"PATH": "/usr/bin:/bin", "DBUS_SYSTEM_BUS_ADDRESS": f"unix:path={silent_bus}",
               "PERFECTSCHED_GRANT_MARK": str(marker / "no-mark-here")}
        r = subprocess.run(["setpriv", f"--reuid={nobody.pw_uid}", "--regid=nogroup",
                            "--clear-groups", *foreign_python(), "-c", PROBE, str(marker)],
                           capture_output=True, text=True, timeout=60, env=env)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "HELD True" in r.stdout, r.stdout + r.stderr
        said = [line for line in r.stdout.splitlines() if line.startswith("LOG ")]
        assert len(said) == 1, said
        assert "no answer from systemd within 5s" in said[0], said
        assert "taking the polkit grant as held, so no job runs as nobody" in said[0], said
    finally:
        shutil.rmtree(marker, ignore_errors=True)
