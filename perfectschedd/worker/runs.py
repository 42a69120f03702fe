"""One run of a claimed occurrence, on a task thread: whether this host may run it (a
schedules file's exec entry's own row, with this host's data; a route), the run through
its executor (executors/router.run_task), the task ended by its result (ending.py), and
what every run leaves whatever happened: its counters, its history row, its place in
the pipeline freed, the claim loop nudged.

The steps, in order: run_one -> _runnable (refused, not this host's, no route: ended
untried) -> _execute (the executor, then ending.run_and_end) -> _settle (what the end
wrote changes the outcome: gave up, paused, SCHED_LATER refused) -> _ended.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from typing import TYPE_CHECKING

from sqlalchemy.exc import DBAPIError

from perfectschedd import logsetup
from perfectschedd.errors import PreemptedError
from perfectschedd.executors.base import Handler, RunControl, RunResult, error_line
from perfectschedd.executors.router import run_task
from perfectschedd.metrics import counters
from perfectschedd.vocabulary.fields import (
    EXEC_TYPE,
    exec_entry_key,
    foreign_exec_row,
    refused_line,
    refused_reason,
    schedule_key,
)
from perfectschedd.vocabulary.history import history_row
from perfectschedd.vocabulary.outcomes import Outcome
from perfectschedd.worker import pipe
from perfectschedd.worker.ending import BatchedTask, run_and_end

if TYPE_CHECKING:
    from perfectschedd.schedules.task import Task
    from perfectschedd.worker.leases import LeasePipeline

log = logging.getLogger("perfectschedd.worker")

# An entry's row holding another host's data (or a 0.1.0 client's, until the convergence
# at start overwrites it) goes back untried for this long at most; not a run: no history
# row (NOT_APPLIED is a counter label only).
NOT_APPLIED = "not_applied"
NOT_APPLIED_WAIT = 2.0


@dataclasses.dataclass(slots=True)
class _Run:
    """What one run leaves for its counters and history row, filled in as it goes."""

    started: float                     # Unix time
    outcome: str = Outcome.FAILED      # an Outcome, or NOT_APPLIED
    duration: float = 0.0              # seconds the executor ran (0: it did not)
    result: RunResult | None = None    # None: no executor ran it
    error: str | None = None           # one line (error_line)


def run_one(p: LeasePipeline, task: Task) -> None:
    """Run one claimed occurrence on this thread, and end it."""
    with p.lock:
        p.active += 1
    try:
        _run_one(p, task)
    finally:
        with p.lock:
            p.active -= 1


def _run_one(p: LeasePipeline, task: Task) -> None:
    run = _Run(time.time())
    try:
        handler = _runnable(p, task, run)
        if handler is not None:
            _execute(p, task, handler, run)
    except PreemptedError:
        run.outcome = Outcome.PREEMPTED
        run.error = error_line("lease lost (schedule deleted, modified or taken over)")
        counters.lease_lost(task.type)
    except DBAPIError as exc:
        run.outcome = Outcome.DB_ERROR
        run.error = error_line("could not record the result (database error); the "
                               "occurrence runs again when its lease expires")
        p.set_db(False, exc)
        log.error("key=%s: could not record the result (database error); the "
                  "occurrence runs again when its lease expires", task.key)
    except Exception as exc:  # noqa: BLE001 - a worker never dies of one task
        run.error = error_line(f"internal error: {type(exc).__name__}: {exc}")  # FAILED
        log.exception("key=%s: internal error while running the task", task.key)
    finally:
        _ended(p, task, run)


def _runnable(p: LeasePipeline, task: Task, run: _Run) -> Handler | None:
    """The handler that runs `task` here; None when it is ended untried (`run` says
    how): refused (a planted exec:K row), not this host's entry data, or no route."""
    if task.type.startswith(EXEC_TYPE):
        refusal = _refusal(p, task)
        if refusal is not None:
            task.refuse(refusal)
            run.outcome, run.error = Outcome.REFUSED, error_line(refusal)
            return None
        if _not_this_entrys(p, task):
            task.give_back(wait=min(p.config.retry_wait, NOT_APPLIED_WAIT))
            run.outcome = NOT_APPLIED  # untried, and no history row: not this host's
            return None
    handler = p.router.match(task.type)
    if handler is None:
        # Claims ask for routed types only; this one slipped through (a database
        # regular expression that Python reads differently, a route that broke):
        # it goes back untried for a host that runs it.
        if task.type not in p.no_route_logged:
            p.no_route_logged.add(task.type)
            log.error("no route for type %r (key %s) although the claim matched it;"
                      " giving it back for %ds", task.type, task.key,
                      p.config.retry_wait)
        task.give_back(wait=p.config.retry_wait)
        run.outcome = Outcome.NO_ROUTE
        run.error = error_line(f"no route for type {task.type!r} on this host; given "
                               "back untried")
        return None
    return handler


