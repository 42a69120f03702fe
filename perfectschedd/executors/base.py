"""The run contract between the worker and the executors: what a task offers them
(:class:`TaskLike`), how the worker tells a run to stop (:class:`RunControl`) and why
(:class:`StopReason`), how a run ended (:class:`Outcome`, :class:`RunResult`), and what
every executor's handler is (:class:`Handler`).

The executors are command.py (exec: a command in its own process group),
systemd/unit.py (exec routes with ``executor: systemd``: a transient unit) and
application.py (python: an :class:`~perfectschedd.executors.application.Application` in
the calling thread); router.py maps task types to their handlers and runs them
(``run_task``).  Nothing here imports an executor.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from perfectschedd.config import RouteConfig

__all__ = [
    "REASON_TEXT",
    "Handler",
    "Log",
    "Outcome",
    "RunControl",
    "RunOptions",
    "RunResult",
    "Stop",
    "StopReason",
    "TaskLike",
    "stop_grace",
    "stop_reason",
]


class TaskLike(Protocol):
    """What handlers need of a task (``schedules.Task`` in the daemon)."""

    key: str
    type: str
    data: dict[str, Any]
    scheduled_time: int
    attempt: int

    @property
    def done(self) -> bool: ...

    def finish(self) -> None: ...

    def retry(self, wait: float | None = None, *, later: bool = False) -> None: ...

    def release(self) -> None: ...

    def give_back(self) -> None: ...


Log = logging.Logger | logging.LoggerAdapter  # type: ignore[type-arg]


class Outcome(enum.StrEnum):
    """How a run ended; also the ``outcome`` label of the task counters."""

    SUCCESS = "success"      # finished
    FAILED = "failed"        # retried after retry_wait (non-zero exit, exception)
    TIMEOUT = "timeout"      # killed or interrupted at the route's timeout, retried
    LATER = "later"          # retried after an explicit wait (SCHED_LATER N, retry(wait=N))
    PREEMPTED = "preempted"  # the lease was lost; nothing was written
    RELEASED = "released"    # the application released the task
    STOPPED = "stopped"      # ended because the daemon stops; task released


@dataclass(frozen=True, slots=True)
class RunResult:
    outcome: Outcome
    duration: float              # seconds, monotonic
    exit_code: int | None = None  # exec only: the exit status, or -signal if killed
    unit: str | None = None       # executor systemd: the run's unit


class StopReason(enum.StrEnum):
    """Why a run was told to end before its command or application did."""

    SHUTDOWN = "stop"        # the daemon stops: the occurrence is given back untried
    PREEMPTED = "preempted"  # the lease was lost (deleted, modified, taken over)
    FENCED = "fenced"        # the lease could not be renewed and is about to expire


class RunControl:
    """Tells one run when to stop, and why.

    The worker sets it (shutdown, lease lost); time sets it too: past ``fence_at``
    (Unix seconds) the worker could not renew the lease for so long that others may
    claim the occurrence soon, so the run must be gone before then (self-fencing).
    Handlers poll ``is_set()`` (a ``threading.Event`` works in its place).
    """

    # A plain flag, not a threading.Event: nobody waits on it (handlers poll), and one
    # is made per claimed occurrence.
    __slots__ = ("_stopped", "reason", "fence_at", "fence_grace")

    def __init__(self, fence_at: float | None = None, fence_grace: float | None = None
                 ) -> None:
        self._stopped = False
        self.reason: StopReason | None = None
        self.fence_at = fence_at
        # TERM-to-KILL time when fencing, if shorter than kill_grace: the run must be
        # gone before the lease can expire.
        self.fence_grace = fence_grace

    def stop(self, reason: StopReason) -> None:
        if self.reason is None:  # the first reason wins: it decides the outcome
            self.reason = reason
        self._stopped = True

    def is_set(self) -> bool:
        if self._stopped:
            return True
        if self.fence_at is not None and time.time() >= self.fence_at:
            self.stop(StopReason.FENCED)
            return True
        return False


Stop = RunControl | threading.Event


def stop_reason(stop_event: RunControl | threading.Event | None) -> StopReason:
    reason = getattr(stop_event, "reason", None)
    return reason if isinstance(reason, StopReason) else StopReason.SHUTDOWN


def stop_grace(stop_event: RunControl | threading.Event | None, kill_grace: float) -> float:
    if isinstance(stop_event, RunControl) and stop_event.reason is StopReason.FENCED \
            and stop_event.fence_grace is not None:
        return min(kill_grace, stop_event.fence_grace)
    return kill_grace


REASON_TEXT = {
    StopReason.SHUTDOWN: "daemon stopping",
    StopReason.PREEMPTED: "lease lost (schedule deleted, modified or taken over)",
    StopReason.FENCED: "lease could not be renewed in time (database unreachable)",
}


@dataclass(frozen=True, slots=True)
class RunOptions:
    """How to run, besides the task and its handler (``run_task``'s keywords)."""

    log: Log
    stop_event: Stop | None = None
    kill_grace: float = 5.0
    run_id: str | None = None                       # exec: RUN_ID_ENV
    on_spawn: Callable[[int], None] | None = None   # exec: the process group exists
    on_unit: Callable[[str], None] | None = None    # systemd: before the unit can exist
    node: str = ""                                  # systemd: the unit's owner
    tag: str = ""                                   # systemd: this daemon instance


class Handler(Protocol):
    """An executor's handler of one route: made by the router (``from_route``), run by
    ``run_task`` (``run``).  A frozen dataclass: the worker replaces its ``timeout``.

    ``run`` performs the task, ends it (``finish``, ``retry`` or ``release``; on a stop,
    ``give_back`` or nothing) and returns (outcome, exit status, unit name).  It may
    raise ``PreemptedError`` (the lease was lost) and the store's errors; the handler's
    own failures are outcomes.
    """

    @property
    def route(self) -> RouteConfig: ...

    @property
    def timeout(self) -> float | None: ...

    @classmethod
    def from_route(cls, route: RouteConfig) -> Handler | str:
        """The handler of `route`, or why it cannot run here."""
        ...

    def run(self, task: TaskLike, options: RunOptions
            ) -> tuple[Outcome, int | None, str | None]: ...
