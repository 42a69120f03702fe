"""The metric objects, nothing else: Prometheus metrics summed over all forked workers.

Workers count tasks with prometheus_client in multiprocess mode: every worker process
writes its own files in PROMETHEUS_MULTIPROC_DIR, and the master's /metrics sums them with
``MultiProcessCollector``, so a worker that dies or is replaced keeps its counts in the
totals.  The master's own numbers (workers, restarts, schedule counts, build info) are
held in memory and exported by a small collector: one writer needs no files, and no
gauge merge mode (``mostrecent`` is missing on prometheus-client 0.16) is involved.

Every function is a cheap no-op until ``setup_master`` ran (library use, perfectschedctl
-c) and, for the worker-side ones, until ``after_fork_in_worker`` ran in this process.
prometheus_client is only imported once the directory is set up.
"""

from __future__ import annotations

import atexit
import bisect
import contextlib
import fcntl
import glob
import json
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from perfectschedd import __version__, logsetup
from perfectschedd.errors import ConfigError

log = logging.getLogger("perfectschedd")

PREFIX = "perfectsched"
LOG_DROPPED = f"{PREFIX}_log_records_dropped"
LOG_DROPPED_HELP = ("Log records dropped, not written: the log output did not keep up and "
                    "a process' queue of them was full (logsetup.QUEUE_MAX).")
# Lateness and duration: from a millisecond to a day.
BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
           300.0, 600.0, 1800.0, 3600.0, 7200.0, 14400.0, 43200.0, 86400.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Distinct task types with a `type` label of their own, besides the exact types of this
# host's routes: a /regexp/ route takes types that users choose, and each one adds series
# to every scrape.  The rest are counted under OTHER_TYPE.
TYPE_LABELS_MAX = 100
OTHER_TYPE = "_other"
# The types admitted so far, one JSON string a line, shared by the master and every
# worker through the multiprocess directory: the bound holds across workers and their
# replacements (their counts stay in the totals).
TYPES_FILE = "type-labels"
# Folded types a worker remembers (each is counted once per worker).
FOLDED_REMEMBERED = 10_000

_dir: str | None = None      # the multiprocess directory, once setup_master ran
_dir_lock: int | None = None  # the master's lock on it
_master: _MasterState | None = None
_worker: _WorkerMetrics | None = None


# --------------------------------------------------------------------------- worker side

class TypeLabels:
    """Which `type` label a task type is counted under: its own (an exact route's type,
    or one of the first TYPE_LABELS_MAX others admitted in `path`), else OTHER_TYPE."""

    def __init__(self, path: str | None, exact: Iterable[str] = ()) -> None:
        self.path = path
        self.exact = frozenset(exact)
        self.admitted: set[str] = set()
        self.full = False  # the file holds TYPE_LABELS_MAX types: it never changes again
        self.folded: set[str] = set()
        self.on_folded: Callable[[], None] = lambda: None

    def label(self, task_type: str) -> str:
        if task_type in self.exact or task_type in self.admitted:
            return task_type
        if task_type in self.folded:
            return OTHER_TYPE
        if not self.full and self._admit(task_type):
            return task_type
        if len(self.folded) < FOLDED_REMEMBERED:
            self.folded.add(task_type)
            self.on_folded()
        return OTHER_TYPE

    def _admit(self, task_type: str) -> bool:
        """Read the shared list (and add `task_type` while there is room), under its
        lock: a new type costs this once per process."""
        if self.path is None:
            return False
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC,
                         0o600)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            with os.fdopen(os.dup(fd), "rb") as f:
                self.admitted = self.read(f.read())
            if task_type not in self.admitted and len(self.admitted) < TYPE_LABELS_MAX:
                os.write(fd, json.dumps(task_type).encode() + b"\n")
                self.admitted.add(task_type)
            self.full = len(self.admitted) >= TYPE_LABELS_MAX
        except OSError:
            return False
        finally:
            os.close(fd)  # and its lock
        return task_type in self.admitted

    @staticmethod
    def read(data: bytes) -> set[str]:
        found = set()
        for line in data.splitlines():
            try:
                found.add(str(json.loads(line)))
            except ValueError:
                continue  # a line cut by a crash: that type is simply not admitted
        return found


