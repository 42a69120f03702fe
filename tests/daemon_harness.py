"""Start a real perfectschedd for tests: temp config, its own NOTIFY_SOCKET, real signals.

    d = Daemon(tmp_path, {"routes": [...]}).start()    # returns after READY=1
    d.ctl("add", "k", "t", "* * * * *")                  # perfectschedctl --socket ...
    d.wait_notify(lambda m: "WATCHDOG=1" in m)
    d.stop()                                             # SIGTERM, wait, returns exit code
"""

from __future__ import annotations

import atexit
import json
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from perfectschedd.executors import guard

DAEMON = [sys.executable, "-m", "perfectschedd"]
CTL = [sys.executable, "-m", "perfectschedctl"]
_foreign: list[str] = []


def foreign_python() -> list[str]:
    """A Python command that another user (setpriv --reuid=nobody) can run our packages
    with, wherever this checkout lives: a clone in a directory only root can enter, or a
    private temporary directory, is out of their reach, and so is this venv.  Debian's
    python3 (its python3-yaml and python3-dbus-next are test dependencies) with a
    world-readable copy of perfectschedd/ and perfectschedctl/."""
    if not _foreign:
        root = Path(__file__).resolve().parent.parent
        copy = Path(tempfile.mkdtemp(prefix="perfectsched-foreign-"))
        atexit.register(shutil.rmtree, copy, True)
        for package in ("perfectschedd", "perfectschedctl"):
            shutil.copytree(root / package, copy / package,
                            ignore=shutil.ignore_patterns("__pycache__"))
        for path in (copy, *copy.rglob("*")):
            path.chmod(0o755 if path.is_dir() else 0o644)
        python = "/usr/bin/python3" if os.access("/usr/bin/python3", os.X_OK) \
            else sys.executable
        _foreign.extend(["env", f"PYTHONPATH={copy}", python])
    return list(_foreign)


def foreign_ctl() -> list[str]:
    return [*foreign_python(), "-m", "perfectschedctl"]


