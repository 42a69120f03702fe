"""The exec executor: a command per run, in its own session (process group).

The task's data goes to the command's standard input as JSON; its output is logged line
by line, each prefixed by the task key, up to ``log_output_limit`` bytes a run (then one
line says how much was not logged), and its last stdout line or else its exit status is
the run's outcome (:func:`exec_verdict`: ``SCHED_LATER N``, ``SCHED_DONE``,
``SCHED_FAIL``), by which the worker ends the task.
The tail of its stdout and stderr together (``output_limit`` bytes, a ring) and its last
non-empty line go into the run's history row (RunResult.output, .error).
On timeout, or when the caller's ``RunControl`` says stop (daemon stopping, lease lost,
lease not renewable in time), the whole group gets SIGTERM, then SIGKILL after
``kill_grace``.  Each live group is recorded in a module registry so that
:func:`kill_all_groups` can leave no orphans behind when the worker exits.  Every
process of a run carries ``PERFECTSCHED_RUN_ID`` (:data:`RUN_ID_ENV`) in its
environment, so that descendants that left the group can still be found (reaper.py)
once the run, or its worker, is gone.  A command starts from cron's environment
(runas.job_environment: HOME, LOGNAME, USER, SHELL, PATH, LANG of its user), never the
daemon's, plus its route's or entry's ``env:`` and the run's ``PERFECTSCHED_*``.
"""

from __future__ import annotations

import json
import math
import os
import re
import select
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from perfectschedd.executors.base import (
    REASON_TEXT,
    Log,
    OutputTail,
    RunOptions,
    RunResult,
    Stop,
    TaskLike,
    error_line,
    status_text,
    stop_grace,
    stop_reason,
)
from perfectschedd.executors.runmarks import RUN_ID_ENV
from perfectschedd.executors.spawn import Child, spawn
from perfectschedd.settings import runas
from perfectschedd.settings.routes import RouteConfig
from perfectschedd.vocabulary.fields import schedule_key
from perfectschedd.vocabulary.outcomes import Outcome

__all__ = ["RUN_ID_ENV", "ExecHandler", "exec_error", "exec_verdict", "kill_all_groups",
           "running_groups"]

# A read chunk, and the longest line kept before it is logged in pieces.
_CHUNK = 65536
_MAX_LINE = 65536
# How often a waiting exec run looks at a stop_event.
_STOP_POLL = 0.1
# After the command exited and its group was killed, how long to keep reading
# pipes that a process outside the group (one that called setsid) still holds.
_DRAIN_AFTER_KILL = 1.0
_SCHED_LATER = re.compile(r"SCHED_LATER\s+(\d+(?:\.\d*)?|\.\d+)")
# The exec protocol's other last lines (Periodic's): they outrank the exit status.
_SCHED_DONE = "SCHED_DONE"
_SCHED_FAIL = "SCHED_FAIL"


@dataclass(frozen=True, slots=True)
class ExecHandler:
    route: RouteConfig
    argv: tuple[str, ...]
    timeout: float | None
    runs_commands: ClassVar[bool] = True  # the worker reports its process group

    def __str__(self) -> str:
        return f"exec {' '.join(self.argv)}"

    @classmethod
    def from_route(cls, route: RouteConfig) -> ExecHandler:
        assert route.exec is not None
        return cls(route, tuple(route.exec), route.timeout)

    def run(self, task: TaskLike, options: RunOptions) -> RunResult:
        return _run_exec(task, self, options.log, options.stop_event, options.kill_grace,
                         options.run_id, options.on_spawn, options.output_limit,
                         options.log_output_limit)


# pgid -> task key of every exec group alive in this process. An entry is
# removed before its leader is reaped, so a pgid here can never be reused.
_groups: dict[int, str] = {}
_groups_lock = threading.Lock()


def running_groups() -> dict[int, str]:
    """Process groups of running exec handlers: ``{pgid: task key}``."""
    with _groups_lock:
        return dict(_groups)