_types = TypeLabels(None)


def exact_types(routes: Iterable[Any]) -> list[str]:
    """The exact (not /regexp/) types of a configuration's routes."""
    return [r.pattern for r in routes if r.regexp is None]


def set_route_types(exact: Iterable[str]) -> None:
    """This process' exact route types, which always have a label of their own."""
    exact = frozenset(exact)
    if exact != _types.exact:
        _types.exact = exact


def type_label(task_type: str) -> str:
    return _types.label(task_type)


class _WorkerMetrics:
    """Created in each worker after fork; written to this process' multiprocess files."""

    def __init__(self) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        p = PREFIX
        self.started = Counter(f"{p}_tasks_started", "Tasks started, by task type.",
                               ["type"], registry=None)
        self.finished = Counter(
            f"{p}_tasks_finished",
            "Tasks ended, by task type and outcome (success, failed, timeout, later, "
            "preempted, released, stopped, no_route, refused, not_applied, db_error).",
            ["type", "outcome"], registry=None)
        self.lateness = Histogram(f"{p}_task_lateness_seconds",
                                  "Start time minus due time of started tasks.",
                                  ["type"], buckets=BUCKETS, registry=None)
        self.duration = Histogram(f"{p}_task_duration_seconds",
                                  "Run time of tasks, by task type.",
                                  ["type"], buckets=BUCKETS, registry=None)
        self.last_success = Gauge(f"{p}_last_success_timestamp_seconds",
                                  "Unix time of the last successful run, by task type.",
                                  ["type"], multiprocess_mode="max", registry=None)
        self.leases_lost = Counter(f"{p}_leases_lost",
                                   "Tasks whose lease was taken over while they ran.",
                                   ["type"], registry=None)
        self.skipped = Counter(f"{p}_occurrences_skipped",
                               "Occurrences not run by their misfire or grace policy.",
                               ["type"], registry=None)
        self.given_up = Counter(f"{p}_occurrences_given_up",
                                "Occurrences given up after max_attempts failed attempts.",
                                ["type"], registry=None)
        self.notifications = Counter(
            f"{p}_notifications",
            "Notifications of failures and recoveries, by notifier kind (exec, mail, "
            "webhook; ? when dropped before one was chosen) and result (sent, failed, "
            "dropped).", ["kind", "result"], registry=None)
        self.notifications_dropped = Counter(
            f"{p}_notifications_dropped",
            "Notifications dropped before they were sent, by reason: user_backlog (one "
            "creator's pending keys at their bound), backlog (a lane's), unverified (first "
            "successes waiting to be checked).", ["reason"], registry=None)
        self.notifications_coalesced = Counter(
            f"{p}_notifications_coalesced",
            "Runs merged into their key's pending notification (its latest state is told "
            "once).", registry=None)
        self.types_folded = Counter(
            f"{p}_type_labels_folded",
            f"Distinct task types counted under type=\"{OTHER_TYPE}\" (beyond "
            f"{TYPE_LABELS_MAX} types besides the routes' exact ones), summed over the "
            "workers that met them.", registry=None)
        self.db_errors = Counter(f"{p}_database_errors",
                                 "Failed database operations of the workers.", registry=None)
        # A database that hangs or fails over (store/deadline.py).
        self.db_deadlines = Counter(
            f"{p}_database_deadline_expiries",
            "Database statements of the workers cut at their client-side deadline (no "
            "answer: a hung server).", registry=None)
        self.db_abandoned = Counter(
            f"{p}_database_connections_abandoned",
            "Database connections of the workers abandoned (never reused): a deadline, a "
            "server that is not the primary any more, a broken connection.", registry=None)
        self.db_reconnects = Counter(
            f"{p}_database_reconnects",
            "Times a worker connected again after losing its database connections.",
            registry=None)
        # livemin: 1 only while every live worker reaches the database.
        self.db_up = Gauge(f"{p}_database_up",
                           "1 if every live worker reached the database on its last try.",
                           multiprocess_mode="livemin", registry=None)
        self.db_up.set(1)
        # This process' log drops (logsetup.dropped()), as far as counted here.
        self.log_dropped = Counter(LOG_DROPPED, LOG_DROPPED_HELP, registry=None)
        self.log_dropped_seen = 0
        # Labelled children by type (and outcome): .labels() per task cost as much as
        # the updates themselves.
        self._per_type: dict[str, tuple[Any, Any, Any, Any]] = {}
        self._finished: dict[tuple[str, str], Any] = {}

    def for_type(self, task_type: str) -> tuple[Any, Any, Any, Any]:
        """(started, lateness, duration, last_success) of one task type."""
        children = self._per_type.get(task_type)
        if children is None:
            label = type_label(task_type)
            children = self._per_type.get(label)
            if children is None:
                children = (self.started.labels(label), self.lateness.labels(label),
                            self.duration.labels(label), self.last_success.labels(label))
            if label != OTHER_TYPE or len(self._per_type) < FOLDED_REMEMBERED:
                self._per_type[task_type] = children
            self._per_type[label] = children
        return children

    def apply(self, events: list[tuple[str, str | None, float, float]]) -> None:
        """Task starts (outcome None: lateness) and ends (outcome, duration, the time of
        a success or 0), in the order they happened."""
        started: dict[str, list[float]] = {}
        finished: dict[tuple[str, str], int] = {}
        durations: dict[str, list[float]] = {}
        success: dict[str, float] = {}
        for task_type, outcome, seconds, at in events:
            if outcome is None:
                started.setdefault(task_type, []).append(max(0.0, seconds))
                continue
            finished[task_type, outcome] = finished.get((task_type, outcome), 0) + 1
            if outcome in ("no_route", "refused", "not_applied"):  # never started: no run time
                continue
            durations.setdefault(task_type, []).append(max(0.0, seconds))
            if at:
                success[task_type] = max(at, success.get(task_type, 0.0))
        for task_type, lateness in started.items():
            count, late, _, _ = self.for_type(task_type)
            count.inc(len(lateness))
            _observe_many(late, lateness)
        for task_type, seconds in durations.items():
            _observe_many(self.for_type(task_type)[2], seconds)
        for (task_type, outcome), n in finished.items():
            self.finished_of(task_type, outcome).inc(n)
        for task_type, at in success.items():
            self.for_type(task_type)[3].set(at)

    def count_log_drops(self) -> None:
        dropped = logsetup.dropped()
        if dropped > self.log_dropped_seen:
            self.log_dropped.inc(dropped - self.log_dropped_seen)
            self.log_dropped_seen = dropped

    def finished_of(self, task_type: str, outcome: str) -> Any:
        child = self._finished.get((task_type, outcome))
        if child is None:
            label = type_label(task_type)
            child = self.finished.labels(label, outcome)
            if label != OTHER_TYPE or len(self._finished) < FOLDED_REMEMBERED:
                self._finished[task_type, outcome] = child
        return child


