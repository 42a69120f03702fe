"""The executors (router.py, command.py, application.py): routing, exec and python handlers,
timeouts, kills, stop."""

from __future__ import annotations

import json
import logging
import os
import pwd
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from perfectschedd.errors import PreemptedError
from perfectschedd.executors import base, command
from perfectschedd.executors.application import Application, HandlerTimeout, PythonHandler
from perfectschedd.executors.command import ExecHandler
from perfectschedd.executors.router import Router, run_task
from perfectschedd.settings.routes import RouteConfig
from perfectschedd.vocabulary.outcomes import Outcome

LOGGER = "test.handlers"


class FakeTask:
    """Stands in for schedules.Task: records how the handler ended it."""

    def __init__(self, key: str = "job-1", type: str = "t", data: dict[str, Any] | None = None,
                 scheduled_time: int = 1357000000, attempt: int = 1,
                 preempted: bool = False) -> None:
        self.key = key
        self.type = type
        self.data = {} if data is None else data
        self.scheduled_time = scheduled_time
        self.attempt = attempt
        self.preempted = preempted
        self.calls: list[tuple[Any, ...]] = []

    @property
    def done(self) -> bool:
        return bool(self.calls)

    def _end(self, *call: Any) -> None:
        if self.preempted:
            raise PreemptedError(self.key)
        assert not self.calls, f"task ended twice: {self.calls} then {call}"
        self.calls.append(call)

    def finish(self) -> None:
        self._end("finish")

    def retry(self, *args: Any, **kwargs: Any) -> None:
        self._end("retry", args, kwargs)

    def release(self) -> None:
        self._end("release")

    def give_back(self) -> None:  # the daemon's release (stop): recorded alike
        self._end("release")


def sh(script: str, timeout: float | None = None) -> ExecHandler:
    """An exec handler running a shell script; the key arrives as $1."""
    argv = ("/bin/sh", "-c", script, "sh")
    return ExecHandler(RouteConfig(pattern="t", exec=argv, timeout=timeout), argv, timeout)


def py(cls: type, timeout: float | None = None) -> PythonHandler:
    route = RouteConfig(pattern="t", python=f"{__name__}:{cls.__name__}", timeout=timeout)
    return PythonHandler(route, cls, timeout)


def run(task: FakeTask, handler: base.Handler, **kw: Any) -> base.RunResult:
    kw.setdefault("log", logging.getLogger(LOGGER))
    kw.setdefault("kill_grace", 1.0)
    return run_task(task, handler, **kw)


def gone(pid: int, within: float = 3.0) -> bool:
    """True once pid no longer runs (dead, or a zombie waiting for its reaper)."""
    end = time.monotonic() + within
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        if time.monotonic() > end:
            return False
        time.sleep(0.01)


def pids(path: Path) -> list[int]:
    return [int(x) for x in path.read_text().split()]


# --------------------------------------------------------------------------- exec


def test_exec_exit_0_finishes() -> None:
    task = FakeTask()
    result = run(task, sh("exit 0"))
    assert result.outcome == Outcome.SUCCESS == "success"
    assert result.exit_code == 0
    assert result.duration >= 0
    assert task.calls == [("finish",)]
    assert command.running_groups() == {}


def test_exec_nonzero_retries_without_wait() -> None:
    task = FakeTask()
    result = run(task, sh("exit 3"))
    assert result.outcome == Outcome.FAILED
    assert result.exit_code == 3
    assert task.calls == [("retry", (), {})]


@pytest.mark.parametrize("code", [0, 1])
def test_exec_sched_later_wins_over_exit_code(code: int) -> None:
    task = FakeTask()
    result = run(task, sh(f"echo working; echo 'SCHED_LATER 7'; echo; exit {code}"))
    assert result.outcome == Outcome.LATER
    assert task.calls == [("retry", (), {"wait": 7, "later": True})]