def kill_all_groups(sig: int = signal.SIGKILL) -> int:
    """Send ``sig`` to every running exec group; returns how many were signalled.

    For the worker's last moments (exit path, atexit): the runs themselves
    notice their command died and return, and their tasks end as usual if they still
    can.
    """
    count = 0
    with _groups_lock:
        for pgid in _groups:
            try:
                os.killpg(pgid, sig)
                count += 1
            except ProcessLookupError:
                pass
    return count


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


class _LogBudget:
    """What of a run's output goes to the daemon's log: its first `limit` bytes, stdout
    and stderr together, in whole lines; from the first line that does not fit on,
    nothing more (the log shows the output's beginning, history its end), only counted.
    A job printing without end must not fill the log's disk, nor its queue."""

    __slots__ = ("limit", "left", "cut_bytes", "cut_lines")

    def __init__(self, limit: int) -> None:
        self.limit = max(0, limit)
        self.left = self.limit
        self.cut_bytes = 0
        self.cut_lines = 0

    @property
    def spent(self) -> bool:
        return self.cut_lines > 0 or not self.left

    def take(self, size: int) -> bool:
        """Whether a line of `size` bytes is logged (else it is counted as cut)."""
        if not self.cut_lines and size <= self.left:
            self.left -= size
            return True
        self.cut(size, 1)
        return False

    def cut(self, size: int, lines: int) -> None:
        self.cut_bytes += size
        self.cut_lines += lines

    def report(self, log: Log, key: str) -> None:
        """The run's last output line in the log: what was not logged, if anything (and
        the log asked for some)."""
        if self.cut_lines and self.limit:
            log.warning("%s: %d bytes (%d lines) of output not logged (log_output_limit "
                        "%d); history keeps its tail", key, self.cut_bytes, self.cut_lines,
                        self.limit)


class _Lines:
    """Splits a pipe's bytes into lines and logs them (within the run's `budget`); keeps
    only the last one.  The bytes also go to `tail`, shared by stdout and stderr (the
    run's output as a terminal would have shown it, in the order the chunks came).  What
    is held stays bounded whatever the output: a partial line of at most _MAX_LINE bytes
    and the tail's ring."""

    __slots__ = ("emit", "key", "buf", "last", "tail", "budget")

    def __init__(self, emit: Any, key: str, tail: OutputTail, budget: _LogBudget) -> None:
        self.emit = emit
        self.key = key
        self.buf = b""
        self.last = ""  # last non-empty line (stdout: SCHED_LATER)
        self.tail = tail
        self.budget = budget

    def feed(self, chunk: bytes) -> None:
        self.tail.add(chunk)
        data = self.buf + chunk if self.buf else chunk
        if self.budget.spent:
            self._skip(data)
        else:
            *lines, self.buf = data.split(b"\n")
            for line in lines:
                self._line(line, len(line) + 1)
        while len(self.buf) > _MAX_LINE:  # a very long line is logged in pieces
            self._line(self.buf[:_MAX_LINE], _MAX_LINE)
            self.buf = self.buf[_MAX_LINE:]

    def close(self) -> None:
        if self.buf:
            self._line(self.buf, len(self.buf))
            self.buf = b""

    def _line(self, raw: bytes, size: int) -> None:
        text = raw.decode("utf-8", "replace").rstrip("\r")
        if text.strip():
            self.last = text
            if not text.startswith("SCHED_"):  # the protocol's words say nothing of why
                self.tail.last_line = text
        if self.budget.take(size):
            self.emit("%s: %s", self.key, text)

    def _skip(self, data: bytes) -> None:
        """Past the log's budget: count the whole lines of `data` as cut and keep what
        _line would have kept of them (the last lines), without splitting or decoding
        each: a flood costs a scan of its bytes, not an object per line."""
        end = data.rfind(b"\n")
        if end < 0:
            self.buf = data
            return
        self.budget.cut(end + 1, data.count(b"\n", 0, end + 1))
        self.buf = data[end + 1:]
        seen_last = False
        while True:  # the lines before `end`, the last first
            start = data.rfind(b"\n", 0, end) + 1
            if data[start:end].strip():
                text = data[start:end].decode("utf-8", "replace").rstrip("\r")
                if text.strip():
                    if not seen_last:
                        self.last = text
                        seen_last = True
                    if not text.startswith("SCHED_"):
                        self.tail.last_line = text
                        return
            if not start:
                return
            end = start - 1