def _observe_many(histogram: Any, amounts: list[float]) -> None:
    """histogram.observe(a) for each of `amounts`, with one update of each bucket hit and
    of the sum (each update is a turn of a lock and a write to the file).  The bucket of
    an amount is the first whose bound is >= it, as observe() picks it; a
    prometheus_client without these attributes gets observe() per amount."""
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets):
        for amount in amounts:
            histogram.observe(amount)
        return
    hits = [0] * len(bounds)
    for amount in amounts:
        hits[bisect.bisect_left(bounds, amount)] += 1
    total.inc(sum(amounts))
    for bucket, n in zip(buckets, hits, strict=True):
        if n:
            bucket.inc(n)


def after_fork_in_worker(exact: Iterable[str] = ()) -> None:
    """In a freshly forked worker: count into files of its own pid.  `exact`: the exact
    types of its routes."""
    global _worker, _types
    if _dir is None:
        return
    _types = TypeLabels(os.path.join(_dir, TYPES_FILE), exact)
    from prometheus_client import values

    # A fresh value class: new files for this pid, and a lock no master thread can hold
    # at the instant of fork.  Also switches on multiprocess mode even if something
    # imported prometheus_client before the directory was set.
    # The pid, read once: prometheus_client asks for it on every update (a system call
    # each, several per task) to notice forks, and a worker never forks a process that
    # counts.
    pid = os.getpid()
    values.ValueClass = values.MultiProcessValue(process_identifier=lambda: pid)
    del _task_events[:]
    _worker = _WorkerMetrics()
    _types.on_folded = _worker.types_folded.inc


