"""Route a task type to an exec or python handler; run it, time it out, kill it.

The worker asks a :class:`Router` for the handler of a task's type and calls
:func:`run_task`, which performs the task and ends it itself (``finish``,
``retry`` or ``release``) and returns a :class:`RunResult`.

* exec routes run a command per task in its own session (process group). On
  timeout, or when the caller's :class:`RunControl` says stop (daemon stopping,
  lease lost, lease not renewable in time), the whole group gets SIGTERM, then
  SIGKILL after ``kill_grace``. Each live group is recorded in a module registry
  so that :func:`kill_all_groups` can leave no orphans behind when the worker
  exits. Every process of a run carries ``PERFECTSCHED_RUN_ID`` in its
  environment, so that descendants that left the group can still be found
  (jobreaper.py) once the run, or its worker, is gone.
* exec routes with ``executor: systemd`` run each task as a transient systemd unit
  instead (:class:`UnitHandler`, unitjobs.py): systemd holds the processes (a cgroup),
  and the same stop reasons stop the unit.
* python routes run an :class:`Application` in the calling thread: no thread
  and no process per task. A timeout (or a stop) is delivered by one shared
  watchdog thread as an asynchronous exception (see :class:`_Watchdog`).

Starting and ending lines of a task are logged by the worker; this module logs
only the handler's own output and its failures, each prefixed by the task key.
"""

from __future__ import annotations

import ctypes
import errno
import heapq
import importlib
import itertools
import json
import logging
import math
import os
import pwd
import re
import select
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from perfectschedd.config import RouteConfig
from perfectschedd.errors import PreemptedError, ProcessStopError
from perfectschedd.executors.base import (
    REASON_TEXT,
    Log,
    Outcome,
    RunControl,
    RunResult,
    Stop,
    StopReason,
    TaskLike,
    stop_grace,
    stop_reason,
)

__all__ = [
    "RUN_ID_ENV",
    "Application",
    "ExecHandler",
    "Handler",
    "HandlerTimeout",
    "Outcome",
    "PythonHandler",
    "Router",
    "RunControl",
    "RunResult",
    "StopReason",
    "TaskLike",
    "UnitHandler",
    "kill_all_groups",
    "run_task",
    "running_groups",
]

logger = logging.getLogger(__name__)

# A read chunk, and the longest line kept before it is logged in pieces.
_CHUNK = 65536
_MAX_LINE = 65536
# How often a waiting exec run or the watchdog looks at a stop_event.
_STOP_POLL = 0.1
# After the command exited and its group was killed, how long to keep reading
# pipes that a process outside the group (one that called setsid) still holds.
_DRAIN_AFTER_KILL = 1.0
_SCHED_LATER = re.compile(r"SCHED_LATER\s+(\d+(?:\.\d*)?|\.\d+)")
# The exec protocol's other last lines (Periodic's): they outrank the exit status.
_SCHED_DONE = "SCHED_DONE"
_SCHED_FAIL = "SCHED_FAIL"
# In the environment of every process of an exec run: "<worker pid>.<run number>".
RUN_ID_ENV = "PERFECTSCHED_RUN_ID"
_ROUTE_CACHE_MAX = 4096


class HandlerTimeout(BaseException):  # noqa: N818 - named like the builtin TimeoutError
    """Raised inside a python handler when its route's timeout has passed.

    A BaseException (like KeyboardInterrupt) so that an application's
    ``except Exception:`` does not swallow it.
    """


class Application:
    """Base class of python handlers (``python: "module:Class"`` routes).

    ``run()`` does the work and ends the task with ``self.task.finish()``,
    ``self.task.retry(wait=None)`` or ``self.task.release()``. Returning
    without any of them finishes the task; an exception retries it.

    ``kill()`` is called from another thread when the run must stop (timeout,
    daemon stopping, lease lost), just before ``run()`` is interrupted: override
    it to stop what ``run()`` waits on (a subprocess, a socket).
    """

    def __init__(self, task: TaskLike) -> None:
        self.task = task

    def run(self) -> None:
        raise NotImplementedError(f"{type(self).__name__}.run() is not implemented")

    def kill(self) -> None:
        """Stop the work of ``run()``; the default does nothing."""


