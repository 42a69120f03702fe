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

import importlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from perfectschedd.config import RouteConfig
from perfectschedd.errors import PreemptedError
from perfectschedd.executors.application import PythonHandler, _run_python
from perfectschedd.executors.base import (
    REASON_TEXT,
    Log,
    Outcome,
    RunControl,
    RunResult,
    Stop,
    StopReason,
    TaskLike,
    stop_reason,
)
from perfectschedd.executors.command import ExecHandler, _run_exec

__all__ = [
    "ExecHandler",
    "Handler",
    "Outcome",
    "Router",
    "RunControl",
    "RunResult",
    "StopReason",
    "TaskLike",
    "UnitHandler",
    "run_task",
]

logger = logging.getLogger(__name__)

_ROUTE_CACHE_MAX = 4096


# --------------------------------------------------------------------------- handlers


@dataclass(frozen=True, slots=True)
class UnitHandler(ExecHandler):
    """An exec route with `executor: systemd`: each run is a transient unit (unitjobs.py).
    An ExecHandler to whatever reads routes; runs check for it first."""

    def __str__(self) -> str:
        return f"systemd unit {' '.join(self.argv)}"


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
