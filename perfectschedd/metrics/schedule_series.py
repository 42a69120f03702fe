"""Series of one schedule on /metrics (docs/metrics.md "Series of one schedule"): what the
master reads of each schedule that asked for them (ScheduleSeries, master/database.py
reads them), and the metric families they become at a scrape."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from perfectschedd.metrics.counters import PREFIX


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


def families(series: list[ScheduleSeries], omitted: int) -> Iterator[Any]:
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
