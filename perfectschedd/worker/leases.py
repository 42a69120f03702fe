"""A worker's lease pipeline: claim -> run -> finish batch, and the heartbeat that keeps
each run bound to its lease.  No process plumbing here (worker.py is the shell around
it), so it is tested with a real SQLite file and no processes (tests/worker/test_leases.py).

Invariants:
- Every claimed occurrence gets a RunControl before it is submitted: a heartbeat that
  finds its lease lost stops the run (PREEMPTED), and a run whose lease could not be
  renewed stops itself `fence_lead` seconds before the lease expires (FENCED).
- Finishes are queued by the runs and written with the next claim, in one transaction;
  a finish that cannot be written stays queued (its lease still protects it).
- Run events (pipe.py's Spawning, Spawned, UnitStarting and Ended lines) reach the master
  through `report` before a run's first process exists and after its last one is gone.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from perfectschedd import logsetup
from perfectschedd.config import Config, privilege_refusal
from perfectschedd.errors import ConfigError, InvalidInputError, PreemptedError, SchemaError
from perfectschedd.executors import reaper
from perfectschedd.executors.base import (
    REASON_TEXT,
    RunControl,
    RunResult,
    StopReason,
    error_line,
)
from perfectschedd.executors.command import ExecHandler
from perfectschedd.executors.router import Router, run_task
from perfectschedd.metrics import counters
from perfectschedd.schedules import catchup
from perfectschedd.schedules.collection import ScheduleCollection, Task
from perfectschedd.settings import unit_props
from perfectschedd.store.schema import lease_until
from perfectschedd.store.sql import TURN_LOST, TURN_START, Store
from perfectschedd.vocabulary.fields import (
    EXEC_TYPE,
    RUN_NOW_MARK,
    exec_entry_key,
    foreign_exec_row,
    refused_line,
    refused_reason,
    schedule_key,
)
from perfectschedd.worker import pipe

log = logging.getLogger("perfectschedd.worker")

# Most occurrences one claim takes at once: big enough for bursts, small enough that one
# worker does not hoard a backlog another worker could start.
CLAIM_BATCH = 64
# A worker leases, beside the `concurrency` occurrences it runs, a queue of about
# QUEUE_SECONDS of work per thread (by the average task duration; at most PREFETCH times
# `concurrency`): the threads never wait for the database between short tasks, and slow
# tasks never queue behind each other (another worker or host can take them).
QUEUE_SECONDS = 0.25
FAST_TASK = 0.05  # the average the estimate starts from is twice this
PREFETCH = 8
# While every thread has a queued task, finishes are written (and the queue refilled)
# at most this long after the first of them ended: one transaction for several
# finishes, instead of one per task.  Their leases still hold them meanwhile.  Below
# QUEUE_SECONDS, so the queue outlasts the wait (a thread left without a queued task
# ends it at once).  0.05 s gave an exec burst on PostgreSQL a transaction per 10 runs,
# each about a millisecond of the worker's and the server's CPU; 0.15 s, one per 20.
FINISH_DEFER = 0.15
HISTORY_FLUSH = 0.5
# Unwritten history a worker keeps while the database is away, in output bytes at most
# (history_kept): with output_limit at its maximum, 10,000 rows would be 10 GiB.
HISTORY_KEPT_BYTES = 64 << 20
DB_BACKOFF_MAX = 2.0  # a cron must resume soon after its database does
# A run queued for its turn in its group (`run KEY` behind a running occurrence) asks
# again this often at most, and at least once per poll_interval.
GROUP_RECHECK = 0.25
# A heartbeat that failed is tried again this soon (at most alive_time/3 later).
HEARTBEAT_RETRY = 1.0
# An entry's row holding another host's data (or a 0.1.0 client's, until the convergence
# at start overwrites it) goes back untried for this long at most; not a run: no history.
NOT_APPLIED = "not_applied"
NOT_APPLIED_WAIT = 2.0


class BatchedTask:
    """The task as a handler sees it: `finish()` is queued and written with the other
    finishes of this worker in one transaction (the daemon's hot path).  A lease lost
    meanwhile is logged and counted when the batch is written, not raised in the handler.
    """

    __slots__ = ("_task", "_queue", "_pipeline")

    def __init__(self, task: Task, pipeline: LeasePipeline) -> None:
        self._task = task
        self._queue = pipeline.finished
        self._pipeline = pipeline

    def __getattr__(self, name: str) -> Any:
        return getattr(self._task, name)

    def finish(self) -> None:
        self._task._end()
        self._task.next_advance()  # now, so that a schedule with no next time is seen here
        if not self._queue:
            self._pipeline.first_finish = time.monotonic()
        self._queue.append(self._task)  # list.append is atomic under the GIL

    def retry(self, wait: float | None = None, *, later: bool = False) -> None:
        self._task.retry(wait, later=later)

    def release(self) -> None:
        self._task.release()

    def heartbeat(self) -> None:
        self._task.heartbeat()

    def give_back(self) -> None:
        self._task.give_back()


class LeasePipeline:
    def __init__(self, config: Config, *, report: Callable[[str], None] = lambda line: None,
                 nudge: Callable[[], None] = lambda: None,
                 while_waiting: Callable[[], None] | None = None,
                 on_recorded: Callable[[list[dict[str, Any]]], None] | None = None,
                 store: Store | None = None) -> None:
        """`store`: an open store of `config`'s database to use (the master's, forked
        with the worker); None: one is opened at the first step."""
        self.config = config
        self._given_store = store
        self.report = report        # a run event for the master
        self.nudge = nudge          # a run ended: the claim loop should look again
        self.while_waiting = while_waiting  # called while waiting for SQLite's writer lock
        # Called with each batch of history rows once it is written (flush_history):
        # what reacts to runs (notifications) sees only what the database holds.
        self.on_recorded = on_recorded
        self.on_recorded_failed = False  # its first exception was logged
        self.kill_event = threading.Event()  # the heartbeat thread ends
        self.sc: ScheduleCollection | None = None
        self.router = Router(config.routes, log=log)
        # exec:K -> the file of this host's entry K, whose own row alone runs its command.
        self.entry_sources = {r.pattern[len(EXEC_TYPE):]: r.source for r in config.routes
                              if r.source is not None and r.pattern.startswith(EXEC_TYPE)}
        self.entry_data = {r.pattern[len(EXEC_TYPE):]: r.data for r in config.routes
                           if r.data is not None and r.pattern.startswith(EXEC_TYPE)}
        self.not_applied_logged: set[str] = set()
        self.unit_tag = unit_props.daemon_tag(config.control_socket)  # units' Description
        self.node = config.node  # read once: socket.gethostname() is a system call per run
        self.running: dict[str, Task] = {}
        # Of `running`, the runs queued for their turn in their group (held, heartbeated,
        # on no thread); the claim loop asks for their turn again (_take_turns).
        self.waiting: dict[str, Task] = {}
        self.turns_asked = 0.0
        # Per running key: what stops its run (shutdown, lease lost, self-fencing).
        self.controls: dict[str, RunControl] = {}
        # Self-fencing: a run stops this long before its lease expires unless a heartbeat
        # renewed it; alive_time/10 is the clock skew tolerated between hosts, kill_grace
        # the time TERM gets before KILL.  Never more than a quarter of alive_time, so
        # that a short lease is not fenced before its first heartbeat (alive_time/3).
        alive = config.alive_time
        self.fence_lead = min(alive / 10 + config.kill_grace, alive / 4)
        self.fence_grace = max(0.1, self.fence_lead - alive / 10)
        # Task threads take ids at once: a generator raises "already executing" when two
        # threads resume it together; itertools.count's next() is one C call (atomic).
        self.run_id_prefix = (f"{os.getpid()}.{time.time_ns() // 1_000_000 % 10**9}."
                              f"{reaper.instance()}.")
        self.run_numbers = itertools.count(1)
        self.lock = threading.Lock()
        self.history: list[dict[str, Any]] = []
        self.finished: list[Task] = []  # finished by handlers, not yet written
        # Seconds, a moving average quick to follow: it starts just "slow", so a few
        # short tasks turn prefetch on and one long task turns it off again.
        self.avg_duration = 2 * FAST_TASK
        self.active = 0  # tasks a thread runs now (the rest of `running` is queued)
        self.first_finish = 0.0  # when the oldest unwritten finish ended
        self.deferred_until = 0.0  # the loop lets finishes gather until then (_step)
        self.no_route_logged: set[str] = set()
        self.db_ok = True
        self.db_backoff = 0.5
        self.last_flush = time.monotonic()

    @property
    def store(self) -> Store:
        """The open collection's store: the calls the collection does not offer (claim
        filters, advances and retargets, history, heartbeats) go to it directly."""
        assert self.sc is not None
        return self.sc.store

    def _queued(self) -> int:
        """Runs claimed and waiting for a thread (not those waiting for their group's
        turn); the caller holds the lock."""
        return len(self.running) - self.active - len(self.waiting)

    def running_count(self) -> int:
        """Runs this worker has started or will start (queued for their turn in a group
        not counted: a stop gives them back at once)."""
        with self.lock:
            return len(self.running) - len(self.waiting)

    def _set_db(self, ok: bool, exc: BaseException | None = None) -> None:
        if ok and not self.db_ok:
            log.info("database reachable again")
            self.db_backoff = 0.5
        elif not ok:
            if self.sc is not None:
                # Pooled connections may be what is broken: SQLite opens a file it may not
                # write read-only, and such a connection stays read-only after the
                # permissions come back.  The next try opens fresh ones.
                self.store.reset_connections()
            if self.db_ok:
                log.error("database unreachable: %s; retrying with back-off",
                          self.store.describe_error(exc) if exc and self.sc is not None
                          else str(exc).splitlines()[0] if exc else "?")
            counters.db_error()
        if ok != self.db_ok:
            counters.set_db_up(ok)
        self.db_ok = ok

    def new_run_id(self) -> str:
        """An exec run's id (PERFECTSCHED_RUN_ID), unique on this host; any thread."""
        return f"{self.run_id_prefix}{next(self.run_numbers)}"

    def step(self, submit: Callable[[Task], None]) -> float:
        """Write finished runs, claim and submit what is due; return how long to sleep:
        never past the next history flush while rows wait (a run's row is written within
        HISTORY_FLUSH of its end, not at the next due time or poll)."""
        wait = self._step(submit)
        counters.flush_tasks()
        if self.history:
            wait = min(wait, max(0.0, HISTORY_FLUSH - (time.monotonic() - self.last_flush)))
        return wait

    def _step(self, submit: Callable[[Task], None]) -> float:
        self.deferred_until = 0.0  # runs that end nudge again, unless this step defers
        self.flush_history()
        if self.sc is None:
            try:
                store, self._given_store = self._given_store, None
                self.sc = ScheduleCollection(self.config, store=store)
                exact, patterns = self.router.claimable()
                self.store.restrict_types(
                    exact, patterns, lambda t: self.router.match(t) is not None)
                if self.store.write_lock is not None:
                    self.store.write_lock.while_waiting = self.while_waiting
                self.store.keep_connection()  # step() runs on the worker's main loop
                self.store.warm_up()
                self._set_db(True)
            except SchemaError:
                raise  # waiting will not change it: the master stops the daemon
            except (SQLAlchemyError, OSError, ConfigError) as exc:
                # ConfigError: e.g. the SQLite file's directory is missing (not mounted
                # yet): retried as the master's own open is.
                self._set_db(False, exc)
                return self._backoff()
        sc = self.sc
        threads = self.config.concurrency
        queue_depth = min(PREFETCH, int(QUEUE_SECONDS / max(self.avg_duration, 1e-3)))
        capacity = threads * (1 + queue_depth)
        with self.lock:
            free = capacity - len(self.running)
            queued = self._queued()
        if self.finished and queued >= threads:
            # Every thread has work waiting: let finishes gather (not long).
            age = time.monotonic() - self.first_finish
            if age < FINISH_DEFER:
                self.deferred_until = time.monotonic() + FINISH_DEFER - age
                return FINISH_DEFER - age
        claimed: list[Task] = []
        want = max(0, min(free, CLAIM_BATCH))
        batch = self._take_finished()
        earliest: int | None = None
        try:
            self._take_turns(submit)
            if not batch and want > 0:
                # Nothing to write: look (a read, no lock) before taking the write lock,
                # which on SQLite every other worker would wait for.
                earliest = sc.earliest_due()
                if earliest is None or earliest > time.time():
                    want = 0
            if batch or want > 0:
                claimed = self._finish_and_claim(batch, want)
                claimed = [t for t in claimed if self._catch_up(t) and self._split(t)]
                self._admit_many(claimed, submit)
                if want > 0 and len(claimed) == want:
                    self._set_db(True)
                    return 0.0  # there may be more due right now
                if free > 0:
                    earliest = sc.earliest_due()
            self._set_db(True)
        except DBAPIError as exc:
            self._set_db(False, exc)
            return self._backoff()
        longest = min(self.config.poll_interval, GROUP_RECHECK) if self.waiting \
            else self.config.poll_interval
        if free <= 0 or earliest is None:
            return longest
        wait = earliest - time.time()
        if wait <= 0 and not claimed:
            wait = 0.005  # due rows held by another claimer this instant
        return max(0.0, min(wait, longest))

    # -- concurrency: rows of their own, turns in a group ----------------------------------

    def _split(self, task: Task) -> bool:
        """An occurrence of an allow or replace schedule takes a row of its own, and the
        schedule moves on at once (Task.split_off); False when the lease was lost."""
        if not task.policy.overlaps:
            return True
        assert self.sc is not None
        if task.split_off(self.sc.owner, self.config.alive_time):
            return True
        log.warning("key=%s: lease lost before the occurrence of %d could start",
                    task.key, task.scheduled_time)
        return False

    def _admit_many(self, tasks: list[Task], submit: Callable[[Task], None]) -> None:
        """_admit each of `tasks`; those of no group (the usual case: nothing to ask the
        database) are held under one turn of the lock, then submitted."""
        plain = [t for t in tasks if t.group is None]
        self._hold(plain)
        for task in plain:
            submit(task)
        for task in tasks:
            if task.group is not None:
                self._admit(task, submit)

    def _admit(self, task: Task, submit: Callable[[Task], None]) -> None:
        """A claimed occurrence is held from now on (heartbeats, self-fencing) and
        starts, unless another run of its schedule runs (its group, `run KEY`): an extra
        run then waits here, queued, and starts once it ends; the schedule's own
        occurrence is given back until then (the end of that run wakes it)."""
        turn = TURN_START if task.group is None else task.group_turn()
        if turn == TURN_LOST:
            log.warning("key=%s: lease lost before the occurrence of %d could start",
                        task.key, task.scheduled_time)
            return
        if turn != TURN_START and RUN_NOW_MARK not in task.key:
            log.info("key=%s: the occurrence of %d waits: another run of the schedule "
                     "goes first", task.key, task.scheduled_time)
            try:
                task.give_back(wait=self.config.alive_time)
            except PreemptedError:
                pass  # changed meanwhile: whoever changed it decides
            return
        self._hold([task], queued=turn != TURN_START)
        if turn == TURN_START:
            submit(task)
        else:
            log.info("key=%s: queued: starts once the running occurrence of %s has ended",
                     task.key, task.group)

    def _hold(self, tasks: list[Task], queued: bool = False) -> None:
        """From now on `tasks` are held: heartbeated, fenced at their lease's end, and
        (`queued`) waiting for their turn in their group."""
        controls = [RunControl(lease_until(t.claimed_at, self.config.alive_time)
                               - self.fence_lead, self.fence_grace) for t in tasks]
        with self.lock:
            for task, control in zip(tasks, controls, strict=True):
                self.running[task.key] = task
                self.controls[task.key] = control
                if queued:
                    self.waiting[task.key] = task

    def _take_turns(self, submit: Callable[[Task], None]) -> None:
        """Ask again for the turn of each run queued here (at most every GROUP_RECHECK):
        those whose turn came start; those whose lease was lost (deleted, replaced,
        not renewed) are let go, never having run."""
        if not self.waiting or time.monotonic() - self.turns_asked < GROUP_RECHECK:
            return
        self.turns_asked = time.monotonic()
        waits: set[str | None] = set()  # groups told to wait this round
        for key, task in list(self.waiting.items()):
            with self.lock:
                control = self.controls.get(key)
            if control is not None and not control.is_set() and task.group in waits:
                continue  # one turn at a time: the others of its group ask next round
            turn = TURN_LOST if control is None or control.is_set() else task.group_turn()
            if turn == TURN_START:
                with self.lock:
                    del self.waiting[key]
                submit(task)
            elif turn != TURN_LOST:
                waits.add(task.group)
            else:
                log.warning("key=%s: lease lost while queued; it did not run", key)
                with self.lock:
                    del self.waiting[key]
                    self.running.pop(key, None)
                    self.controls.pop(key, None)

    def _group_ended(self, batch: list[Task], lost: set[str]) -> None:
        """Runs of a group whose finish was just written: a schedule's occurrence that
        gave way to them may run now (ScheduleCollection.wake_group)."""
        for task in batch:
            group = task.group
            if group is not None and task.key not in lost:
                self._wake_group(group)

    def _catch_up(self, task: Task) -> bool:
        """Apply the schedule's misfire and grace policy to an occurrence just claimed;
        False when nothing is to run now (the schedule moved on, its lease ended)."""
        now = time.time()
        try:
            plan = catchup.plan(task, now)
        except InvalidInputError as exc:  # no occurrence left: the finish will say so
            log.warning("key=%s: misfire policy not applied: %s", task.key, exc)
            return True
        if plan is None:
            return True
        assert self.sc is not None
        if plan.skipped:
            counters.occurrences_skipped(task.type, len(plan.skipped))
            more = "+" if len(plan.skipped) >= catchup.COUNT_CAP else ""
            log.warning("key=%s: skipped %d%s missed occurrence(s) (misfire %s%s), %s",
                        task.key, len(plan.skipped), more, task.policy.misfire,
                        f", grace {task.policy.grace}s" if task.policy.grace is not None
                        else "", f"running the one of {plan.run}" if plan.run is not None
                        else f"next at {plan.next_time}")
            keep = self.config.history_limit
            with self.lock:
                why = error_line(f"not run: misfire {task.policy.misfire}" + (
                    f", grace {task.policy.grace} s" if task.policy.grace is not None
                    else ""))
                self.history.extend(
                    {"key": task.key, "type": task.type, "scheduled_time": t,
                     "attempt": 0, "started_at": now, "finished_at": now,
                     "outcome": "skipped", "worker": self.sc.owner, "unit": None,
                     "exit_code": None, "signal": None, "duration": None,
                     "output": None, "error": why}
                    for t in reversed(plan.skipped[:keep]))
        if plan.run is None:
            task._end()
            assert plan.next_time is not None
            if self.store.advance([task.advance_to(plan.next_time)]):
                log.warning("key=%s: lease lost while skipping missed occurrences", task.key)
            return False
        if plan.run != task.scheduled_time:
            if not self.store.retarget(task.key, task.fence, plan.run):
                return False  # the lease is gone: nothing of it is ours to run
            task.scheduled_time = plan.run
        return True

    def _backoff(self) -> float:
        wait = self.db_backoff
        self.db_backoff = min(self.db_backoff * 2, DB_BACKOFF_MAX)
        return wait

    def run_one(self, task: Task) -> None:
        with self.lock:
            self.active += 1
        try:
            self._run_one(task)
        finally:
            with self.lock:
                self.active -= 1

    def _run_one(self, task: Task) -> None:
        started = time.time()
        # Due at the later of the occurrence (+delay) and this claim's due time: a retry or
        # a later --at is due after the occurrence; an --at before it runs early, never late.
        due = max(task.due_time, task.scheduled_time + task.delay)
        outcome = "failed"
        duration = 0.0
        unit: str | None = None
        result: RunResult | None = None
        error: str | None = None
        try:
            refusal = self._refusal(task) if task.type.startswith(EXEC_TYPE) else None
            if refusal is not None:
                task.refuse(refusal)
                outcome, error = "refused", error_line(refusal)
                return
            if task.type.startswith(EXEC_TYPE) and self._not_this_entrys(task):
                task.give_back(wait=min(self.config.retry_wait, NOT_APPLIED_WAIT))
                outcome = NOT_APPLIED  # untried, and no history row: not this host's
                return
            handler = self.router.match(task.type)
            if handler is None:
                # Claims ask for routed types only; this one slipped through (a database
                # regular expression that Python reads differently, a route that broke):
                # it goes back untried for a host that runs it.
                if task.type not in self.no_route_logged:
                    self.no_route_logged.add(task.type)
                    log.error("no route for type %r (key %s) although the claim matched it;"
                              " giving it back for %ds", task.type, task.key,
                              self.config.retry_wait)
                task.give_back(wait=self.config.retry_wait)
                outcome = "no_route"
                error = error_line(f"no route for type {task.type!r} on this host; given "
                                   "back untried")
                return
            counters.task_started(task.type, max(0.0, started - due))
            logsetup.info(log, f"start key={task.key} type={task.type} scheduled="
                          f"{int(task.scheduled_time)} attempt={int(task.attempt)} "
                          f"late={started - due:.3f}s")
            control = self.controls.get(task.key) or RunControl()  # one step: no lock
            run_id: str | None = None
            if isinstance(handler, ExecHandler):
                # Reported before the spawn: the master must know the run before any
                # process of it can become the master's orphan.
                run_id = self.new_run_id()
                self.report(pipe.Spawning(run_id).line())
            if task.policy.timeout is not None:  # the schedule's, over the route's
                handler = dataclasses.replace(handler, timeout=task.policy.timeout)
            try:
                result = run_task(
                    BatchedTask(task, self), handler, log=log, stop_event=control,
                    kill_grace=self.config.kill_grace, run_id=run_id,
                    on_spawn=None if run_id is None else
                    (lambda pgid, r=run_id: self.report(pipe.Spawned(r, pgid).line())),
                    on_unit=None if run_id is None else
                    (lambda name, r=run_id: self.report(pipe.UnitStarting(r, name).line())),
                    node=self.node,
                    tag=self.unit_tag, output_limit=self.config.output_limit,
                    log_output_limit=self.config.log_output_limit)
            finally:
                if run_id is not None:
                    self.report(pipe.Ended(run_id).line())
            outcome, duration, unit = str(result.outcome), result.duration, result.unit
            error = result.error
            if task.exhausted:
                outcome = "failed"
                error = error or error_line(task.exhausted)
                log.error("key=%s: %s", task.key, task.exhausted)
            if task.later_refused is not None:
                outcome, error = "failed", error_line(task.later_refused)
                log.error("key=%s: %s", task.key, task.later_refused)
            if task.gave_up:
                counters.occurrence_given_up(task.type)
            if task.gave_up and task.later_refused is None:
                log.error("key=%s: gave up the occurrence of %d after %d failed attempt(s) "
                          "(max_attempts); the schedule moves on", task.key,
                          task.scheduled_time, task.attempt)
            self.avg_duration = 0.8 * self.avg_duration + 0.2 * duration
            logsetup.info(log, f"end key={task.key} scheduled={int(task.scheduled_time)} "
                          f"attempt={int(task.attempt)} duration={duration:.3f}s "
                          f"outcome={outcome}" + (f" exit={result.exit_code}"
                                                  if result.exit_code is not None else ""))
            if outcome == "preempted":
                counters.lease_lost(task.type)
        except PreemptedError:
            outcome = "preempted"
            error = error_line("lease lost (schedule deleted, modified or taken over)")
            counters.lease_lost(task.type)
        except DBAPIError as exc:
            outcome = "db_error"
            error = error_line("could not record the result (database error); the "
                               "occurrence runs again when its lease expires")
            self._set_db(False, exc)
            log.error("key=%s: could not record the result (database error); the "
                      "occurrence runs again when its lease expires", task.key)
        except Exception as exc:  # noqa: BLE001 - a worker never dies of one task
            error = error_line(f"internal error: {type(exc).__name__}: {exc}")
            log.exception("key=%s: internal error while running the task", task.key)
        finally:
            counters.task_finished(task.type, outcome, duration)
            # Its history row first: whoever waits for no run to be left (a drain, a
            # stop) then writes it; recorded after, it was lost when a worker exited
            # between the two (a draining worker's last run had no history).
            if outcome != NOT_APPLIED:
                self._record(task, started, duration, outcome, unit, result, error)
            with self.lock:
                self.running.pop(task.key, None)
                self.controls.pop(task.key, None)
                # This run's thread is still counted active: it takes the next task.
                queued = self._queued() + 1
            if task.group is not None and task not in self.finished and not (
                    outcome == "later" and task.group == task.key):
                # Ended otherwise than by a finish (retry, release, stopped), or finished
                # and already written: the group's next run may start (a finish still
                # queued wakes it once written).  Not the row that asked to run later.
                self._wake_group(task.group)
            # While the loop sleeps letting finishes gather and every thread still has
            # a task waiting, a nudge would only turn the loop to defer again (a wake-up
            # per run of a burst of exec runs); it wakes by itself at deferred_until.
            if queued < self.config.concurrency or time.monotonic() >= self.deferred_until:
                self.nudge()

    def _refusal(self, task: Task) -> str | None:
        """Why this occurrence of a schedules file's exec entry must not run (it is not
        that entry's own row: fields.foreign_exec_row, whatever wrote it, a database peer
        included), as its paused_reason; logged.  None: it runs."""
        base = schedule_key(task.key)
        rows = {r.key: r for r in self.store.rows_of(keys=list({task.key, base}))}
        schedule = rows.get(base)
        entry = exec_entry_key(task.type) or ""
        why = foreign_exec_row(task.key, task.type,
                               None if schedule is None else (schedule.type, schedule.source),
                               self.entry_sources.get(entry))
        if why is None:
            return None
        reason = refused_reason(why)
        row = rows.get(task.key)
        log.warning("%s", refused_line(task.key, task.type,
                                       None if row is None else row.creator, reason))
        return reason

    def _not_this_entrys(self, task: Task) -> bool:
        """Whether entry K's own row holds other data than this host's entry K: written
        by another host whose file differs, or by a 0.1.0 client's `apply` that this
        host's convergence at start has not overwritten yet.  This host's command never
        runs with it; the row goes back untried (for the host whose entry it is, or
        until the convergence writes this host's data)."""
        entry = exec_entry_key(task.type)
        wanted = self.entry_data.get(entry or "")
        if wanted is None or task.key != entry or task.data == json.loads(wanted):
            return False
        if task.key not in self.not_applied_logged:
            self.not_applied_logged.add(task.key)
            log.warning("key=%s: its data is not this host's schedules file entry's; "
                        "given back untried", task.key)
        return True

    def _record(self, task: Task, started: float, duration: float, outcome: str,
                unit: str | None = None, result: RunResult | None = None,
                error: str | None = None) -> None:
        """Queue the history row of one run (written in batches by flush_history): what
        happened, with the exit status or signal, output tail and error line the
        executor gave (`result`, None when it did not run), or `error`."""
        row = {
            "key": task.key, "type": task.type, "scheduled_time": task.scheduled_time,
            "attempt": task.attempt, "started_at": started,
            "finished_at": started + duration if duration else time.time(),
            "outcome": outcome, "worker": self.sc.owner if self.sc else "?",
            "unit": unit, "exit_code": None, "signal": None,
            "duration": duration if result is not None else None, "output": None,
            "error": error,
        }
        if result is not None:
            row["exit_code"], row["signal"] = result.status, result.signal
            row["output"] = result.output
        if task.policy.notify:  # not a column: the schedule's own notifier, for on_recorded
            row["notify"] = task.policy.notify
        if self.on_recorded is not None:  # not a column: whose turn it is to be told
            row["creator"] = task.creator
        self.history.append(row)  # one step under the GIL; flush_history takes a prefix

    def _take_finished(self) -> list[Task]:
        batch = self.finished[:]
        del self.finished[:len(batch)]
        return batch

    def _finish_and_claim(self, batch: list[Task], want: int) -> list[Task]:
        """Write finished tasks and lease up to `want` more, in one transaction."""
        assert self.sc is not None
        try:
            lost, claimed = self.sc.finish_and_poll(batch, want)
        except DBAPIError:
            self.finished[:0] = batch  # the leases still protect them; try again
            raise
        self._report_lost(batch, lost)
        if batch:
            self._group_ended(batch, lost)
        return claimed

    def _wake_group(self, group: str) -> None:
        if self.sc is None:
            return
        try:
            self.sc.wake_group(group)
        except SQLAlchemyError:
            pass  # the waiting occurrence runs when its give-back ends (alive_time)

    def _report_lost(self, batch: list[Task], lost: set[str]) -> None:
        tasks = [t for t in batch if t.key in lost]
        why = self._why_lost(tasks)
        for task in tasks:
            if why[task.key] is StopReason.PREEMPTED:
                log.warning("key=%s: lease lost before its finish was written; the "
                            "occurrence may run again elsewhere", task.key)
            else:  # it runs nowhere again: nothing is left of it to run
                log.warning("key=%s: %s before its finish was written; its result is "
                            "discarded", task.key, REASON_TEXT[why[task.key]])
            counters.lease_lost(task.type)

    def _why_lost(self, tasks: list[Task]) -> dict[str, StopReason]:
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
            rows = self.store.group_holders({*bases, *bases.values()})  # those that exist
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

    def flush_history(self, force: bool = False) -> None:
        if self.sc is None or self.config.history_limit == 0:
            return
        now = time.monotonic()
        if not force and now - self.last_flush < HISTORY_FLUSH:
            return
        self.last_flush = now
        # Copy, then delete what was copied: rows task threads append meanwhile (without
        # the lock) stay for the next flush.
        batch = self.history[:]
        del self.history[:len(batch)]
        if not batch:
            return
        try:
            self.store.record_runs(batch)
        except DBAPIError:
            with self.lock:  # keep them for the next flush, bounded
                self.history[:0] = batch[-self.history_kept:]
            return
        self._recorded(batch)

    @property
    def history_kept(self) -> int:
        """How many unwritten history rows a worker keeps while the database is away:
        10,000, fewer when their output could make them weigh more than HISTORY_KEPT_BYTES."""
        return max(100, min(10_000, HISTORY_KEPT_BYTES // max(1, self.config.output_limit)))

    def _recorded(self, batch: list[dict[str, Any]]) -> None:
        """Hand a written batch to on_recorded.  It runs on the claim loop: it must not
        block (it queues); what it raises is logged once and swallowed, since a run's
        record is written whatever its observers do."""
        if self.on_recorded is None:
            return
        try:
            self.on_recorded(batch)
        except Exception:  # noqa: BLE001 - an observer never stops the worker
            if not self.on_recorded_failed:
                self.on_recorded_failed = True
                log.exception("on_recorded failed (logged once; the history is written)")

    # -- heartbeat --------------------------------------------------------------------------

    def heartbeat_loop(self) -> None:
        interval = max(0.2, self.config.alive_time / 3)
        wait = interval
        while not self.kill_event.wait(wait):
            with self.lock:
                # Finished tasks whose result is not written yet keep their lease too.  A
                # key held twice (finished, then claimed again) keeps its newest fence: the
                # claim shows the older finish was written.
                newest: dict[str, int] = {}
                for t in (*self.finished, *self.running.values()):
                    newest[t.key] = max(t.fence, newest.get(t.key, t.fence))
                held = list(newest.items())
            if not held or self.sc is None:
                wait = interval
                continue
            # A renewal that failed (an outage, a hung server cut at its deadline, a
            # failover) is tried again soon, not a third of alive_time later: the runs
            # keep going until their fence_at, and are renewed as soon as a primary
            # answers.
            wait = interval if self.renew(held) else min(interval, HEARTBEAT_RETRY)

    def renew(self, held: list[tuple[str, int]], now: float | None = None) -> bool:
        """One heartbeat of the leases `held` ((key, fence) pairs); False when the
        database did not answer."""
        assert self.sc is not None
        try:
            lease = lease_until(time.time() if now is None else now, self.config.alive_time)
            lost = self.store.heartbeat(held, lease)
        except SQLAlchemyError as exc:  # not only DBAPIError: this thread must not die
            # No renewal: the runs' fence_at stays, and they stop themselves in time.
            self._set_db(False, exc)
            return False
        self._renewed(held, lost, lease)
        return True

    def _renewed(self, held: list[tuple[str, int]], lost: set[str], lease: int) -> None:
        """After a heartbeat: renewed runs move their fence; lost ones are stopped.  Only
        the run that holds the fence renewed is touched: a key may have been finished and
        claimed again meanwhile (a newer run with a newer fence)."""
        with self.lock:
            runs = {k: (t, self.controls.get(k)) for k, t in self.running.items()}
            pending = {(t.key, t.fence) for t in self.finished}
        stopping: list[tuple[Task, RunControl]] = []
        for key, fence in held:
            task, control = runs.get(key, (None, None))
            if task is None or control is None or task.fence != fence:
                if key in lost and (key, fence) in pending:
                    log.warning("key=%s: lease lost before its finish was written", key)
                continue
            if key not in lost:
                control.fence_at = lease - self.fence_lead
            elif control.reason is None:
                stopping.append((task, control))
        why = self._why_lost([task for task, _ in stopping])
        for task, control in stopping:
            reason = why[task.key]
            if reason is StopReason.PREEMPTED:
                log.warning("key=%s: lease lost (deleted, modified or taken over); "
                            "stopping its run", task.key)
            else:
                log.warning("key=%s: %s; stopping its run", task.key, REASON_TEXT[reason])
            control.stop(reason)

    # -- stop -------------------------------------------------------------------------------

    def stop_runs(self, reason: StopReason) -> None:
        with self.lock:
            controls = list(self.controls.values())
        for control in controls:
            control.stop(reason)

    def _as_daemon_user(self, task: Task) -> bool:
        """Whether `task` runs as this process's user where that user holds the polkit
        grant: what the grant refuses (config.privilege_refusal), exec and python runs
        and units without another user."""
        handler = self.router.match(task.type)
        return handler is not None and privilege_refusal(
            handler.route.executor, handler.route.user, True) is not None

    def stop_runs_as_daemon_user(self) -> int:
        """The polkit grant came on (pipe.GRANT): stop every run, started or queued,
        that runs as the daemon's user (StopReason.GRANT: given back untried, its history
        says why); how many were told."""
        with self.lock:
            held = [(t, self.controls.get(k)) for k, t in self.running.items()]
        stopped = 0
        for task, control in held:
            if control is not None and self._as_daemon_user(task):
                control.stop(StopReason.GRANT)
                stopped += 1
        return stopped

    def runs_as_daemon_user(self) -> list[str]:
        """The keys of the runs held here that run as the daemon's user."""
        with self.lock:
            tasks = list(self.running.values())
        return [t.key for t in tasks if self._as_daemon_user(t)]

    def give_back_queued(self, tasks: list[Task]) -> int:
        """A draining worker's claimed occurrences that no thread started (`tasks`, and
        the runs queued for their turn in a group): back now, to run on another worker;
        how many went back."""
        with self.lock:
            tasks = [*tasks, *self.waiting.values()]
            self.waiting.clear()
            for task in tasks:
                if self.running.get(task.key) is task:
                    del self.running[task.key]
                    self.controls.pop(task.key, None)
        given = 0
        for task in tasks:
            try:
                task.give_back()
                given += 1
            except PreemptedError:
                log.warning("key=%s: lease lost before it could be given back", task.key)
            except SQLAlchemyError as exc:
                self._set_db(False, exc)
                log.warning("key=%s: could not give it back (database error); it runs "
                            "again when its lease expires", task.key)
        return given

    def drain_step(self) -> None:
        """A draining worker's turn: write the finishes and history of the runs that
        ended; claim nothing."""
        self.flush_history()
        batch = self._take_finished()
        if not batch or self.sc is None:
            return
        try:
            self._finish_and_claim(batch, 0)
            self._set_db(True)
        except DBAPIError as exc:
            self._set_db(False, exc)  # the batch is queued again; its leases hold it

    def give_back_leftovers(self) -> None:
        """Runs that did not end (python handlers stuck in C code): their occurrences go
        back to run again elsewhere."""
        with self.lock:
            leftover = list(self.running.values())
        for task in leftover:
            try:
                task.give_back()
            except Exception:  # noqa: BLE001 - best effort at exit; the lease expires anyway
                pass

    def close(self) -> None:
        """Write what finished, record the history, close the store."""
        self.kill_event.set()
        try:
            if self.sc is not None and self.finished:
                self._finish_and_claim(self._take_finished(), 0)
        except DBAPIError:
            log.error("could not write %d finished task(s); they run again when their "
                      "leases expire", len(self.finished))
        self.flush_history(force=True)
        counters.flush_tasks()
        if self.sc is not None:
            self.sc.close()
