"""The heartbeat that keeps each run of a worker bound to its lease: every alive_time/3 it
renews the leases held (runs, and finishes not written yet); a run whose lease was lost
is stopped (StopReason: why, as the database still tells), and a run whose lease could
not be renewed moves no fence and stops itself in time (RunControl.fence_at)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from sqlalchemy.exc import SQLAlchemyError

from perfectschedd.executors.base import REASON_TEXT, RunControl, StopReason
from perfectschedd.store.schema import lease_until
from perfectschedd.vocabulary.fields import schedule_key

if TYPE_CHECKING:
    from perfectschedd.schedules.task import Task
    from perfectschedd.worker.leases import LeasePipeline

log = logging.getLogger("perfectschedd.worker")

# A heartbeat that failed is tried again this soon (at most alive_time/3 later).
HEARTBEAT_RETRY = 1.0


def heartbeat_loop(p: LeasePipeline) -> None:
    """The heartbeat thread's body, until p.kill_event is set."""
    interval = max(0.2, p.config.alive_time / 3)
    wait = interval
    while not p.kill_event.wait(wait):
        with p.lock:
            # Finished tasks whose result is not written yet keep their lease too.  A
            # key held twice (finished, then claimed again) keeps its newest fence: the
            # claim shows the older finish was written.
            newest: dict[str, int] = {}
            for t in (*p.finished, *p.running.values()):
                newest[t.key] = max(t.fence, newest.get(t.key, t.fence))
            held = list(newest.items())
        if not held or p.sc is None:
            wait = interval
            continue
        # A renewal that failed (an outage, a hung server cut at its deadline, a
        # failover) is tried again soon, not a third of alive_time later: the runs
        # keep going until their fence_at, and are renewed as soon as a primary
        # answers.
        wait = interval if renew(p, held) else min(interval, HEARTBEAT_RETRY)


def renew(p: LeasePipeline, held: list[tuple[str, int]], now: float | None = None) -> bool:
    """One heartbeat of the leases `held` ((key, fence) pairs); False when the
    database did not answer."""
    assert p.sc is not None
    try:
        lease = lease_until(time.time() if now is None else now, p.config.alive_time)
        lost = p.store.heartbeat(held, lease)
    except SQLAlchemyError as exc:  # not only DBAPIError: this thread must not die
        # No renewal: the runs' fence_at stays, and they stop themselves in time.
        p.set_db(False, exc)
        return False
    _renewed(p, held, lost, lease)
    return True


def _renewed(p: LeasePipeline, held: list[tuple[str, int]], lost: set[str],
             lease: int) -> None:
    """After a heartbeat: renewed runs move their fence; lost ones are stopped.  Only
    the run that holds the fence renewed is touched: a key may have been finished and
    claimed again meanwhile (a newer run with a newer fence)."""
    with p.lock:
        runs = {k: (t, p.controls.get(k)) for k, t in p.running.items()}
        pending = {(t.key, t.fence) for t in p.finished}
    stopping: list[tuple[Task, RunControl]] = []
    for key, fence in held:
        task, control = runs.get(key, (None, None))
        if task is None or control is None or task.fence != fence:
            if key in lost and (key, fence) in pending:
                log.warning("key=%s: lease lost before its finish was written", key)
            continue
        if key not in lost:
            control.fence_at = lease - p.fence_lead
        elif control.reason is None:
            stopping.append((task, control))
    why = why_lost(p, [task for task, _ in stopping])
    for task, control in stopping:
        reason = why[task.key]
        if reason is StopReason.PREEMPTED:
            log.warning("key=%s: lease lost (deleted, modified or taken over); "
                        "stopping its run", task.key)
        else:
            log.warning("key=%s: %s; stopping its run", task.key, REASON_TEXT[reason])
        control.stop(reason)


def why_lost(p: LeasePipeline, tasks: list[Task]) -> dict[str, StopReason]:
    """Why each of `tasks` lost its lease, as the database still tells: DELETED when
    its schedule's row is gone; REPLACED when it is a row of its own (KEY@run-...)
    of a replace schedule, gone while its schedule's runs passed to another
    (store.group_turn deletes the rows it replaces); else PREEMPTED (modified,
    taken over, or the database did not answer)."""
    why = dict.fromkeys((t.key for t in tasks), StopReason.PREEMPTED)
    if not tasks:
        return why
    bases = {t.key: schedule_key(t.key) for t in tasks}
    try:
        rows = p.store.group_holders({*bases, *bases.values()})  # those that exist
    except SQLAlchemyError:
        return why
    for task in tasks:
        base = bases[task.key]
        if base not in rows:
            why[task.key] = StopReason.DELETED
        elif task.key != base and task.key not in rows and \
                task.policy.concurrency == "replace" and rows[base] not in (None, task.key):
            why[task.key] = StopReason.REPLACED
    return why