def _execute(p: LeasePipeline, task: Task, handler: Handler, run: _Run) -> None:
    """Run `task` through its executor and end it by the result."""
    started = run.started
    # Due at the later of the occurrence (+delay) and this claim's due time: a retry or
    # a later --at is due after the occurrence; an --at before it runs early, never late.
    due = max(task.due_time, task.scheduled_time + task.delay)
    counters.task_started(task.type, max(0.0, started - due))
    logsetup.info(log, f"start key={task.key} type={task.type} scheduled="
                  f"{int(task.scheduled_time)} attempt={int(task.attempt)} "
                  f"late={started - due:.3f}s")
    control = p.controls.get(task.key) or RunControl()  # one step: no lock
    run_id: str | None = None
    if handler.runs_commands:
        # Reported before the spawn: the master must know the run before any
        # process of it can become the master's orphan.
        run_id = p.new_run_id()
        p.report(pipe.Spawning(run_id).line())
    if task.policy.timeout is not None:  # the schedule's, over the route's
        handler = dataclasses.replace(handler, timeout=task.policy.timeout)
    try:
        result = run_and_end(BatchedTask(task, p), lambda: run_task(
            task, handler, log=log, stop_event=control,
            kill_grace=p.config.kill_grace, run_id=run_id,
            on_spawn=None if run_id is None else
            (lambda pgid, r=run_id: p.report(pipe.Spawned(r, pgid).line())),
            on_unit=None if run_id is None else
            (lambda name, r=run_id: p.report(pipe.UnitStarting(r, name).line())),
            node=p.node, tag=p.unit_tag, output_limit=p.config.output_limit,
            log_output_limit=p.config.log_output_limit), log)
    finally:
        if run_id is not None:
            p.report(pipe.Ended(run_id).line())
    _settle(p, task, result, run)


def _settle(p: LeasePipeline, task: Task, result: RunResult, run: _Run) -> None:
    """The run's outcome and error once its end is written: a finish that paused the
    schedule (no next occurrence), a retry that gave the occurrence up (max_attempts)
    or a SCHED_LATER refused (later_limit) say so; logged, counted."""
    run.result = result
    # A plain str from here (the counters' labels, the log line, the history row): an
    # enum member formats and converts in Python code, several times a run.
    run.outcome = str(result.outcome)
    run.duration, run.error = result.duration, result.error
    if task.exhausted:
        run.outcome = Outcome.FAILED
        run.error = run.error or error_line(task.exhausted)
        log.error("key=%s: %s", task.key, task.exhausted)
    if task.later_refused is not None:
        run.outcome, run.error = Outcome.FAILED, error_line(task.later_refused)
        log.error("key=%s: %s", task.key, task.later_refused)
    if task.gave_up:
        counters.occurrence_given_up(task.type)
    if task.gave_up and task.later_refused is None:
        log.error("key=%s: gave up the occurrence of %d after %d failed attempt(s) "
                  "(max_attempts); the schedule moves on", task.key,
                  task.scheduled_time, task.attempt)
    p.avg_duration = 0.8 * p.avg_duration + 0.2 * run.duration
    logsetup.info(log, f"end key={task.key} scheduled={int(task.scheduled_time)} "
                  f"attempt={int(task.attempt)} duration={run.duration:.3f}s "
                  f"outcome={run.outcome}" + (f" exit={result.exit_code}"
                                              if result.exit_code is not None else ""))
    if run.outcome == Outcome.PREEMPTED:
        counters.lease_lost(task.type)


