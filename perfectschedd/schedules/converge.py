"""Converge the database to schedules files: the daemon at start and on reload (its
files' state, what it loaded and applied, is master/file_schedules.py's), and
`perfectschedctl apply` on demand (control/commands.py, its dry run too).

Rules (SPEC "Declarative schedules and migration"):
- An entry missing from the database is added; one that differs is changed (a new cron
  or zone recomputes the next times, as `modify` does); an equal one is not written, so
  its times and any running lease stay, and hosts with the same files write nothing.
- A schedule is removed only when it came from a file of this host (source file:NAME)
  and left it.  Schedules made with `add` are never touched, nor are keys that another
  file holds.  `apply` by a caller other than root changes and removes only the
  schedules that caller made (ownership.owns).
- A daemon remembers what it applied (`previous`).  After its first apply it writes only what
  changed in its own files since: where the database holds something else for an entry
  it did not change, another host (whose files differ) wrote it, and the daemon logs the
  disagreement once instead of writing it back, so that hosts never flap.
- A key root deleted with --force is not added again while its entry is as it was
  (deletions.py: a marker in the database, read by every host, at start and on apply).
- A row whose type names an entry's command (exec:K) but is not that entry's own
  (fields.foreign_exec_row) is paused with the reason, at start and on every reload
  (master/file_schedules.py).
"""

from __future__ import annotations

import json
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from perfectschedd.errors import (
    AlreadyExistsError,
    InvalidInputError,
    NotFoundError,
    NotSupportedError,
)
from perfectschedd.schedules import cron, deletions
from perfectschedd.schedules.collection import INTERVAL_FEATURE, ScheduleCollection, ScheduleInfo
from perfectschedd.schedules.files import SOURCE_FILE, Entry, check_entry
from perfectschedd.schedules.ownership import made_by, owns
from perfectschedd.vocabulary.fields import SOURCE_API, SOURCE_MAX, detached_source

# What happened to one key.
ADDED, CHANGED, REMOVED, UNCHANGED = "added", "changed", "removed", "unchanged"
DIFFERS = "differs"    # the database holds another host's version; not written
REFUSED = "refused"    # the key belongs to `add` or to another file
DETACHED = "detached"  # root changed it with --force: the file's entry is not applied
DELETED = "deleted"    # root deleted it with --force: the entry, unchanged, is not added


@dataclass(frozen=True)
class Change:
    action: str
    key: str
    detail: str = ""
    # Not applied for now (a host too old for it is live): the next apply tries again.
    again: bool = False

    def line(self) -> str:
        return f"{self.action} {self.key}" + (f" ({self.detail})" if self.detail else "")


def _differences(info: ScheduleInfo, wanted: Mapping[str, Any]) -> dict[str, Any]:
    current = info.as_dict()
    return {name: value for name, value in wanted.items() if current.get(name) != value}


def _interval_refusal(sc: ScheduleCollection, entries: Mapping[str, Entry],
                      rows: Mapping[str, Any], now: float, *, whole: bool
                      ) -> dict[str, str]:
    """The entries that would bring `@every` into the database while a host too old to
    read it is live, each with the reason (SPEC "Upgrades").  `whole` (perfectschedctl
    apply, its dry run too): the whole request is refused before anything is written,
    as `add` is; the daemon's own files go on without those entries."""
    new = [key for key, entry in entries.items() if cron.period(entry.cron) is not None
           and (key not in rows or rows[key].cron != entry.cron)]
    if not new:
        return {}
    try:
        sc.refuse_on_older_hosts(INTERVAL_FEATURE, now)
    except NotSupportedError as exc:
        if whole:
            raise
        return {key: str(exc) for key in new}
    return {}