# The base environment of jobs of the daemon's own user (no `user:`, or user: naming it),
# encoded once per process: a passwd lookup per run showed in a burst of short runs.
_own_env: dict[bytes, bytes] | None = None


def _encoded(env: dict[str, str]) -> dict[bytes, bytes]:
    return {os.fsencode(k): os.fsencode(v) for k, v in env.items()}


def _job_base(user: str | None) -> tuple[dict[bytes, bytes], dict[str, Any]]:
    """A run's environment before its PERFECTSCHED_* and `env:` (runas.job_environment:
    cron's, never the daemon's), and Popen's arguments to run it as `user`."""
    global _own_env
    if user is None and _own_env is not None:
        return _own_env.copy(), {}
    pw = runas.account(user)
    env = _encoded(runas.job_environment(pw))
    if user is None:
        _own_env = env.copy()
    return env, runas.as_user_args(pw)


def _exec_env(task: TaskLike, run_id: str | None, route: RouteConfig
              ) -> tuple[dict[bytes, bytes], dict[str, Any]]:
    """The run's environment and Popen's user arguments: the job user's base, the route's
    or entry's `env:`, then the run's PERFECTSCHED_* (which `env:` cannot replace:
    PERFECTSCHED_RUN_ID is how a run's processes are found, reaper.py)."""
    env, as_user = _job_base(route.user)
    for name, value in route.env:
        env[os.fsencode(name)] = os.fsencode(value)
    env[b"PERFECTSCHED_KEY"] = os.fsencode(task.key)
    env[b"PERFECTSCHED_SCHEDULE_KEY"] = os.fsencode(schedule_key(task.key))
    env[b"PERFECTSCHED_TYPE"] = os.fsencode(task.type)
    env[b"PERFECTSCHED_SCHEDULED_TIME"] = b"%d" % int(task.scheduled_time)
    env[b"PERFECTSCHED_ATTEMPT"] = b"%d" % int(task.attempt)
    if run_id is not None:
        env[RUN_ID_ENV.encode()] = run_id.encode()
    return env, as_user


def _later(line: str) -> float | None:
    m = _SCHED_LATER.fullmatch(line.strip())
    if m is None:
        return None
    text = m.group(1)
    return int(text) if text.isdigit() else float(text)


def _run_exec(task: TaskLike, handler: ExecHandler, log: Log, stop_event: Stop | None,
              kill_grace: float, run_id: str | None,
              on_spawn: Callable[[int], None] | None, output_limit: int,
              log_output_limit: int) -> RunResult:
    key = task.key
    route = handler.route
    argv = [*handler.argv, key] if route.append_key else list(handler.argv)
    try:
        payload = json.dumps(task.data).encode()
        env, as_user = _exec_env(task, run_id, route)
        proc, fds = _spawn(argv, env, as_user)
    except OSError as exc:
        log.error("%s: cannot run %s: %s", key, argv[0], exc.strerror or exc)
        return RunResult(Outcome.FAILED, 0.0,
                         error=error_line(f"cannot run {argv[0]}", exc.strerror or str(exc)))
    pgid = proc.pid  # a session leader leads its own process group
    with _groups_lock:
        _groups[pgid] = key
    completed = False
    tail = OutputTail(output_limit)
    try:
        if on_spawn is not None:
            on_spawn(pgid)
        why, last_line = _supervise(proc, fds, key, payload, handler.timeout, log,
                                    stop_event, kill_grace, tail,
                                    _LogBudget(log_output_limit))
        completed = True
    finally:
        if not completed:  # an error of our own: no orphan, no wait on a live command
            _signal_group(pgid, signal.SIGKILL)
        with _groups_lock:
            _groups.pop(pgid, None)
        code = proc.wait()  # the leader is a zombie by now (or dies of SIGKILL at once)
    output = tail.text()
    if why == "stop":
        reason = stop_reason(stop_event)
        error = error_line(f"stopped: {REASON_TEXT[reason]}", tail.last_line)
        if reason.gives_back:
            return RunResult(Outcome.STOPPED, 0.0, code, None, output, error)
        # Nothing to write: the lease is not ours.
        return RunResult(Outcome.PREEMPTED, 0.0, code, None, output, error)
    if why == "timeout":
        return RunResult(Outcome.TIMEOUT, 0.0, code, None, output, error_line(
            f"timed out after {handler.timeout:g} s", tail.last_line))
    outcome, wait = exec_verdict(key, last_line.strip(), code, log)
    return RunResult(outcome, 0.0, code, None, output,
                     exec_error(outcome, last_line.strip(), code, tail.last_line), wait)


