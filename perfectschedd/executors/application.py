"""The python executor: python routes (``python: "module:Class"``) run an
:class:`Application` in the calling thread, with no thread and no process per task.

A timeout (or a stop: daemon stopping, lease lost) is delivered by one shared watchdog
thread as an asynchronous exception (see :class:`_Watchdog`), after the application's
``kill()`` was called.  The application's ``finish()``, ``retry()`` and ``release()``
only say how the run ended (:class:`_ObservedTask`); the worker writes it once the run
returned (worker/ending.py), so no interruption can cut a write in half.

A run that raised leaves in its history row the exception ("ExcType: message") and the
tail of its traceback (``output_limit`` bytes); what the application prints is not
captured (it runs in the worker, beside other runs: its output is the daemon's).
"""

from __future__ import annotations

import ctypes
import heapq
import importlib
import itertools
import logging
import os
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from perfectschedd.errors import AlreadyFinishedError, PreemptedError, ProcessStopError
from perfectschedd.executors.base import (
    REASON_TEXT,
    Log,
    RunOptions,
    RunResult,
    Stop,
    TaskLike,
    error_line,
    output_tail,
    stop_reason,
)
from perfectschedd.settings.routes import RouteConfig
from perfectschedd.vocabulary.outcomes import Outcome

__all__ = ["Application", "HandlerTimeout", "PythonHandler"]

logger = logging.getLogger(__name__)

# How often the watchdog looks at the stop_events of the runs it watches.
_STOP_POLL = 0.1


class HandlerTimeout(BaseException):  # noqa: N818 - named like the builtin TimeoutError
    """Raised inside a python handler when its route's timeout has passed.

    A BaseException (like KeyboardInterrupt) so that an application's
    ``except Exception:`` does not swallow it.
    """


class Application:
    """Base class of python handlers (``python: "module:Class"`` routes).

    ``run()`` does the work and ends the task with ``self.task.finish()``,
    ``self.task.retry(wait=None)`` or ``self.task.release()`` (written by the worker
    once ``run()`` returned). Returning without any of them finishes the task; an
    exception retries it.

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


@dataclass(frozen=True, slots=True)
class PythonHandler:
    route: RouteConfig
    app_class: type[Any]
    timeout: float | None
    runs_commands: ClassVar[bool] = False  # it runs in the worker's own thread

    def __str__(self) -> str:
        return f"python {self.route.python}"

    @classmethod
    def from_route(cls, route: RouteConfig) -> PythonHandler | str:
        """Imports the route's class (the router does so once per route)."""
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
        return cls(route, obj, route.timeout)

    def run(self, task: TaskLike, options: RunOptions) -> RunResult:
        return _run_python(task, self, options.log, options.stop_event, options.output_limit)


def _raise_in_thread(thread_id: int, exc: type[BaseException] | None) -> None:
    """Make ``thread_id`` raise ``exc`` at its next bytecode; None clears a pending one."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), None if exc is None else ctypes.py_object(exc))


class _Watch:
    """One armed python run: its thread, deadline, stop event and kill() callback."""

    __slots__ = ("thread_id", "deadline", "stop_event", "fired", "done", "on_kill")

    def __init__(self, thread_id: int, deadline: float | None, stop_event: Stop | None) -> None:
        self.thread_id = thread_id
        self.deadline = deadline
        self.stop_event = stop_event
        self.on_kill: Callable[[], None] | None = None
        self.fired: type[BaseException] | None = None
        self.done = False


class _Watchdog:
    """One thread per process interrupting python runs past their deadline.

    A thread cannot be killed. PyThreadState_SetAsyncExc makes the target
    thread raise an exception the next time it executes Python bytecode: a
    handler stuck in a blocking C call (a socket read without timeout, a
    long C computation, time.sleep) is only interrupted once that call
    returns. Handlers should use timeouts on their own I/O.

    The run does not write its end (``_ObservedTask`` records it; the worker writes it
    after the run), so no write can be cut in half. Each watch fires at most once.
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
                while self._heap and self._heap[0][0] <= now:
                    watch = heapq.heappop(self._heap)[2]
                    if watch.done or watch.fired is not None:
                        self._stale = max(0, self._stale - 1)
                    else:
                        self._fire(watch, HandlerTimeout)
                for watch in list(self._stoppable):
                    if watch.stop_event is not None and watch.stop_event.is_set():
                        self._fire(watch, ProcessStopError)
                wake: float | None = None
                if self._heap:
                    wake = self._heap[0][0]
                if self._stoppable:
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
    """A forked child (a worker) has no watchdog thread: it makes its own on first use."""
    global _watchdog
    _watchdog = _Watchdog()


os.register_at_fork(after_in_child=_after_fork_in_child)