# --------------------------------------------------------------------------- handlers


@dataclass(frozen=True, slots=True)
class ExecHandler:
    route: RouteConfig
    argv: tuple[str, ...]
    timeout: float | None

    def __str__(self) -> str:
        return f"exec {' '.join(self.argv)}"


@dataclass(frozen=True, slots=True)
class UnitHandler(ExecHandler):
    """An exec route with `executor: systemd`: each run is a transient unit (unitjobs.py).
    An ExecHandler to whatever reads routes; runs check for it first."""

    def __str__(self) -> str:
        return f"systemd unit {' '.join(self.argv)}"


@dataclass(frozen=True, slots=True)
class PythonHandler:
    route: RouteConfig
    app_class: type[Any]
    timeout: float | None

    def __str__(self) -> str:
        return f"python {self.route.python}"


Handler = ExecHandler | UnitHandler | PythonHandler


class Router:
    """Maps task types to handlers: the first matching route wins.

    Python classes are imported on first use, once per route. A route whose
    class cannot be imported, or that this host refuses (RouteConfig.refused), is
    broken: ``match`` returns None for the types it would serve, and the problem is
    logged once per type.
    """

    def __init__(self, routes: tuple[RouteConfig, ...], *, log: Log | None = None) -> None:
        self.routes = tuple(routes)
        self._log = log or logger
        self._by_type: dict[str, Handler | None] = {}
        # Per route index: its handler, or the reason it is broken.
        self._resolved: dict[int, Handler | str] = {}
        self._lock = threading.Lock()

    def match(self, task_type: str) -> Handler | None:
        try:
            return self._by_type[task_type]
        except KeyError:
            pass
        with self._lock:
            if task_type in self._by_type:
                return self._by_type[task_type]
            handler = self._lookup(task_type)
            if len(self._by_type) >= _ROUTE_CACHE_MAX:
                self._by_type.clear()
            self._by_type[task_type] = handler
            return handler

    def preload(self) -> list[str]:
        """Import every python route now (a worker calls this at start), so the first
        task of a type does not pay for the import; returns the problems found."""
        problems = []
        with self._lock:
            for index, route in enumerate(self.routes):
                if index not in self._resolved:
                    self._resolved[index] = self._resolve(route)
                resolved = self._resolved[index]
                # A refused route was reported by the master, once for the host.
                if isinstance(resolved, str) and route.refused is None:
                    problems.append(f"route {route.pattern}: {resolved}")
        return problems

    def claimable(self) -> tuple[list[str], list[str]]:
        """The types this router runs, for the claim: exact names, and the regular
        expressions of /re/ routes; routes that cannot be imported are left out."""
        self.preload()
        exact: list[str] = []
        patterns: list[str] = []
        for index, route in enumerate(self.routes):
            if isinstance(self._resolved.get(index), str):
                continue
            if route.regexp is None:
                exact.append(route.pattern)
            else:
                patterns.append(route.pattern[1:-1])
        # First match wins: a name an earlier broken route takes is not runnable here.
        return [name for name in exact if self.match(name) is not None], patterns

    def _lookup(self, task_type: str) -> Handler | None:
        index = next((i for i, r in enumerate(self.routes) if r.matches(task_type)), None)
        if index is None:
            return None
        route = self.routes[index]
        resolved = self._resolved.get(index)
        if resolved is None:
            resolved = self._resolved[index] = self._resolve(route)
        if isinstance(resolved, str):
            self._log.error("route %s cannot run here, tasks of type %r are not run: %s",
                            route.pattern, task_type, resolved)
            return None
        return resolved

    @staticmethod
    def _resolve(route: RouteConfig) -> Handler | str:
        if route.refused is not None:
            return route.refused
        if route.exec is not None and route.executor == "systemd":
            return UnitHandler(route, tuple(route.exec), route.timeout)
        if route.exec is not None:
            return ExecHandler(route, tuple(route.exec), route.timeout)
        assert route.python is not None
        module_name, _, attr = route.python.partition(":")
        try:
            obj: Any = importlib.import_module(module_name)
            for part in attr.split("."):
                obj = getattr(obj, part)
        except Exception as exc:  # SyntaxError, ImportError, errors raised by the module
            return f"cannot import {route.python}: {type(exc).__name__}: {exc}"
        if not isinstance(obj, type) or not callable(getattr(obj, "run", None)):
            return f"{route.python} is not a class with a run() method (subclass Application)"
        return PythonHandler(route, obj, route.timeout)