def _spawn(argv: list[str], env: dict[bytes, bytes],
           as_user: dict[str, Any]) -> tuple[Child, tuple[int, int, int]]:
    """Start the command in a session of its own (spawn.py); returns it and our ends of
    its stdin, stdout and stderr pipes (raw descriptors, close-on-exec).

    The pipes are ours, not Popen's PIPE: Popen would wrap each end in a buffered file
    object, three objects per run that nothing here reads through.
    """
    fds: list[int] = []
    try:
        for _ in range(3):
            fds.extend(os.pipe())
        in_r, in_w, out_r, out_w, err_r, err_w = fds
        child = spawn(argv, env, in_r, out_w, err_w, as_user)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    for fd in (in_r, out_w, err_w):  # the command's ends: it has its own copies
        os.close(fd)
    return child, (in_w, out_r, err_r)


def exec_error(outcome: Outcome, last: str, code: int, last_line: str) -> str | None:
    """The error line of a command that ended by itself (exec_verdict's `outcome`): how it
    ended ("exit status 3", "killed by SIGKILL", SCHED_FAIL) and its last non-empty line
    of output that is not a SCHED_ word; None when it succeeded or asked to run later."""
    if outcome is not Outcome.FAILED:
        return None
    how = status_text(code)
    if last == _SCHED_FAIL:
        how = f"{_SCHED_FAIL} ({how})"
    return error_line(how, last_line)


def exec_verdict(key: str, last: str, code: int, log: Log) -> tuple[Outcome, float | None]:
    """The outcome of a command by its last stdout line, else by its exit status; and
    for LATER the seconds it asked for (the worker retries it after them: asked for, not
    a failure, max_attempts aside).

    An explicit line outranks the exit status: a command that says "again in N
    seconds" (or DONE, or FAIL) and then exits otherwise, as ``set -e`` scripts
    may, gets what it asked for.
    """
    if last == _SCHED_DONE:
        return Outcome.SUCCESS, None
    if last == _SCHED_FAIL:
        return Outcome.FAILED, None
    wait = _later(last) if last else None
    if wait is not None:
        return Outcome.LATER, wait
    if last.startswith("SCHED_LATER"):
        log.warning("%s: ignoring malformed %r (expected SCHED_LATER <seconds>)", key, last)
    if code == 0:
        return Outcome.SUCCESS, None
    return Outcome.FAILED, None