def _ended(p: LeasePipeline, task: Task, run: _Run) -> None:
    """What every run leaves, whatever happened: counters, its history row, its place
    freed, its group's next run woken, the claim loop nudged."""
    counters.task_finished(task.type, run.outcome, run.duration)
    # Its history row first: whoever waits for no run to be left (a drain, a
    # stop) then writes it; recorded after, it was lost when a worker exited
    # between the two (a draining worker's last run had no history).
    if run.outcome != NOT_APPLIED:
        _record(p, task, run)
    with p.lock:
        p.running.pop(task.key, None)
        p.controls.pop(task.key, None)
        # This run's thread is still counted active: it takes the next task.
        queued = p.queued_count() + 1
    if task.group is not None and task not in p.finished and not (
            run.outcome == Outcome.LATER and task.group == task.key):
        # Ended otherwise than by a finish (retry, release, stopped), or finished
        # and already written: the group's next run may start (a finish still
        # queued wakes it once written).  Not the row that asked to run later.
        p.wake_group(task.group)
    # While the loop sleeps letting finishes gather and every thread still has
    # a task waiting, a nudge would only turn the loop to defer again (a wake-up
    # per run of a burst of exec runs); it wakes by itself at deferred_until.
    if queued < p.config.concurrency or time.monotonic() >= p.deferred_until:
        p.nudge()


def _record(p: LeasePipeline, task: Task, run: _Run) -> None:
    """Queue the history row of one run (written in batches by the claim loop): what
    happened, with the exit status or signal, output tail and error line the
    executor gave (`run.result`, None when it did not run), or `run.error`."""
    result = run.result
    row = history_row(
        key=task.key, type=task.type, scheduled_time=task.scheduled_time,
        attempt=task.attempt, started_at=run.started,
        finished_at=run.started + run.duration if run.duration else time.time(),
        outcome=run.outcome, worker=p.sc.owner if p.sc else "?",
        unit=None if result is None else result.unit,
        exit_code=None if result is None else result.status,
        signal=None if result is None else result.signal,
        duration=None if result is None else run.duration,
        output=None if result is None else result.output, error=run.error)
    if task.policy.notify:  # not a column: the schedule's own notifier, for on_recorded
        row["notify"] = task.policy.notify
    if p.history.on_recorded is not None:  # not a column: whose turn it is to be told
        row["creator"] = task.creator
    p.history.add(row)


def _refusal(p: LeasePipeline, task: Task) -> str | None:
    """Why this occurrence of a schedules file's exec entry must not run (it is not
    that entry's own row: fields.foreign_exec_row, whatever wrote it, a database peer
    included), as its paused_reason; logged.  None: it runs."""
    base = schedule_key(task.key)
    rows = {r.key: r for r in p.store.rows_of(keys=list({task.key, base}))}
    schedule = rows.get(base)
    entry = exec_entry_key(task.type) or ""
    why = foreign_exec_row(task.key, task.type,
                           None if schedule is None else (schedule.type, schedule.source),
                           p.entry_sources.get(entry))
    if why is None:
        return None
    reason = refused_reason(why)
    row = rows.get(task.key)
    log.warning("%s", refused_line(task.key, task.type,
                                   None if row is None else row.creator, reason))
    return reason


def _not_this_entrys(p: LeasePipeline, task: Task) -> bool:
    """Whether entry K's own row holds other data than this host's entry K: written
    by another host whose file differs, or by a 0.1.0 client's `apply` that this
    host's convergence at start has not overwritten yet.  This host's command never
    runs with it; the row goes back untried (for the host whose entry it is, or
    until the convergence writes this host's data)."""
    entry = exec_entry_key(task.type)
    wanted = p.entry_data.get(entry or "")
    if wanted is None or task.key != entry or task.data == json.loads(wanted):
        return False
    if task.key not in p.not_applied_logged:
        p.not_applied_logged.add(task.key)
        log.warning("key=%s: its data is not this host's schedules file entry's; "
                    "given back untried", task.key)
    return True