# Task threads queue their starts and ends here (list.append is one step under the GIL)
# and flush_tasks writes them to prometheus_client from one thread: a run then costs no
# turn of prometheus_client's process-wide lock (several per task, which the task threads
# of a burst queued up on), and counts of one type are added once per flush.
_task_events: list[tuple[str, str | None, float, float]] = []
_flush_lock = threading.Lock()


def task_started(task_type: str, lateness: float) -> None:
    """Counted at the next flush_tasks (the worker's next loop turn or ping)."""
    if _worker is not None:
        _task_events.append((task_type, None, lateness, 0.0))


def task_finished(task_type: str, outcome: str, duration: float) -> None:
    """Counted at the next flush_tasks; a success's time is taken now."""
    if _worker is not None:
        _task_events.append((task_type, outcome, duration,
                             time.time() if outcome == "success" else 0.0))


def flush_tasks() -> None:
    """Write the queued task starts and ends, and the log records dropped since; any
    thread (one at a time here)."""
    if _worker is None or not _task_events and \
            logsetup.dropped() == _worker.log_dropped_seen:
        return
    with _flush_lock:
        # Copy, then delete what was copied: what a task thread appends meanwhile stays.
        batch = _task_events[:]
        del _task_events[:len(batch)]
        _worker.apply(batch)
        _worker.count_log_drops()


def occurrences_skipped(task_type: str, count: int) -> None:
    if _worker is not None and count > 0:
        _worker.skipped.labels(type_label(task_type)).inc(count)


def occurrence_given_up(task_type: str) -> None:
    if _worker is not None:
        _worker.given_up.labels(type_label(task_type)).inc()


def notification(kind: str, result: str) -> None:
    if _worker is not None:
        _worker.notifications.labels(kind, result).inc()


def notification_dropped(reason: str) -> None:
    if _worker is not None:
        _worker.notifications_dropped.labels(reason).inc()


def notification_coalesced() -> None:
    if _worker is not None:
        _worker.notifications_coalesced.inc()


def lease_lost(task_type: str) -> None:
    if _worker is not None:
        _worker.leases_lost.labels(type_label(task_type)).inc()


def db_error() -> None:
    if _worker is not None:
        _worker.db_errors.inc()


def db_deadline_expired() -> None:
    if _worker is not None:
        _worker.db_deadlines.inc()


def db_connection_abandoned() -> None:
    if _worker is not None:
        _worker.db_abandoned.inc()


def db_reconnected() -> None:
    if _worker is not None:
        _worker.db_reconnects.inc()


def set_db_up(ok: bool) -> None:
    if _worker is not None:
        _worker.db_up.set(1 if ok else 0)


# --------------------------------------------------------------------------- master side

@dataclass(frozen=True)
class ScheduleSeries:
    """What /metrics shows of one schedule that asked for series of its own."""

    key: str
    type: str
    state: str                    # vocabulary/states.py
    next_due: float | None        # None: paused
    period: int | None            # None: a one-off
    last_success: float | None    # when its latest success ended; None: none kept
    last_failure: float | None


class _MasterState:
    """What only the master knows; read by the HTTP thread, written by the main loop."""

    def __init__(self) -> None:
        self.started = time.time()
        self.workers_configured = 0
        self.workers_alive = 0
        self.restarts = 0
        self.counts: dict[str, int] | None = None
        self.counts_time = 0.0
        self.unclaimed: dict[str, int] = {}
        self.states: dict[str, int] | None = None
        self.oldest_overdue = 0.0
        self.beyond_period = 0
        self.alive_time = 0.0
        self.series: list[ScheduleSeries] | None = None
        self.series_omitted = 0
        # The master's view of its database, asked at each scrape: unreachable since (Unix
        # time), or None.  Asked, not published: a call the database has not answered
        # for a while says so before its deadline (or its retry's) ends it.
        self.db_unreachable_since: Callable[[], float | None] = lambda: None


