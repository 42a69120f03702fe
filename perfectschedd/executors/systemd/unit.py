"""Jobs as systemd transient units (routes and entries with `executor: systemd`): the
unit a run asks for, the run itself, and what the unit's end makes of the run (its
RunResult, by which the worker ends the task).

The invariant is the exec executor's (command.py): a unit runs only while its worker holds the
occurrence's lease.  The worker starts the unit (StartTransientUnit, with AddRef so that
systemd keeps the finished unit until its result is read), waits for its end (signals:
bus.py), stops it (StopUnit, then KillUnit SIGKILL after the grace) on timeout,
stop or a lost lease, and says which unit it runs to the master before the unit can
exist.  The master stops a dead worker's units before the occurrence can run again, and
at start the units a previous instance of the daemon on this host left behind
(bus.stop_units).  Every unit's Description names its worker ("worker NODE:PID"),
so units are found by their owner even when a report was lost.
"""

from __future__ import annotations

import grp
import json
import logging
import os
import pwd
import select
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dbus_next import Variant

from perfectschedd.executors.base import (
    REASON_TEXT,
    Log,
    RunOptions,
    RunResult,
    Stop,
    TaskLike,
    error_line,
    stop_grace,
    stop_reason,
)
from perfectschedd.executors.command import ExecHandler, exec_error, exec_verdict
from perfectschedd.executors.systemd.bus import Systemd, SystemdError, Watch
from perfectschedd.settings import unit_props
from perfectschedd.vocabulary.fields import schedule_key
from perfectschedd.vocabulary.outcomes import Outcome

logger = logging.getLogger(__name__)

# How often a waiting run looks at its RunControl (as exec runs do).
_STOP_POLL = 0.1
# How long the verdict pipe is read after the unit ended (its processes are gone by then).
_VERDICT_WAIT = 2.0
# The most of the verdict pipe kept: wrap.py writes one line of at most 4 KiB, but the
# pipe's writer runs as the job's user, who may write anything into it.
_VERDICT_MAX = 8192
# Our own deadline, beyond RuntimeMaxSec + the stop grace: systemd should have ended it.
_DEADLINE_SLACK = 5.0
_CLD_EXITED = 1
_CLD_CODES = (1, 2, 3)  # exited, killed, dumped; 0: the main process has not ended
_WRAPPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "wrap.py")


def owner_mark(node: str, pid: int) -> str:
    """The end of a unit's Description naming the worker that runs it."""
    return f"(worker {node}:{pid})"


