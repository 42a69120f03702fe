"""A worker's claim loop (on its main thread): write the finishes of the runs that ended
and claim what is due, in one transaction; hand each claimed occurrence on (admission.py,
then a task thread); how long to sleep until the next step.  A draining worker's step
(drain_step), and the last one (close)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from perfectschedd.errors import ConfigError, SchemaError
from perfectschedd.executors.base import REASON_TEXT, StopReason
from perfectschedd.metrics import counters
from perfectschedd.schedules.collection import ScheduleCollection
from perfectschedd.schedules.task import Task
from perfectschedd.worker import admission
from perfectschedd.worker.heartbeat import why_lost
from perfectschedd.worker.leases import LeasePipeline

log = logging.getLogger("perfectschedd.worker")

# Most occurrences one claim takes at once: big enough for bursts, small enough that one
# worker does not hoard a backlog another worker could start.
CLAIM_BATCH = 64
# A worker leases, beside the `concurrency` occurrences it runs, a queue of about
# QUEUE_SECONDS of work per thread (by the average task duration; at most PREFETCH times
# `concurrency`): the threads never wait for the database between short tasks, and slow
# tasks never queue behind each other (another worker or host can take them).
QUEUE_SECONDS = 0.25
PREFETCH = 8
# While every thread has a queued task, finishes are written (and the queue refilled)
# at most this long after the first of them ended: one transaction for several
# finishes, instead of one per task.  Their leases still hold them meanwhile.  Below
# QUEUE_SECONDS, so the queue outlasts the wait (a thread left without a queued task
# ends it at once).  0.05 s gave an exec burst on PostgreSQL a transaction per 10 runs,
# each about a millisecond of the worker's and the server's CPU; 0.15 s, one per 20.
FINISH_DEFER = 0.15
DB_BACKOFF_MAX = 2.0  # a cron must resume soon after its database does


def step(p: LeasePipeline, submit: Callable[[Task], None]) -> float:
    """Write finished runs, claim and submit what is due; return how long to sleep:
    never past the next history flush while rows wait (a run's row is written within
    HISTORY_FLUSH of its end, not at the next due time or poll)."""
    wait = _step(p, submit)
    counters.flush_tasks()
    history_due = p.history.wait()
    return wait if history_due is None else min(wait, history_due)


def _open(p: LeasePipeline) -> bool:
    """Open the collection (the first step, and after a failed one): claims ask for
    the types routed here; False when the database did not answer."""
    try:
        store, p.given_store = p.given_store, None
        p.sc = ScheduleCollection(p.config, store=store)
        exact, patterns = p.router.claimable()
        p.store.restrict_types(
            exact, patterns, lambda t: p.router.match(t) is not None)
        if p.store.write_lock is not None:
            p.store.write_lock.while_waiting = p.while_waiting
        p.store.keep_connection()  # step() runs on the worker's main loop
        p.store.warm_up()
        p.set_db(True)
    except SchemaError:
        raise  # waiting will not change it: the master stops the daemon
    except (SQLAlchemyError, OSError, ConfigError) as exc:
        # ConfigError: e.g. the SQLite file's directory is missing (not mounted
        # yet): retried as the master's own open is.
        p.set_db(False, exc)
        return False
    return True


def _step(p: LeasePipeline, submit: Callable[[Task], None]) -> float:
    p.deferred_until = 0.0  # runs that end nudge again, unless this step defers
    p.flush_history()
    if p.sc is None and not _open(p):
        return _backoff(p)
    sc = p.sc
    assert sc is not None
    threads = p.config.concurrency
    queue_depth = min(PREFETCH, int(QUEUE_SECONDS / max(p.avg_duration, 1e-3)))
    capacity = threads * (1 + queue_depth)
    with p.lock:
        free = capacity - len(p.running)
        queued = p.queued_count()
    if p.finished and queued >= threads:
        # Every thread has work waiting: let finishes gather (not long).
        age = time.monotonic() - p.first_finish
        if age < FINISH_DEFER:
            p.deferred_until = time.monotonic() + FINISH_DEFER - age
            return FINISH_DEFER - age
    claimed: list[Task] = []
    want = max(0, min(free, CLAIM_BATCH))
    batch = _take_finished(p)
    earliest: int | None = None
    try:
        admission.take_turns(p, submit)
        if not batch and want > 0:
            # Nothing to write: look (a read, no lock) before taking the write lock,
            # which on SQLite every other worker would wait for.
            earliest = sc.earliest_due()
            if earliest is None or earliest > time.time():
                want = 0
        if batch or want > 0:
            claimed = _finish_and_claim(p, batch, want)
            claimed = [t for t in claimed
                       if admission.catch_up(p, t) and admission.split(p, t)]
            admission.admit_many(p, claimed, submit)
            if want > 0 and len(claimed) == want:
                p.set_db(True)
                return 0.0  # there may be more due right now
            if free > 0:
                earliest = sc.earliest_due()
        p.set_db(True)
    except DBAPIError as exc:
        p.set_db(False, exc)
        return _backoff(p)
    longest = min(p.config.poll_interval, admission.GROUP_RECHECK) if p.waiting \
        else p.config.poll_interval
    if free <= 0 or earliest is None:
        return longest
    wait = earliest - time.time()
    if wait <= 0 and not claimed:
        wait = 0.005  # due rows held by another claimer this instant
    return max(0.0, min(wait, longest))


def _backoff(p: LeasePipeline) -> float:
    wait = p.db_backoff
    p.db_backoff = min(p.db_backoff * 2, DB_BACKOFF_MAX)
    return wait


def _take_finished(p: LeasePipeline) -> list[Task]:
    batch = p.finished[:]
    del p.finished[:len(batch)]
    return batch


def _finish_and_claim(p: LeasePipeline, batch: list[Task], want: int) -> list[Task]:
    """Write finished tasks and lease up to `want` more, in one transaction."""
    assert p.sc is not None
    try:
        lost, claimed = p.sc.finish_and_poll(batch, want)
    except DBAPIError:
        p.finished[:0] = batch  # the leases still protect them; try again
        raise
    _report_lost(p, batch, lost)
    if batch:
        _group_ended(p, batch, lost)
    return claimed


def _report_lost(p: LeasePipeline, batch: list[Task], lost: set[str]) -> None:
    tasks = [t for t in batch if t.key in lost]
    why = why_lost(p, tasks)
    for task in tasks:
        if why[task.key] is StopReason.PREEMPTED:
            log.warning("key=%s: lease lost before its finish was written; the "
                        "occurrence may run again elsewhere", task.key)
        else:  # it runs nowhere again: nothing is left of it to run
            log.warning("key=%s: %s before its finish was written; its result is "
                        "discarded", task.key, REASON_TEXT[why[task.key]])
        counters.lease_lost(task.type)


def _group_ended(p: LeasePipeline, batch: list[Task], lost: set[str]) -> None:
    """Runs of a group whose finish was just written: a schedule's occurrence that
    gave way to them may run now (ScheduleCollection.wake_group)."""
    for task in batch:
        group = task.group
        if group is not None and task.key not in lost:
            p.wake_group(group)


def drain_step(p: LeasePipeline) -> None:
    """A draining worker's turn: write the finishes and history of the runs that
    ended; claim nothing."""
    p.flush_history()
    batch = _take_finished(p)
    if not batch or p.sc is None:
        return
    try:
        _finish_and_claim(p, batch, 0)
        p.set_db(True)
    except DBAPIError as exc:
        p.set_db(False, exc)  # the batch is queued again; its leases hold it


def close(p: LeasePipeline) -> None:
    """Write what finished, record the history, close the store."""
    p.kill_event.set()
    try:
        if p.sc is not None and p.finished:
            _finish_and_claim(p, _take_finished(p), 0)
    except DBAPIError:
        log.error("could not write %d finished task(s); they run again when their "
                  "leases expire", len(p.finished))
    p.flush_history(force=True)
    counters.flush_tasks()
    if p.sc is not None:
        p.sc.close()
