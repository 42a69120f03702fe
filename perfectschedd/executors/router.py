"""Route a task type to its executor's handler, and run it.

The worker asks a :class:`Router` for the handler of a task's type and calls
:func:`run_task`, which performs the task and returns a
:class:`~perfectschedd.executors.base.RunResult`; the worker then ends the task by it
(worker/ending.py), as APScheduler's scheduler ends a job its executor ran.

A route's executor is found by name in :data:`HANDLER_CLASSES`: ``exec`` (command.py: a
command in its own process group), ``systemd`` (systemd/unit.py: a transient unit, for
exec routes with ``executor: systemd``) and ``python`` (application.py: an Application
in the calling thread).

Starting and ending lines of a task are logged by the worker; the executors log only
the handler's own output and its failures, each prefixed by the task key.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from perfectschedd.config import DEFAULT_LOG_OUTPUT_LIMIT
from perfectschedd.errors import PreemptedError
from perfectschedd.executors.application import PythonHandler
from perfectschedd.executors.base import (
    REASON_TEXT,
    Handler,
    Log,
    RunOptions,
    RunResult,
    Stop,
    TaskLike,
    error_line,
    lease_lost_while_running,
    stop_reason,
)
from perfectschedd.executors.command import ExecHandler
from perfectschedd.settings.routes import RouteConfig
from perfectschedd.vocabulary.outcomes import Outcome

__all__ = ["HANDLER_CLASSES", "Router", "handler_class", "run_task"]

logger = logging.getLogger(__name__)

_ROUTE_CACHE_MAX = 4096


def _unit_handler() -> type[Handler]:
    """The systemd executor's handler class, imported on first use: D-Bus (dbus-next)
    loads only where a route runs units."""
    from perfectschedd.executors.systemd.unit import UnitHandler

    return UnitHandler


# Executor name -> its handler class (as gunicorn's SUPPORTED_WORKERS): a route's
# `executor:` ("python" for python routes) picks the class by name.  An entry is a
# function returning the class, so that a heavy executor is imported by the first route
# that uses it.
HANDLER_CLASSES: dict[str, Callable[[], type[Handler]]] = {
    "exec": lambda: ExecHandler,
    "systemd": _unit_handler,
    "python": lambda: PythonHandler,
}


def handler_class(route: RouteConfig) -> type[Handler] | None:
    """The handler class of `route`'s executor; None for an executor unknown here."""
    load = HANDLER_CLASSES.get(route.executor if route.exec is not None else "python")
    return None if load is None else load()


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
        cls = handler_class(route)
        if cls is None:
            return f"unknown executor {route.executor!r}"
        return cls.from_route(route)


def run_task(task: TaskLike, handler: Handler, *, log: Log = logger,
             stop_event: Stop | None = None, kill_grace: float = 5.0,
             run_id: str | None = None,
             on_spawn: Callable[[int], None] | None = None,
             on_unit: Callable[[str], None] | None = None, node: str = "", tag: str = "",
             output_limit: int = 4096,
             log_output_limit: int = DEFAULT_LOG_OUTPUT_LIMIT) -> RunResult:
    """Run ``task`` with ``handler`` and return how it ended; never raises for handler
    failures, and never ends the task (the worker does, by the result's outcome:
    worker/ending.py).

    ``stop_event`` means "end now" (a :class:`RunControl` says why). An exec
    command then gets SIGTERM, SIGKILL after ``kill_grace``; a python
    application gets its ``kill()`` called and ``ProcessStopError`` raised. On
    shutdown the outcome is ``stopped`` (the task goes back); when the lease was
    lost or could not be renewed it is ``preempted`` (nothing is written: the
    occurrence belongs to whoever holds it next).

    ``run_id`` goes into the environment of exec commands (RUN_ID_ENV);
    ``on_spawn(pgid)`` is called once the command's process group exists.  A unit run
    calls ``on_unit(name)`` before its unit can exist; ``node`` names this host in the
    unit's Description (its owner: "worker NODE:PID"), and ``tag`` this daemon instance
    (unit_props.daemon_tag).  ``output_limit`` bounds the output tail the result keeps
    (config.output_limit), ``log_output_limit`` the output an exec run logs
    (config.log_output_limit).

    Errors of the store other than ``PreemptedError`` (a database that is
    down, met by a python application's own calls) propagate to the caller.
    """
    start = time.monotonic()
    try:
        if stop_event is not None and stop_event.is_set():
            outcome = _stopped_before_start(task, stop_event, log)
            return RunResult(outcome, time.monotonic() - start, error=error_line(
                f"not started: {REASON_TEXT[stop_reason(stop_event)]}"))
        options = RunOptions(log, stop_event, kill_grace, run_id, on_spawn, on_unit, node,
                             tag, output_limit, log_output_limit)
        result = handler.run(task, options)
    except PreemptedError:
        return lease_lost_while_running(task.key, time.monotonic() - start, log)
    # Built, not dataclasses.replace(): that one looks the fields up on every call.
    return RunResult(result.outcome, time.monotonic() - start, result.exit_code, result.unit,
                     result.output, result.error, result.retry_wait, result.already_ended)


def _stopped_before_start(task: TaskLike, stop: Stop, log: Log) -> Outcome:
    """A run told to stop before it started: STOPPED (it goes back untried) or, when
    the lease is not ours any more, PREEMPTED (logged: nothing is written)."""
    reason = stop_reason(stop)
    if reason.gives_back:
        return Outcome.STOPPED
    log.warning("%s: not started: %s", task.key, REASON_TEXT[reason])
    return Outcome.PREEMPTED