class _ObservedTask:
    """The task as an Application sees it: ``finish()``, ``retry()`` and ``release()``
    record how the run ended it (``ended``: the outcome, and the wait of a LATER), which
    the executor returns and the worker writes once ``run()`` returned.  Attribute reads
    (and the task's other methods) go to the real task.

    One assignment records an end, so the watchdog's exception cannot leave half of
    one behind.  A second end raises AlreadyFinishedError, as the task itself would.
    """

    __slots__ = ("_task", "ended")

    def __init__(self, task: TaskLike) -> None:
        self._task = task
        self.ended: tuple[Outcome, float | None] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._task, name)

    def __repr__(self) -> str:
        return f"<task {self._task.key!r} via {type(self).__name__}>"

    @property
    def done(self) -> bool:
        return self.ended is not None or self._task.done

    def _end(self, outcome: Outcome, wait: float | None = None) -> None:
        if self.done:
            raise AlreadyFinishedError(f"task {self._task.key!r} was already finished")
        self.ended = (outcome, wait)

    def finish(self) -> None:
        self._end(Outcome.SUCCESS)

    def retry(self, wait: float | None = None) -> None:
        if wait is None:
            self._end(Outcome.FAILED)
        else:  # SCHED_LATER's equivalent: not a failure (max_attempts aside)
            self._end(Outcome.LATER, wait)

    def release(self) -> None:
        self._end(Outcome.RELEASED)


def exception_line(exc: BaseException) -> str:
    """"ExcType: message" (the first line of the message), as a history row's error."""
    name = type(exc).__qualname__
    try:
        message = str(exc).strip().splitlines()
    except Exception:  # noqa: BLE001 - an exception whose str() raises: its name will do
        message = []
    return error_line(f"{name}: {message[0]}" if message else name)


def traceback_tail(exc: BaseException, limit: int) -> str | None:
    """The end of the traceback of `exc` (where it was raised, and the exception), at most
    `limit` bytes; None when limit is 0."""
    if limit <= 0:
        return None
    try:
        text = "".join(traceback.format_exception(exc))
    except Exception:  # noqa: BLE001 - an exception whose str() raises
        text = f"{type(exc).__qualname__} (its message could not be read)\n"
    data = text.encode("utf-8", "replace")
    return output_tail(data, len(data), limit)


def _run_python(task: TaskLike, handler: PythonHandler, log: Log, stop_event: Stop | None,
                output_limit: int = 0) -> RunResult:
    """Run the application; the outcome, and what went wrong: the error line and the
    traceback's tail (for a timeout or a stop, where run() was interrupted)."""
    caught: list[BaseException] = []
    outcome, wait, already_ended = _run_application(task, handler, log, stop_event, caught)
    if outcome in (Outcome.SUCCESS, Outcome.RELEASED, Outcome.LATER):
        return RunResult(outcome, 0.0, retry_wait=wait, already_ended=already_ended)
    error = caught[0] if caught else None
    output = traceback_tail(error, output_limit) if error is not None else None
    if outcome is Outcome.TIMEOUT:
        line = error_line(f"timed out after {handler.timeout:g} s")
    elif outcome in (Outcome.PREEMPTED, Outcome.STOPPED):
        line = error_line(f"stopped: {REASON_TEXT[stop_reason(stop_event)]}")
    elif error is None:
        line = error_line(f"{handler.route.python} called retry()")
    else:
        line = exception_line(error)
    return RunResult(outcome, 0.0, output=output, error=line)


def _run_application(task: TaskLike, handler: PythonHandler, log: Log,
                     stop_event: Stop | None, caught: list[BaseException]
                     ) -> tuple[Outcome, float | None, bool]:
    """Run the application: its outcome, the wait of a LATER, and whether it ended the
    task itself (through the task's own methods); what run() raised (an application's
    exception, or the watchdog's) is appended to `caught`."""
    timeout = handler.timeout
    watch = None
    if timeout is not None or stop_event is not None:
        deadline = time.monotonic() + timeout if timeout is not None else None
        watch = _watchdog.arm(deadline, stop_event)
    observed = _ObservedTask(task)
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
    if error is not None:
        caught.append(error)

    if observed.ended is not None:
        if error is not None and not isinstance(error, HandlerTimeout | ProcessStopError):
            log.error("%s: %s raised after ending the task", task.key, handler.route.python,
                      exc_info=error)
        outcome, wait = observed.ended
        return outcome, wait, False
    if isinstance(error, PreemptedError):
        raise error
    if isinstance(error, ProcessStopError) or fired is ProcessStopError:
        reason = stop_reason(stop_event)
        log.warning("%s: %s; %s interrupted", task.key, REASON_TEXT[reason],
                    handler.route.python)
        # Given back; or, the lease not ours, nothing is written.
        return (Outcome.STOPPED if reason.gives_back else Outcome.PREEMPTED), None, False
    if isinstance(error, HandlerTimeout) or fired is HandlerTimeout:
        log.warning("%s: %s timed out after %gs; interrupted", task.key, handler.route.python,
                    timeout)
        return Outcome.TIMEOUT, None, False
    if isinstance(error, KeyboardInterrupt):
        raise error  # the worker gives the occurrence back (worker/ending.py)
    if error is not None:
        log.error("%s: %s failed", task.key, handler.route.python, exc_info=error)
        return Outcome.FAILED, None, False
    # A run that ended the task behind our back (the task's own give_back()) keeps its
    # word; else returning finishes it.
    return Outcome.SUCCESS, None, task.done