# --------------------------------------------------------------------------- run_task


def run_task(task: TaskLike, handler: Handler, *, log: Log = logger,
             stop_event: Stop | None = None, kill_grace: float = 5.0,
             run_id: str | None = None,
             on_spawn: Callable[[int], None] | None = None,
             on_unit: Callable[[str], None] | None = None, node: str = "", tag: str = ""
             ) -> RunResult:
    """Run ``task`` with ``handler`` and end it; never raises for handler failures.

    ``stop_event`` means "end now" (a :class:`RunControl` says why). An exec
    command then gets SIGTERM, SIGKILL after ``kill_grace``; a python
    application gets its ``kill()`` called and ``ProcessStopError`` raised. On
    shutdown the task is given back (outcome ``stopped``); when the lease was
    lost or could not be renewed nothing is written (outcome ``preempted``):
    the occurrence belongs to whoever holds it next.

    ``run_id`` goes into the environment of exec commands (RUN_ID_ENV);
    ``on_spawn(pgid)`` is called once the command's process group exists.  A unit run
    calls ``on_unit(name)`` before its unit can exist; ``node`` names this host in the
    unit's Description (its owner: "worker NODE:PID"), and ``tag`` this daemon instance
    (unitprops.daemon_tag).

    Errors of the store other than ``PreemptedError`` (a database that is
    down) propagate to the caller.
    """
    start = time.monotonic()
    unit: str | None = None
    try:
        if stop_event is not None and stop_event.is_set():
            return RunResult(_stopped_before_start(task, stop_event, log),
                             time.monotonic() - start)
        if isinstance(handler, UnitHandler):
            from perfectschedd.executors.systemd import (
                unit as unitjobs,  # D-Bus: only where a route runs units
            )

            outcome, code, unit = unitjobs.run(task, handler, log, stop_event, kill_grace,
                                               node, on_unit, tag)
        elif isinstance(handler, ExecHandler):
            outcome, code = _run_exec(task, handler, log, stop_event, kill_grace, run_id,
                                      on_spawn)
        else:
            outcome, code = _run_python(task, handler, log, stop_event), None
    except PreemptedError:
        log.warning("%s: lease lost while running; the result was discarded", task.key)
        outcome, code = Outcome.PREEMPTED, None
    return RunResult(outcome, time.monotonic() - start, code, unit)


def _stopped_before_start(task: TaskLike, stop: Stop, log: Log) -> Outcome:
    reason = stop_reason(stop)
    if reason is StopReason.SHUTDOWN:
        task.give_back()
        return Outcome.STOPPED
    log.warning("%s: not started: %s", task.key, REASON_TEXT[reason])
    return Outcome.PREEMPTED


# --------------------------------------------------------------------------- exec

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
    notice their command died and end their tasks as usual if they still can.
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


class _Lines:
    """Splits a pipe's bytes into lines and logs them; keeps only the last one."""

    __slots__ = ("emit", "key", "buf", "last")

    def __init__(self, emit: Any, key: str) -> None:
        self.emit = emit
        self.key = key
        self.buf = b""
        self.last = ""  # last non-empty line (stdout: SCHED_LATER)

    def feed(self, chunk: bytes) -> None:
        data = self.buf + chunk if self.buf else chunk
        *lines, self.buf = data.split(b"\n")
        for line in lines:
            self._line(line)
        while len(self.buf) > _MAX_LINE:  # a very long line is logged in pieces
            self._line(self.buf[:_MAX_LINE])
            self.buf = self.buf[_MAX_LINE:]

    def close(self) -> None:
        if self.buf:
            self._line(self.buf)
            self.buf = b""

    def _line(self, raw: bytes) -> None:
        text = raw.decode("utf-8", "replace").rstrip("\r")
        if text.strip():
            self.last = text
        self.emit("%s: %s", self.key, text)