def converge(sc: ScheduleCollection, entries: Mapping[str, Entry],
             remove_from: Collection[str], *, previous: Mapping[str, Entry] | None = None,
             dry_run: bool = False, now: float | None = None,
             creators: Mapping[str, int] | None = None, creator: int | None = None,
             applier: int | None = None) -> list[Change]:
    """Make the database hold `entries`, and remove the schedules of sources
    `remove_from` that they do not hold.  `previous`: what this caller applied last
    time (None: nothing is known, everything that differs is written).  What it adds
    records as creator the uid `creators` gives for its source, else `creator`, else
    this process's.  `applier`: the uid of the caller of `apply` (None: the daemon, for
    its own files), who changes and removes only what it owns (ownership.owns)."""
    creators = creators or {}
    now = time.time() if now is None else now
    tz = sc.config.timezone
    rows = {r.key: r for r in sc.rows_of(keys=list(entries), sources=list(remove_from))}
    intervals_refused = _interval_refusal(sc, entries, rows, now, whole=applier is not None)
    changes: list[Change] = []
    older: list[str] | None = None  # hosts of an older release, asked once if need be
    markers = sc.deleted_markers()
    forgotten: list[str] = []  # markers of forced deletes that end now (deletions.py)
    for key, entry in entries.items():
        row = rows.get(key)
        marker = markers.get(deletions.name(key))
        if marker is not None:
            if row is not None:
                forgotten.append(deletions.name(key))  # added again (an older host's add)
            elif deletions.marker_digest(marker) == deletions.digest(
                    key, entry.source, entry.stored(tz)):
                changes.append(Change(DELETED, key, "deleted with --force: the file's entry"
                                      " is not added again until it changes"))
                continue
            # The entry changed since: added below, and its insert ends the marker.
        if key in intervals_refused:
            changes.append(Change(REFUSED, key, intervals_refused[key], again=True))
            continue
        if entry.policy.overlaps:
            # An older host would run its occurrences in turn, or not stop them (SPEC
            # "Upgrades"): refused alone, and what the database holds stays; tried again
            # once those hosts are gone.
            older = sc.older_hosts(now) if older is None else older
            if older:
                changes.append(Change(REFUSED, key, f"concurrency: {entry.policy.concurrency}"
                                      " needs every host upgraded; older hosts use this "
                                      f"database: {', '.join(older)}", again=True))
                continue
        mine_unchanged = previous is not None and previous.get(key) == entry
        if row is None:
            if mine_unchanged:
                changes.append(Change(DIFFERS, key, "removed from the database elsewhere; "
                                      "not added again"))
                continue
            if not dry_run:
                try:
                    sc.add(key, now=now, source=entry.source, file_entry=True,
                           creator=creators.get(entry.source, creator), **entry.stored(tz))
                except AlreadyExistsError:  # another host added it just now
                    changes.append(Change(UNCHANGED, key, "added by another host"))
                    continue
            changes.append(Change(ADDED, key))
            continue
        owner = row.source or SOURCE_API
        if owner == detached_source(entry.source):
            changes.append(Change(DETACHED, key, f"source {owner}, changed with --force: "
                                  "the file's entry is not applied"))
            continue
        if owner != entry.source:
            changes.append(Change(REFUSED, key, f"the key belongs to {owner}"
                                  + (" (made with add)" if owner == SOURCE_API else "")))
            continue
        if applier is not None and not owns(applier, row.creator):
            changes.append(Change(REFUSED, key, f"the key belongs to {owner}, made by "
                                  f"{made_by(row.creator)}"))
            continue
        diff = _differences(ScheduleInfo.from_row(row), entry.stored(tz))
        if not diff:
            changes.append(Change(UNCHANGED, key))
        elif mine_unchanged:
            changes.append(Change(DIFFERS, key, "the database has another " +
                                  ", ".join(sorted(diff)) + "; not written"))
        else:
            if not dry_run:
                try:
                    sc[key].modify(now=now, file_entry=True, **diff)
                except NotFoundError:  # deleted meanwhile: added again next time
                    continue
            changes.append(Change(CHANGED, key, ", ".join(sorted(diff))))
    for key, row in rows.items():
        if key in entries or row.source not in remove_from:
            continue
        if applier is not None and not owns(applier, row.creator):
            continue  # another's: not this caller's to prune
        if previous is not None and key not in previous:
            # Never in this caller's files: a file of the same name elsewhere holds it.
            changes.append(Change(DIFFERS, key, f"in {row.source} of another host only; "
                                  "not removed"))
            continue
        if not dry_run:
            try:
                sc[key].delete()
            except NotFoundError:
                continue
        changes.append(Change(REMOVED, key))
    forgotten += _left_their_files(markers, entries, remove_from, previous, applier)
    if forgotten and not dry_run:
        sc.drop_deleted_markers(forgotten)
    return changes


def _left_their_files(markers: Mapping[str, str], entries: Mapping[str, Entry],
                      remove_from: Collection[str], previous: Mapping[str, Entry] | None,
                      applier: int | None) -> list[str]:
    """The markers of forced deletes whose entries left their files: the same entry added
    back later is added again.  As a schedule is removed (converge): only from the
    sources being pruned, and, once this caller applied its files, only for keys it had
    (a file of the same name on another host may hold it still).  A forced delete is
    root's: only root's `apply` forgets it."""
    if applier not in (None, 0):
        return []
    held = {deletions.name(k) for k in entries}
    had = None if previous is None else {deletions.name(k) for k in previous}
    return [name for name, value in markers.items()
            if name not in held and (had is None or name in had)
            and any(deletions.marker_of_source(value, s) for s in remove_from)]


def summary(changes: list[Change]) -> dict[str, Any]:
    """An `apply` answer: the lines, and counts by action."""
    counts: dict[str, int] = {}
    for c in changes:
        counts[c.action] = counts.get(c.action, 0) + 1
    return {"changes": [c.line() for c in changes], "counts": counts}


def to_wire(entries: Mapping[str, Entry]) -> list[dict[str, Any]]:
    """Entries as `apply` sends them to the daemon: what is stored, never a command, an
    environment or a user."""
    out = []
    for e in entries.values():
        item: dict[str, Any] = {"key": e.key, "source": e.source, "type": e.type,
                                "cron": e.cron, "delay": e.delay, "data": json.loads(e.data),
                                **e.policy.to_fields_changed()}
        if e.timezone is not None:
            item["timezone"] = e.timezone
        out.append(item)
    return out


def from_wire(items: Any) -> dict[str, Entry]:
    """to_wire()'s list back, checked as a file's entries are."""
    if not isinstance(items, list) or not all(isinstance(i, Mapping) for i in items):
        raise InvalidInputError("entries", "must be a list of objects")
    out: dict[str, Entry] = {}
    for item in items:
        source = item.get("source")
        if not isinstance(source, str) or not source.startswith(SOURCE_FILE) or \
                len(source) > SOURCE_MAX or len(source) == len(SOURCE_FILE):
            raise InvalidInputError("source", f"must be {SOURCE_FILE}NAME (at most "
                                    f"{SOURCE_MAX} characters)")
        entry = check_entry({k: v for k, v in item.items() if k != "source"}, source,
                            need_user_support=False, stored_only=True)
        if entry.key in out:
            raise InvalidInputError("key", f"{entry.key!r} appears twice")
        out[entry.key] = entry
    return out
