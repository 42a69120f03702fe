"""The library API: open(), ScheduleCollection, Schedule and ScheduleInfo.  The leased
occurrence a poll returns, Task, is task.py's.

Validation of user input happens here, before anything reaches the store, so a refused
request never changes what is stored.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from perfectschedd import __version__
from perfectschedd.config import Config, load
from perfectschedd.errors import (
    AlreadyExistsError,
    InvalidInputError,
    NotFoundError,
    NotSupportedError,
)
from perfectschedd.schedules import missed
from perfectschedd.schedules.cron import first_at_or_after, is_once, period
from perfectschedd.schedules.policy import DEFAULT, OPTIONS, Policy, check, due_time, from_text
from perfectschedd.schedules.task import Task
from perfectschedd.schedules.validate import (
    MAX_DEPTH,
    check_cron,
    check_data,
    check_int,
    check_key,
    check_timezone,
    check_type,
    lookup_key,
)
from perfectschedd.store.schema import Row, lease_until
from perfectschedd.store.sql import Store
from perfectschedd.vocabulary.fields import (
    INFO_FIELDS,
    KEY_MAX,
    PAUSED_ALL_REASON,
    RUN_NOW_MARK,
    SCHEDULE_FIELDS,
    SOURCE_API,
    dumps_data,
)
from perfectschedd.vocabulary.history import history_row
from perfectschedd.vocabulary.outcomes import FAILURES, Outcome

_UNSET: Any = object()
# What refuse_on_older_hosts names for an interval schedule.
INTERVAL_FEATURE = "@every"
# A host that recorded itself this recently is live (it writes every 10 s: master/database.py).
OLDER_HOSTS_WINDOW = 30.0


class _ScheduleView:
    """What ScheduleInfo does (its fields: fields.INFO_FIELDS, made below)."""

    __slots__ = ()

    @property
    def running(self) -> bool:
        return self.owner is not None

    def as_dict(self) -> dict[str, Any]:
        # Shallow: asdict() deep-copies `data` recursively, and a row stored by an older
        # version may hold data nested deeper than the recursion limit.
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_row(cls, row: Row) -> Any:
        shown = {n: getattr(row, n) for n in INFO_FIELDS if n not in _SHOWN_OTHERWISE}
        return cls(**shown, data=_stored_data(row.data), source=row.source or SOURCE_API,
                   **from_text(row.policy).as_fields())

    @property
    def policy(self) -> Policy:
        return Policy(**{k: getattr(self, k) for k in OPTIONS})


# The fields shown otherwise than stored: data decoded, source named, policy as options.
_SHOWN_OTHERWISE = {"data": dict[str, Any], "source": str, "policy": None}
# The fields after `data` may be left out; their defaults when not None.
_SHOWN_DEFAULTS = {"paused": False, "attempt": 0, "source": SOURCE_API}


def _shown_fields() -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    optional = False
    for name in INFO_FIELDS:
        if name == "policy":
            out += [(f.name, f.type, dataclasses.field(default=f.default))
                    for f in dataclasses.fields(Policy)]
            continue
        kind = _SHOWN_OTHERWISE.get(name) or SCHEDULE_FIELDS[name]
        out.append((name, kind, dataclasses.field(default=_SHOWN_DEFAULTS.get(name)))
                   if optional else (name, kind))
        optional = optional or name == "data"
    return out


# One schedule as users see it (list, show, the library): fields.INFO_FIELDS, made from
# the one list of a schedule's fields.
ScheduleInfo = dataclasses.make_dataclass(
    "ScheduleInfo", _shown_fields(), bases=(_ScheduleView,), frozen=True,
    namespace={"__doc__": "One schedule as users see it (list, show, the library)."})
ScheduleInfo.__module__ = __name__


def _stored_data(text: str) -> dict[str, Any]:
    try:
        return json.loads(text)
    except RecursionError:  # stored before depth limits existed: shown, not fatal
        return {"unreadable": f"data nested deeper than {MAX_DEPTH} levels; modify or "
                              "delete this schedule"}


# How a run of a row ends in its history (the latest says why an unheld row waits).
RUN_ENDS = tuple(sorted({*FAILURES, *(o.value for o in (
    Outcome.SUCCESS, Outcome.LATER, Outcome.RELEASED, Outcome.STOPPED, Outcome.PREEMPTED,
    Outcome.NO_ROUTE))}))


# -- schedules ----------------------------------------------------------------------------

class Schedule:
    """A handle on one schedule by key; it reads the store on every call."""

    def __init__(self, collection: ScheduleCollection, key: str) -> None:
        self._collection = collection
        self.key = key

    def __repr__(self) -> str:
        return f"Schedule({self.key!r})"

    def exists(self) -> bool:
        return self._collection.store.exists(self.key)

    def info(self) -> ScheduleInfo:
        row = self._collection.store.get(self.key)
        if row is None:
            raise NotFoundError(f"schedule {self.key!r} not found")
        return ScheduleInfo.from_row(row)

    def delete(self, marker: Callable[[ScheduleInfo], str | None] | None = None) -> int:
        """Delete the schedule and its extra runs (a running one is stopped: its lease is
        gone); returns how many extra runs went with it.  `marker`: the record of a forced
        delete of a schedules file's schedule (deletions.py), or None, from the schedule
        as it is deleted; written with it."""
        of_row = None if marker is None else (
            lambda row: marker(ScheduleInfo.from_row(row)))  # type: ignore[misc]
        deleted = self._collection.store.delete(self.key, of_row)
        if not deleted:
            raise NotFoundError(f"schedule {self.key!r} not found")
        return deleted - 1

    def modify(self, *, type: str = _UNSET, cron: str = _UNSET, delay: int = _UNSET,
               timezone: str = _UNSET, data: Any = _UNSET, now: float | None = None,
               file_entry: bool = False, source: str | None = _UNSET,
               at: int | None = None, **policies: Any) -> None:
        """Change fields; new cron/timezone/delay/jitter recompute next_time and
        next_run_time.  `at` (Unix seconds): the next run then, as add's --at (a @once
        schedule's one run; a cron schedule's next occurrence runs then).  `policies`:
        policy options to change (None: back to the default).
        `file_entry`: the schedules files' convergence writes its entry (check_type).
        `source`: its new source, in the same write (a schedule detached from its file).

        A task of this schedule running now loses its lease (PreemptedError on finish).
        """
        unknown = set(policies) - set(OPTIONS)
        if unknown:
            raise InvalidInputError(sorted(unknown)[0], "unknown option")
        policy_changes = check(policies)
        values: dict[str, Any] = {}
        if type is not _UNSET:
            values["type"] = check_type(type, exec_key=self.key if file_entry else None)
        if cron is not _UNSET:
            values["cron"] = check_cron(cron)
        if delay is not _UNSET:
            values["delay"] = check_int("delay", delay)
        if timezone is not _UNSET:
            values["timezone"] = check_timezone(timezone)
        if data is not _UNSET:
            values["data"] = check_data(data)
        if at is not None:
            at = check_int("at", at)
        if not values and not policy_changes and at is None:
            raise InvalidInputError("modify", "nothing to change")
        current = self.info()
        new_policy = current.policy.changed(policy_changes)
        values["policy"] = new_policy.to_text()
        new_cron = values.get("cron", current.cron)
        new_tz = values.get("timezone", current.timezone)
        new_delay = values.get("delay", current.delay)
        next_time = current.next_time
        if "cron" in values and period(values["cron"]) is not None:
            self._collection.refuse_on_older_hosts(INTERVAL_FEATURE, now)
        if ("cron" in values or "timezone" in values) and new_cron is not None \
                and not is_once(new_cron):
            now_s = int(time.time() if now is None else now)
            next_time = cron_first(new_cron, new_tz, now_s)
        if at is not None and is_once(new_cron):
            next_time = at  # a one-shot's occurrence is its run
        values.update(next_time=next_time,
                      next_run_time=at if at is not None else
                      due_time(next_time, self.key, new_delay, new_policy.jitter),
                      attempt=0)
        if source is not _UNSET:
            values["source"] = source
        if not self._collection.store.update(self.key, values, take_lease=True):
            raise NotFoundError(f"schedule {self.key!r} not found")

    def pause(self) -> None:
        if not self._collection.store.update(self.key, {"paused": 1, "paused_reason": None},
                                             take_lease=False):
            raise NotFoundError(f"schedule {self.key!r} not found")

    def resume(self) -> None:
        if not self._collection.store.update(self.key, {"paused": 0, "paused_reason": None},
                                             take_lease=False):
            raise NotFoundError(f"schedule {self.key!r} not found")

    def run_now(self, now: float | None = None, *, creator: int | None = None) -> str:
        """Run one extra occurrence now, without moving the schedule; returns its key.
        `creator`: who asked (default: this process's uid)."""
        info = self.info()
        now_s = int(time.time() if now is None else now)
        run_key = f"{self.key}{RUN_NOW_MARK}{now_s}-{os.urandom(3).hex()}"
        if len(run_key) > KEY_MAX:
            raise InvalidInputError("key", f"too long to add a run marker (max {KEY_MAX - 30})")
        if not self._collection.store.mark_extra(self.key):
            raise NotFoundError(f"schedule {self.key!r} not found")
        self._collection.insert_rows([Row(
            key=run_key, type=info.type, cron=None, delay=0, timezone=info.timezone,
            data=dumps_data(info.data), next_time=now_s, next_run_time=now_s, paused=False,
            fence=0, attempt=0, owner=None, claimed_at=None,
            policy=extra_run_policy(info.policy).to_text(),
            creator=os.geteuid() if creator is None else creator)])
        return run_key


def waits_its_turn(key: str, concurrency: str, holder: str | None) -> bool:
    """Whether a claimed run waits for its schedule's running one to end: an extra run
    (`run KEY`) that is not its group's holder (`holder`: Store.group_holder of its
    schedule), unless the schedule's runs may overlap (`concurrency` allow)."""
    return RUN_NOW_MARK in key and key != holder and concurrency != "allow"


def extra_run_policy(schedule: Policy) -> Policy:
    """What an extra run (`run KEY`) keeps of its schedule's policy: how it runs and
    ends (timeout, max_attempts, retry_wait, notify) and its concurrency (under allow it
    runs beside a running occurrence, under replace it stops it).  Not the misfire,
    grace and jitter of the schedule's cron times: it was asked for now, and runs now
    however long it waited its turn."""
    return Policy(timeout=schedule.timeout, max_attempts=schedule.max_attempts,
                             retry_wait=schedule.retry_wait, notify=schedule.notify,
                             concurrency=schedule.concurrency)


def cron_first(expr: str, tz: str, start: int) -> int:
    try:
        return first_at_or_after(expr, tz, start)
    except OverflowError:
        raise InvalidInputError("start", f"out of range: {start}") from None


class ScheduleCollection:
    """All schedules of one table.  Use one per process (create it after fork)."""

    def __init__(self, config: Config, page_cache_kib: int | None = None,
                 store: Store | None = None) -> None:
        """`page_cache_kib`: Store's.  `store`: an open store of `config`'s database to
        use instead of opening one (a worker's, built by its master before the fork); the
        collection closes it."""
        self.config = config
        self.store = store or Store(config.url, config.table, config.alive_time,
                                    page_cache_kib)
        self.owner = f"{config.node}:{os.getpid()}"
        self.store.ensure_initialized()

    def __enter__(self) -> ScheduleCollection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.store.close()

    def init(self) -> bool:
        """Create the table if missing; True if this collection created it (opening one
        already creates a missing table)."""
        self.store.init()
        return self.store.created_table

    def __getitem__(self, key: str) -> Schedule:
        return Schedule(self, lookup_key(key))

    def build_row(self, key: str, type: str, cron: str | None = None, *, delay: int = 0,
                  timezone: str | None = None, next_time: int | None = None,
                  next_run_time: int | None = None, data: Any = None,
                  now: float | None = None, start: int | None = None,
                  at: int | None = None, source: str | None = None,
                  creator: int | None = None, file_entry: bool = False,
                  **policies: Any) -> Row:
        """Validate an `add` request into a row (no I/O).  `policies`: the schedule
        policy options (policy.OPTIONS); `creator`: the uid recorded as its maker
        (default: this process's); `file_entry`: the schedules files' convergence adds its
        entry (check_type)."""
        unknown = set(policies) - set(OPTIONS)
        if unknown:
            raise InvalidInputError(sorted(unknown)[0], "unknown option")
        # Most adds set no option: the defaults, stored as no text, without rebuilding them.
        chosen = DEFAULT.changed(policies) if policies else DEFAULT
        check_key(key)
        check_type(type, exec_key=key if file_entry else None)
        tz = check_timezone(timezone if timezone is not None else self.config.timezone)
        delay = check_int("delay", delay)
        data_text = check_data(data)
        start = start if start is not None else next_time
        at = at if at is not None else next_run_time
        now_s = int(time.time() if now is None else now)
        start = check_int("start", start) if start is not None else now_s
        if cron is None:
            raise InvalidInputError("cron", "required")
        expr = check_cron(cron)
        at = check_int("at", at) if at is not None else None
        if is_once(expr):  # one run, at --at (default: now)
            first = at if at is not None else start
        else:
            first = cron_first(expr, tz, start)
        run_at = at if at is not None else due_time(first, key, delay, chosen.jitter)
        return Row(key=key, type=type, cron=expr, delay=delay, timezone=tz, data=data_text,
                   next_time=first, next_run_time=run_at, paused=False, fence=0, attempt=0,
                   owner=None, claimed_at=None,
                   policy=chosen.to_text() if policies else None, source=source,
                   creator=os.geteuid() if creator is None else creator)

    def add(self, key: str, type: str, cron: str | None = None, **options: Any) -> Schedule:
        """Register a schedule (SPEC `add`); AlreadyExistsError if the key is taken."""
        row = self.build_row(key, type, cron, **options)
        self._refuse_intervals_on_older_hosts([row], options.get("now"))
        if not self.insert_rows([row]):
            raise AlreadyExistsError(f"schedule {key!r} already exists")
        return Schedule(self, key)

    def insert_rows(self, rows: Sequence[Row]) -> bool:
        """Store new schedules (several: all or nothing, IntegrityError if a key exists;
        one: False if its key exists).  While everything is paused (pause --all) they are
        stored paused with it, and start at resume --all.  A pause --all recorded while
        they were being stored pauses them too: the pause is looked for again once they
        are (a pause that committed before this second look, and whose update did not
        see them, is seen by it)."""
        paused_all = self.store.paused_all() is not None
        if paused_all:
            rows = [dataclasses.replace(r, paused=True, paused_reason=PAUSED_ALL_REASON)
                    for r in rows]
        if len(rows) == 1:
            if not self.store.insert(rows[0]):
                return False
        else:
            self.store.insert_many(rows)
        if not paused_all and self.store.paused_all() is not None:
            self.store.join_pause_all([r.key for r in rows])
        return True

    def add_many(self, requests: list[dict[str, Any]]) -> int:
        """Register many schedules in one transaction; all or nothing."""
        from sqlalchemy.exc import IntegrityError

        # One clock reading for the batch: its rows, stored in one transaction, start from
        # the same second, so those sharing a cron line share its first occurrence
        # (cron.next_after's cache) instead of each second of a long batch computing anew.
        now = time.time()
        rows = [self.build_row(**{"now": now, **r}) for r in requests]
        if not rows:
            return 0
        keys = [r.key for r in rows]
        if len(set(keys)) != len(keys):
            raise InvalidInputError("key", "duplicate keys in one request")
        self._refuse_intervals_on_older_hosts(rows, requests[0].get("now", now))
        try:
            self.insert_rows(rows)
        except IntegrityError:
            raise AlreadyExistsError("one of the keys already exists; nothing added") from None
        return len(rows)

    def _refuse_intervals_on_older_hosts(self, rows: Sequence[Row], now: float | None
                                         ) -> None:
        """A release before 0.2.0 cannot read `@every`: a host of one would stop at such
        a schedule's first run (SPEC "Upgrades")."""
        if any(r.cron is not None and period(r.cron) is not None for r in rows):
            self.refuse_on_older_hosts(INTERVAL_FEATURE, now)

    def list(self, *, prefix: str | None = None, limit: int | None = None,
             after_key: str | None = None) -> list[ScheduleInfo]:
        return [ScheduleInfo.from_row(r)
                for r in self.store.rows(prefix=prefix, limit=limit, after_key=after_key)]

    def list_with_last_run(self, *, prefix: str | None = None, limit: int | None = None,
                           after_key: str | None = None
                           ) -> list[tuple[ScheduleInfo, dict[str, Any] | None]]:
        """list(), each schedule with its latest run (outcome, attempt, finished_at,
        error; None: none recorded), read in one query."""
        return [(ScheduleInfo.from_row(r), last) for r, last in
                self.store.rows_with_last_run(prefix=prefix, limit=limit,
                                              after_key=after_key)]

    def poll(self, now: float | None = None) -> Task | None:
        tasks = self.poll_many(1, now)
        return tasks[0] if tasks else None

    def poll_many(self, limit: int, now: float | None = None) -> list[Task]:
        """Lease up to `limit` due occurrences (oldest first) to this process."""
        now = time.time() if now is None else now
        claimed = self.store.claim(now, self.config.alive_time, self.owner, limit)
        return [Task(self.store, self.config, c, now) for c in claimed]

    def finish_many(self, tasks: list[Task]) -> set[str]:
        """Finish several tasks in one transaction; returns the keys that were preempted."""
        for t in tasks:
            t._end()
        return self.store.advance([t.next_advance() for t in tasks])

    def finish_and_poll(self, finished: list[Task], limit: int, now: float | None = None
                        ) -> tuple[set[str], list[Task]]:
        """Write finishes already ended with Task._end() and lease up to `limit` more
        occurrences, in one transaction.  Returns (preempted keys, new tasks)."""
        now = time.time() if now is None else now
        lost, claimed = self.store.finish_and_claim(
            [t.next_advance() for t in finished], now, self.config.alive_time, self.owner,
            limit)
        return lost, [Task(self.store, self.config, c, now) for c in claimed]

    def heartbeat_many(self, tasks: list[Task], now: float | None = None) -> set[str]:
        now = time.time() if now is None else now
        lease = lease_until(now, self.config.alive_time)
        return self.store.heartbeat([(t.key, t.fence) for t in tasks if not t.done], lease)

    def earliest_due(self) -> int | None:
        return self.store.earliest_due()

    # -- what the commands read beside the schedules themselves ----------------------------

    def history(self, key: str, limit: int, attempt: int | None = None,
                after_id: int | None = None) -> list[dict[str, Any]]:
        """The latest `limit` runs of `key`, newest first (`attempt`: only those that
        were that attempt of their occurrence; `after_id`: only those recorded after
        that row, history_start)."""
        return self.store.history(key, limit, attempt, after_id=after_id)

    def history_start(self, key: str) -> int | None:
        """Where the runs of the schedule `key` names now begin in its history (the
        newest history row of those it named before it was last added), or None."""
        return self.store.history_start(key)

    def extra_runs(self, key: str) -> list[Row]:
        """The pending extra runs (`run KEY`) of `key`."""
        return self.store.extra_runs(key)

    def wake_group(self, key: str, now: float | None = None) -> None:
        """A run of `key`'s group ended: the schedule's own occurrence, if it waits for
        its turn (given back until later although it is due), becomes due now.  One that
        waits after a failed attempt (attempt > 0: its retry wait) is left alone."""
        now_s = int(time.time() if now is None else now)
        row = self.store.get(key)
        if row is None or row.owner is not None or row.paused or row.attempt \
                or row.next_run_time <= now_s:
            return
        due = due_time(row.next_time, key, row.delay, from_text(row.policy).jitter)
        # One that waits because its run asked to (SCHED_LATER: its attempt did not
        # count) is left alone too.
        if due <= now_s and self.store.last_outcome(key, now_s + 1, RUN_ENDS) != Outcome.LATER:
            self.store.wake(key, row.fence, now_s)

    def group_holders(self, keys: Collection[str]) -> dict[str, str | None]:
        """group_holder of each of `keys` (schedules) that exists, in one query."""
        return self.store.group_holders(keys)

    def group_holder(self, key: str) -> str | None:
        """The run of `key`'s group (itself or a row KEY@run-...) that runs now, or ran
        last: of its held rows the others wait for their turn."""
        return self.store.group_holder(key)

    def group_busy(self, run_key: str, key: str, now: int) -> bool:
        """Whether another member of `key`'s group holds a live lease: `run_key` then
        starts once it has ended."""
        return self.store.group_busy(run_key, key, now)

    def older_hosts(self, now: float | None = None) -> list[str]:
        """The live hosts on this database that run an older release than this one, as
        "NAME (VERSION)": those that record themselves (0.2.0 on) and were heard of within
        alive_time, and nodes at work that do not record themselves (0.1.0).  SPEC
        "Upgrades": a feature such a host cannot honour is refused naming them."""
        now = time.time() if now is None else now
        since = now - max(self.config.alive_time, OLDER_HOSTS_WINDOW)
        recorded = self.store.hosts()
        older = {h["name"]: h["version"] for h in recorded
                 if h["last_seen"] >= since and _release(h["version"]) < _release(__version__)}
        known = {h["name"] for h in recorded}
        older.update({n: "0.1.0" for n in self.store.nodes_at_work(since) if n not in known})
        return [f"{name} ({version})" for name, version in sorted(older.items())]

    def refuse_on_older_hosts(self, feature: str, now: float | None = None) -> None:
        """NotSupportedError naming the older live hosts, if any, for `feature` (what the
        request asks, in words: "--concurrency allow")."""
        older = self.older_hosts(now)
        if older:
            raise NotSupportedError(
                f"{feature} needs PerfectSched {__version__} or newer on every host; "
                f"older hosts use this database: {', '.join(older)} (upgrade them first)")

    # -- pausing many: keys, and everything (pause --all) ----------------------------------

    def paused_all(self) -> dict[str, Any] | None:
        """{"since": Unix time, "by": user name} while everything is paused, else None."""
        text = self.store.paused_all()
        if text is None:
            return None
        try:
            state = json.loads(text)
        except ValueError:
            state = None
        return state if isinstance(state, dict) else {"since": None, "by": None}

    def pause_all(self, by: str, now: float | None = None) -> int:
        """Pause everything, on every host, until resume_all (stored in each row's own
        `paused`, so that every release obeys it): how many schedules it paused."""
        now = time.time() if now is None else now
        return self.store.pause_all(json.dumps({"since": int(now), "by": by}))

    def resume_all(self, *, skip_missed: bool = False, now: float | None = None
                   ) -> tuple[int, int]:
        """End pause_all: what it paused runs again (its missed occurrences as its misfire
        policy says; `skip_missed`: none of them), schedules paused on their own stay
        paused.  Returns (schedules resumed, occurrences skipped)."""
        now = time.time() if now is None else now
        moves, runs = self._skips(self.store.paused_with_all(), now) if skip_missed \
            else ({}, {})
        resumed, moved = self.store.resume_all(moves)
        return resumed, self._record_skips(runs, moved)

    def count_paused(self, *, with_all: bool) -> int:
        """How many schedules pause_all paused (`with_all`), or are paused on their own."""
        return self.store.count_paused(with_all)

    def pause_keys(self, keys: Sequence[str], *,
                   sources: Mapping[str, str] | None = None) -> None:
        """Pause these schedules, each on its own (resume_all leaves them paused);
        `sources`: new sources of some of them (detached by --force), in the same write."""
        self.store.set_paused(keys, True, sources=sources)

    def resume_keys(self, keys: Sequence[str], *, skip_missed: bool = False,
                    now: float | None = None,
                    sources: Mapping[str, str] | None = None) -> int:
        """Resume these schedules; `skip_missed`: without running what they missed.
        Returns the occurrences skipped."""
        now = time.time() if now is None else now
        moves, runs = self._skips([r for r in self.store.rows_of(keys=keys) if r.paused],
                                  now) if skip_missed else ({}, {})
        return self._record_skips(runs, self.store.set_paused(keys, False, moves,
                                                              sources=sources))

    def _skips(self, rows: Sequence[Row], now: float) -> tuple[
            dict[str, tuple[int, dict[str, Any]]], dict[str, tuple[int, list[dict[str, Any]]]]]:
        """Where each row moves on to without catching up (key -> (next_time read, new
        times)), and the occurrences it skips (key -> (how many, up to missed.COUNT_CAP;
        the history rows of the newest history_limit of them)."""
        moves: dict[str, tuple[int, dict[str, Any]]] = {}
        runs: dict[str, tuple[int, list[dict[str, Any]]]] = {}
        for row in rows:
            plan = missed.skip(row, now)
            if plan is None:
                continue
            moves[row.key] = (row.next_time, {"next_time": plan.next_time,
                                              "next_run_time": plan.next_run_time,
                                              "attempt": 0})
            runs[row.key] = (len(plan.skipped), [
                history_row(key=row.key, type=row.type, scheduled_time=t, attempt=0,
                            started_at=now, finished_at=now, outcome=Outcome.SKIPPED,
                            worker=self.owner, error=missed.SKIPPED_WHY)
                for t in reversed(plan.skipped[:self.config.history_limit])])
        return moves, runs

    def _record_skips(self, runs: Mapping[str, tuple[int, list[dict[str, Any]]]],
                      moved: set[str]) -> int:
        """Record the skipped occurrences of the schedules moved on; how many they were."""
        self.store.record_runs([r for key in sorted(moved) for r in runs[key][1]])
        return sum(runs[key][0] for key in moved)

    def rows_of(self, keys: Sequence[str] = (), sources: Sequence[str] = ()) -> list[Row]:
        """The stored rows of these keys and of these sources (file:NAME)."""
        return self.store.rows_of(keys=keys, sources=sources)

    def deleted_markers(self) -> dict[str, str]:
        """The markers of forced deletes of schedules files' schedules (deletions.py)."""
        return self.store.deleted_markers()

    def drop_deleted_markers(self, names: Sequence[str]) -> None:
        if names:
            self.store.drop_deleted_markers(names)

    def file_sources(self) -> list[str]:
        """Every file:NAME source that has schedules."""
        return self.store.file_sources()


def _release(version: str) -> tuple[int, ...]:
    """A release's number as a tuple (0.10.0 after 0.9.0); what does not parse sorts first."""
    try:
        return tuple(int(part) for part in version.split("+")[0].split(".")[:3])
    except ValueError:
        return (0,)


def open(config: Mapping[str, Any] | str | os.PathLike[str] | Config | None = None,
         environment: str | None = None) -> ScheduleCollection:
    """Open the schedules named by a config (dict, YAML path, or Config)."""
    return ScheduleCollection(load(config, environment))