def test_exec_sched_later_only_as_last_line(caplog: pytest.LogCaptureFixture) -> None:
    task = FakeTask()
    assert run(task, sh("echo 'SCHED_LATER 7'; echo more")).outcome == Outcome.SUCCESS
    task = FakeTask()
    assert run(task, sh("echo 'SCHED_LATER soon'")).outcome == Outcome.SUCCESS
    assert "malformed" in caplog.text


def test_exec_stdin_argv_env(tmp_path: Path) -> None:
    data = {"k": "v", "n": [1, 2], "u": "é"}
    task = FakeTask(key="my key", type="backup", data=data, scheduled_time=1357000123,
                    attempt=4)
    script = f"""
        cat > {tmp_path}/stdin
        printf '%s\\n' "$@" > {tmp_path}/args
        env | grep -E "^PERFECTSCHED_(KEY|TYPE|SCHEDULED_TIME|ATTEMPT)=" | sort > {tmp_path}/env
    """
    argv = ("/bin/sh", "-c", script, "sh", "--full")
    handler = ExecHandler(RouteConfig(pattern="t", exec=argv), argv, None)
    assert run(task, handler).outcome == Outcome.SUCCESS
    assert json.loads((tmp_path / "stdin").read_text()) == data
    assert (tmp_path / "args").read_text().splitlines() == ["--full", "my key"]
    assert (tmp_path / "env").read_text().splitlines() == [
        "PERFECTSCHED_ATTEMPT=4",
        "PERFECTSCHED_KEY=my key",
        "PERFECTSCHED_SCHEDULED_TIME=1357000123",
        "PERFECTSCHED_TYPE=backup",
    ]


