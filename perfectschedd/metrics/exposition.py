"""The master's side of the metrics: /metrics rendered (the workers' files summed, with
the master's own numbers), and those numbers (workers, restarts, schedule counts and
states, the series of one schedule, build info).

The master's numbers are held in memory and exported by a small collector: one writer
needs no files, and no gauge merge mode (``mostrecent`` is missing on prometheus-client
0.16) is involved.  Every function is a cheap no-op until ``setup_master`` ran (never in
library use or perfectschedctl -c).
"""

from __future__ import annotations

import glob
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from perfectschedd import __version__, logsetup
from perfectschedd.metrics import multiproc
from perfectschedd.metrics.counters import LOG_DROPPED, LOG_DROPPED_HELP, PREFIX
from perfectschedd.metrics.schedule_series import ScheduleSeries, families
from perfectschedd.metrics.type_labels import exact_types, fold_types, share

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_master: _MasterState | None = None


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
            yield from families(s.series, s.series_omitted)
        unclaimed = GaugeMetricFamily(
            f"{p}_occurrences_unclaimed",
            "Occurrences due for over a minute that no worker claimed (no live host routes "
            "their type, or every worker is busy), by type.", labels=["type"])
        for task_type, n in sorted(fold_types(s.unclaimed).items()):
            unclaimed.add_metric([task_type], n)
        yield unclaimed


def setup_master(config: Any) -> None:
    """Prepare and clear the multiprocess directory, set the environment, master metrics."""
    global _master
    directory = multiproc.prepare(config)
    share(directory, exact_types(getattr(config, "routes", ())))
    _master = _MasterState()
    # Imported here, once, not by each worker after its fork (its pages are then shared
    # with every worker) nor lazily on a path that may run out of file descriptors.
    import prometheus_client.multiprocess  # noqa: F401
    import prometheus_client.values  # noqa: F401

    from perfectschedd.metrics import archive  # noqa: F401


def worker_exited(pid: int) -> None:
    directory = multiproc.directory()
    if directory is None:
        return
    from prometheus_client import multiprocess  # imported by setup_master already

    from perfectschedd.metrics import archive

    multiprocess.mark_process_dead(pid, directory)
    archive.fold_dead(directory, pid)


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
    directory = multiproc.directory()
    if directory is not None and os.path.isdir(directory):
        WorkerFiles(registry, path=directory)
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