_NOT_INHERITED = (b"PROMETHEUS_MULTIPROC_DIR", RUN_ID_ENV.encode())


def _exec_env(task: TaskLike, run_id: str | None) -> dict[bytes, bytes]:
    # os.environ's own bytes-to-bytes dict, copied in C: dict(os.environ) decodes every
    # variable and Popen encodes it again, a tenth of an exec run's CPU in the worker.
    env: dict[bytes, bytes] = os.environ._data.copy()  # type: ignore[attr-defined]
    # The daemon's own metric files (metrics.py): a job using prometheus_client must not
    # write into them; and a job run by a job is not that job's run.
    for name in _NOT_INHERITED:
        env.pop(name, None)
    env[b"PERFECTSCHED_KEY"] = os.fsencode(task.key)
    env[b"PERFECTSCHED_TYPE"] = os.fsencode(task.type)
    env[b"PERFECTSCHED_SCHEDULED_TIME"] = b"%d" % int(task.scheduled_time)
    env[b"PERFECTSCHED_ATTEMPT"] = b"%d" % int(task.attempt)
    if run_id is not None:
        env[RUN_ID_ENV.encode()] = run_id.encode()
    return env


def _as_user(name: str, env: dict[bytes, bytes]) -> dict[str, Any]:
    """Popen's arguments to run a job as user `name` (a schedules file's `user:`), as
    cron does: its uid, primary and supplementary groups, HOME/USER/LOGNAME, and its home
    as working directory.  Nothing when the daemon already runs as that user."""
    try:
        pw = pwd.getpwnam(name)
    except KeyError:  # removed since the file was read: this run fails, logged
        raise OSError(errno.ESRCH, f"no such user {name!r}") from None
    if pw.pw_uid == os.geteuid():
        return {}
    env[b"HOME"] = os.fsencode(pw.pw_dir)
    env[b"USER"] = env[b"LOGNAME"] = os.fsencode(pw.pw_name)
    return {"user": pw.pw_uid, "group": pw.pw_gid,
            "extra_groups": os.getgrouplist(pw.pw_name, pw.pw_gid),
            "cwd": pw.pw_dir if os.path.isdir(pw.pw_dir) else "/"}


def _later(line: str) -> float | None:
    m = _SCHED_LATER.fullmatch(line.strip())
    if m is None:
        return None
    text = m.group(1)
    return int(text) if text.isdigit() else float(text)


def _run_exec(task: TaskLike, handler: ExecHandler, log: Log, stop_event: Stop | None,
              kill_grace: float, run_id: str | None,
              on_spawn: Callable[[int], None] | None) -> tuple[Outcome, int | None]:
    key = task.key
    route = handler.route
    argv = [*handler.argv, key] if route.append_key else list(handler.argv)
    try:
        payload = json.dumps(task.data).encode()
        env = _exec_env(task, run_id)
        for name, value in route.env:
            env[os.fsencode(name)] = os.fsencode(value)
        as_user = _as_user(route.user, env) if route.user is not None else {}
        proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=env, start_new_session=True, close_fds=True, **as_user,
        )
    except OSError as exc:
        log.error("%s: cannot run %s: %s", key, argv[0], exc.strerror or exc)
        task.retry()
        return Outcome.FAILED, None
    pgid = proc.pid  # a session leader leads its own process group
    with _groups_lock:
        _groups[pgid] = key
    completed = False
    try:
        if on_spawn is not None:
            on_spawn(pgid)
        why, last_line = _supervise(proc, key, payload, handler.timeout, log, stop_event,
                                    kill_grace)
        completed = True
    finally:
        if not completed:  # an error of our own: no orphan, no wait on a live command
            _signal_group(pgid, signal.SIGKILL)
        with _groups_lock:
            _groups.pop(pgid, None)
        code = proc.wait()  # the leader is a zombie by now (or dies of SIGKILL at once)
    if why == "stop":
        reason = stop_reason(stop_event)
        if reason is StopReason.SHUTDOWN:
            task.give_back()
            return Outcome.STOPPED, code
        return Outcome.PREEMPTED, code  # nothing to write: the lease is not ours
    if why == "timeout":
        task.retry()
        return Outcome.TIMEOUT, code
    return exec_verdict(task, last_line.strip(), code, log), code


