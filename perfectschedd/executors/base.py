"""The run contract between the worker and the executors: what a task offers them
(:class:`TaskLike`), how the worker tells a run to stop (:class:`RunControl`) and why
(:class:`StopReason`), how a run ended (:class:`Outcome`, :class:`RunResult`), and what
every executor's handler is (:class:`Handler`).

An executor only runs and returns a RunResult, as APScheduler's executors do; it never
writes the task's end.  The worker ends the task by the result, in one place
(worker/ending.py: finish, retry, release or give back).

The executors are command.py (exec: a command in its own process group),
systemd/unit.py (exec routes with ``executor: systemd``: a transient unit) and
application.py (python: an :class:`~perfectschedd.executors.application.Application` in
the calling thread); router.py maps task types to their handlers and runs them
(``run_task``).  Nothing here imports an executor.
"""

from __future__ import annotations

import enum
import logging
import os
import pwd
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from perfectschedd.config import DEFAULT_LOG_OUTPUT_LIMIT
from perfectschedd.settings.routes import RouteConfig
from perfectschedd.vocabulary.fields import ERROR_MAX
from perfectschedd.vocabulary.outcomes import Outcome

__all__ = [
    "REASON_TEXT",
    "Handler",
    "Log",
    "OutputTail",
    "RunControl",
    "RunOptions",
    "RunResult",
    "Stop",
    "StopReason",
    "TaskLike",
    "clean_text",
    "cut_mark",
    "error_line",
    "lease_lost_while_running",
    "output_tail",
    "signal_name",
    "status_text",
    "stop_grace",
    "stop_reason",
]


class TaskLike(Protocol):
    """What handlers read of a task (``schedules.Task`` in the daemon).  None of its
    methods that end it: the worker ends it by the RunResult (worker/ending.py)."""

    key: str
    type: str
    data: dict[str, Any]
    scheduled_time: int
    attempt: int

    @property
    def done(self) -> bool: ...


Log = logging.Logger | logging.LoggerAdapter  # type: ignore[type-arg]


# RunResult and RunOptions are made on every run (three times for a python run): not
# frozen, since a frozen dataclass sets each field through object.__setattr__, about
# 0.85 us more per object of 8 fields here, 2.5 us a run (docs/performance.md, #41).
# Nobody changes them once made; nothing hashes them.
@dataclass(slots=True)
class RunResult:
    """How a run ended, as its history row records it and as the worker ends its task
    (worker/ending.py: the outcome says finish, retry, release, give back or nothing).  A
    handler's ``run`` returns one with duration 0; ``run_task`` sets the duration it
    measured.  Read only, by convention (see above)."""

    outcome: Outcome
    duration: float              # seconds, monotonic
    exit_code: int | None = None  # exec, systemd: the exit status, or -signal if killed
    unit: str | None = None       # executor systemd: the run's unit
    output: str | None = None     # the tail of the output (output_tail), None: none kept
    error: str | None = None      # one line (error_line): what went wrong; None: nothing
    retry_wait: float | None = None  # LATER: the seconds asked for (SCHED_LATER N)
    # The run ended the task itself (an application calling the task's own give_back()):
    # the worker writes nothing more of it.
    already_ended: bool = False

    @property
    def status(self) -> int | None:
        """The exit status of a command that exited (None: killed, or no command)."""
        return self.exit_code if self.exit_code is not None and self.exit_code >= 0 \
            else None

    @property
    def signal(self) -> int | None:
        """The signal that killed the command (None: it exited, or no command)."""
        return -self.exit_code if self.exit_code is not None and self.exit_code < 0 \
            else None


# -- what a run said: its output's tail and one line of error -------------------------------



