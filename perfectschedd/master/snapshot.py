"""What `status` and /metrics show of the database: the Snapshot the master's
housekeeping thread publishes (database.py), and the reading that fills it: counts,
running and queued runs, the schedules' states, failing and overdue schedules, hosts, and
the schedules with series of their own on /metrics.

The queries run under the caller's fork gate, on the housekeeping thread, never on the
master's loop; what is computed from their rows runs after, outside the gate.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from perfectschedd.config import Config
from perfectschedd.master import heap
from perfectschedd.metrics import exposition
from perfectschedd.metrics.schedule_series import ScheduleSeries
from perfectschedd.schedules import overdue, policy
from perfectschedd.schedules.collection import ScheduleCollection, waits_its_turn
from perfectschedd.store.schema import Row
from perfectschedd.store.sql import Store
from perfectschedd.vocabulary import states
from perfectschedd.vocabulary.fields import RUN_NOW_MARK, schedule_key
from perfectschedd.vocabulary.outcomes import Outcome

# The schedules that run next, in status (the web console's overview).
NEXT_DUE_SHOWN = 10
# Due and unclaimed for this long: no live worker takes it (shown by status and metrics).
UNCLAIMED_AFTER = 60
# Failing and overdue schedules named by status (the totals count them all).
FAILING_SHOWN = 20
# A host not heard of for this long has gone for good: its row is deleted.
HOST_FORGET_AFTER = 7 * 86400.0

# The schedules' states as last read (Store.state_summary without its overdue rows),
# and the schedules with series of their own (exposition.set_schedule_series' arguments).
States = dict[str, Any]
Series = tuple[list[ScheduleSeries], int]


@dataclass
class Snapshot:
    """What the housekeeping thread last read; replaced whole, never changed in place."""

    counts: dict[str, int] = field(default_factory=dict)
    running: list[dict[str, Any]] = field(default_factory=list)
    # The schedules that run next (NEXT_DUE_SHOWN): key, type, run_at.
    next_due: list[dict[str, Any]] = field(default_factory=list)
    # Claimed runs waiting for their schedule's running one to end (`run KEY` under forbid)
    queued: list[dict[str, Any]] = field(default_factory=list)
    unclaimed: dict[str, int] = field(default_factory=dict)  # type -> occurrences
    # Keys stored before today's key rules (they work; a rename is advised): key -> why.
    rename: dict[str, str] = field(default_factory=dict)
    # The hosts table (name, version, last_seen, ...), and nodes seen at work (leases,
    # recent runs) that are not in it: hosts of a release before 0.2.0.
    hosts: list[dict[str, Any]] = field(default_factory=list)
    unrecorded_nodes: list[str] = field(default_factory=list)
    # Schedules by state (vocabulary/states.py); those retrying or whose latest run failed
    # (at most FAILING_SHOWN, and how many in all); overdue ones (schedules/overdue.py).
    states: dict[str, int] = field(default_factory=dict)
    failing: list[dict[str, Any]] = field(default_factory=list)
    failing_total: int = 0
    oldest_overdue: float = 0.0        # seconds; 0: nothing overdue
    beyond_period: list[dict[str, Any]] = field(default_factory=list)
    beyond_period_total: int = 0
    # While everything is paused (pause --all): since, by, and the schedules it holds.
    paused_all: dict[str, Any] | None = None
    # Rows paused as not their file entry's own (fields.foreign_exec_row): key, type,
    # creator, why.
    refused_rows: list[dict[str, Any]] = field(default_factory=list)
    read_at: float | None = None       # Unix time of `counts`/`running`
    ok: bool | None = None             # None: not asked yet
    unreachable_since: float | None = None
    error: str | None = None


@dataclass
class Figures:
    """One reading's rows, as the queries returned them (read_figures)."""

    paused_all: dict[str, Any] | None
    counts: dict[str, int]
    refused_rows: list[dict[str, Any]]
    overdue_rows: list[Row]
    rows: list[Row]
    holders: dict[str, Any]
    unclaimed: dict[str, int]
    hosts: list[dict[str, Any]]
    next_due: list[dict[str, Any]]
    at_work: set[str]


def read_states(store: Store, config: Config, now: float) -> tuple[States, Series]:
    """The schedules' states and the series of their own on /metrics: both read every
    schedule with its latest run, the costly part of a reading (database.STATES_SHARE)."""
    found = store.state_summary(int(now), overdue=0)
    series = read_series(store, config)
    heap.trim()  # it read every schedule with its latest run
    return found, series


def read_series(store: Store, config: Config) -> Series:
    """The schedules with series of their own on /metrics (policy `metrics`, a route's
    default), at most schedule_metrics_max, and how many more there are."""
    limit = config.schedule_metrics_max
    routed = [r for r in config.routes if r.metrics]
    types = {r.pattern for r in routed if r.regexp is None}
    if any(r.regexp is not None for r in routed):
        types.update(t for t in store.types_present()
                     if any(r.matches(t) for r in routed))
    rows, total = store.series_rows(types, limit)
    last = store.last_success_and_failure([r.key for r in rows])
    series = []
    for r in rows:
        success, failure = last.get(r.key, (None, None))
        series.append(ScheduleSeries(
            key=r.key, type=r.type,
            state=states.state_of(r.paused, r.owner, r.attempt,
                                  _latest_outcome(success, failure)),
            next_due=None if r.paused else float(overdue.due_of(r)),
            period=overdue.period_of(r), last_success=success, last_failure=failure))
    return series, total - len(series)