def own_unit() -> str | None:
    """The service this process runs in (the last part of its cgroup), for
    StopPropagatedFrom=/After=; None when it does not run as a service of its own (started
    by hand, in tests)."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    # systemd's own hierarchy: cgroup v2 (unified, "0::"), else v1's "name=systemd".
    ours = [line for line in lines if line.startswith("0::")] or \
        [line for line in lines if ":name=systemd:" in line]
    if not ours:
        return None
    last = ours[0].split(":", 2)[2].rstrip("/").rsplit("/", 1)[-1]
    return last if last.endswith(".service") else None


_client = Systemd()
os.register_at_fork(after_in_child=_client.reset_after_fork)


@dataclass(frozen=True, slots=True)
class UnitHandler(ExecHandler):
    """An exec route with `executor: systemd`: each run is a transient unit.  An
    ExecHandler to whatever reads routes; its runs start processes too (the unit's), so
    the worker reports them alike (runs_commands, inherited)."""

    def __str__(self) -> str:
        return f"systemd unit {' '.join(self.argv)}"

    def run(self, task: TaskLike, options: RunOptions) -> RunResult:
        return run(task, self, options.log, options.stop_event, options.kill_grace,
                   options.node, options.on_unit, options.tag)


# -- one run -------------------------------------------------------------------------------


def properties(task: TaskLike, handler: UnitHandler, name: str, *, node: str, kill_grace: float,
               stderr_index: int = 0, tag: str = "") -> list[tuple[str, Variant]]:
    """The transient unit of one run (StartTransientUnit's properties)."""
    route = handler.route
    argv = [*handler.argv, task.key] if route.append_key else list(handler.argv)
    python = sys.executable or "/usr/bin/python3"
    # The wrapper by its path, not -m perfectschedd.executors.systemd.wrap: importing the
    # package would load the whole library (SQLAlchemy...) into every job, and count
    # against MemoryMax.
    wrapped = [python, "-I", _WRAPPER, "--", *argv]
    # systemd gives the unit HOME, LOGNAME, USER, SHELL (of User=), PATH and the system's
    # LANG, never the daemon's environment; `env:` first, so that it cannot replace ours.
    env = [*(f"{k}={v}" for k, v in route.env),
           f"PERFECTSCHED_KEY={task.key}",
           f"PERFECTSCHED_SCHEDULE_KEY={schedule_key(task.key)}",
           f"PERFECTSCHED_TYPE={task.type}",
           f"PERFECTSCHED_SCHEDULED_TIME={int(task.scheduled_time)}",
           f"PERFECTSCHED_ATTEMPT={int(task.attempt)}", f"PERFECTSCHED_UNIT={name}"]
    props: list[tuple[str, Variant]] = [
        ("Description", Variant("s", " ".join(filter(None, (
            f"PerfectSched job {task.key}", tag, owner_mark(node, os.getpid())))))),
        ("Type", Variant("s", "exec")),
        ("ExecStart", Variant("a(sasb)", [[python, wrapped, False]])),
        ("SyslogIdentifier", Variant("s", os.path.basename(argv[0]) or "perfectsched-job")),
        ("StandardInput", Variant("s", "data")),
        ("StandardInputData", Variant("ay", json.dumps(task.data).encode())),
        ("StandardOutput", Variant("s", "journal")),
        ("StandardErrorFileDescriptor", Variant("h", stderr_index)),
        ("Environment", Variant("as", env)),
        ("CollectMode", Variant("s", "inactive-or-failed")),
        # systemd keeps the unit (and its Result) until we Unref it or our bus
        # connection closes: a quick command's result cannot be collected unread.
        ("AddRef", Variant("b", True)),
        ("TimeoutStopUSec", Variant("t", int(kill_grace * 1_000_000))),
    ]
    if handler.timeout is not None:
        props.append(("RuntimeMaxUSec", Variant("t", int(handler.timeout * 1_000_000))))
    # Without user: the daemon's own user, never systemd's default (root).  The daemon
    # refuses the routes for which that would be root or a uid that may start units
    # (config.privilege_refusal).
    try:
        pw = pwd.getpwnam(route.user) if route.user is not None else pwd.getpwuid(os.geteuid())
    except KeyError:  # removed since the file was read: this run fails, logged
        raise SystemdError(f"no such user {route.user!r}") from None
    props.append(("User", Variant("s", pw.pw_name)))
    try:
        props.append(("Group", Variant("s", grp.getgrgid(pw.pw_gid).gr_name)))
    except KeyError:
        props.append(("Group", Variant("s", str(pw.pw_gid))))
    daemon_unit = own_unit()
    if daemon_unit is not None:
        # Stopping the daemon (or its failing) stops its jobs.  StopPropagatedFrom=, not
        # PartOf=: PartOf= also propagates restarts, and systemd would run the job again
        # (a new invocation, outside any lease) whenever the daemon restarts or is
        # restarted after a crash.  After=: jobs stop before the daemon does.
        props.append(("StopPropagatedFrom", Variant("as", [daemon_unit])))
        props.append(("After", Variant("as", [daemon_unit])))
    props.extend((n, Variant(sig, value)) for n, sig, value in route.unit)
    return props


def run(task: TaskLike, handler: UnitHandler, log: Log, stop: Stop | None,
        kill_grace: float, node: str, on_unit: Callable[[str], None] | None,
        tag: str = "") -> RunResult:
    """Run one task as a unit and return how it ended (as command.py's exec runs do).  Its
    output stays in the journal (perfectschedctl logs reads it there): the result carries
    none."""
    key = task.key
    name = unit_props.unit_name(key, task.scheduled_time, task.attempt)
    verdict_r, verdict_w = os.pipe()
    try:
        try:
            props = properties(task, handler, name, node=node, kill_grace=kill_grace, tag=tag)
            if on_unit is not None:
                on_unit(name)  # the master knows the unit before it can exist
            watch = _client.start(name, props, [verdict_w])
        except SystemdError as exc:
            log.error("%s: cannot start unit %s: %s", key, name, exc)
            return RunResult(Outcome.FAILED, 0.0, None, name,
                             error=error_line(f"cannot start unit {name}", str(exc)))
        finally:
            os.close(verdict_w)  # the unit holds its own copy
        log.info("%s: running as unit %s", key, name)
        why = _wait(watch, name, key, handler.timeout, log, stop, kill_grace)
        state = _client.result(name, watch)
        last = _read_verdict(verdict_r)
    finally:
        os.close(verdict_r)
    return unit_result(key, name, state, last, why, stop, handler.timeout, log)


def exit_code(state: dict[str, Any]) -> int | None:
    """The command's exit status from ExecMainCode/ExecMainStatus, or -signal."""
    if "ExecMainStatus" not in state or state.get("ExecMainCode") not in _CLD_CODES:
        return None
    status = int(state["ExecMainStatus"])
    return status if state.get("ExecMainCode") == _CLD_EXITED else -status


def unit_result(key: str, name: str, state: dict[str, Any], last: str, why: str | None,
                stop: Stop | None, timeout: float | None, log: Log) -> RunResult:
    """How a run ended by how its unit ended: `why` we stopped it (stop, timeout) first,
    then the unit's Result (timeout, oom-kill, start failures), then the exec protocol
    (the last stdout line, else the exit status) as for an exec run."""
    outcome, wait = unit_outcome(key, name, state, last, why, stop, timeout, log)
    return RunResult(outcome, 0.0, exit_code(state), name,
                     error=unit_error(outcome, name, state, last, why, stop, timeout),
                     retry_wait=wait)


def unit_outcome(key: str, name: str, state: dict[str, Any], last: str, why: str | None,
                 stop: Stop | None, timeout: float | None, log: Log
                 ) -> tuple[Outcome, float | None]:
    """unit_result's outcome, and for LATER the seconds asked for; logs what went
    wrong."""
    result = str(state.get("Result", "unknown"))
    code = exit_code(state)
    if why == "stop":
        if stop_reason(stop).gives_back:
            return Outcome.STOPPED, None
        return Outcome.PREEMPTED, None  # nothing to write: the lease is not ours
    if why == "timeout" or result == "timeout":
        log.warning("%s: unit %s timed out after %gs and was stopped", key, name,
                    timeout or 0)
        return Outcome.TIMEOUT, None
    if result == "oom-kill":
        log.error("%s: unit %s was killed: out of memory (OOM, its MemoryMax)", key, name)
        return Outcome.FAILED, None
    if result not in ("success", "exit-code", "signal", "core-dump") or code is None:
        log.error("%s: unit %s failed: result %s%s", key, name, result,
                  f", status {code}" if code is not None else
                  " (no exit status: its result was lost)" if result == "success" else "")
        return Outcome.FAILED, None
    return exec_verdict(key, last, code, log)


def unit_error(outcome: Outcome, name: str, state: dict[str, Any], last: str,
               why: str | None, stop: Stop | None, timeout: float | None) -> str | None:
    """The error line of a unit's run that unit_outcome gave `outcome` (the same
    reasons, in the same order); None when nothing went wrong."""
    result = str(state.get("Result", "unknown"))
    code = exit_code(state)
    if why == "stop":
        return error_line(f"stopped: {REASON_TEXT[stop_reason(stop)]}")
    if why == "timeout" or result == "timeout":
        return error_line(f"timed out after {timeout or 0:g} s")
    if result == "oom-kill":
        return error_line(f"unit {name} was killed: out of memory (OOM, its MemoryMax)")
    if result not in ("success", "exit-code", "signal", "core-dump") or code is None:
        return error_line(f"unit {name} failed: result {result}"
                          + (f", status {code}" if code is not None else ""))
    # The last stdout line wrap.py passed on is the only line seen here (the rest is in
    # the journal); a SCHED_ word says nothing of why.
    return exec_error(outcome, last, code, "" if last.startswith("SCHED_") else last)


def _wait(watch: Watch, name: str, key: str, timeout: float | None, log: Log,
          stop: Stop | None, kill_grace: float) -> str | None:
    """Wait for the unit to end; stop it on a stop request, or if it outlives its
    RuntimeMaxSec by far.  Returns why we stopped it (None: it ended by itself)."""
    deadline = time.monotonic() + timeout + kill_grace + _DEADLINE_SLACK \
        if timeout is not None else None
    why: str | None = None
    kill_at: float | None = None
    killed = False
    while not watch.ended.wait(_STOP_POLL):
        now = time.monotonic()
        try:
            _client.check()
            if why is None and stop is not None and stop.is_set():
                why = "stop"
                log.warning("%s: %s; stopping unit %s", key, REASON_TEXT[stop_reason(stop)],
                            name)
                _client.stop(name)
                kill_at = now + stop_grace(stop, kill_grace)
            elif why is None and deadline is not None and now >= deadline:
                why = "timeout"
                log.warning("%s: unit %s still runs %gs past its timeout; stopping it", key,
                            name, now - deadline + _DEADLINE_SLACK)
                _client.stop(name)
                kill_at = now + kill_grace
            if kill_at is not None and not killed and now >= kill_at:
                log.warning("%s: unit %s still running %gs after the stop; sending SIGKILL",
                            key, name, kill_grace)
                _client.kill(name)
                killed = True
        except SystemdError as exc:
            log.error("%s: cannot stop unit %s: %s", key, name, exc)
    return why


def _read_verdict(fd: int) -> str:
    """The last stdout line wrap.py wrote to the pipe ("" if none came)."""
    os.set_blocking(fd, False)
    data = b""
    end = time.monotonic() + _VERDICT_WAIT
    while time.monotonic() < end:
        ready, _, _ = select.select([fd], [], [], max(0.0, end - time.monotonic()))
        if not ready:
            break
        try:
            chunk = os.read(fd, 8192)
        except BlockingIOError:
            continue
        if not chunk:
            break
        data = (data + chunk)[-_VERDICT_MAX:]
    return data.decode("utf-8", "replace").strip()