def signal_name(number: int) -> str:
    """SIGTERM for 15; "signal 99" for a number Python does not name."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def status_text(code: int) -> str:
    """An exit status as people read it: "exit status 3", "killed by SIGKILL"."""
    return f"exit status {code}" if code >= 0 else f"killed by {signal_name(-code)}"


def clean_text(text: str) -> str:
    """Text any database stores: no NUL (PostgreSQL refuses it in text and in JSON), no
    lone surrogates (no UTF-8 for them: an exception's message may carry undecodable
    file names as surrogates)."""
    if "\0" in text:
        text = text.replace("\0", "\ufffd")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = text.encode("utf-8", "replace").decode("utf-8")
    return text


def error_line(*parts: str | None) -> str:
    """One line of at most ERROR_MAX characters: the parts that are not empty, joined by
    ": ", line breaks and control characters made spaces (a history table stays one row a
    line, a mail's subject one line)."""
    text = ": ".join(p.strip() for p in parts if p and p.strip())
    text = "".join(c if c.isprintable() else " " for c in clean_text(text))
    return text if len(text) <= ERROR_MAX else text[:ERROR_MAX - 3] + "..."


def cut_mark(cut: int) -> str:
    """What stands before an output tail that lost its first `cut` bytes."""
    return f"[... {cut} bytes cut]\n"


def output_tail(data: bytes, total: int, limit: int) -> str | None:
    """The text of an output's last bytes: `data` is its tail, `total` how many bytes it
    had in all.  At most `limit` bytes of UTF-8 (None when 0), invalid bytes replaced, cut
    at a character boundary; a tail that lost its beginning starts with cut_mark()."""
    if limit <= 0:
        return None
    text, shown = _decoded_tail(data, limit)
    if shown >= total:
        return text
    # The mark's length with the most digits it can have: mark and text stay in limit.
    text, shown = _decoded_tail(data, max(0, limit - len(cut_mark(total).encode())))
    return cut_mark(total - shown) + text


def _decoded_tail(data: bytes, budget: int) -> tuple[str, int]:
    """The longest tail of `data` whose text takes at most `budget` bytes of UTF-8, and
    how many bytes of `data` it shows."""
    keep = data[-budget:] if budget else b""
    while True:
        start = 0
        # A character cut in two: its continuation bytes (at most 3) go with the cut.
        while start < min(3, len(keep)) and 0x80 <= keep[start] <= 0xBF:
            start += 1
        text = clean_text(keep[start:].decode("utf-8", "replace"))
        size = len(text.encode())
        if size <= budget:
            return text, len(keep) - start
        # Replacement characters (3 bytes for an invalid byte or a NUL) made it longer:
        # drop a third of the excess from its beginning (no more: each byte dropped
        # shortens the text by 1 to 3 bytes), and decode again.
        keep = keep[start + max(1, (size - budget) // 3):]


class OutputTail:
    """The last `limit` bytes of an output, kept while it is produced (a ring: the
    memory of a run with endless output stays bounded), and its last non-empty line."""

    __slots__ = ("limit", "buf", "total", "last_line")

    def __init__(self, limit: int) -> None:
        self.limit = max(0, limit)
        self.buf = bytearray()
        self.total = 0
        self.last_line = ""  # set by the caller, which splits lines anyway (command.py)

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        if not self.limit:
            return
        if len(chunk) >= self.limit:
            self.buf[:] = chunk[-self.limit:]
            return
        self.buf += chunk
        if len(self.buf) > 2 * self.limit:  # trimmed now and then, not on every chunk
            del self.buf[:-self.limit]

    def text(self) -> str | None:
        """output_tail() of what was added; None when nothing was, or limit is 0."""
        if not self.total:
            return None
        return output_tail(bytes(self.buf[-self.limit:]), self.total, self.limit)


class StopReason(enum.StrEnum):
    """Why a run was told to end before its command or application did."""

    SHUTDOWN = "stop"        # the daemon stops: the occurrence is given back untried
    PREEMPTED = "preempted"  # the lease was lost (deleted, modified, taken over)
    FENCED = "fenced"        # the lease could not be renewed and is about to expire
    GRANT = "grant"          # the polkit grant came on: no job may run as the daemon's
    #                          user (given back untried, as at a stop)
    # PREEMPTED with what the database still says of why (worker/heartbeat.py):
    DELETED = "deleted"      # its schedule was deleted
    REPLACED = "replaced"    # a newer occurrence took its place (concurrency: replace)

    @property
    def gives_back(self) -> bool:
        """The occurrence is still ours and goes back (outcome stopped); the others lost
        their lease (outcome preempted, nothing to write)."""
        return self in (StopReason.SHUTDOWN, StopReason.GRANT)


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


def _daemon_user() -> str:
    """This process's user name (the daemon's: workers are its forks)."""
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return f"uid {os.geteuid()}"


REASON_TEXT = {
    StopReason.SHUTDOWN: "daemon stopping",
    StopReason.PREEMPTED: "lease lost (schedule deleted, modified or taken over)",
    StopReason.DELETED: "schedule deleted",
    StopReason.REPLACED: "replaced by a newer occurrence (concurrency: replace)",
    StopReason.FENCED: "lease could not be renewed in time (database unreachable)",
    StopReason.GRANT: "the polkit grant was enabled (jobs may not run as "
                      f"{_daemon_user()})",
}


def lease_lost_while_running(key: str, duration: float, log: Log) -> RunResult:
    """The result of a run whose lease was found lost while it ran or as its end was
    written (PreemptedError): nothing of it is written, and the log says so."""
    log.warning("%s: lease lost while running; the result was discarded", key)
    return RunResult(Outcome.PREEMPTED, duration, error=error_line(
        "lease lost while running (schedule deleted, modified or taken over); the "
        "result was discarded"))


@dataclass(slots=True)
class RunOptions:
    """How to run, besides the task and its handler (``run_task``'s keywords).  Not
    frozen, as RunResult is not (made on every run)."""

    log: Log
    stop_event: Stop | None = None
    kill_grace: float = 5.0
    run_id: str | None = None                       # exec: RUN_ID_ENV
    on_spawn: Callable[[int], None] | None = None   # exec: the process group exists
    on_unit: Callable[[str], None] | None = None    # systemd: before the unit can exist
    node: str = ""                                  # systemd: the unit's owner
    tag: str = ""                                   # systemd: this daemon instance
    output_limit: int = 4096                        # config.output_limit: tail kept
    log_output_limit: int = DEFAULT_LOG_OUTPUT_LIMIT  # exec: output bytes logged a run


class Handler(Protocol):
    """An executor's handler of one route: made by the router (``from_route``), run by
    ``run_task`` (``run``).  A frozen dataclass: the worker replaces its ``timeout``.

    ``run`` performs the task and returns a RunResult (outcome, exit status, unit name,
    output tail, error line; duration 0: ``run_task`` measures it); it does not end the
    task (the worker does, by the outcome).  It may raise ``PreemptedError`` (the lease
    was lost: a python application's own store calls) and the store's errors; the
    handler's own failures are outcomes.

    ``runs_commands``: its runs start processes of their own (exec, systemd units), which
    the master must know of before they exist (the worker reports them: worker/pipe.py's
    Spawning and Ended lines).
    """

    runs_commands: ClassVar[bool]

    @property
    def route(self) -> RouteConfig: ...

    @property
    def timeout(self) -> float | None: ...

    @classmethod
    def from_route(cls, route: RouteConfig) -> Handler | str:
        """The handler of `route`, or why it cannot run here."""
        ...

    def run(self, task: TaskLike, options: RunOptions) -> RunResult: ...