class _MasterCollector:
    def __init__(self, state: _MasterState) -> None:
        self.state = state

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s, p = self.state, PREFIX
        build = GaugeMetricFamily(f"{p}_build_info", "Version of the running perfectschedd.",
                                  labels=["version", "python_version"])
        build.add_metric([__version__, ".".join(map(str, sys.version_info[:3]))], 1)
        yield build
        yield GaugeMetricFamily(f"{p}_start_time_seconds",
                                "Unix time the master process started.", value=s.started)
        yield GaugeMetricFamily(f"{p}_workers_configured",
                                "Worker processes the configuration asks for.",
                                value=s.workers_configured)
        yield GaugeMetricFamily(f"{p}_workers_alive", "Worker processes running.",
                                value=s.workers_alive)
        yield CounterMetricFamily(f"{p}_worker_restarts",
                                  "Workers that died unexpectedly and were replaced.",
                                  value=s.restarts)
        yield GaugeMetricFamily(f"{p}_alive_time_seconds",
                                "alive_time of the running configuration (lease length).",
                                value=s.alive_time)
        since = s.db_unreachable_since()
        yield GaugeMetricFamily(
            f"{p}_database_unreachable_seconds",
            "How long the master has not reached the database (no answer, an error, "
            "hung, not the primary); 0 while it does.",
            value=0.0 if since is None else max(0.0, time.time() - since))
        counts = s.counts
        if counts is None:  # not read from the database yet: absent rather than wrong
            return
        for name, key, doc in (
                ("registered", "schedules", "Schedules in the table."),
                ("paused", "paused", "Paused schedules."),
                ("overdue", "due", "Unpaused schedules due now that no worker holds."),
                ("running", "running", "Schedules a worker holds (running tasks).")):
            yield GaugeMetricFamily(f"{p}_schedules_{name}",
                                    f"{doc} Refreshed every 15 s.", value=counts.get(key, 0))
        yield GaugeMetricFamily(f"{p}_schedule_counts_timestamp_seconds",
                                "Unix time the schedule counts were read.",
                                value=s.counts_time)
        if s.states is not None:
            by_state = GaugeMetricFamily(
                f"{p}_schedules", "Schedules by state: ok, paused, running, retrying (the "
                "current occurrence failed and waits for another attempt), failed (the "
                "latest run failed and was given up). Refreshed every 15 s.",
                labels=["state"])
            for state, n in s.states.items():
                by_state.add_metric([state], n)
            yield by_state
            yield GaugeMetricFamily(
                f"{p}_oldest_overdue_seconds",
                "How long the most overdue occurrence has been due without starting or "
                "succeeding (0: none). Refreshed every 15 s.", value=s.oldest_overdue)
            yield GaugeMetricFamily(
                f"{p}_schedules_overdue_beyond_period",
                "Schedules whose current occurrence is overdue by more than their period "
                "(docs/metrics.md). Refreshed every 15 s.", value=s.beyond_period)
        if s.series is not None:
            yield from _schedule_families(s.series, s.series_omitted)
        unclaimed = GaugeMetricFamily(
            f"{p}_occurrences_unclaimed",
            "Occurrences due for over a minute that no worker claimed (no live host routes "
            "their type, or every worker is busy), by type.", labels=["type"])
        for task_type, n in sorted(fold_types(s.unclaimed).items()):
            unclaimed.add_metric([task_type], n)
        yield unclaimed


