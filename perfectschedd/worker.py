"""One forked worker: claim -> run with heartbeat -> finish/retry.

The worker talks to its master through two pipes: it reads `wake` (a byte means "look
for due work now"; EOF means the master died) and writes `alive`: a pinger thread's line
every PING_INTERVAL (running count, database state, how long ago the main loop last
turned and whether it is inside a database call: so a worker waiting on a slow database
is not mistaken for a wedged one), and for each exec run its id and process group, so
that the master can kill what is left of it if this worker dies.
It sleeps until the earliest `next_run_time` in the table, bounded by `poll_interval`,
so a due occurrence starts within milliseconds.

A run lives only as long as its lease: a heartbeat that finds the lease lost stops the
run (TERM, then KILL after kill_grace) and writes nothing; a run whose lease could not
be renewed stops itself before the lease can expire for the others (self-fencing, see
`fence_lead`); when the master dies, runs stop at once.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import queue
import select
import selectors
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy.exc import DBAPIError, SQLAlchemyError

from . import handlers, jobreaper, logsetup, metrics
from .config import Config
from .errors import PreemptedError
from .handlers import RunControl, StopReason
from .schedules import ScheduleCollection, Task

log = logging.getLogger("perfectschedd.worker")

# Most occurrences one claim takes at once: big enough for bursts, small enough that one
# worker does not hoard a backlog another worker could start.
CLAIM_BATCH = 64
# While tasks take less than FAST_TASK seconds on average, a worker leases up to PREFETCH
# times `concurrency` occurrences at once, so the pool never waits for the database; slow
# tasks never queue behind each other (another worker or host can take them).
FAST_TASK = 0.05
PREFETCH = 8
PING_INTERVAL = 1.0
HISTORY_FLUSH = 0.5
DB_BACKOFF_MAX = 5.0  # a cron must resume soon after its database does
# How long a run event may wait for room in the alive pipe (the master reads it at once
# unless it is gone or stuck).
REPORT_WAIT = 2.0


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


class BatchedTask:
    """The task as a handler sees it: `finish()` is queued and written with the other
    finishes of this worker in one transaction (the daemon's hot path).  A lease lost
    meanwhile is logged and counted when the batch is written, not raised in the handler.
    """

    __slots__ = ("_task", "_queue")

    def __init__(self, task: Task, queue: list[Task]) -> None:
        self._task = task
        self._queue = queue

    def __getattr__(self, name: str) -> Any:
        return getattr(self._task, name)

    def finish(self) -> None:
        self._task._end()
        self._queue.append(self._task)  # list.append is atomic under the GIL

    def retry(self, wait: float | None = None) -> None:
        self._task.retry(wait)

    def release(self) -> None:
        self._task.release()

    def heartbeat(self) -> None:
        self._task.heartbeat()

    def give_back(self) -> None:
        self._task.give_back()


class Worker:
    def __init__(self, config: Config, index: int, wake_fd: int, alive_fd: int,
                 master_pid: int) -> None:
        self.config = config
        self.index = index
        self.wake_fd = wake_fd
        self.alive_fd = alive_fd
        self.master_pid = master_pid
        self.stopping = threading.Event()  # no new claims
        self.kill_event = threading.Event()  # running handlers must end now
        self.sc: ScheduleCollection | None = None
        self.router = handlers.Router(config.routes, log=log)
        self.running: dict[str, Task] = {}
        # Per running key: what stops its run (shutdown, lease lost, self-fencing).
        self.controls: dict[str, RunControl] = {}
        # Self-fencing: a run stops this long before its lease expires unless a heartbeat
        # renewed it; alive_time/10 is the clock skew tolerated between hosts, kill_grace
        # the time TERM gets before KILL.  Never more than a quarter of alive_time, so
        # that a short lease is not fenced before its first heartbeat (alive_time/3).
        alive = config.alive_time
        self.fence_lead = min(alive / 10 + config.kill_grace, alive / 4)
        self.fence_grace = max(0.1, self.fence_lead - alive / 10)
        self.run_ids = (f"{os.getpid()}.{time.time_ns() // 1_000_000 % 10**9}.{n}"
                        for n in itertools.count(1))
        self.master_gone = False
        self.report_dropped = False
        self.lock = threading.Lock()
        self.history: list[dict[str, Any]] = []
        self.finished: list[Task] = []  # finished by handlers, not yet written
        # Seconds, a moving average quick to follow: it starts just "slow", so a few
        # short tasks turn prefetch on and one long task turns it off again.
        self.avg_duration = 2 * FAST_TASK
        self.no_route_logged: set[str] = set()
        self.db_ok = True
        self.db_backoff = 0.5
        self.last_ping = 0.0
        self.loop_at = time.monotonic()  # the main loop's last turn
        self.in_db = False  # the main loop is inside a database call
        self.last_flush = time.monotonic()
        self.selfpipe_r, self.selfpipe_w = os.pipe()
        os.set_blocking(self.selfpipe_w, False)
        self.nudged = False
        os.set_blocking(alive_fd, False)

    # -- plumbing ---------------------------------------------------------------------------

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

    def _ping(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last_ping < PING_INTERVAL:
            return
        self.last_ping = now
        with self.lock:
            n = len(self.running)
        line = f"{n} {int(self.db_ok)} {now - self.loop_at:.1f} {int(self.in_db)}\n"
        try:
            os.write(self.alive_fd, line.encode())
        except BlockingIOError:
            pass
        except OSError:
            self.stopping.set()  # master gone

    def _report(self, line: str) -> None:
        """A run event for the master; unlike pings, it waits for room in the pipe."""
        data = f"{line}\n".encode()
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

    def _set_db(self, ok: bool, exc: BaseException | None = None) -> None:
        if ok and not self.db_ok:
            log.info("database reachable again")
            self.db_backoff = 0.5
        elif not ok:
            if self.db_ok:
                log.error("database unreachable: %s; retrying with back-off",
                          str(exc).splitlines()[0] if exc else "?")
            metrics.db_error()
        if ok != self.db_ok:
            metrics.set_db_up(ok)
        self.db_ok = ok

    # -- main loop ------------------------------------------------------------------------

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_term)
        signal.signal(signal.SIGQUIT, self._on_term)
        # Ctrl-C and reload signals are the master's.  A no-op handler, not SIG_IGN: an
        # ignored signal would stay ignored in every command the worker execs.
        for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGUSR1):
            signal.signal(sig, _ignore)
        signal.signal(signal.SIGUSR2, self._on_usr2)
        for problem in self.router.preload():
            log.error("%s; its tasks are retried until a reload fixes it", problem)
        log.info("worker %d started", self.index)
        sel = selectors.DefaultSelector()
        sel.register(self.wake_fd, selectors.EVENT_READ)
        sel.register(self.selfpipe_r, selectors.EVENT_READ)
        pool = TaskThreads(self.config.concurrency, self._run_one)
        beat = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        beat.start()
        threading.Thread(target=self._pinger, name="pinger", daemon=True).start()
        try:
            while not self.stopping.is_set():
                self.loop_at = time.monotonic()
                self._ping()
                self.in_db = True
                try:
                    wait = self._step(pool)
                finally:
                    self.in_db = False
                deadline = time.monotonic() + wait
                while not self._sleep(sel, deadline):
                    self.loop_at = time.monotonic()
                    self._ping()
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
        if os.getppid() != self.master_pid:
            self._master_gone()
        return bool(events) or self.stopping.is_set() or time.monotonic() >= deadline

    def _step(self, pool: TaskThreads) -> float:
        """Claim and start what is due; return how long to sleep."""
        self._flush_history()
        if self.sc is None:
            try:
                self.sc = ScheduleCollection(self.config)
                if self.sc.store.write_lock is not None:
                    self.sc.store.write_lock.while_waiting = self._ping
                self.sc.store.warm_up()
                self._set_db(True)
            except (SQLAlchemyError, OSError) as exc:
                self._set_db(False, exc)
                return self._backoff()
        sc = self.sc
        capacity = self.config.concurrency
        if self.avg_duration < FAST_TASK:
            capacity *= PREFETCH
        with self.lock:
            free = capacity - len(self.running)
        claimed: list[Task] = []
        want = max(0, min(free, CLAIM_BATCH))
        batch = self._take_finished()
        earliest: int | None = None
        try:
            if not batch and want > 0:
                # Nothing to write: look (a read, no lock) before taking the write lock,
                # which on SQLite every other worker would wait for.
                earliest = sc.earliest_due()
                if earliest is None or earliest > time.time():
                    want = 0
            if batch or want > 0:
                claimed = self._finish_and_claim(batch, want)
                for task in claimed:
                    # The claim wrote the lease as int(claimed_at) + alive_time.
                    control = RunControl(int(task.claimed_at) + self.config.alive_time
                                         - self.fence_lead, self.fence_grace)
                    with self.lock:
                        self.running[task.key] = task
                        self.controls[task.key] = control
                    pool.submit(task)
                if want > 0 and len(claimed) == want:
                    self._set_db(True)
                    return 0.0  # there may be more due right now
                if free > 0:
                    earliest = sc.earliest_due()
            self._set_db(True)
        except DBAPIError as exc:
            self._set_db(False, exc)
            return self._backoff()
        if free <= 0 or earliest is None:
            return self.config.poll_interval
        wait = earliest - time.time()
        if wait <= 0 and not claimed:
            wait = 0.005  # due rows held by another claimer this instant
        return max(0.0, min(wait, self.config.poll_interval))

    def _master_gone(self) -> None:
        if not self.master_gone:
            log.warning("master process gone; worker stops its runs and exits")
        self.master_gone = True
        self.stopping.set()

    def _backoff(self) -> float:
        wait = self.db_backoff
        self.db_backoff = min(self.db_backoff * 2, DB_BACKOFF_MAX)
        return wait

    # -- one task ---------------------------------------------------------------------------

    def _run_one(self, task: Task) -> None:
        started = time.time()
        # Due at the later of the occurrence (+delay) and this claim's due time: a retry or
        # a later --at is due after the occurrence; an --at before it runs early, never late.
        due = max(task.due_time, task.scheduled_time + task.delay)
        outcome = "failed"
        duration = 0.0
        try:
            handler = self.router.match(task.type)
            if handler is None:
                if task.type not in self.no_route_logged:
                    self.no_route_logged.add(task.type)
                    log.error("no route for type %r (key %s); retrying its tasks every "
                              "retry_wait=%ds until a route is configured",
                              task.type, task.key, self.config.retry_wait)
                task.retry()
                outcome = "no_route"
                return
            metrics.task_started(task.type, max(0.0, started - due))
            log.info("start key=%s type=%s scheduled=%d attempt=%d late=%.3fs",
                     task.key, task.type, task.scheduled_time, task.attempt, started - due)
            with self.lock:
                control = self.controls.get(task.key) or RunControl()
            run_id: str | None = None
            if isinstance(handler, handlers.ExecHandler):
                # Reported before the spawn: the master must know the run before any
                # process of it can become the master's orphan.
                run_id = next(self.run_ids)
                self._report(f"s {run_id}")
            try:
                result = handlers.run_task(
                    BatchedTask(task, self.finished), handler, log=log, stop_event=control,
                    kill_grace=self.config.kill_grace, run_id=run_id,
                    on_spawn=None if run_id is None else
                    (lambda pgid, r=run_id: self._report(f"g {r} {pgid}")))
            finally:
                if run_id is not None:
                    self._report(f"e {run_id}")
            outcome, duration = str(result.outcome), result.duration
            self.avg_duration = 0.8 * self.avg_duration + 0.2 * duration
            log.info("end key=%s scheduled=%d attempt=%d duration=%.3fs outcome=%s%s",
                     task.key, task.scheduled_time, task.attempt, duration, outcome,
                     f" exit={result.exit_code}" if result.exit_code is not None else "")
            if outcome == "preempted":
                metrics.lease_lost(task.type)
        except PreemptedError:
            outcome = "preempted"
            metrics.lease_lost(task.type)
        except DBAPIError as exc:
            outcome = "db_error"
            self._set_db(False, exc)
            log.error("key=%s: could not record the result (database error); the "
                      "occurrence runs again when its lease expires", task.key)
        except Exception:  # noqa: BLE001 - a worker never dies of one task
            log.exception("key=%s: internal error while running the task", task.key)
        finally:
            metrics.task_finished(task.type, outcome, duration)
            with self.lock:
                self.running.pop(task.key, None)
                self.controls.pop(task.key, None)
                self.history.append({
                    "key": task.key, "type": task.type, "scheduled_time": task.scheduled_time,
                    "attempt": task.attempt, "started_at": started,
                    "finished_at": started + duration if duration else time.time(),
                    "outcome": outcome, "worker": self.sc.owner if self.sc else "?",
                })
            self._nudge()

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
        return claimed

    def _report_lost(self, batch: list[Task], lost: set[str]) -> None:
        for task in batch:
            if task.key in lost:
                log.warning("key=%s: lease lost before its finish was written; the "
                            "occurrence may run again elsewhere", task.key)
                metrics.lease_lost(task.type)

    def _flush_history(self, force: bool = False) -> None:
        if self.sc is None or self.config.history_limit == 0:
            return
        now = time.monotonic()
        if not force and now - self.last_flush < HISTORY_FLUSH:
            return
        self.last_flush = now
        with self.lock:
            batch, self.history = self.history, []
        if not batch:
            return
        try:
            self.sc.store.record_runs(batch)
        except DBAPIError:
            with self.lock:  # keep them for the next flush, bounded
                self.history[:0] = batch[-10_000:]

    # -- heartbeat --------------------------------------------------------------------------

    def _heartbeat_loop(self) -> None:
        interval = max(0.2, self.config.alive_time / 3)
        while not self.kill_event.wait(interval):
            with self.lock:
                # Finished tasks whose result is not written yet keep their lease too.
                held = [(t.key, t.fence) for t in (*self.running.values(), *self.finished)]
            if not held or self.sc is None:
                continue
            try:
                lease = math.ceil(time.time()) + self.config.alive_time
                lost = self.sc.store.heartbeat(held, lease)
            except SQLAlchemyError as exc:  # not only DBAPIError: this thread must not die
                # No renewal: the runs' fence_at stays, and they stop themselves in time.
                self._set_db(False, exc)
                continue
            self._renewed(held, lost, lease)

    def _renewed(self, held: list[tuple[str, int]], lost: set[str], lease: int) -> None:
        """After a heartbeat: renewed runs move their fence; lost ones are stopped."""
        with self.lock:
            controls = dict(self.controls)
        for key, _ in held:
            control = controls.get(key)
            if control is None:
                if key in lost:
                    log.warning("key=%s: lease lost before its finish was written", key)
                continue
            if key not in lost:
                control.fence_at = lease - self.fence_lead
            elif control.reason is None:
                log.warning("key=%s: lease lost (deleted, modified or taken over); "
                            "stopping its run", key)
                control.stop(StopReason.PREEMPTED)

    # -- stop -------------------------------------------------------------------------------

    def _shutdown(self, pool: TaskThreads) -> None:
        # Without a master nobody would kill what a run leaves behind if this worker
        # died next: runs stop now rather than at the end of a graceful wait.
        grace = 0.0 if self.master_gone else self.config.shutdown_timeout
        deadline = time.monotonic() + grace
        with self.lock:
            n = len(self.running)
        if n and grace:
            log.info("stopping: waiting up to %.0fs for %d running task(s)", grace, n)
        while time.monotonic() < deadline:
            with self.lock:
                if not self.running:
                    break
            self.loop_at = time.monotonic()  # waiting for runs is not being wedged
            self._ping(force=True)
            time.sleep(0.05)
        with self.lock:
            controls = list(self.controls.values())
        for control in controls:  # exec groups get TERM/KILL, tasks are given back
            control.stop(StopReason.SHUTDOWN)
        self.kill_event.set()
        pool.shutdown()  # queued tasks are not started; they are given back below
        end = time.monotonic() + self.config.kill_grace + 2
        while time.monotonic() < end:
            self.loop_at = time.monotonic()
            with self.lock:
                if not self.running:
                    break
            time.sleep(0.05)
        handlers.kill_all_groups()
        if self.master_gone:
            # Their orphans went to init, not to a master that would kill them.
            me = os.getpid()
            jobreaper.kill_marked(lambda r: jobreaper.worker_of(r) == me, me=me)
        with self.lock:
            leftover = list(self.running.values())
        for task in leftover:  # python handlers stuck in C code: give their tasks back
            try:
                task.give_back()
            except Exception:  # noqa: BLE001 - best effort at exit; the lease expires anyway
                pass
        try:
            if self.sc is not None and self.finished:
                self._finish_and_claim(self._take_finished(), 0)
        except DBAPIError:
            log.error("could not write %d finished task(s); they run again when their "
                      "leases expire", len(self.finished))
        self._flush_history(force=True)
        if self.sc is not None:
            self.sc.close()
        log.info("worker %d stopped", self.index)


def _ignore(signum: int, frame: Any) -> None:
    pass


def run(config: Config, index: int, wake_fd: int, alive_fd: int, master_pid: int) -> int:
    logsetup.set_process_name(f"worker-{index}")
    return Worker(config, index, wake_fd, alive_fd, master_pid).run()
