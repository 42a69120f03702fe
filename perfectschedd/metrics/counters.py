"""The workers' counters: what each worker process counts (task starts and ends, skipped
and given-up occurrences, notifications, lease losses, database errors), written with
prometheus_client in multiprocess mode to files of its own pid in the multiprocess
directory (multiproc.py), which the master's /metrics sums (exposition.py).

Every function is a cheap no-op until the master set the directory up
(exposition.setup_master; never in library use or perfectschedctl -c) and
``after_fork_in_worker`` ran in this process.  prometheus_client is only imported once
the directory is set up.
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from collections.abc import Iterable
from typing import Any

from perfectschedd import logsetup
from perfectschedd.metrics import multiproc
from perfectschedd.metrics.type_labels import (
    FOLDED_REMEMBERED,
    OTHER_TYPE,
    TYPE_LABELS_MAX,
    share,
    type_label,
)

PREFIX = "perfectsched"
LOG_DROPPED = f"{PREFIX}_log_records_dropped"
LOG_DROPPED_HELP = ("Log records dropped, not written: the log output did not keep up and "
                    "a process' queue of them was full (logsetup.QUEUE_MAX).")
# Lateness and duration: from a millisecond to a day.
BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
           300.0, 600.0, 1800.0, 3600.0, 7200.0, 14400.0, 43200.0, 86400.0)

_worker: _WorkerMetrics | None = None


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
    global _worker
    directory = multiproc.directory()
    if directory is None:
        return
    labels = share(directory, exact)
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
    labels.on_folded = _worker.types_folded.inc


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