def _schedule_families(series: list[ScheduleSeries], omitted: int) -> Iterator[Any]:
    """The series of the schedules that asked for them (docs/metrics.md "Series of one
    schedule"), labelled by key and type; a value that does not exist (no success kept, a
    one-off's period) is a series left out, not a 0 that an alert would read as 1970."""
    from prometheus_client.core import GaugeMetricFamily

    p, labels = PREFIX, ["key", "type"]
    fams = {
        "last_success": GaugeMetricFamily(
            f"{p}_schedule_last_success_timestamp_seconds",
            "Unix time the schedule's latest successful run ended (of the runs history "
            "keeps). Refreshed every 15 s.", labels=labels),
        "last_failure": GaugeMetricFamily(
            f"{p}_schedule_last_failure_timestamp_seconds",
            "Unix time the schedule's latest failed run (failed, timeout, lost) ended. "
            "Refreshed every 15 s.", labels=labels),
        "next_due": GaugeMetricFamily(
            f"{p}_schedule_next_run_timestamp_seconds",
            "Unix time the schedule's current occurrence is due (a retry's own due time); "
            "absent while paused.", labels=labels),
        "period": GaugeMetricFamily(
            f"{p}_schedule_period_seconds",
            "The schedule's period: the gap between its cron times, at least 60 s; absent "
            "for one-off runs.", labels=labels),
    }
    state = GaugeMetricFamily(
        f"{p}_schedule_state", "1 for the schedule's state: ok, paused, running, retrying "
        "or failed (vocabulary/states.py).", labels=[*labels, "state"])
    for x in series:
        for name, fam in fams.items():
            value = getattr(x, name)
            if value is not None:
                fam.add_metric([x.key, x.type], float(value))
        state.add_metric([x.key, x.type, x.state], 1)
    yield from fams.values()
    yield state
    yield GaugeMetricFamily(
        f"{p}_schedule_series_omitted",
        "Schedules that asked for series of their own beyond schedule_metrics_max (not "
        "shown).", value=omitted)


def fold_types(counts: dict[str, int]) -> dict[str, int]:
    """The master's counts by type under the workers' rule (their list is shared, and
    the master adds to it: a type no host routes is never run, and still worth its own
    label while there is room)."""
    out: dict[str, int] = {}
    for task_type, n in counts.items():
        label = _types.label(task_type)
        out[label] = out.get(label, 0) + n
    return out


def multiproc_dir(config: Any) -> str:
    """Where the workers' metric files go (created if needed; not yet cleared)."""
    runtime = os.environ.get("RUNTIME_DIRECTORY", "").split(":")[0]
    candidates = []
    if runtime:
        candidates.append(os.path.join(runtime, "metrics"))
    sock = getattr(config, "control_socket", None)
    if sock:
        stem = os.path.splitext(os.path.basename(sock))[0] or "perfectschedd"
        candidates.append(os.path.join(os.path.dirname(os.path.abspath(sock)),
                                       f"{stem}-metrics"))
    for path in candidates:
        try:
            os.makedirs(path, mode=0o700, exist_ok=True)
        except OSError:
            continue
        if os.access(path, os.W_OK | os.X_OK):
            return path
    path = tempfile.mkdtemp(prefix="perfectschedd-metrics-")
    atexit.register(shutil.rmtree, path, True)
    return path