def read_figures(store: Store, sc: ScheduleCollection, config: Config, now: float
                 ) -> Figures:
    """The rest of a reading (under the caller's gate): cheap next to read_states."""
    paused_all = sc.paused_all()
    if paused_all is not None:
        paused_all = {**paused_all, "schedules": store.count_paused(with_all=True)}
    counts = store.counts(int(now))
    refused_rows = [r._asdict() for r in store.refused_rows()]
    overdue_rows = store.overdue_rows(int(now))
    rows = store.running()
    holders = store.group_holders({schedule_key(r.key) for r in rows
                                   if RUN_NOW_MARK in r.key})
    return Figures(
        paused_all=paused_all, counts=counts, refused_rows=refused_rows,
        overdue_rows=overdue_rows, rows=rows, holders=holders,
        unclaimed=store.unclaimed(int(now) - UNCLAIMED_AFTER),
        hosts=store.hosts(forget_before=now - HOST_FORGET_AFTER),
        next_due=[{"key": k, "type": ty, "run_at": at}
                  for k, ty, at in store.next_due(NEXT_DUE_SHOWN)],
        at_work=store.nodes_at_work(now - config.alive_time))


def snapshot_of(old: Snapshot, figures: Figures, found: States, now: float) -> Snapshot:
    """`old` with a reading's figures (the states as last read: `found`), read at `now`
    (Unix time): the database answered."""
    summary = {**found, "overdue": figures.overdue_rows}
    running: list[dict[str, Any]] = []
    queued: list[dict[str, Any]] = []
    for r in figures.rows:
        waits = waits_its_turn(r.key, policy.from_text(r.policy).concurrency,
                               figures.holders.get(schedule_key(r.key)))
        (queued if waits else running).append({
            "key": r.key, "type": r.type, "scheduled_time": r.next_time,
            "timezone": r.timezone, "owner": r.owner,
            "age": round(now - r.claimed_at, 3) if r.claimed_at else None,
            "attempt": r.attempt})
    failing = [_failing(r, last, now) for r, last in summary["problems"]]
    lates = overdue.late([*summary["overdue"], *(r for r, _ in summary["problems"])], now)
    beyond = [{"key": x.key, "due": x.due, "overdue_by": x.overdue_by,
               "period": x.period} for x in lates if x.beyond_period]
    recorded = {h["name"] for h in figures.hosts}
    return replace(old, counts=figures.counts, running=running, queued=queued,
                   next_due=figures.next_due,
                   states=summary["counts"], failing=failing[:FAILING_SHOWN],
                   failing_total=len(failing),
                   oldest_overdue=lates[0].overdue_by if lates else 0.0,
                   beyond_period=beyond[:FAILING_SHOWN],
                   beyond_period_total=len(beyond),
                   unclaimed=figures.unclaimed, hosts=figures.hosts,
                   paused_all=figures.paused_all, refused_rows=figures.refused_rows,
                   unrecorded_nodes=sorted(figures.at_work - recorded),
                   read_at=now, ok=True, unreachable_since=None, error=None)


def show_on_metrics(snap: Snapshot, series: Series) -> None:
    """A reading's figures on /metrics.  The series before the counts: a scrape that sees
    this reading's time (the counts' timestamp) sees its series too."""
    assert snap.read_at is not None
    exposition.set_schedule_series(*series)
    exposition.set_schedule_counts(snap.counts, snap.read_at, snap.unclaimed)
    exposition.set_schedule_states(snap.states, snap.oldest_overdue, snap.beyond_period_total)


def _latest_outcome(success: float | None, failure: float | None) -> str | None:
    """Of a schedule's latest success and latest failure, the outcome of the later."""
    if failure is not None and (success is None or failure > success):
        return Outcome.FAILED
    return "success" if success is not None else None


def _failing(row: Row, last: dict[str, Any] | None, now: float) -> dict[str, Any]:
    """One schedule status lists as failing: retrying its occurrence (since that
    occurrence was due), or failed (since its latest run ended)."""
    outcome = last["outcome"] if last else None
    state = states.state_of(row.paused, row.owner, row.attempt, outcome)
    since = overdue.due_of(row) if state == states.RETRYING else \
        (last["finished_at"] if last else None)
    return {"key": row.key, "type": row.type, "state": state, "attempt": row.attempt,
            "scheduled_time": row.next_time, "timezone": row.timezone,
            "since": round(since, 3) if since is not None else None,
            "next_try": row.next_run_time if state == states.RETRYING else None,
            "last_outcome": outcome, "creator": row.creator,  # who may read the error
            "error": states.first_line(last.get("error")) if last else None}
