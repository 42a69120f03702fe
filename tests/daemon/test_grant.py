"""The polkit grant takes effect at once (issue 38): a daemon that is not root notices by
itself, within seconds, that the grant came on (the mark `perfectsched-grant enable`
leaves, made here by hand), refuses its routes that run as its own user and stops their
running jobs (exec and python), each with a history row that says why; and
`perfectsched-grant enable` returns only once none runs.

The daemon runs as `nobody` (a root daemon holds every right: the grant means nothing
to it), from a world-readable copy of the packages (daemon_harness.foreign_python);
PERFECTSCHED_GRANT_* move the grant's files into the test's directory.  No systemd here:
the mark is what the daemon goes by.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import YEARLY, Daemon, foreign_python, pid_alive, sh, wait_until

ROOT = Path(__file__).resolve().parent.parent.parent
SCRIPT = ROOT / "packaging" / "scripts" / "perfectsched-grant"
STOPPED = "stopped: the polkit grant was enabled (jobs may not run as nobody)"

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                                reason="needs root (to run the daemon as nobody) and setpriv")

PYJOB = """
import os, time
from perfectschedd import Application

class Sleeper(Application):
    def run(self):
        with open(os.path.join({dir!r}, "pyjob.started"), "w") as f:
            f.write(str(os.getpid()))
        for _ in range(600):
            time.sleep(0.1)
"""


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory of nobody's (pytest's tmp_path is private to root)."""
    path = Path(tempfile.mkdtemp(prefix="psched-grant-"))
    nobody = pwd.getpwnam("nobody")
    os.chmod(path, 0o755)
    os.chown(path, nobody.pw_uid, nobody.pw_gid)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def nobody_daemon(where: Path, routes: list[dict[str, Any]], **config: Any) -> Daemon:
    """A daemon of user nobody whose grant mark is where/grant-enabled."""
    nobody = pwd.getpwnam("nobody")
    mods = where / "mods"
    mods.mkdir()
    (mods / "grantjob.py").write_text(PYJOB.format(dir=str(where)))
    # worker_timeout: a loaded host must not have a worker killed (and its jobs with it)
    # for being slow: that would stop the jobs for another reason than the grant.
    # Its routes run as itself (no user:, which names another user: refused to nobody).
    routes = [{k: v for k, v in r.items() if k != "user"} for r in routes]
    d = Daemon(where, {"routes": routes, "kill_grace": 1, "poll_interval": 0.2,
                       "worker_timeout": 60, **config},
               command=["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
                        *foreign_python(), "-m", "perfectschedd"],
               extra_args=["-I", str(mods)],
               env={"PERFECTSCHED_GRANT_MARK": str(where / "grant-enabled")})
    os.chown(d.dir, nobody.pw_uid, nobody.pw_gid)
    return d


def started(d: Daemon) -> Daemon:
    """d.start(), with its notify socket open to nobody (bound under umask 0)."""
    old = os.umask(0)
    try:
        d.start(wait_ready=False)
    finally:
        os.umask(old)
    d.wait_notify(lambda m: "READY=1" in m, timeout=60, what="READY=1")
    return d


def job_pid(path: Path) -> int:
    return int(wait_until(lambda: path.exists() and path.read_text().strip(), timeout=30,
                          what=f"{path.name}"))


def history(d: Daemon, key: str) -> list[dict[str, Any]]:
    return list(d.ctl_json("history", key, "-n", "20"))


def grant_state(d: Daemon) -> tuple[bool, list[Any], list[str]]:
    status = d.status()
    return status["unit_grant"], status["grant_stopping"], status["refused"]