def test_exec_never_inherits_the_daemon_s_environment(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Cron's environment of the job's user, the route's env: and the run's variables;
    nothing of the daemon's (which holds PGPASSWORD and the like)."""
    monkeypatch.setenv("PGPASSWORD", "secret")
    monkeypatch.setenv("PERFECTSCHED_CONFIG", "/etc/secret.yml")
    monkeypatch.setenv("LANG", "C.UTF-8")
    argv = ("/bin/sh", "-c", f"tr '\\0' '\\n' < /proc/$$/environ > {tmp_path}/out", "sh")
    route = RouteConfig(pattern="t", exec=argv, env=(("EXTRA", "1"), ("PERFECTSCHED_KEY", "x")))
    run(FakeTask(key="k@run-1-ab"), ExecHandler(route, argv, None), run_id="1.2")
    env = dict(line.split("=", 1) for line in (tmp_path / "out").read_text().splitlines())
    me = pwd.getpwuid(os.geteuid())
    assert env == {"HOME": me.pw_dir, "LOGNAME": me.pw_name, "USER": me.pw_name,
                   "SHELL": me.pw_shell, "LANG": "C.UTF-8",
                   "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                   "EXTRA": "1", "PERFECTSCHED_KEY": "k@run-1-ab",
                   "PERFECTSCHED_SCHEDULE_KEY": "k", "PERFECTSCHED_TYPE": "t",
                   "PERFECTSCHED_SCHEDULED_TIME": str(FakeTask().scheduled_time),
                   "PERFECTSCHED_ATTEMPT": "1", "PERFECTSCHED_RUN_ID": "1.2"}


def test_exec_output_is_logged_with_key(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    run(FakeTask(key="k42"), sh("echo hello out; echo hello err >&2; printf 'no newline'"))
    records = {(r.levelno, r.getMessage()) for r in caplog.records}
    assert (logging.INFO, "k42: hello out") in records
    assert (logging.WARNING, "k42: hello err") in records
    assert (logging.INFO, "k42: no newline") in records


def test_exec_missing_or_not_executable_retries(tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    missing = str(tmp_path / "nope")
    task = FakeTask(key="k-missing")
    result = run(task, ExecHandler(RouteConfig(pattern="t", exec=(missing,)), (missing,), None))
    assert result.outcome == Outcome.FAILED
    assert result.exit_code is None
    assert task.calls == [("retry", (), {})]
    assert f"k-missing: cannot run {missing}: No such file or directory" in caplog.text

    plain = tmp_path / "plain"
    plain.write_text("#!/bin/sh\n")
    task = FakeTask(key="k-noexec")
    run(task, ExecHandler(RouteConfig(pattern="t", exec=(str(plain),)), (str(plain),), None))
    assert task.calls == [("retry", (), {})]
    assert f"k-noexec: cannot run {plain}: Permission denied" in caplog.text
    assert command.running_groups() == {}


def test_exec_timeout_kills_whole_group(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    pidfile = tmp_path / "pids"
    # A grandchild in the background holding our stdout, and the script itself.
    script = f"sleep 1000 & echo $! > {pidfile}; echo $$ >> {pidfile}; wait"
    task = FakeTask(key="slow")
    result = run(task, sh(script, timeout=0.3), kill_grace=2.0)
    assert result.outcome == Outcome.TIMEOUT
    assert task.calls == [("retry", (), {})]
    assert 0.3 <= result.duration < 2.0  # SIGTERM was enough
    assert result.exit_code is not None and result.exit_code < 0
    grandchild, child = pids(pidfile)
    assert gone(child) and gone(grandchild)
    assert "slow: timed out after 0.3s" in caplog.text
    assert command.running_groups() == {}


def test_exec_sigterm_ignored_gets_sigkill(tmp_path: Path,
                                           caplog: pytest.LogCaptureFixture) -> None:
    pidfile = tmp_path / "pids"
    script = f"trap '' TERM; sleep 1000 & echo $! > {pidfile}; echo $$ >> {pidfile}; wait"
    task = FakeTask(key="stubborn")
    result = run(task, sh(script, timeout=0.2), kill_grace=0.3)
    assert result.outcome == Outcome.TIMEOUT
    assert task.calls == [("retry", (), {})]
    assert result.duration >= 0.5
    assert result.exit_code == -9
    assert all(gone(pid) for pid in pids(pidfile))
    assert "sending SIGKILL" in caplog.text


def test_exec_leftovers_die_with_the_task(tmp_path: Path) -> None:
    pidfile = tmp_path / "pids"
    # Exits at once but leaves a background process behind (output redirected).
    script = f"sleep 1000 >/dev/null 2>&1 & echo $! > {pidfile}"
    task = FakeTask()
    assert run(task, sh(script)).outcome == Outcome.SUCCESS
    assert gone(pids(pidfile)[0])


def test_exec_leftover_holding_stdout_does_not_hang(tmp_path: Path) -> None:
    pidfile = tmp_path / "pids"
    script = f"(trap '' TERM; sleep 1000) & echo $! > {pidfile}; echo done"
    task = FakeTask()
    result = run(task, sh(script), kill_grace=0.2)
    assert result.outcome == Outcome.SUCCESS
    assert result.duration < 1.5
    assert gone(pids(pidfile)[0])


def test_exec_large_output_no_deadlock() -> None:
    size = 5_000_000
    seen = {logging.INFO: 0, logging.WARNING: 0}

    class Count(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen[record.levelno] += len(record.getMessage()) - len("big: ") + 1

    log = logging.getLogger(LOGGER + ".big")
    log.propagate = False
    log.addHandler(Count())
    log.setLevel(logging.INFO)
    line = "x" * 199
    script = f"""
        (yes {line} | head -c {size} >&2) &
        yes {line} | head -c {size}
        wait
    """
    big = "y" * 100
    task = FakeTask(key="big", data={"blob": big * 20000})  # 2 MB on stdin, never read
    start = time.monotonic()
    result = run_task(task, sh(script, timeout=30), log=log, kill_grace=1.0,
                      log_output_limit=2 * size)  # every line logged, none cut
    assert result.outcome == Outcome.SUCCESS
    assert seen == {logging.INFO: size, logging.WARNING: size}
    assert time.monotonic() - start < 10


def test_exec_large_payload_reaches_stdin_whole(tmp_path: Path) -> None:
    # Beyond PIPE_BUF the payload goes through the poll loop, in pieces.
    data = {"blob": "z" * 300_000}
    assert run(FakeTask(data=data), sh(f"cat > {tmp_path}/stdin")).outcome == Outcome.SUCCESS
    assert json.loads((tmp_path / "stdin").read_text()) == data


def test_exec_command_inherits_no_descriptor_of_the_worker(tmp_path: Path) -> None:
    # An inheritable descriptor of the worker (a python job may leave one) stays out of
    # the command: it sees its stdin, stdout and stderr only (and ls its directory).
    fd = os.open(tmp_path, os.O_RDONLY)
    high = os.dup2(fd, 200, inheritable=True)
    try:
        assert os.get_inheritable(high)
        argv = ("/bin/sh", "-c", f"exec ls -1 /proc/self/fd > {tmp_path}/fds")
        handler = ExecHandler(RouteConfig(pattern="t", exec=argv, append_key=False), argv,
                              None)
        assert run(FakeTask(), handler).outcome == Outcome.SUCCESS
    finally:
        os.close(high)
        os.close(fd)
    seen = {int(x) for x in (tmp_path / "fds").read_text().split()}
    assert {0, 1, 2} <= seen <= {0, 1, 2, 3}


def test_exec_runs_leave_no_descriptor_open(tmp_path: Path) -> None:
    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    missing = str(tmp_path / "nope")
    runs = [
        (sh("read -r line; echo done"), {}),                 # small payload, read
        (sh("exit 3"), {"blob": "b" * 100_000}),              # large payload, not read
        (ExecHandler(RouteConfig(pattern="t", exec=(missing,)), (missing,), None), {}),
    ]
    before = open_fds()
    for handler, data in runs * 3:
        run(FakeTask(data=data), handler)
    assert open_fds() == before


def test_exec_huge_line_is_bounded(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    run(FakeTask(key="wide"), sh("head -c 300000 /dev/zero | tr '\\0' x"),
        log_output_limit=1 << 20)
    lengths = [len(r.getMessage()) for r in caplog.records if r.name == LOGGER]
    assert sum(lengths) == 300000 + len("wide: ") * len(lengths)
    assert max(lengths) <= command._MAX_LINE + len("wide: ")


def test_exec_stop_terminates_and_releases(tmp_path: Path) -> None:
    pidfile = tmp_path / "pids"
    script = f"sleep 1000 & echo $! > {pidfile}; echo $$ >> {pidfile}; wait"
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    task = FakeTask()
    result = run(task, sh(script, timeout=60), stop_event=stop)
    assert result.outcome == Outcome.STOPPED
    assert task.calls == [("release",)]
    assert all(gone(pid) for pid in pids(pidfile))
    assert result.duration < 1.5


def test_stop_before_start_releases() -> None:
    stop = threading.Event()
    stop.set()
    task = FakeTask()
    assert run(task, sh("exit 0"), stop_event=stop).outcome == Outcome.STOPPED
    assert task.calls == [("release",)]


def test_kill_all_groups(tmp_path: Path) -> None:
    pidfile = tmp_path / "pids"
    script = f"sleep 1000 & echo $! > {pidfile}; wait"
    task = FakeTask(key="victim")
    results: list[base.RunResult] = []
    t = threading.Thread(target=lambda: results.append(run(task, sh(script))))
    t.start()
    end = time.monotonic() + 5
    # The group is in the table once the executor's thread is back from the spawn, which
    # on a loaded machine can be after the child wrote its pid file.
    while not (pidfile.exists() and pidfile.read_text() and command.running_groups()) \
            and time.monotonic() < end:
        time.sleep(0.01)
    assert list(command.running_groups().values()) == ["victim"]
    assert command.kill_all_groups() == 1
    t.join(5)
    assert results[0].outcome == Outcome.FAILED
    assert results[0].exit_code == -9
    assert gone(pids(pidfile)[0])


def test_exec_preempted() -> None:
    assert run(FakeTask(preempted=True), sh("exit 0")).outcome == Outcome.PREEMPTED


# --------------------------------------------------------------------------- python


class Finishes(Application):
    def run(self) -> None:
        self.task.finish()


class ReturnsQuietly(Application):
    def run(self) -> None:
        pass


class RetriesLater(Application):
    def run(self) -> None:
        self.task.retry(wait=12)


class Retries(Application):
    def run(self) -> None:
        self.task.retry()


class Releases(Application):
    def run(self) -> None:
        self.task.release()


class Raises(Application):
    def run(self) -> None:
        raise ValueError("boom")


class Spins(Application):
    def run(self) -> None:
        while True:
            time.sleep(0.01)


class SpinsCatchingException(Application):
    def run(self) -> None:
        while True:
            try:
                time.sleep(0.01)
            except Exception:  # must not swallow HandlerTimeout
                pass


class FinishesSlowly(Application):
    def run(self) -> None:
        self.task.finish()
        while True:
            time.sleep(0.01)


@pytest.mark.parametrize("cls,outcome,calls", [
    (Finishes, Outcome.SUCCESS, [("finish",)]),
    (ReturnsQuietly, Outcome.SUCCESS, [("finish",)]),
    (Retries, Outcome.FAILED, [("retry", (), {})]),
    # SCHED_LATER's equivalent: not a failure (issue 39 item 3).
    (RetriesLater, Outcome.LATER, [("retry", (), {"wait": 12, "later": True})]),
    (Releases, Outcome.RELEASED, [("release",)]),
])
@pytest.mark.parametrize("armed", [False, True])
def test_python_outcomes(cls: type, outcome: Outcome, calls: list[Any], armed: bool) -> None:
    task = FakeTask()
    kw: dict[str, Any] = {"stop_event": threading.Event()} if armed else {}
    result = run(task, py(cls, timeout=10 if armed else None), **kw)
    assert result.outcome == outcome
    assert result.exit_code is None
    assert task.calls == calls


def test_python_exception_retries_with_traceback(caplog: pytest.LogCaptureFixture) -> None:
    task = FakeTask(key="k-raise")
    assert run(task, py(Raises)).outcome == Outcome.FAILED
    assert task.calls == [("retry", (), {})]
    record = next(r for r in caplog.records if r.getMessage().startswith("k-raise:"))
    assert record.levelno == logging.ERROR
    assert record.exc_info is not None and "boom" in caplog.text


def test_python_preempted() -> None:
    assert run(FakeTask(preempted=True), py(Finishes)).outcome == Outcome.PREEMPTED
    assert run(FakeTask(preempted=True), py(ReturnsQuietly)).outcome == Outcome.PREEMPTED


@pytest.mark.parametrize("cls", [Spins, SpinsCatchingException])
def test_python_timeout_retries_and_thread_goes_on(cls: type,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    out: list[Any] = []

    def worker() -> None:
        first = FakeTask(key="spin")
        out.append((run(first, py(cls, timeout=0.2)), first.calls))
        time.sleep(0.3)  # no stray exception arrives later
        second = FakeTask()
        out.append((run(second, py(Finishes, timeout=5)), second.calls))

    t = threading.Thread(target=worker)
    t.start()
    t.join(5)
    assert not t.is_alive()
    (first, first_calls), (second, second_calls) = out
    assert first.outcome == Outcome.TIMEOUT
    assert 0.2 <= first.duration < 1.0
    assert first_calls == [("retry", (), {})]
    assert second.outcome == Outcome.SUCCESS and second_calls == [("finish",)]
    assert "spin: " in caplog.text and "timed out after 0.2s" in caplog.text


def test_python_timeout_after_finish_keeps_success() -> None:
    task = FakeTask()
    result = run(task, py(FinishesSlowly, timeout=0.1))
    assert result.outcome == Outcome.SUCCESS
    assert task.calls == [("finish",)]


def test_python_stop_releases() -> None:
    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    task = FakeTask()
    result = run(task, py(Spins), stop_event=stop)
    assert result.outcome == Outcome.STOPPED
    assert task.calls == [("release",)]
    assert result.duration < 1.0


def test_handler_timeout_is_not_an_exception() -> None:
    assert not issubclass(HandlerTimeout, Exception)


def test_python_overhead_is_microseconds() -> None:
    handler = py(ReturnsQuietly, timeout=60)
    stop = threading.Event()
    log = logging.getLogger(LOGGER)
    for kw in ({}, {"stop_event": stop}):
        plain = py(ReturnsQuietly)
        for h in (plain, handler):
            n = 2000
            start = time.perf_counter()
            for _ in range(n):
                run_task(FakeTask(), h, log=log, **kw)
            per_task = (time.perf_counter() - start) / n
            assert per_task < 100e-6, (h, kw, per_task)


# --------------------------------------------------------------------------- router


def routes(*pairs: tuple[str, str]) -> tuple[RouteConfig, ...]:
    out = []
    for pattern, target in pairs:
        if ":" in target:
            out.append(RouteConfig(pattern=pattern, python=target))
        else:
            out.append(RouteConfig(pattern=pattern, exec=(target,), timeout=5))
    return tuple(out)


def test_router_exact_regexp_first_wins() -> None:
    router = Router(routes(
        ("backup", "/bin/backup"),
        ("/^report-.*$/", "/bin/report"),
        ("/report/", "/bin/other"),
        ("report-x", "/bin/never"),
    ))
    backup = router.match("backup")
    assert isinstance(backup, ExecHandler)
    assert backup.argv == ("/bin/backup",) and backup.timeout == 5
    report = router.match("report-x")
    assert isinstance(report, ExecHandler) and report.argv == ("/bin/report",)
    other = router.match("my-report")
    assert isinstance(other, ExecHandler) and other.argv == ("/bin/other",)
    assert router.match("backup2") is None
    assert router.match("unknown") is None
    assert router.match("backup") is backup


def test_router_imports_python_lazily_once(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "handlers_lazy_jobs.py").write_text(
        "import perfectschedd.executors.application as h\n"
        "IMPORTS = globals().get('IMPORTS', 0) + 1\n"
        "class Report(h.Application):\n"
        "    def run(self):\n"
        "        self.task.finish()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    router = Router(routes(("/^report-/", "handlers_lazy_jobs:Report")))
    assert "handlers_lazy_jobs" not in sys.modules
    a = router.match("report-a")
    b = router.match("report-b")
    assert isinstance(a, PythonHandler) and a is b
    assert a.app_class.__name__ == "Report"
    task = FakeTask()
    assert run_task(task, a).outcome == Outcome.SUCCESS
    monkeypatch.delitem(sys.modules, "handlers_lazy_jobs")


@pytest.mark.parametrize("target", ["no_such_module_xyz:Job", "json:NoSuchClass", "json:dumps"])
def test_router_broken_python_route(target: str, caplog: pytest.LogCaptureFixture) -> None:
    router = Router(routes(("job", target), ("/.*/", "/bin/fallback")))
    assert router.match("job") is None
    assert router.match("job") is None
    broken = [r for r in caplog.records if "cannot run here" in r.getMessage()]
    assert len(broken) == 1
    assert broken[0].levelno == logging.ERROR
    assert target in broken[0].getMessage() and "'job'" in broken[0].getMessage()
    assert isinstance(router.match("other"), ExecHandler)


# --------------------------------------------------------------------------- lease-bound runs


@pytest.mark.parametrize(("script", "outcome", "calls"), [
    ("echo SCHED_DONE; exit 3", Outcome.SUCCESS, [("finish",)]),
    ("echo SCHED_FAIL; exit 0", Outcome.FAILED, [("retry", (), {})]),
    ("echo '  SCHED_DONE  '; exit 1", Outcome.SUCCESS, [("finish",)]),
    ("echo SCHED_FAIL; echo ok", Outcome.SUCCESS, [("finish",)]),  # only the last line
    ("echo SCHED_DONE_NOT; exit 2", Outcome.FAILED, [("retry", (), {})]),
])
def test_exec_last_line_outranks_exit_status(script: str, outcome: Outcome,
                                             calls: list[Any]) -> None:
    task = FakeTask()
    assert run(task, sh(script)).outcome == outcome
    assert task.calls == calls


@pytest.mark.parametrize("reason", [base.StopReason.PREEMPTED, base.StopReason.FENCED])
def test_exec_lease_lost_stops_group_and_writes_nothing(tmp_path: Path,
                                                        reason: base.StopReason) -> None:
    out = tmp_path / "pids"
    control = base.RunControl()
    threading.Timer(0.3, control.stop, args=(reason,)).start()
    task = FakeTask()
    result = run(task, sh(f"sleep 60 & echo $! >> {out}; wait"), stop_event=control)
    assert result.outcome == Outcome.PREEMPTED
    assert task.calls == []  # the lease is not ours: no finish, retry or release
    assert all(gone(p) for p in pids(out))


def test_exec_fences_itself_at_fence_at(tmp_path: Path) -> None:
    control = base.RunControl(fence_at=time.time() + 0.3, fence_grace=0.2)
    task = FakeTask()
    # TERM is ignored: KILL comes after fence_grace, not after kill_grace (5 s here).
    result = run(task, sh("trap '' TERM; sleep 60 & wait; sleep 60"), stop_event=control,
                 kill_grace=5.0)
    assert result.outcome == Outcome.PREEMPTED
    assert control.reason is base.StopReason.FENCED
    assert result.duration < 2.0


@pytest.mark.skipif(os.geteuid() != 0, reason="running a job as another user needs root")
def test_exec_as_another_user_gets_its_identity_stdin_and_output(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # The run-as path (no vfork: Popen changes user and groups in a forked child) with
    # the pipes _spawn makes: the payload arrives, the output is logged and kept.
    caplog.set_level(logging.INFO, LOGGER)
    user = pwd.getpwnam("nobody")
    argv = ("/bin/sh", "-c", 'read -r data; echo "$(id -u) $(id -g) $USER $data"; '
            'echo "$HOME $LOGNAME $SHELL"', "sh")
    handler = ExecHandler(RouteConfig(pattern="t", exec=argv, user="nobody",
                                      append_key=False), argv, None)
    result = run(FakeTask(key="k-user", data={"n": 7}), handler)
    assert result.outcome == Outcome.SUCCESS
    line = f'{user.pw_uid} {user.pw_gid} nobody {{"n": 7}}'
    assert f"k-user: {line}" in caplog.text
    assert result.output is not None and line in result.output
    assert f"k-user: {user.pw_dir} nobody {user.pw_shell}" in caplog.text


def test_exec_run_id_is_in_the_environment(tmp_path: Path) -> None:
    out = tmp_path / "env"
    spawned: list[int] = []
    task = FakeTask()
    run(task, sh(f'echo "$PERFECTSCHED_RUN_ID $$" > {out}'), run_id="123.4.5",
        on_spawn=spawned.append)
    run_id, pid = out.read_text().split()
    assert run_id == "123.4.5" and spawned == [int(pid)]


class KillRecorder(Application):
    killed: list[str] = []

    def run(self) -> None:
        while True:
            time.sleep(0.01)

    def kill(self) -> None:
        KillRecorder.killed.append(self.task.key)


@pytest.mark.parametrize("how", ["timeout", "stop", "preempted"])
def test_python_kill_is_called_when_the_run_is_stopped(how: str) -> None:
    KillRecorder.killed = []
    control = base.RunControl()
    if how == "stop":
        threading.Timer(0.2, control.stop, args=(base.StopReason.SHUTDOWN,)).start()
    elif how == "preempted":
        threading.Timer(0.2, control.stop, args=(base.StopReason.PREEMPTED,)).start()
    task = FakeTask(key=f"k-{how}")
    result = run(task, py(KillRecorder, timeout=0.2 if how == "timeout" else None),
                 stop_event=control)
    expected = {"timeout": Outcome.TIMEOUT, "stop": Outcome.STOPPED,
                "preempted": Outcome.PREEMPTED}[how]
    assert result.outcome == expected
    wait = time.monotonic() + 2
    while not KillRecorder.killed and time.monotonic() < wait:
        time.sleep(0.01)
    assert KillRecorder.killed == [f"k-{how}"]
    assert task.calls == {"timeout": [("retry", (), {})], "stop": [("release",)],
                          "preempted": []}[how]