def exec_verdict(task: TaskLike, last: str, code: int, log: Log) -> Outcome:
    """End the task by the command's last stdout line, else by its exit status.

    An explicit line outranks the exit status: a command that says "again in N
    seconds" (or DONE, or FAIL) and then exits otherwise, as ``set -e`` scripts
    may, gets what it asked for.
    """
    if last == _SCHED_DONE:
        task.finish()
        return Outcome.SUCCESS
    if last == _SCHED_FAIL:
        task.retry()
        return Outcome.FAILED
    wait = _later(last) if last else None
    if wait is not None:
        task.retry(wait=wait, later=True)  # asked for, not a failure: max_attempts aside
        return Outcome.LATER
    if last.startswith("SCHED_LATER"):
        log.warning("%s: ignoring malformed %r (expected SCHED_LATER <seconds>)", task.key, last)
    if code == 0:
        task.finish()
        return Outcome.SUCCESS
    task.retry()
    return Outcome.FAILED


def _supervise(proc: subprocess.Popen[bytes], key: str, payload: bytes, timeout: float | None,
               log: Log, stop_event: Stop | None,
               kill_grace: float) -> tuple[str | None, str]:
    """Feed stdin, log output, enforce timeout/stop; return (reason, last stdout line).

    Returns once the leader has exited (not reaped: its zombie keeps the pgid
    reserved, so signalling the group stays safe) and the pipes are drained.
    """
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    pgid = proc.pid
    start = time.monotonic()
    deadline = start + timeout if timeout is not None else None
    out = _Lines(log.info, key)
    err = _Lines(log.warning, key)
    # poll(2) itself, not a selectors object: a few wake-ups per run, and the wrapper's
    # per-call bookkeeping showed in a burst of short runs.
    poller = select.poll()
    readers: dict[int, _Lines] = {proc.stdout.fileno(): out, proc.stderr.fileno(): err}
    for fd in readers:
        os.set_blocking(fd, False)
        poller.register(fd, select.POLLIN)
    in_fd = proc.stdin.fileno()
    os.set_blocking(in_fd, False)
    poller.register(in_fd, select.POLLOUT)
    pending = memoryview(payload)
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
                        proc.stdin.close()
                else:
                    try:
                        chunk = os.read(fd, _CHUNK)
                    except BlockingIOError:
                        continue
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
        for f in (proc.stdin, proc.stdout, proc.stderr):
            try:
                f.close()
            except OSError:
                pass
        for lines in readers.values():
            lines.close()
    return reason, out.last


# --------------------------------------------------------------------------- python