def _lock_dir(path: str) -> int:
    """Hold the directory for this daemon: a second daemon given the same one (the same
    RUNTIME_DIRECTORY, another socket) is refused before it clears the files of the
    running one's workers.  The lock goes with the master's last descriptor of it."""
    fd = os.open(os.path.join(path, ".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(f"metrics directory {path} is in use by another perfectschedd; "
                          "give each daemon its own control_socket and runtime directory"
                          ) from None
    return fd


def master_fds() -> list[int]:
    """Descriptors only the master keeps (a forked worker closes them)."""
    return [] if _dir_lock is None else [_dir_lock]


def setup_master(config: Any) -> None:
    """Prepare and clear the multiprocess directory, set the environment, master metrics."""
    global _dir, _master, _dir_lock, _types
    path = multiproc_dir(config)
    _dir_lock = _lock_dir(path)
    for f in [*glob.glob(os.path.join(path, "*.db")), os.path.join(path, TYPES_FILE)]:
        with contextlib.suppress(FileNotFoundError):
            os.remove(f)
    _types = TypeLabels(os.path.join(path, TYPES_FILE),
                        exact_types(getattr(config, "routes", ())))
    # Read by prometheus_client's value classes in every process forked from here on.
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    _dir = path
    _master = _MasterState()
    # Imported here, once, not by each worker after its fork (its pages are then shared
    # with every worker) nor lazily on a path that may run out of file descriptors.
    import prometheus_client.multiprocess  # noqa: F401
    import prometheus_client.values  # noqa: F401

    from perfectschedd.metrics import archive  # noqa: F401


def worker_exited(pid: int) -> None:
    if _dir is None:
        return
    from prometheus_client import multiprocess  # imported by setup_master already

    from perfectschedd.metrics import archive

    multiprocess.mark_process_dead(pid, _dir)
    archive.fold_dead(_dir, pid)


def worker_restarted() -> None:
    if _master is not None:
        _master.restarts += 1


def set_schedule_counts(counts: dict[str, int], read_at: float | None = None,
                        unclaimed: dict[str, int] | None = None) -> None:
    if _master is not None:
        _master.unclaimed = dict(unclaimed or {})
        _master.counts = dict(counts)
        _master.counts_time = time.time() if read_at is None else read_at


def set_schedule_states(by_state: dict[str, int], oldest_overdue: float,
                        beyond_period: int) -> None:
    if _master is not None:
        _master.states = dict(by_state)
        _master.oldest_overdue = float(oldest_overdue)
        _master.beyond_period = int(beyond_period)


def set_schedule_series(series: list[ScheduleSeries], omitted: int) -> None:
    if _master is not None:
        _master.series = list(series)
        _master.series_omitted = int(omitted)


def watch_database(unreachable_since: Callable[[], float | None]) -> None:
    """Where the master's view of its database is asked at each scrape: unreachable since
    (Unix time; None: it answers).  The database in use: set again when it changes."""
    if _master is not None:
        _master.db_unreachable_since = unreachable_since


def set_alive_time(alive_time: float) -> None:
    """The lease length of the running configuration, which alert rules compare with."""
    if _master is not None:
        _master.alive_time = float(alive_time)


def set_workers(configured: int, alive: int) -> None:
    if _master is not None:
        _master.workers_configured = configured
        _master.workers_alive = alive


def _complete_files(path: str) -> list[str]:
    """The *.db files past their 8-byte header.

    A worker that starts creates its files empty and then sizes them; reading one in
    between makes prometheus_client's reader fail (struct.error), so a scrape during a
    worker replacement would fail.  Files only grow, so a size check first is enough."""
    files = []
    for f in glob.glob(os.path.join(path, "*.db")):
        try:
            if os.path.getsize(f) >= 8:
                files.append(f)
        except FileNotFoundError:  # a live gauge's file removed by mark_process_dead
            pass
    return files


def render() -> bytes:
    """The /metrics body: the workers' files summed, plus the master's own metrics."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector

    class WorkerFiles(MultiProcessCollector):  # type: ignore[misc]
        def collect(self) -> Any:
            return _with_master_log_drops(self.merge(_complete_files(self._path),
                                                     accumulate=True))

    from perfectschedd.metrics import archive

    registry = CollectorRegistry(auto_describe=False)
    if _dir is not None and os.path.isdir(_dir):
        WorkerFiles(registry, path=_dir)
    if _master is not None:
        registry.register(_MasterCollector(_master))
    with archive.LOCK:  # no fold half-way: no total counted twice or missing
        return bytes(generate_latest(registry))


def _with_master_log_drops(families: list[Any]) -> list[Any]:
    """The workers' log drops plus the master's own (counted in memory: the master
    writes no metric files), as one counter."""
    if _master is None:
        return families
    from prometheus_client.core import CounterMetricFamily

    mine = logsetup.dropped()
    for family in families:
        if family.name == LOG_DROPPED:
            family.samples = [s._replace(value=s.value + mine) if s.name.endswith("_total")
                              else s for s in family.samples]
            return families
    total = CounterMetricFamily(LOG_DROPPED, LOG_DROPPED_HELP, value=mine)
    return [*families, total]


def render_with_type() -> tuple[bytes, str]:
    """The /metrics body and its content type (web/app.py serves it)."""
    return render(), CONTENT_TYPE
