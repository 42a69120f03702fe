"""A worker's lease pipeline: the occurrences it holds, from the claim to the written
finish, and the state the pipeline's steps share.  No process plumbing here (process.py
is the shell around it), so it is tested with a real SQLite file and no processes
(tests/worker/test_leases.py).

Each step has a module of its own, working on this state: claims.py (the claim loop:
finishes written and occurrences claimed in one transaction), admission.py (from a claim
to a thread: misfire catch-up, rows of their own, turns in a group), runs.py (one run on
a task thread), ending.py (the one place a run's task is ended), heartbeat.py (leases
renewed, lost runs stopped), history_queue.py (history rows written in batches),
stopping.py (runs told to end: stop, grant, drain, exit).

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

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy.exc import SQLAlchemyError

from perfectschedd.config import Config
from perfectschedd.executors import reaper
from perfectschedd.executors.base import RunControl
from perfectschedd.executors.router import Router
from perfectschedd.metrics import counters
from perfectschedd.schedules.collection import ScheduleCollection
from perfectschedd.schedules.task import Task
from perfectschedd.settings import unit_props
from perfectschedd.store.sql import Store
from perfectschedd.vocabulary.fields import EXEC_TYPE
from perfectschedd.worker.history_queue import HistoryQueue

log = logging.getLogger("perfectschedd.worker")

FAST_TASK = 0.05  # the average task duration starts from twice this (claims.py)


class LeasePipeline:
    """A worker's claimed occurrences, from the claim to the written finish; the state
    the steps of the pipeline (claims, admission, runs, heartbeat, stopping) work on."""

    def __init__(self, config: Config, *, report: Callable[[str], None] = lambda line: None,
                 nudge: Callable[[], None] = lambda: None,
                 while_waiting: Callable[[], None] | None = None,
                 on_recorded: Callable[[list[dict[str, Any]]], None] | None = None,
                 store: Store | None = None) -> None:
        """`store`: an open store of `config`'s database to use (the master's, forked
        with the worker); None: one is opened at the first step."""
        self.config = config
        self.given_store = store
        self.report = report        # a run event for the master
        self.nudge = nudge          # a run ended: the claim loop should look again
        self.while_waiting = while_waiting  # called while waiting for SQLite's writer lock
        self.history = HistoryQueue(config.output_limit, on_recorded)
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
        # on no thread); the claim loop asks for their turn again (admission.take_turns).
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
        self.finished: list[Task] = []  # finished by their runs, not yet written
        # Seconds, a moving average quick to follow: it starts just "slow", so a few
        # short tasks turn prefetch on and one long task turns it off again.
        self.avg_duration = 2 * FAST_TASK
        self.active = 0  # tasks a thread runs now (the rest of `running` is queued)
        self.first_finish = 0.0  # when the oldest unwritten finish ended
        self.deferred_until = 0.0  # the loop lets finishes gather until then (claims.py)
        self.no_route_logged: set[str] = set()
        self.db_ok = True
        self.db_backoff = 0.5

    @property
    def store(self) -> Store:
        """The open collection's store: the calls the collection does not offer (claim
        filters, advances and retargets, history, heartbeats) go to it directly."""
        assert self.sc is not None
        return self.sc.store

    def queued_count(self) -> int:
        """Runs claimed and waiting for a thread (not those waiting for their group's
        turn); the caller holds the lock."""
        return len(self.running) - self.active - len(self.waiting)

    def running_count(self) -> int:
        """Runs this worker has started or will start (queued for their turn in a group
        not counted: a stop gives them back at once)."""
        with self.lock:
            return len(self.running) - len(self.waiting)

    def set_db(self, ok: bool, exc: BaseException | None = None) -> None:
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

    def wake_group(self, group: str) -> None:
        """A run of `group` ended: the occurrence waiting for it may run now."""
        if self.sc is None:
            return
        try:
            self.sc.wake_group(group)
        except SQLAlchemyError:
            pass  # the waiting occurrence runs when its give-back ends (alive_time)

    def flush_history(self, force: bool = False) -> None:
        """Write the history rows queued (HistoryQueue.flush).  With history_limit 0 none
        is kept: the rows are dropped unwritten, but still told to on_recorded (a failure
        is notified whatever history keeps), and never pile up in the worker."""
        if self.sc is None:
            return
        self.history.flush(self.store if self.config.history_limit else None, force)