def _raise_in_thread(thread_id: int, exc: type[BaseException] | None) -> None:
    """Make ``thread_id`` raise ``exc`` at its next bytecode; None clears a pending one."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), None if exc is None else ctypes.py_object(exc))


class _Watch:
    """One armed python run: its thread, deadline, stop event and kill() callback."""

    __slots__ = ("thread_id", "deadline", "stop_event", "fired", "suspended", "done", "on_kill")

    def __init__(self, thread_id: int, deadline: float | None, stop_event: Stop | None) -> None:
        self.thread_id = thread_id
        self.deadline = deadline
        self.stop_event = stop_event
        self.on_kill: Callable[[], None] | None = None
        self.fired: type[BaseException] | None = None
        self.suspended = False
        self.done = False


class _Watchdog:
    """One thread per process interrupting python runs past their deadline.

    A thread cannot be killed. PyThreadState_SetAsyncExc makes the target
    thread raise an exception the next time it executes Python bytecode: a
    handler stuck in a blocking C call (a socket read without timeout, a
    long C computation, time.sleep) is only interrupted once that call
    returns. Handlers should use timeouts on their own I/O.

    The exception is never raised while the run talks to the store (see
    ``_ObservedTask``), so a finish() is not cut in half. Each watch fires at
    most once.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._heap: list[tuple[float, int, _Watch]] = []
        self._stoppable: set[_Watch] = set()
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        self._wake_at: float | None = None  # None: sleeping without a timeout
        self._stale = 0  # heap entries of watches already disarmed

    def arm(self, deadline: float | None, stop_event: Stop | None) -> _Watch:
        watch = _Watch(threading.get_ident(), deadline, stop_event)
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="perfectsched-watchdog",
                                                daemon=True)
                self._thread.start()
            notify = False
            if deadline is not None:
                heapq.heappush(self._heap, (deadline, next(self._seq), watch))
                notify = self._wake_at is None or deadline < self._wake_at
            if stop_event is not None:
                self._stoppable.add(watch)
                notify = notify or self._wake_at is None or (
                    self._wake_at > time.monotonic() + _STOP_POLL)
            if notify:
                self._cond.notify()
        return watch

    def disarm(self, watch: _Watch) -> None:
        """Called by the watched thread; clears an exception not yet raised."""
        with self._cond:
            watch.done = True
            self._stoppable.discard(watch)
            if watch.fired is not None:
                _raise_in_thread(watch.thread_id, None)
            elif watch.deadline is not None:
                # Long timeouts and many short runs: drop dead entries now and then.
                self._stale += 1
                if self._stale > 1024 and self._stale * 2 > len(self._heap):
                    self._heap = [e for e in self._heap if not e[2].done and e[2].fired is None]
                    heapq.heapify(self._heap)
                    self._stale = 0

    @contextmanager
    def suspended(self, watch: _Watch) -> Iterator[None]:
        """No exception is raised in the watched thread inside this block."""
        with self._cond:
            watch.suspended = True
            if watch.fired is not None:  # fired but maybe not raised yet: let the call run
                _raise_in_thread(watch.thread_id, None)
        try:
            yield
        finally:
            # No notify: a watch that came due while suspended keeps the loop polling
            # every 10 ms (retry_soon), and a wake-up per finish() cost every task a
            # turn of the watchdog thread.
            with self._cond:
                watch.suspended = False

    def _fire(self, watch: _Watch, exc: type[BaseException]) -> None:
        watch.fired = exc
        self._stoppable.discard(watch)
        if watch.on_kill is not None:
            # Its own thread: an application's kill() must not hold up this loop (and
            # the other runs' deadlines) while it waits for whatever it stops.
            threading.Thread(target=_call_kill, args=(watch.on_kill,),
                             name="perfectsched-kill", daemon=True).start()
        _raise_in_thread(watch.thread_id, exc)

    def _loop(self) -> None:
        with self._cond:
            while True:
                now = time.monotonic()
                retry_soon = False
                while self._heap and self._heap[0][0] <= now:
                    watch = self._heap[0][2]
                    if watch.done or watch.fired is not None:
                        heapq.heappop(self._heap)
                        self._stale = max(0, self._stale - 1)
                    elif watch.suspended:
                        retry_soon = True
                        break
                    else:
                        heapq.heappop(self._heap)
                        self._fire(watch, HandlerTimeout)
                for watch in list(self._stoppable):
                    if watch.stop_event is not None and watch.stop_event.is_set():
                        if watch.suspended:
                            retry_soon = True
                        else:
                            self._fire(watch, ProcessStopError)
                wake: float | None = None
                if self._heap:
                    wake = self._heap[0][0]
                if retry_soon:
                    wake = now + 0.01
                elif self._stoppable:
                    wake = min(wake, now + _STOP_POLL) if wake is not None else now + _STOP_POLL
                self._wake_at = wake
                self._cond.wait(None if wake is None else max(0.0, wake - now))