def test_a_grant_made_by_hand_stops_the_running_jobs_of_the_daemon_s_user(
        open_dir: Path) -> None:
    """The mark made by hand (no script, no reload): within seconds the exec and the
    python job running as the daemon's user are stopped, not drained, their history says
    why, their routes are refused; the mark removed, they run again."""
    routes = [sh("shell", f'echo $$ > {open_dir}/exec.started; exec sleep 60'),
              {"type": "py", "python": "grantjob:Sleeper"}]
    d = nobody_daemon(open_dir, routes)
    try:
        started(d)
        d.wait_log("polkit grant to start units: not held")
        d.ctl("add", "sh1", "shell", YEARLY, "--at", "0")
        d.ctl("add", "py1", "py", YEARLY, "--at", "0")
        exec_pid = job_pid(open_dir / "exec.started")
        job_pid(open_dir / "pyjob.started")
        assert pid_alive(exec_pid)

        (open_dir / "grant-enabled").write_text("by hand\n")
        t0 = time.monotonic()
        wait_until(lambda: not pid_alive(exec_pid), timeout=15, what="the exec job stopped")
        runs = {k: wait_until(lambda k=k: history(d, k), timeout=15, what=f"{k}'s history")
                for k in ("sh1", "py1")}
        took = time.monotonic() - t0
        assert took < 30, took  # seconds (CHECK_EVERY), not the 60 s of the jobs
        for key, rows in runs.items():
            assert [(r["outcome"], r["error"].split(":")[0]) for r in rows] == \
                [("stopped", "stopped")], (key, rows)
            assert rows[0]["error"].startswith(STOPPED), rows
        held, stopping, refused = wait_until(
            lambda: (s := grant_state(d)) and s[0] and not s[1] and s, timeout=10,
            what="status: the grant held, nothing left to stop")
        assert len(refused) == 2 and all("nobody" in r and "polkit grant" in r for r in refused), \
            refused
        d.wait_log("the polkit grant to start units is now held")
        # Refused: a run now starts nothing here.
        (open_dir / "exec.started").unlink()
        d.ctl("run", "sh1")
        time.sleep(2)
        assert not (open_dir / "exec.started").exists()

        # Off again (perfectsched-grant disable, by hand): the route runs again.
        (open_dir / "grant-enabled").unlink()
        d.wait_log("the polkit grant to start units is now off", timeout=15)
        assert job_pid(open_dir / "exec.started")
        assert d.status()["refused"] == []
        assert d.alive()
    finally:
        d.kill()


def run_script(where: Path, d: Daemon, *args: str, socket: str | None = None,
               wait: int | None = None) -> subprocess.CompletedProcess[str]:
    share = where / "share"
    share.mkdir(exist_ok=True)
    for name in ("perfectsched.rules", "perfectsched-before-257.rules"):
        (share / name).write_text("// a rule\n")
    (where / "rules.d").mkdir(exist_ok=True)
    env = {**os.environ,
           "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}",
           "PERFECTSCHED_GRANT_RULE": str(where / "rules.d" / "60-perfectsched.rules"),
           "PERFECTSCHED_GRANT_MARK": str(where / "grant-enabled"),
           "PERFECTSCHED_GRANT_SHARE": str(share),
           "PERFECTSCHED_SOCKET": socket or d.socket_path}
    if wait is not None:
        env["PERFECTSCHED_GRANT_WAIT"] = str(wait)
    return subprocess.run(["sh", str(SCRIPT), *args], capture_output=True, text=True,
                          env=env, timeout=60)


def test_enable_returns_once_no_job_of_the_daemon_s_user_runs(open_dir: Path) -> None:
    d = nobody_daemon(open_dir, [sh("shell", f'echo $$ > {open_dir}/exec.started; '
                                             'exec sleep 60')])
    try:
        started(d)
        d.ctl("add", "sh1", "shell", YEARLY, "--at", "0")
        pid = job_pid(open_dir / "exec.started")
        r = run_script(open_dir, d, "enable")
        assert r.returncode == 0, r.stdout + r.stderr
        assert not pid_alive(pid)  # gone when enable returned
        assert "no job runs as its user" in r.stdout, r.stdout
        assert (open_dir / "rules.d" / "60-perfectsched.rules").is_symlink()
        assert (open_dir / "grant-enabled").exists()
        rows = wait_until(lambda: history(d, "sh1"), timeout=10, what="the history row")
        assert rows[0]["outcome"] == "stopped" and rows[0]["error"].startswith(STOPPED), rows
    finally:
        d.kill()


def test_enable_gives_up_and_turns_the_grant_off_when_a_job_will_not_stop(
        open_dir: Path) -> None:
    """A job that ignores TERM (kill_grace 20 s) outlives the wait: enable fails in one
    line naming it, and the grant is off again."""
    d = nobody_daemon(open_dir, [sh("shell", f'trap "" TERM; echo $$ > {open_dir}/'
                                             'exec.started; exec sleep 60')], kill_grace=20)
    try:
        started(d)
        d.ctl("add", "stubborn", "shell", YEARLY, "--at", "0")
        pid = job_pid(open_dir / "exec.started")
        r = run_script(open_dir, d, "enable", wait=3)
        assert r.returncode == 1, r.stdout + r.stderr
        assert "did not stop its jobs as its own user within 3s (still running: " \
               "stubborn)" in r.stderr, r.stderr
        assert "the grant stays off" in r.stderr, r.stderr
        assert not (open_dir / "grant-enabled").exists()
        assert not (open_dir / "rules.d" / "60-perfectsched.rules").exists()
        assert pid_alive(pid)
    finally:
        d.kill()


def test_enable_without_a_running_daemon_just_enables(open_dir: Path) -> None:
    d = nobody_daemon(open_dir, [])  # never started
    r = run_script(open_dir, d, "enable", socket=str(open_dir / "no-such.sock"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "perfectschedd is not running" in r.stdout, r.stdout
    assert (open_dir / "grant-enabled").exists()
    assert (open_dir / "rules.d" / "60-perfectsched.rules").is_symlink()
