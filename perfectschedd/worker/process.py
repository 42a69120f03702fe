"""One forked worker: the process shell around its lease pipeline (leases.py, and its
steps: claims.py, runs.py, heartbeat.py, stopping.py).

The worker talks to its master through two pipes: it reads `wake` (pipe.WAKE means
"look for due work now", pipe.DRAIN "drain": a reload; EOF means the master died) and
writes `alive`: a pinger thread's line every PING_INTERVAL (running count, database
state, how long ago the main loop last turned and whether it is inside a database call:
so a worker waiting on a slow database is not mistaken for a wedged one), and for each
exec run its id and process group, so that the master can kill what is left of it if
this worker dies.
It sleeps until the earliest `next_run_time` in the table, bounded by `poll_interval`,
so a due occurrence starts within milliseconds.

A run lives only as long as its lease: a heartbeat that finds the lease lost stops the
run (TERM, then KILL after kill_grace) and writes nothing; a run whose lease could not
be renewed stops itself before the lease can expire for the others (self-fencing, see
`fence_lead`); when the master dies, runs stop at once.

Draining (a reload) is not stopping: the worker claims nothing more, gives back at once
the occurrences it claimed but did not start, and keeps renewing, finishing and recording
its running jobs until the last one ends by itself; then it exits.  Only TERM/QUIT (or
the master's death) stop its jobs, as they would any worker's.
"""

from __future__ import annotations

import logging
import os
import queue
import select
import selectors
import signal
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from perfectschedd import logsetup
from perfectschedd.config import Config
from perfectschedd.executors import command, reaper, runmarks
from perfectschedd.executors.base import StopReason
from perfectschedd.metrics import counters
from perfectschedd.notify.dispatch import STATE_OUTCOMES, Dispatcher
from perfectschedd.schedules.task import Task
from perfectschedd.store.sql import Store
from perfectschedd.worker import claims, pipe, runs, stopping
from perfectschedd.worker.heartbeat import heartbeat_loop
from perfectschedd.worker.leases import LeasePipeline

log = logging.getLogger("perfectschedd.worker")

PING_INTERVAL = 1.0
# How long a run event may wait for room in the alive pipe (the master reads it at once
# unless it is gone or stuck).
REPORT_WAIT = 2.0
# How long a stopping worker waits for its queued notifications to go out.
NOTIFY_DRAIN = 5.0


class TaskThreads:
    """`size` threads running tasks from a queue.

    Not concurrent.futures: a Future and a work item per task, and the executor's
    bookkeeping, cost more than a trivial task itself; nothing here needs a result.
    """

    def __init__(self, size: int, run: Callable[[Task], None]) -> None:
        self._queue: queue.SimpleQueue[Task | None] = queue.SimpleQueue()
        self._run = run
        self._stopped = False
        self._size = size
        for i in range(size):
            threading.Thread(target=self._loop, name=f"task-{i}", daemon=True).start()

    def submit(self, task: Task) -> None:
        self._queue.put(task)

    def take_queued(self) -> list[Task]:
        """The tasks no thread has started yet, taken off the queue."""
        taken = []
        while True:
            try:
                task = self._queue.get_nowait()
            except queue.Empty:
                return taken
            if task is not None:
                taken.append(task)

    def _loop(self) -> None:
        while True:
            task = self._queue.get()
            if task is None or self._stopped:
                return
            self._run(task)

    def shutdown(self) -> None:
        """Threads finish the task they run and start no other."""
        self._stopped = True
        while True:  # drop what waits, then wake every thread with a sentinel
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        for _ in range(self._size):
            self._queue.put(None)


