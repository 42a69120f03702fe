"""The exec executor (command.py): a command per run in its own process group, its
outcome by its last line or exit status (and the task the worker then ends by it),
timeouts, kills, stops and lost leases."""

from __future__ import annotations

import json
import logging
import os
import pwd
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from executor_harness import LOGGER, FakeTask, gone, pids, run, sh

from perfectschedd.executors import base, command
from perfectschedd.executors.command import ExecHandler
from perfectschedd.executors.router import run_task
from perfectschedd.settings.routes import RouteConfig
from perfectschedd.vocabulary.outcomes import Outcome

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
