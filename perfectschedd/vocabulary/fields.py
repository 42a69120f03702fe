"""The limits and markers of a schedule's fields, shared by validation, the importers,
the config and the store, and the limits the control protocol and perfectschedctl's
parser state.  Kept apart from the table definitions (store/schema.py) so that what only
checks input never loads SQLAlchemy, and apart from the schedule code (cron.py:
croniter) so that perfectschedctl's start loads none of it."""

from __future__ import annotations

import json
from typing import Any

# Extra runs of a schedule (perfectschedctl run) are one-off rows keyed KEY@run-....
RUN_NOW_MARK = "@run-"
# The source of a schedule from a schedules file: file:NAME (NULL: made with `add`).
SOURCE_FILE = "file:"
# The source shown for a schedule made with `add` (stored as NULL).
SOURCE_API = "api"
# The source of a schedule root took from its file with --force: forced:file:NAME.  Not
# file:NAME, so that no convergence (a reload, apply, apply --prune, an older host's)
# writes the file's version back or removes it.
SOURCE_FORCED = "forced:"
# The type of a schedules file's exec entry: exec:KEY (schedules.check_type keeps it for
# them), routed to the command of that entry on the hosts whose files hold it.
EXEC_TYPE = "exec:"
KEY_MAX = 256
TYPE_MAX = 256
CRON_MAX = 256
TZ_MAX = 64
DATA_MAX = 65536
PAUSED_REASON_MAX = 400
# The paused_reason of a schedule paused by `pause --all` (a cluster-wide pause): stored in
# each row's own `paused` column, so that every host, 0.1.0 included, obeys it; the reason
# tells it from a schedule paused on its own (NULL: by a user; "paused by perfectschedd:
# ...": no next occurrence), which `resume --all` leaves paused.
PAUSED_ALL_REASON = "paused with every schedule (perfectschedctl pause --all)"
# The name of the meta table's row (store/schema.meta_table) that says everything is
# paused: JSON {"since": Unix time, "by": user name}.  Absent: nothing is.
PAUSED_ALL_META = "paused_all"
# A schedules file's schedule root deleted with --force leaves a marker in the meta table,
# named this prefix + deleted_marker_name's digest of its key (the key itself may be longer
# than a name), valued the entry's digest and its source (schedules/deletions.py): no
# convergence adds the entry back while it is as it was.
DELETED_META = "deleted:"
POLICY_MAX = 400
SOURCE_MAX = 300


def schedule_key(key: str) -> str:
    """The schedule a run's key belongs to: KEY for KEY@run-... (an extra run, or an
    allow/replace schedule's occurrence on a row of its own), else the key itself."""
    return key.split(RUN_NOW_MARK, 1)[0]


# The paused_reason of a row refused because its type names a schedules file's exec entry
# whose own row it is not (foreign_exec_row): status lists the rows it starts, `resume
# --all` leaves them paused, and a worker that claims one anyway refuses it again.
REFUSED_ROW_REASON = "refused by perfectschedd: "


def exec_entry_key(task_type: str) -> str | None:
    """K for a type exec:K (a schedules file's exec entry), else None."""
    return task_type[len(EXEC_TYPE):] if task_type.startswith(EXEC_TYPE) else None


def foreign_exec_row(key: str, task_type: str, schedule: tuple[str, str | None] | None,
                     entry_source: str | None = None) -> str | None:
    """Why a stored row must not run, or None: its type exec:K runs entry K's command,
    as K's user, and it is not entry K's own row.  The one rule (SPEC "Privilege model":
    a row is trusted no more than its writer, whatever version wrote it), used by the
    upgrade (store/upgrade.py), the daemon's start and reloads (schedules/converge.py) and
    the worker before each run (worker/runs.py).

    Entry K's own: key K or one of K's extra runs (K@run-...), whose schedule, the row
    keyed K (`schedule`: its type and source, None when there is none; an extra run
    records no source: it is its schedule's), is of type exec:K and came from a schedules
    file: `entry_source` (file:NAME, the file that holds K on this host, or root's
    --force of it), any file when that is not known here (None)."""
    entry = exec_entry_key(task_type)
    if entry is None:
        return None
    if schedule_key(key) != entry:
        return (f"its type {task_type} runs schedules file entry {entry!r}'s command, and "
                f"it is not that entry's row nor one of its extra runs")
    if schedule is None or schedule[0] != task_type:
        return (f"its type {task_type} runs schedules file entry {entry!r}'s command, and "
                f"no row {entry!r} of that type exists")
    source = schedule[1]
    if entry_source is not None:
        ok = source in (entry_source, detached_source(entry_source))
    else:
        ok = source is not None and (source.startswith(SOURCE_FILE) or
                                     source.startswith(SOURCE_FORCED + SOURCE_FILE))
    if not ok:
        return (f"its type {task_type} runs schedules file entry {entry!r}'s command, and "
                f"the row {entry!r} came from {source or SOURCE_API}, not from "
                + (entry_source if entry_source is not None else "a schedules file"))
    return None


def refused_reason(why: str) -> str:
    """The paused_reason stored for a row foreign_exec_row refuses."""
    text = f"{REFUSED_ROW_REASON}{why}; it never runs (delete it)"
    return text if len(text) <= PAUSED_REASON_MAX else text[:PAUSED_REASON_MAX - 3] + "..."