def wait_until(pred: Callable[[], Any], timeout: float = 20.0, interval: float = 0.05,
               what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


YEARLY = "0 0 1 1 *"  # due once via --at 0, then not again during a test


def log_stamp(text: str) -> float:
    """A log line's time ("2026-11-22 15:40:01,123") as Unix seconds.  Lines of different
    processes are in the file in the order their log writer threads wrote them, not in
    the order they were logged: compare these times, not positions."""
    whole, ms = text.split(",")
    return time.mktime(time.strptime(whole, "%Y-%m-%d %H:%M:%S")) + int(ms) / 1000


# Who runs the tests, and so the daemons they start: a route's `user:` that keeps a job
# running as the daemon's user (a root daemon refuses a route without one).
RUNNER = pwd.getpwuid(os.geteuid()).pw_name


def sh(task_type: str, script: str, **extra: Any) -> dict[str, Any]:
    """An exec route running `script` with /bin/sh as the daemon's user; the task key is
    $1."""
    return {"type": task_type, "exec": ["/bin/sh", "-c", script, "sh"], "user": RUNNER,
            **extra}


def shared_dir() -> Path:
    """A directory every user may write to (sticky, as /tmp), for jobs and notifiers that
    run as another user (nobody): pytest's tmp_path is its runner's alone.  Removed at
    exit."""
    path = Path(tempfile.mkdtemp(prefix="perfectsched-shared-"))
    path.chmod(0o1777)
    atexit.register(shutil.rmtree, path, True)
    return path


def lines(path: Path) -> list[str]:
    """The lines of a file a job appends to ([] before it exists)."""
    try:
        return path.read_text().splitlines()
    except FileNotFoundError:
        return []


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class NotifyListener:
    """The systemd side of sd_notify: a datagram socket collecting messages."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.sock.settimeout(0.2)
        self.messages: list[tuple[float, str]] = []
        self.lock = threading.Lock()
        self.closed = False
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.closed:
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            with self.lock:
                self.messages.append((time.monotonic(), data.decode(errors="replace")))

    def all(self) -> list[str]:
        with self.lock:
            return [m for _, m in self.messages]

    def timed(self) -> list[tuple[float, str]]:
        with self.lock:
            return list(self.messages)

    def close(self) -> None:
        self.closed = True
        self.sock.close()


class Daemon:
    def __init__(self, tmp_path: Path, overrides: dict[str, Any] | None = None, *,
                 url: str | None = None, name: str = "d", watchdog_usec: int | None = None,
                 extra_args: list[str] | None = None, env: dict[str, str] | None = None,
                 command: list[str] | None = None, ctl_command: list[str] | None = None
                 ) -> None:
        # The programs run: this tree's by default (tests/old_release.py: a past release's).
        self.command = list(command or DAEMON)
        self.ctl_command = list(ctl_command or CTL)
        self.dir = Path(tmp_path) / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.socket_path = str(self.dir / "ctl.sock")
        self.metrics_port = free_port()
        self.config: dict[str, Any] = {
            "type": "rdb_compat",
            "url": url or f"sqlite:///{self.dir / 'sched.db'}",
            "control_socket": self.socket_path,
            "metrics_listen": f"127.0.0.1:{self.metrics_port}",
            "poll_interval": 0.5,
            "alive_time": 10,
            "retry_wait": 5,
            "workers": 2,
            "shutdown_timeout": 5,
            "kill_grace": 1,
            "worker_timeout": 10,
            "routes": [],
        }
        self.config.update(overrides or {})
        self.config_path = self.dir / "perfectsched.yml"
        self.write_config()
        self.log_path = self.dir / "daemon.log"
        self.watchdog_usec = watchdog_usec
        self.extra_args = extra_args or []
        self.extra_env = env or {}
        self.proc: subprocess.Popen[bytes] | None = None
        self.notify: NotifyListener | None = None

    # -- config ---------------------------------------------------------------------------

    def write_config(self, config: dict[str, Any] | None = None, raw: str | None = None) -> None:
        text = raw if raw is not None else yaml.safe_dump(config or self.config)
        tmp = self.config_path.with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, self.config_path)

    # -- lifecycle ------------------------------------------------------------------------

    def start(self, wait_ready: bool = True, timeout: float = 30.0) -> Daemon:
        notify_path = self.dir / "notify.sock"
        if notify_path.exists():
            notify_path.unlink()
        self.notify = NotifyListener(notify_path)
        env = {k: v for k, v in os.environ.items() if not k.startswith("PERFECTSCHED_")}
        env.update(self.extra_env)
        env["NOTIFY_SOCKET"] = self.notify.path
        env["PYTHONUNBUFFERED"] = "1"
        if self.watchdog_usec:
            env["WATCHDOG_USEC"] = str(self.watchdog_usec)
        self.proc = subprocess.Popen(
            [*self.command, "-c", str(self.config_path), *self.extra_args],
            stdin=subprocess.DEVNULL, stdout=self.log_path.open("ab"),
            stderr=subprocess.STDOUT, env=env, start_new_session=True,
            cwd=str(self.dir))
        if wait_ready:
            self.wait_notify(lambda m: "READY=1" in m, timeout=timeout, what="READY=1")
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def send_signal(self, sig: int) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, sig)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.send_signal(sig)
        try:
            code = self.proc.wait(timeout)
        finally:
            self.kill()
        return code

    def kill(self) -> None:
        """Last resort cleanup: nothing of this daemon may outlive the test.  Its jobs
        run in sessions of their own, and once the daemon's group is killed they belong
        to init (the job guard dies with the group): they are named first."""
        jobs = self.descendants()
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
        for pid in {*jobs, *self.descendants()}:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.notify is not None:
            self.notify.close()
            self.notify = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    # -- observation ----------------------------------------------------------------------

    def messages(self) -> list[str]:
        return self.notify.all() if self.notify else []

    def wait_notify(self, pred: Callable[[str], bool], timeout: float = 20.0,
                    what: str = "notify message", after: int = 0) -> str:
        def found() -> str | None:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"daemon exited ({self.proc.returncode}) while waiting "
                                     f"for {what}; log:\n{self.log()[-3000:]}")
            for m in self.messages()[after:]:
                if pred(m):
                    return m
            return None
        return wait_until(found, timeout, what=what)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def wait_log(self, text: str, timeout: float = 20.0, count: int = 1) -> None:
        wait_until(lambda: self.log().count(text) >= count, timeout, what=f"log {text!r}")

    def logged_at(self, pattern: str) -> list[float]:
        """The times of the log lines matching the regular expression (after the time)."""
        return [log_stamp(t) for t in
                re.findall(rf"^(\S+ \S+) .*?(?:{pattern})", self.log(), re.M)]

    def children(self) -> list[int]:
        """Direct children of the master: the workers (not its job guard)."""
        return [p for p in _children(self.pid) if not is_guard(p)]

    def guard(self) -> int:
        """The pid of the master's job guard (executors/guard.py)."""
        [pid] = [p for p in _children(self.pid) if is_guard(p)]
        return pid

    def descendants(self) -> list[int]:
        if self.proc is None:
            return []
        out, todo = [], [self.proc.pid]
        while todo:
            kids = _children(todo.pop())
            out.extend(kids)
            todo.extend(kids)
        return out

    # -- perfectschedctl ------------------------------------------------------------------

    def ctl(self, *args: str, check: bool = True, as_user: str | None = None,
            timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        cmd = [*self.ctl_command, "--socket", self.socket_path, *args]
        if as_user:
            cmd = ["setpriv", f"--reuid={as_user}", f"--regid={as_user}", "--clear-groups",
                   *foreign_ctl(), "--socket", self.socket_path, *args]
        env = {k: v for k, v in os.environ.items() if not k.startswith("PERFECTSCHED_")}
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        if check and res.returncode != 0:
            raise AssertionError(f"perfectschedctl {' '.join(args)} -> {res.returncode}\n"
                                 f"{res.stdout}{res.stderr}")
        return res

    def ctl_json(self, *args: str) -> Any:
        return json.loads(self.ctl("--json", *args).stdout)

    def status(self) -> dict[str, Any]:
        return dict(self.ctl_json("status"))


def is_guard(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/comm").read_bytes().strip() == guard.NAME
    except OSError:
        return False


def _children(pid: int) -> list[int]:
    """Children of every thread of `pid` (exec jobs are started by worker threads)."""
    out: list[int] = []
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    for tid in threads:
        try:
            out.extend(int(p) for p in Path(f"/proc/{pid}/task/{tid}/children").read_text()
                       .split())
        except OSError:
            continue
    return sorted(set(out))


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except OSError:
        return False


def start_plain_daemon(d: Path, tree: Path, url: str | None = None
                       ) -> tuple[subprocess.Popen[bytes], NotifyListener, str, dict[str, str]]:
    """A daemon of the checkout `tree` (PYTHONPATH) in `d`, no routes, no metrics, up to
    READY=1 (30 s, else RuntimeError): the benches that time requests against it.
    Returns the process, its notify listener, the control socket and its environment."""
    sock = str(d / "ctl.sock")
    cfg = {"type": "rdb_compat", "url": url or f"sqlite:///{d / 'sched.db'}",
           "control_socket": sock, "metrics_listen": "off", "workers": 2,
           "routes": [], "schedules_dir": str(d / "none")}
    (d / "none").mkdir(exist_ok=True)  # named, so it must exist (an empty one: no files)
    (d / "c.yml").write_text(yaml.safe_dump(cfg))
    notify = NotifyListener(d / "notify.sock")
    env = {**os.environ, "PYTHONPATH": str(tree), "NOTIFY_SOCKET": notify.path}
    proc = subprocess.Popen([sys.executable, "-m", "perfectschedd", "-c", str(d / "c.yml")],
                            cwd=d, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while not any("READY=1" in m for m in notify.all()):
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            proc.wait(10)
            notify.close()
            raise RuntimeError(f"{tree}: the daemon did not become ready")
        time.sleep(0.05)
    return proc, notify, sock, env