class Worker:
    def __init__(self, config: Config, index: int, wake_fd: int, alive_fd: int,
                 master_pid: int, store: Store | None = None) -> None:
        self.config = config
        self.index = index
        self.wake_fd = wake_fd
        self.alive_fd = alive_fd
        self.master_pid = master_pid
        self.stopping = threading.Event()  # no new claims; runs stop (bounded)
        self.draining = False  # no new claims; runs go on to their end (main loop only)
        # pipe.GRANT came: its runs as the daemon's user were stopped; the master is told
        # once none is left (_grant_done).
        self.grant_pending = False
        # Notifications only where some notifier is configured: without one, the
        # pipeline's history path is exactly as before.
        self.notices: Dispatcher | None = None
        if config.all_notifiers():
            self.notices = Dispatcher(config, self._previous_outcome,
                                      previous_many=self._previous_outcomes)
        self.pipeline = LeasePipeline(
            config, report=self._report, nudge=self._nudge, while_waiting=self._ping,
            on_recorded=None if self.notices is None else self.notices.on_recorded,
            store=store)
        self.master_gone = False
        self.report_dropped = False
        self.last_ping = 0.0
        self.loop_at = time.monotonic()  # the main loop's last turn
        self.in_db = False  # the main loop is inside a database call
        self.selfpipe_r, self.selfpipe_w = os.pipe()
        os.set_blocking(self.selfpipe_w, False)
        self.nudged = False
        os.set_blocking(alive_fd, False)

    # -- plumbing ---------------------------------------------------------------------------

    def _previous_outcome(self, key: str, before: float) -> str | None:
        """For the notification thread: `key`'s last state outcome before a run."""
        if self.pipeline.sc is None:
            return None
        return self.pipeline.store.last_outcome(key, before, STATE_OUTCOMES)

    def _previous_outcomes(self, runs: list[tuple[str, float]]) -> dict[str, str | None]:
        """The same for many keys, in one query."""
        if self.pipeline.sc is None:
            return {}
        return self.pipeline.store.last_outcomes(runs, STATE_OUTCOMES)

    def _nudge(self, force: bool = False) -> None:
        # One wake-up byte until the loop has read it: a burst of finishing tasks must not
        # cost a system call (and a GIL hand-over) each.
        if self.nudged and not force:
            return
        self.nudged = True
        try:
            os.write(self.selfpipe_w, b"x")
        except OSError:
            pass  # pipe full: the loop is awake anyway

    def _on_term(self, signum: int, frame: Any) -> None:
        self.stopping.set()
        self._nudge(force=True)

    def _on_usr2(self, signum: int, frame: Any) -> None:
        logsetup.reopen()

    def _pinger(self) -> None:
        """Liveness from a thread of its own: it keeps going while the main loop waits on
        the database, and stops when the whole process is frozen or holds the GIL."""
        while True:  # until the process exits (a daemon thread)
            time.sleep(PING_INTERVAL)
            self._ping(force=True)
            # Task starts and ends reach /metrics within a second also while the main
            # loop waits (on the database, or for the next due time).
            counters.flush_tasks()

    def _ping(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last_ping < PING_INTERVAL:
            return
        self.last_ping = now
        in_db = self.in_db  # read before loop_at, which is set before in_db is cleared
        ping = pipe.Ping(self.pipeline.running_count(), self.pipeline.db_ok,
                         now - self.loop_at, in_db)
        try:
            os.write(self.alive_fd, pipe.encode(ping.line()))
        except BlockingIOError:
            pass
        except OSError:
            self.stopping.set()  # master gone

    def _report(self, line: str) -> None:
        """A run event (a pipe message's line) for the master; unlike pings, it waits for
        room in the pipe."""
        data = pipe.encode(line)
        deadline = time.monotonic() + REPORT_WAIT
        while True:
            try:
                os.write(self.alive_fd, data)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    if not self.report_dropped:
                        self.report_dropped = True
                        log.warning("master not reading; run events dropped (its "
                                    "processes are still found by their run id)")
                    return
                select.select([], [self.alive_fd], [], 0.05)
            except OSError:
                self.stopping.set()  # master gone
                return

    # -- main loop ------------------------------------------------------------------------

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_term)
        signal.signal(signal.SIGQUIT, self._on_term)
        # Ctrl-C and reload signals are the master's.  A no-op handler, not SIG_IGN: an
        # ignored signal would stay ignored in every command the worker execs.
        for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
            signal.signal(sig, _ignore)
        signal.signal(signal.SIGUSR2, self._on_usr2)
        for problem in self.pipeline.router.preload():
            log.error("%s; its tasks are retried until a reload fixes it", problem)
        log.info("worker %d started", self.index)
        sel = selectors.DefaultSelector()
        sel.register(self.wake_fd, selectors.EVENT_READ)
        sel.register(self.selfpipe_r, selectors.EVENT_READ)
        pool = TaskThreads(self.config.concurrency, partial(runs.run_one, self.pipeline))
        beat = threading.Thread(target=heartbeat_loop, args=(self.pipeline,), name="heartbeat",
                                daemon=True)
        beat.start()
        threading.Thread(target=self._pinger, name="pinger", daemon=True).start()
        try:
            while not self.stopping.is_set() and not self.draining:
                self.loop_at = time.monotonic()
                self._ping()
                self.in_db = True
                try:
                    wait = claims.step(self.pipeline, pool.submit)
                finally:
                    # The loop moves on now: a ping between here and the next turn must
                    # not report the time spent waiting on the database as a stall.
                    self.loop_at = time.monotonic()
                    self.in_db = False
                deadline = time.monotonic() + wait
                while not self._sleep(sel, deadline):
                    self.loop_at = time.monotonic()
                    self._ping()
            if self.draining and not self.stopping.is_set():
                self._drain(pool, sel)
        finally:
            self._shutdown(pool)
        return 0

    def _sleep(self, sel: selectors.BaseSelector, deadline: float) -> bool:
        """Wait at most PING_INTERVAL for a wake-up; True when it is time to poll again."""
        events = sel.select(max(0.0, min(deadline - time.monotonic(), PING_INTERVAL)))
        self.nudged = False  # before _step runs: later finishes will wake us again
        for key, _ in events:
            data = os.read(key.fd, 4096)
            if key.fd == self.wake_fd and not data:
                self._master_gone()
            elif key.fd == self.wake_fd:
                if pipe.DRAIN in data:
                    self.draining = True
                if pipe.GRANT in data:
                    self._grant()
        if os.getppid() != self.master_pid:
            self._master_gone()
        return bool(events) or self.stopping.is_set() or time.monotonic() >= deadline

    def _master_gone(self) -> None:
        if not self.master_gone:
            log.warning("master process gone; worker stops its runs and exits")
        self.master_gone = True
        self.stopping.set()

    # -- the polkit grant came on ---------------------------------------------------------

    def _grant(self) -> None:
        """Stop the runs that run as the daemon's user (they may not while it holds the
        grant: one could start a unit as root), then drain: this worker's routes are the
        configuration's from before, the master starts workers that refuse those."""
        self.draining = True
        if not self.grant_pending:
            self.grant_pending = True
            stopped = stopping.stop_runs_as_daemon_user(self.pipeline)
            log.warning("worker %d: the polkit grant is on: stopping %d run(s) as the "
                        "daemon's user; then it drains", self.index, stopped)
        self._grant_done()

    def _grant_done(self) -> None:
        """Tell the master once no run as the daemon's user is left here."""
        if self.grant_pending and not stopping.runs_as_daemon_user(self.pipeline):
            self.grant_pending = False
            self._report(pipe.GrantDone().line())

    # -- drain (a reload) -------------------------------------------------------------------

    def _drain(self, pool: TaskThreads, sel: selectors.BaseSelector) -> None:
        """Give back what waits, then write the running jobs' finishes and history as
        they end (the heartbeat thread renews their leases meanwhile) until none runs."""
        queued = pool.take_queued()
        self.in_db = True
        try:
            gave = stopping.give_back_queued(self.pipeline, queued)
        finally:
            self.in_db = False
        if gave:
            self._report(pipe.GaveBack().line())  # the master wakes the other workers
        log.info("worker %d drains (a reload): %d running task(s) go on to their end, "
                 "%d queued given back", self.index, self.pipeline.running_count(), gave)
        while self.pipeline.running_count() and not self.stopping.is_set():
            self._grant_done()
            self.loop_at = time.monotonic()
            self._ping()
            self.in_db = True
            try:
                claims.drain_step(self.pipeline)
            finally:
                self.in_db = False
            self._sleep(sel, time.monotonic() + PING_INTERVAL)  # a run's end wakes it
        self._grant_done()
        if not self.stopping.is_set():
            log.info("worker %d drained", self.index)

    # -- stop -----------------------------------------------------------------------------

    def _shutdown(self, pool: TaskThreads) -> None:
        # Without a master nobody would kill what a run leaves behind if this worker
        # died next: runs stop now rather than at the end of a graceful wait.
        grace = 0.0 if self.master_gone else self.config.shutdown_timeout
        deadline = time.monotonic() + grace
        n = self.pipeline.running_count()
        if n and grace:
            log.info("stopping: waiting up to %.0fs for %d running task(s)", grace, n)
        while time.monotonic() < deadline and self.pipeline.running_count():
            self.loop_at = time.monotonic()  # waiting for runs is not being wedged
            self._ping(force=True)
            time.sleep(0.05)
        # Exec groups get TERM/KILL, tasks are given back.
        stopping.stop_runs(self.pipeline, StopReason.SHUTDOWN)
        pool.shutdown()  # queued tasks are not started; they are given back below
        end = time.monotonic() + self.config.kill_grace + 2
        while time.monotonic() < end and self.pipeline.running_count():
            self.loop_at = time.monotonic()
            time.sleep(0.05)
        command.kill_all_groups()
        if self.master_gone:
            # Their orphans went to init, not to a master that would kill them.
            me = os.getpid()
            runmarks.kill_marked(lambda r: reaper.worker_of(r) == me, me=me)
        stopping.give_back_leftovers(self.pipeline)
        if self.notices is not None:
            # The last runs' notifications, briefly: a stop must not wait on a receiver.
            self.pipeline.flush_history(force=True)
            self.notices.drain(NOTIFY_DRAIN)
        claims.close(self.pipeline)
        log.info("worker %d stopped", self.index)


def _ignore(signum: int, frame: Any) -> None:
    pass


def run(config: Config, index: int, wake_fd: int, alive_fd: int, master_pid: int,
        store: Store | None = None) -> int:
    """`store`: the master's open store of this configuration's database, to use
    (LeasePipeline); None: the worker opens its own."""
    logsetup.set_process_name(f"worker-{index}")
    return Worker(config, index, wake_fd, alive_fd, master_pid, store).run()