def _supervise(proc: Child, fds: tuple[int, int, int], key: str,
               payload: bytes, timeout: float | None, log: Log, stop_event: Stop | None,
               kill_grace: float, tail: OutputTail,
               budget: _LogBudget) -> tuple[str | None, str]:
    """Feed stdin, log output (within `budget`; and keep its `tail`), enforce
    timeout/stop; return (reason, last stdout line).  `fds`: our ends of the command's
    stdin, stdout and stderr (_spawn); all three are closed on return.

    Returns once the leader has exited (not reaped: its zombie keeps the pgid
    reserved, so signalling the group stays safe) and the pipes are drained.
    """
    in_fd, out_fd, err_fd = fds
    pgid = proc.pid
    start = time.monotonic()
    deadline = start + timeout if timeout is not None else None
    out = _Lines(log.info, key, tail, budget)
    err = _Lines(log.warning, key, tail, budget)
    # poll(2) itself, not a selectors object: a few wake-ups per run, and the wrapper's
    # per-call bookkeeping showed in a burst of short runs.
    poller = select.poll()
    readers: dict[int, _Lines] = {out_fd: out, err_fd: err}
    for fd in readers:  # blocking: read only once poll said so, by this thread alone
        poller.register(fd, select.POLLIN)
    pending = memoryview(payload)
    if len(payload) <= select.PIPE_BUF:
        # The common case, a small payload: the pipe is new and empty, so one write of
        # at most PIPE_BUF bytes cannot block (even a pipe cut to one page holds it),
        # and the run needs no POLLOUT turn of the loop.
        try:
            os.write(in_fd, payload)
        except OSError:  # EPIPE: the command is gone already (or closed its stdin)
            pass
        pending = pending[:0]
        os.close(in_fd)
        in_fd = -1
    else:
        os.set_blocking(in_fd, False)
        poller.register(in_fd, select.POLLOUT)
    try:
        pidfd: int | None = os.pidfd_open(proc.pid)
        poller.register(pidfd, select.POLLIN)
    except (AttributeError, OSError):  # no pidfd (old kernel): poll with waitid
        pidfd = None

    reason: str | None = None
    exited = False
    term_sent = False
    kill_at: float | None = None   # when SIGKILL is due after SIGTERM
    killed = False
    give_up: float | None = None   # stop reading pipes held outside the group

    def terminate(now: float, grace: float = kill_grace) -> None:
        nonlocal term_sent, kill_at
        _signal_group(pgid, signal.SIGTERM)
        term_sent = True
        kill_at = now + grace

    try:
        while readers or not exited:
            now = time.monotonic()
            if reason is None and not exited:
                if deadline is not None and now >= deadline:
                    reason = "timeout"
                    log.warning("%s: timed out after %gs; sending SIGTERM to process group %d",
                                key, timeout, pgid)
                    terminate(now)
                elif stop_event is not None and stop_event.is_set():
                    reason = "stop"
                    log.warning("%s: %s; sending SIGTERM to process group %d", key,
                                REASON_TEXT[stop_reason(stop_event)], pgid)
                    terminate(now, stop_grace(stop_event, kill_grace))
            if kill_at is not None and not killed and now >= kill_at:
                log.warning("%s: process group %d still running %gs after SIGTERM; "
                            "sending SIGKILL", key, pgid, kill_grace)
                _signal_group(pgid, signal.SIGKILL)
                killed = True
                give_up = now + _DRAIN_AFTER_KILL
            if exited and give_up is not None and now >= give_up:
                break
            waits = []
            if reason is None and not exited:
                if deadline is not None:
                    waits.append(deadline - now)
                if stop_event is not None:
                    waits.append(_STOP_POLL)
            if kill_at is not None and not killed:
                waits.append(kill_at - now)
            if give_up is not None:
                waits.append(give_up - now)
            if pidfd is None and not exited:
                waits.append(0.02)
            wait = math.ceil(max(0.0, min(waits)) * 1000) if waits else None
            for fd, _ in poller.poll(wait):
                if fd == pidfd:
                    poller.unregister(fd)
                    exited = True
                elif fd == in_fd:
                    try:
                        pending = pending[os.write(fd, pending):]
                    except BlockingIOError:
                        continue
                    except OSError:  # EPIPE: the command does not read its input
                        pending = pending[:0]
                    if not pending:
                        poller.unregister(fd)
                        os.close(fd)
                        in_fd = -1
                else:
                    chunk = os.read(fd, _CHUNK)
                    if chunk:
                        readers[fd].feed(chunk)
                    else:
                        poller.unregister(fd)
                        readers.pop(fd).close()
            if pidfd is None and not exited:
                exited = os.waitid(os.P_PID, proc.pid,
                                   os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
            if exited and not term_sent:
                # The command is done; what it left running in its group goes too.
                # Leftovers holding our pipes get SIGKILL after kill_grace.
                terminate(time.monotonic())
    finally:
        if pidfd is not None:
            os.close(pidfd)
        for fd in (in_fd, out_fd, err_fd):
            if fd >= 0:
                os.close(fd)
        for lines in readers.values():
            lines.close()
        budget.report(log, key)
    return reason, out.last


def _after_fork_in_child() -> None:
    """A forked child (a worker) runs none of its parent's groups."""
    global _groups_lock
    _groups.clear()
    _groups_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