def refused_line(key: str, task_type: str, creator: int | None, reason: str) -> str:
    """The journal's WARNING line for a refused row (one per row)."""
    who = "unknown (before 0.2.0)" if creator is None else f"uid {creator}"
    return (f"schedule {key!r} refused and paused: type {task_type}, creator {who}: "
            f"{reason.removeprefix(REFUSED_ROW_REASON)}")


def detached_source(source: str) -> str:
    """The source recorded for a schedule of `source` (file:NAME) changed with --force."""
    return f"{SOURCE_FORCED}{source}"[:SOURCE_MAX]


# The meta row that records, for a key added again, the newest history row of the
# schedules it named before (history_from_name): its new readers see only what follows.
HISTORY_FROM_META = "history-from:"


def history_from_name(key: str) -> str:
    """The meta row's name of `key`'s history start (HISTORY_FROM_META)."""
    import hashlib  # as deleted_marker_name

    return HISTORY_FROM_META + hashlib.sha256(key.encode()).hexdigest()[:50]


def deleted_marker_name(key: str) -> str:
    """The meta row's name of a forced delete of `key` (DELETED_META)."""
    import hashlib  # here: OpenSSL's library takes 2-3 ms to load, at every perfectschedctl start

    return DELETED_META + hashlib.sha256(key.encode()).hexdigest()[:56]


UNIT_MAX = 255  # systemd's longest unit name
ERROR_MAX = 400  # a history row's error: one line
# The last second of year 9999: the calendar ends here (datetime, and so croniter, knows
# no year 10000); it bounds every time and duration we store (and keeps them in 64 bits).
LAST_INSTANT = 253402300799

# Nesting deeper than this in a request, or in a schedule's data, is refused (no JSON
# document we accept needs it).
MAX_DEPTH = 64
# How many fire times `perfectschedctl next` prints by default, and at most (preview.py).
PREVIEW_COUNT = 5
PREVIEW_MAX = 1000


def json_depth(obj: Any, limit: int = MAX_DEPTH) -> int:
    """Nesting depth of a decoded JSON value, iteratively (no recursion to exhaust);
    stops counting once past `limit`."""
    deepest, todo = 0, [(obj, 1)]
    while todo:
        value, level = todo.pop()
        if isinstance(value, dict | list):
            deepest = max(deepest, level)
            if deepest > limit:
                return deepest
            items = value.values() if isinstance(value, dict) else value
            todo.extend((v, level + 1) for v in items)
    return deepest


def dumps_data(data: Any) -> str:
    """A schedule's data as stored: compact JSON with sorted keys."""
    # allow_nan=False: NaN/Infinity are not JSON; other clients could not read them.
    return json.dumps(data, separators=(",", ":"), sort_keys=True, allow_nan=False)


# A schedule's fields, each once: its name, the Python type of its value as stored, and
# what it holds.  In the schedules table's column order (store/schema.py makes the
# columns; tests/vocabulary/test_fields.py holds them to this list).  Row and Claimed
# (store/schema.py) and ScheduleInfo (schedules/collection.py) are made from it.
SCHEDULE_FIELDS: dict[str, Any] = {
    "key": str,
    "type": str,
    "cron": str | None,           # None: a one-off run (an extra run, KEY@run-...)
    "delay": int,
    "timezone": str,
    "data": str,                  # JSON text (dumps_data)
    "next_time": int,             # the occurrence, as cron says
    "next_run_time": int,         # when it may run; while a worker holds it, the lease's end
    "paused": bool,
    "fence": int,                 # grows on every claim and every write that takes the row
                                  # from its holder: a holder's write names the one it got
    "attempt": int,
    "owner": str | None,          # the holder (node:pid), None when nobody holds it
    "claimed_at": float | None,
    "due_time": int | None,       # next_run_time when the holder claimed it (lateness)
    "has_extra": int | None,      # `run` made extra runs of it: they must not overlap it
    "paused_reason": str | None,  # why the daemon paused it; None when a user did
    "policy": str | None,         # policy.Policy.to_text(): None for the defaults
    "group_holder": str | None,   # the member of its group that runs now, or ran last
    "source": str | None,         # file:NAME (a schedules file); None: made with `add`
    "creator": int | None,        # the uid that made it; None: unknown (before 0.2.0)
}
# Row: a schedule as read and written whole.  The last ones, from paused_reason on, may
# be left out when one is made (None).
ROW_FIELDS = ("key", "type", "cron", "delay", "timezone", "data", "next_time",
              "next_run_time", "paused", "fence", "attempt", "owner", "claimed_at",
              "paused_reason", "policy", "source", "creator")
ROW_OPTIONAL = ROW_FIELDS[ROW_FIELDS.index("paused_reason"):]
# Claimed: a row just leased to a worker, as it is after the claim, in the order the
# backends' claims return its columns.
CLAIMED_FIELDS = ("key", "type", "cron", "delay", "timezone", "data", "next_time", "fence",
                  "attempt", "due_time", "has_extra", "policy", "creator")
CLAIMED_OPTIONAL = ("policy", "creator")
# ScheduleInfo: a schedule as users see it, in the order `list --json` shows it: `data`
# decoded, `policy` as its options (policy.OPTIONS), `source` "api" for `add`'s.
INFO_FIELDS = ("key", "type", "cron", "delay", "timezone", "next_time", "next_run_time",
               "data", "paused", "attempt", "owner", "claimed_at", "paused_reason",
               "policy", "source", "creator")