def _call_kill(kill: Callable[[], None]) -> None:
    try:
        kill()
    except Exception:  # noqa: BLE001 - an application's kill() must not end the watchdog
        logger.exception("kill() of a python handler raised")


_watchdog = _Watchdog()


def _after_fork_in_child() -> None:
    global _watchdog, _groups_lock
    _watchdog = _Watchdog()
    _groups.clear()
    _groups_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


class _ObservedTask:
    """The task as an Application sees it: records how the run ended it.

    Attribute reads go to the real task. Store calls run with the watchdog
    suspended, so a timeout never interrupts a half-done finish().
    """

    __slots__ = ("_task", "_watch", "action", "wait")

    def __init__(self, task: TaskLike, watch: _Watch | None) -> None:
        self._task = task
        self._watch = watch
        self.action: str | None = None
        self.wait: float | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._task, name)

    def __repr__(self) -> str:
        return f"<task {self._task.key!r} via {type(self).__name__}>"

    @contextmanager
    def _store_call(self) -> Iterator[None]:
        if self._watch is None:
            yield
        else:
            with _watchdog.suspended(self._watch):
                yield

    def finish(self) -> None:
        with self._store_call():
            self._task.finish()
            self.action = "finish"

    def retry(self, wait: float | None = None) -> None:
        with self._store_call():
            if wait is None:
                self._task.retry()
            else:
                self._task.retry(wait=wait)
            self.action, self.wait = "retry", wait

    def release(self) -> None:
        with self._store_call():
            self._task.release()
            self.action = "release"


_ACTION_OUTCOME = {"finish": Outcome.SUCCESS, "release": Outcome.RELEASED}


def _run_python(task: TaskLike, handler: PythonHandler, log: Log,
                stop_event: Stop | None) -> Outcome:
    timeout = handler.timeout
    watch = None
    if timeout is not None or stop_event is not None:
        deadline = time.monotonic() + timeout if timeout is not None else None
        watch = _watchdog.arm(deadline, stop_event)
    observed = _ObservedTask(task, watch)
    error: BaseException | None = None
    try:
        try:
            app = handler.app_class(observed)
            kill = getattr(app, "kill", None)
            if watch is not None and callable(kill) and \
                    getattr(kill, "__func__", None) is not Application.kill:
                watch.on_kill = kill
            app.run()
        except BaseException as exc:  # includes HandlerTimeout
            error = exc
        finally:
            if watch is not None:
                _watchdog.disarm(watch)
    except (HandlerTimeout, ProcessStopError) as late:  # fired just as run() returned
        error = error or late
    fired = watch.fired if watch is not None else None

    if observed.action is not None:
        if error is not None and not isinstance(error, HandlerTimeout | ProcessStopError):
            log.error("%s: %s raised after ending the task", task.key, handler.route.python,
                      exc_info=error)
        if observed.action == "retry":
            return Outcome.LATER if observed.wait is not None else Outcome.FAILED
        return _ACTION_OUTCOME[observed.action]
    if isinstance(error, PreemptedError):
        raise error
    if isinstance(error, ProcessStopError) or fired is ProcessStopError:
        reason = stop_reason(stop_event)
        log.warning("%s: %s; %s interrupted", task.key, REASON_TEXT[reason],
                    handler.route.python)
        if reason is not StopReason.SHUTDOWN:
            return Outcome.PREEMPTED  # the lease is not ours to write
        task.give_back()
        return Outcome.STOPPED
    if isinstance(error, HandlerTimeout) or fired is HandlerTimeout:
        log.warning("%s: %s timed out after %gs; interrupted", task.key, handler.route.python,
                    timeout)
        task.retry()
        return Outcome.TIMEOUT
    if isinstance(error, KeyboardInterrupt):
        task.give_back()
        raise error
    if error is not None:
        log.error("%s: %s failed", task.key, handler.route.python, exc_info=error)
        task.retry()
        return Outcome.FAILED
    if not task.done:  # a run that ended the task behind our back keeps its word
        task.finish()
    return Outcome.SUCCESS
