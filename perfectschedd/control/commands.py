"""One request (a JSON-able dict) -> one ScheduleCollection call -> a JSON-able result.

Shared by the control socket, D-Bus and `perfectschedctl -c` (direct mode), so the three
accept the same arguments and refuse the same bad input with the same messages.  What
each command is, takes and may be called by is registry.py's; this module implements
those that run on the database.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from perfectschedd.control import registry
from perfectschedd.control.auth import WITHHELD, Access, Caller, check_force, check_root_only
from perfectschedd.control.protocol import ATTEMPT_MAX, HISTORY_MAX, HISTORY_OUTPUT_BYTES
from perfectschedd.errors import InvalidInputError, NotFoundError, ScheduleError, describe
from perfectschedd.schedules import cron, deletions, policy
from perfectschedd.schedules.collection import ScheduleCollection, ScheduleInfo, waits_its_turn
from perfectschedd.schedules.ownership import known_user_name
from perfectschedd.schedules.validate import check_key, check_type, lookup_key
from perfectschedd.settings import notify_spec
from perfectschedd.settings.routes import RouteConfig
from perfectschedd.vocabulary import states, tokens
from perfectschedd.vocabulary.fields import (
    RUN_NOW_MARK,
    SOURCE_API,
    SOURCE_FILE,
    detached_source,
    schedule_key,
)

Args = Mapping[str, Any]

log = logging.getLogger("perfectschedd")

# Fields of `list --json` (SPEC) and of `show`, in this order.
LIST_FIELDS = ("key", "type", "cron", "delay", "timezone", "next_time", "next_run_time", "data",
               *policy.OPTIONS, "source", "creator")
SHOW_FIELDS = LIST_FIELDS + ("paused", "paused_reason", "attempt", "owner", "claimed_at")


def _info(info: ScheduleInfo, fields: tuple[str, ...]) -> dict[str, Any]:
    d = info.as_dict()
    return {f: d[f] for f in fields}


def _shown(access: Access, info: ScheduleInfo, fields: tuple[str, ...],
           readable: bool | None = None) -> dict[str, Any]:
    """A schedule as `access`'s caller may see it: its data withheld (null, and a note
    saying why) unless they may read it (auth.Access.may_read; `readable`: already
    known).  Every answer that holds a schedule's data goes through here."""
    shown = _info(info, fields)
    if readable is None:
        readable = access.may_read(info.creator, info.type)
    if not readable and "data" in shown:
        shown["data"] = None
        shown["withheld"] = WITHHELD
    return shown


def _withhold_runs(runs: list[dict[str, Any]]) -> None:
    """History rows a reader may not read: what the run printed (output, and the error
    line, which holds its last line) is withheld; when and how it ended stays."""
    for r in runs:
        r["output"] = r["error"] = None
        r["withheld"] = WITHHELD


def _arg(args: Mapping[str, Any], name: str, required: bool = True) -> Any:
    if name not in args:
        if required:
            raise InvalidInputError(name, "required")
        return None
    return args[name]


def _may_schedule(access: Access, key: Any, task_type: Any) -> None:
    """Whether the caller may make `task_type` run as `key` (auth.py), once both are
    what add would take."""
    access.check_route(check_key(key), check_type(task_type))


def _check_notify(sc: ScheduleCollection, name: Any) -> None:
    """A schedule names a notifier of the configuration of the host that handles the
    request (the notifier's command or address never travels with it); '' and none
    clear it.  The name's form is policy.check's."""
    if not isinstance(name, str) or name in ("", *notify_spec.NONE_WORDS) or \
            not notify_spec.NAME.match(name):
        return
    if sc.config.notifier(name) is None:
        known = ", ".join(n for n, _ in sc.config.notifiers) or "none are defined"
        raise InvalidInputError("notify", f"no notifier named {name!r} in this host's "
                                f"notifiers: ({known})")


def _check_concurrency(sc: ScheduleCollection, value: Any, now: float,
                       what: str = "--concurrency") -> None:
    """allow and replace put an occurrence on a row of its own, which a host of an older
    release would run in turn with the others, or not stop: refused while one uses the
    database (SPEC "Upgrades"), once the value itself is valid."""
    chosen = policy.check({"concurrency": value})["concurrency"] if value is not None \
        else None
    if chosen in ("allow", "replace"):
        sc.refuse_on_older_hosts(f"{what} {chosen}", now)


# A start this many occurrences back, with misfire all by default, is asked about: `-s 0`
# of an hourly schedule would queue some 500,000 runs, one after the other.
CATCH_UP_ASK = 1_000


def _check_catch_up(a: Mapping[str, Any], now: float, sc: ScheduleCollection) -> None:
    """A start far in the past runs every occurrence since, unless a misfire policy is
    chosen: refused past CATCH_UP_ASK of them unless --misfire says what is meant.  Bad
    values are left for add to refuse by name."""
    start, expr = a.get("start"), a.get("cron")
    if a.get("misfire") is not None or isinstance(start, bool) or \
            not isinstance(start, int | float) or not isinstance(expr, str) or \
            start >= now or cron.is_once(expr):
        return
    zone = a.get("timezone") or sc.config.timezone
    try:
        missed = cron.occurrences_back(expr, zone, int(now), int(start), CATCH_UP_ASK + 1)
    except (InvalidInputError, ValueError, OverflowError, KeyError, OSError):
        return
    if len(missed) > CATCH_UP_ASK:
        raise InvalidInputError(
            "start", f"more than {CATCH_UP_ASK:,} occurrences since "
            f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(start))} would each "
            "run, one after the other (misfire all); say --misfire all to mean it, or "
            "--misfire latest (run only the newest) or skip")


def _add(sc: ScheduleCollection, a: Args, now: float, access: Access) -> dict[str, Any]:
    options = {k: a[k] for k in ("delay", "timezone", "start", "at", "data", *policy.OPTIONS)
               if a.get(k) is not None}
    _may_schedule(access, _arg(a, "key"), _arg(a, "type"))
    _check_notify(sc, a.get("notify"))
    _check_concurrency(sc, a.get("concurrency"), now)
    _check_catch_up(a, now, sc)
    sc.add(a["key"], a["type"], _arg(a, "cron"), now=now, creator=access.creator, **options)
    return _shown(access, sc[a["key"]].info(), LIST_FIELDS)


def _add_many(sc: ScheduleCollection, a: Args, now: float, access: Access) -> dict[str, Any]:
    items = _arg(a, "schedules")
    if not isinstance(items, list) or not all(isinstance(i, Mapping) for i in items):
        raise InvalidInputError("schedules", "must be a list of objects")
    allowed = {"key", "type", "cron", "delay", "timezone", "start", "at", "data",
               *policy.OPTIONS}
    for item in items:
        unknown = set(item) - allowed
        if unknown:
            raise InvalidInputError("schedules", f"unknown field(s) {', '.join(sorted(unknown))}")
        _may_schedule(access, item.get("key"), item.get("type"))
        _check_notify(sc, item.get("notify"))
        _check_concurrency(sc, item.get("concurrency"), now)
        _check_catch_up(item, now, sc)
    return {"added": sc.add_many([{**i, "now": now, "creator": access.creator}
                                  for i in items])}


def _list(sc: ScheduleCollection, a: Args, now: float, access: Access) -> list[dict[str, Any]]:
    prefix = a.get("prefix")
    if prefix == "":
        prefix = None
    if prefix is not None:
        lookup_key(prefix, "prefix")
    after = a.get("after")
    if after is not None:
        lookup_key(after, "after")
    limit = check_limit(a.get("limit"))
    fields = SHOW_FIELDS if a.get("verbose") else LIST_FIELDS
    listed = sc.list_with_last_run(prefix=prefix, limit=limit, after_key=after)
    queued = _queued_runs(sc, [i for i, _ in listed], now)
    # allow: lists are looked up once per creator and type, not once per row.
    readable: dict[tuple[int | None, str], bool] = {}
    for i, _ in listed:
        if (i.creator, i.type) not in readable:
            readable[(i.creator, i.type)] = access.may_read(i.creator, i.type)
    return [{**_shown(access, i, fields, readable[(i.creator, i.type)]),
             **state_fields(i, last, queued=i.key in queued)} for i, last in listed]


def _queued_runs(sc: ScheduleCollection, infos: Sequence[ScheduleInfo], now: float
                 ) -> set[str]:
    """The extra runs of `infos` that a worker holds but that wait for their schedule's
    running occurrence to end (as status and show tell them apart): one query, only when
    the page holds such a run."""
    held = [i for i in infos if RUN_NOW_MARK in i.key and i.owner is not None
            and i.next_run_time > now]
    if not held:
        return set()
    holders = sc.group_holders({schedule_key(i.key) for i in held})
    return {i.key for i in held
            if waits_its_turn(i.key, i.concurrency, holders.get(schedule_key(i.key)))}


def state_fields(info: ScheduleInfo, last: Mapping[str, Any] | None,
                 queued: bool = False) -> dict[str, Any]:
    """What `list --json` and `show` say of a schedule's state (vocabulary/states.py): paused,
    the outcome of its latest run, the attempts of its current occurrence, the state
    (`queued`: an extra run held until its schedule's running occurrence ends)."""
    outcome = last["outcome"] if last else None
    state = states.state_of(info.paused, info.owner, info.attempt, outcome)
    if queued and state == states.RUNNING:
        state = states.QUEUED
    return {"paused": bool(info.paused), "last_outcome": outcome, "attempt": info.attempt,
            "state": states.shown(state, info.attempt)}


def check_limit(limit: Any) -> int | None:
    """A `list` limit: None (all) or a whole number >= 0."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)
                              or not 0 <= limit < 1 << 62):
        raise InvalidInputError("limit", "must be a whole number >= 0")
    return limit


def _show(sc: ScheduleCollection, a: Args, now: float, access: Access) -> dict[str, Any]:
    info = sc[_arg(a, "key")].info()
    shown = _shown(access, info, SHOW_FIELDS)
    shown["creator_name"] = _creator_name(sc, info.creator)
    # Extra runs (`run KEY`) and occurrences on rows of their own (allow, replace) not
    # ended yet.  Unless allowed to overlap, a held one runs only as its group's holder;
    # the others are queued for their turn.
    extra = sc.extra_runs(a["key"])
    holder = sc.group_holder(info.key) if extra else None
    shown["extra_runs"] = []
    for r in extra:
        held = r.owner is not None and r.next_run_time > now
        running = held and not waits_its_turn(
            r.key, policy.from_text(r.policy).concurrency, holder)
        shown["extra_runs"].append({"run_key": r.key, "run_at": r.next_run_time,
                                    "running": running, "queued": held and not running})
    return shown


def _creator_name(sc: ScheduleCollection, creator: int | None) -> str | None:
    """A user's name, or `token NAME` for what an API token made (auth.Caller)."""
    if creator is not None and creator < 0:
        token = sc.store.token_by_id(-creator)
        return f"token {token.name}" if token is not None else f"token #{-creator}"
    return known_user_name(creator)


def _changing(sc: ScheduleCollection, a: Args, access: Access) -> ScheduleInfo:
    """The schedule a change (modify, pause, resume, delete) is about, once the caller may
    change it: a schedules file's only with root's `force`, a route's with `user:` only
    as its allow: says (auth.py)."""
    force = check_force(access.caller, a.get("force"))
    info = sc[_arg(a, "key")].info()
    access.check_change(info.key, info.source, force, sc.config.schedules_dir)
    access.check_route(info.key, info.type)
    return info


def _detaching(info: ScheduleInfo) -> dict[str, Any]:
    """The new source of a schedules file's schedule changed with --force (as the change
    itself writes it): forced:file:NAME, which no convergence of files touches."""
    source = _detaching_source(info.source)
    return {} if source is None else {"source": source}


def _detaching_source(source: str | None) -> str | None:
    """None for a schedule that is no schedules file's (a stored source may be NULL:
    schedules made before sources were recorded)."""
    return detached_source(source) if source and source.startswith(SOURCE_FILE) else None


def _delete(sc: ScheduleCollection, a: Args, now: float, access: Access) -> dict[str, Any]:
    # Deleted, a schedule has no source left to record: a marker of the entry as it was
    # keeps every host's convergence from adding it back until it changes (schedules/deletions.py).
    info = _changing(sc, a, access)
    if _detaching_source(info.source) is not None:
        # A host of an older release reads no marker: it would add the entry back at its
        # start, or at an apply of the file (SPEC "Upgrades").
        sc.refuse_on_older_hosts("delete --force of a schedules file's schedule", now)

    def marker(deleted: ScheduleInfo) -> str | None:
        """From the row as it is deleted, in the delete's transaction: the entry a
        convergence changed since `info` was read is the one marked (marked as it was, it
        would come back at the next apply)."""
        if deleted.source != info.source:  # not the schedule the checks above were for
            raise ScheduleError(f"{info.key} changed while it was being deleted (its source "
                                f"is now {deleted.source or SOURCE_API}): nothing deleted")
        if _detaching_source(deleted.source) is None:
            return None
        return deletions.marker(deleted.key, deleted.source, deleted.as_dict())

    extra = sc[a["key"]].delete(marker)
    return {"key": a["key"], "deleted": True, "extra_runs": extra}


def _modify(sc: ScheduleCollection, a: Args, now: float, access: Access) -> dict[str, Any]:
    changes = {k: a[k] for k in ("type", "cron", "delay", "timezone", "data", "at",
                                 *policy.OPTIONS) if k in a}
    info = _changing(sc, a, access)  # what runs as its route's user changes: allow:
    _check_notify(sc, a.get("notify"))
    _check_concurrency(sc, a.get("concurrency"), now)
    if "type" in changes:
        access.check_route(info.key, check_type(changes["type"]))
    sc[a["key"]].modify(now=now, **changes, **_detaching(info))
    return _shown(access, sc[a["key"]].info(), SHOW_FIELDS)


def _pause(sc: ScheduleCollection, a: Args, now: float, access: Access) -> dict[str, Any]:
    """pause KEY..., --prefix P or --all: all or nothing (every key is checked first)."""
    which = _selected(a, "pause")
    if which is None:  # every admitted caller's (auth.py says why)
        check_force(access.caller, a.get("force"))  # not needed; refused as elsewhere
        return {"all": True, "paused": sc.pause_all(access.caller.name, now),
                **(sc.paused_all() or {})}
    keys, detached = _pausing(sc, a, which, access)
    sc.pause_keys(keys, sources=detached)
    return _paused_result(sc, which, keys, "paused", access)


def _resume(sc: ScheduleCollection, a: Args, now: float, access: Access) -> dict[str, Any]:
    """resume KEY..., --prefix P or --all; skip_missed: without catching up."""
    skip_missed = a.get("skip_missed", False)
    if not isinstance(skip_missed, bool):
        raise InvalidInputError("skip_missed", "must be true or false")
    which = _selected(a, "resume")
    if which is None:
        check_force(access.caller, a.get("force"))
        resumed, skipped = sc.resume_all(skip_missed=skip_missed, now=now)
        return {"all": True, "resumed": resumed, "skipped_occurrences": skipped,
                "paused_on_their_own": sc.count_paused(with_all=False)}
    keys, detached = _pausing(sc, a, which, access)
    skipped = sc.resume_keys(keys, skip_missed=skip_missed, now=now, sources=detached)
    return {**_paused_result(sc, which, keys, "resumed", access),
            **({"skipped_occurrences": skipped} if skip_missed else {})}


# What pause and resume act on: one of these (a single `key`: the request of 0.1.0
# clients and of D-Bus Pause/Resume, answered as they expect).
_SELECTORS = ("key", "keys", "prefix", "all")
# Keys named in one request, at most (each is read and changed in one transaction).
KEYS_MAX = 10_000


def _selected(a: Args, verb: str) -> str | None:
    """Which selector a pause or resume request uses (None: `all`), once it uses exactly
    one, well formed."""
    # Absent, null and false are not given; anything else is, and is checked below.
    given = [n for n in _SELECTORS if a.get(n) is not None and a.get(n) is not False]
    if not given:
        raise InvalidInputError("key", f"{verb} what? give KEY..., --prefix PREFIX or --all")
    if len(given) > 1:
        shown = {"key": "KEY", "keys": "KEY...", "prefix": "--prefix", "all": "--all"}
        raise InvalidInputError(given[0], f"give one of KEY..., --prefix or --all, not "
                                f"{' and '.join(shown[g] for g in given)}")
    if given[0] == "all":
        if a["all"] is not True:
            raise InvalidInputError("all", "must be true or false")
        return None
    if given[0] == "keys":
        keys = a["keys"]
        if not isinstance(keys, list) or not 0 < len(keys) <= KEYS_MAX:
            raise InvalidInputError("keys", f"must be a list of 1 to {KEYS_MAX} keys")
    return given[0]


def _pausing(sc: ScheduleCollection, a: Args, which: str, access: Access
             ) -> tuple[list[str], dict[str, str]]:
    """The keys a pause or resume by key or prefix (`which`) is about, once the caller
    may change every one of them (a schedules file's only with root's `force`:
    auth.py), and the new sources of the schedules files' ones that force detaches
    (_detaching); any refusal refuses the whole request."""
    force = check_force(access.caller, a.get("force"))
    if which == "key":
        keys = [lookup_key(a["key"])]
    elif which == "keys":
        keys = list(dict.fromkeys(lookup_key(k) for k in a["keys"]))
    else:
        prefix = lookup_key(a["prefix"], "prefix")  # never empty: that is --all
        # LIKE ignores case on SQLite and MySQL: the exact prefix is checked here.  Extra
        # runs (KEY@run-...) go with --all only, as `pause KEY` leaves them too.
        keys = [i.key for i in sc.list(prefix=prefix)
                if i.key.startswith(prefix) and RUN_NOW_MARK not in i.key]
        if not keys:
            raise NotFoundError(f"no schedule key starts with {prefix!r}; nothing changed")
    rows = {r.key: r for r in sc.rows_of(keys=keys)}
    missing = [k for k in keys if k not in rows]
    if missing:
        if which == "key":
            raise NotFoundError(f"schedule {missing[0]!r} not found")
        raise NotFoundError(f"schedule(s) not found: {', '.join(missing[:20])}"
                            f"{' ...' if len(missing) > 20 else ''}; nothing changed")
    detached: dict[str, str] = {}
    for key in keys:
        access.check_change(key, rows[key].source, force, sc.config.schedules_dir)
        access.check_route(key, rows[key].type)
        source = _detaching_source(rows[key].source)
        if source is not None:
            detached[key] = source
    return keys, detached


def _paused_result(sc: ScheduleCollection, which: str, keys: list[str], verb: str,
                   access: Access) -> dict[str, Any]:
    if which == "key":  # as before several keys could be given
        return _shown(access, sc[keys[0]].info(), SHOW_FIELDS)
    return {verb: keys, "count": len(keys)}


def _run(sc: ScheduleCollection, a: Args, now: float, access: Access) -> dict[str, Any]:
    # `run` of a schedules file's schedule needs no force: an extra occurrence is no change
    # of the file (the schedule does not move; the run has the file's type and data), and
    # the route's own rule says who may make its type run (auth.Access.check_route).
    schedule = sc[_arg(a, "key")]
    info = schedule.info()
    access.check_route(info.key, info.type)
    run_key = schedule.run_now(now=now, creator=access.creator)
    # allow: it runs beside a running occurrence; replace: it stops it.
    busy = info.concurrency != "allow" and sc.group_busy(run_key, a["key"], int(now))
    replaces = busy and info.concurrency == "replace"
    return {"key": a["key"], "run_key": run_key, "run_at": int(now),
            "after_running": busy and not replaces, "replaces": replaces,
            "note": ("starts now and stops the running occurrence of this schedule"
                     if replaces else
                     "starts once the running occurrence of this schedule has ended"
                     if busy else "starts now")}


def _history(sc: ScheduleCollection, a: Args, now: float, access: Access) -> list[dict[str, Any]]:
    """The newest runs of a schedule, each with what it did (exit status or signal,
    duration, output tail, error); `attempt`: only the runs that were that attempt.
    Their output and error lines only to those who may read the schedule (_readable);
    `raw` (the client prints output unescaped) only to root."""
    key = lookup_key(_arg(a, "key"))
    access.check_raw(a.get("raw"))
    limit = a.get("limit", 20)
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= HISTORY_MAX:
        raise InvalidInputError("limit", f"must be a whole number from 1 to {HISTORY_MAX}")
    attempt = a.get("attempt")
    if attempt is not None and (isinstance(attempt, bool) or not isinstance(attempt, int)
                                or not 1 <= attempt <= ATTEMPT_MAX):
        raise InvalidInputError("attempt", f"must be a whole number from 1 to {ATTEMPT_MAX}")
    readable = _readable(sc, key, access)
    # Those who do not read everything see the runs of the schedule the key names now,
    # not of those it named before (deleted, then added again, perhaps by another).
    after = None if access.reads_all else sc.history_start(schedule_key(key))
    runs = sc.history(key, limit, attempt, after_id=after)
    if not runs and not sc[key].exists():
        sc[key].info()  # raises NotFoundError with the usual message
    if not readable:
        _withhold_runs(runs)
    budget = HISTORY_OUTPUT_BYTES
    for r in runs:
        r.pop("id", None)
        # An answer waits whole in the daemon's memory until the client reads it: the
        # newest runs keep their output up to a budget, older ones say theirs was left out.
        output = r.get("output")
        if output:
            budget -= len(output)
            if budget < 0:
                r["output"], r["output_omitted"] = None, True
    return runs


def _readable(sc: ScheduleCollection, key: str, access: Access) -> bool:
    """Whether the caller may read the runs of `key` (an extra run's: its schedule's).
    A deleted schedule names no creator and no type to judge by: its runs are for those
    who read everything, and to anyone else it is not found."""
    if access.reads_all:
        return True
    schedule = sc[schedule_key(key)]
    if not schedule.exists():
        raise NotFoundError(f"schedule {schedule_key(key)!r} not found (the history of a "
                            "deleted schedule is shown to root only)")
    info = schedule.info()
    return access.may_read(info.creator, info.type)


def access_of(caller: Caller | None, routes: Sequence[RouteConfig], where: str) -> Access:
    """What `caller` (None: this process) may do and read, reaching us `where`: direct
    mode holds the database's credentials, so it reads everything, as root does; so
    does the daemon's own user, through the daemon."""
    caller = caller or Caller.this_process()
    direct = where != registry.DAEMON
    return Access(caller, routes,
                  reads_all=direct or caller.schedules_root or (
                      caller.token is None and caller.uid == os.geteuid()),
                  raw_ok=direct or caller.schedules_root)


def withhold_status(status: dict[str, Any], access: Access) -> dict[str, Any]:
    """`status` as `access`'s caller may see it: every key and state, and the error lines
    (a run's last line of output) of the failing schedules it may read."""
    failing = status.get("failing")
    if access.reads_all or not failing:
        return status
    shown = []
    for f in failing:
        f = dict(f)
        if f.get("error") and not access.may_read(f.get("creator"), str(f.get("type"))):
            f["error"], f["withheld"] = None, WITHHELD
        shown.append(f)
    return {**status, "failing": shown}


def _types(sc: ScheduleCollection, a: Args, now: float, access: Access) -> dict[str, int]:
    """Schedules by task type (every admitted caller sees every key and type)."""
    task_type = a.get("type")
    if task_type is not None:
        check_type(task_type)
    return sc.store.type_counts(task_type)


def _init(sc: ScheduleCollection, a: Args, now: float, access: Access) -> dict[str, Any]:
    created = sc.init()
    return {"table": sc.config.table, "initialized": True, "created": created}


def _apply(sc: ScheduleCollection, a: Args, now: float, access: Access) -> dict[str, Any]:
    """Converge to schedules files read by the caller (perfectschedctl apply): their
    entries, without commands.  Adds and changes; with `prune`, also removes."""
    from perfectschedd.schedules import converge

    entries = converge.from_wire(_arg(a, "entries"))
    for entry in entries.values():
        access.check_apply_type(entry.key, entry.type)
        _check_notify(sc, entry.policy.notify)
        _check_concurrency(sc, entry.policy.concurrency, now, f"{entry.key}: concurrency:")
    prune, dry_run = a.get("prune", False), a.get("dry_run", False)
    if not isinstance(prune, bool) or not isinstance(dry_run, bool):
        raise InvalidInputError("prune", "prune and dry_run must be true or false")
    # --prune: every schedule that came from a file and is not in these files goes (those
    # the caller may change: Access.owns), and so do the markers of forced deletes of
    # these files' entries that left them (a file whose schedules were all deleted with
    # --force has no schedule left to name it).
    remove_from = sorted(set(sc.file_sources()) | {e.source for e in entries.values()}) \
        if prune else []
    changes = converge.converge(sc, entries, remove_from, dry_run=dry_run, now=now,
                                creator=access.creator, applier=access.caller.uid)
    return converge.summary(changes)


TOKEN_ACTIONS = ("add", "list", "revoke")
# What `token list` shows of a token, in this order: never its hash.
TOKEN_FIELDS = ("id", "name", "role", "created_at", "created_by", "expires_at", "revoked_at")


def _token(sc: ScheduleCollection, a: Args, now: float, access: Access) -> Any:
    """token add|list|revoke: the HTTP API's credentials (vocabulary/tokens.py), root's
    only (execute refused anyone else already: auth.check_root_only), through the
    daemon or -c alike.  Each change is logged with the token's name and who made it, never its
    secret."""
    action = _arg(a, "action")
    if action not in TOKEN_ACTIONS:
        raise InvalidInputError("action", f"must be add, list or revoke, not "
                                          f"{describe(action)}")
    given = [f for f in ("name", "role", "expires") if a.get(f) is not None]
    takes = {"add": ("name", "role", "expires"), "list": (), "revoke": ("name",)}[action]
    if extra := [f for f in given if f not in takes]:
        shown = {"name": "NAME", "role": "--role", "expires": "--expires"}
        raise InvalidInputError(extra[0], f"token {action} takes no "
                                          f"{' or '.join(shown[f] for f in extra)}")
    if action == "list":
        return [{**{f: getattr(t, f) for f in TOKEN_FIELDS},
                 "state": tokens.state(t.revoked_at, t.expires_at, now)}
                for t in sc.store.tokens()]
    name = tokens.check_name(_arg(a, "name"))
    if action == "revoke":
        sc.store.revoke_token(name, now)
        log.info("token %s revoked by %s", name, access.caller.name)
        return {"name": name, "revoked": True, "revoked_at": now}
    if a.get("role") is None:
        raise InvalidInputError("role", f"required: give --role "
                                        f"{'|'.join(tokens.ROLES)}")
    role = tokens.check_role(a["role"])
    expires = a.get("expires")
    expires_at = None if expires is None else now + tokens.parse_expires(expires)
    token_id, secret = sc.store.add_token(name, role, access.caller.name, expires_at, now)
    log.info("token %s added (role %s, %s) by %s", name, role,
             "no expiry" if expires_at is None else
             time.strftime("expires %Y-%m-%d %H:%M:%S UTC", time.gmtime(expires_at)),
             access.caller.name)
    return {"id": token_id, "name": name, "role": role, "created_at": now,
            "created_by": access.caller.name, "expires_at": expires_at, "secret": secret,
            "note": "the secret is shown only this once (the database keeps a hash of it)"}


Handler = Callable[[ScheduleCollection, Args, float, Access], Any]

# The implementation of each command that runs on the database (registry.COMMANDS says
# everything else about it; status and reload are answered by the daemon itself).
HANDLERS: dict[str, Handler] = {
    "add": _add, "add_many": _add_many, "list": _list, "show": _show, "delete": _delete,
    "modify": _modify, "pause": _pause, "resume": _resume, "run": _run,
    "history": _history, "init": _init, "apply": _apply, "token": _token, "types": _types,
}


def execute(sc: ScheduleCollection, command: str, args: Mapping[str, Any] | None = None,
            now: float | None = None, where: str = registry.DIRECT,
            caller: Caller | None = None,
            routes: Sequence[RouteConfig] | None = None) -> Any:
    """Run one command for `caller` (default: this process, as perfectschedctl -c is)
    reaching it `where` (registry.DAEMON: the daemon's dispatch; DIRECT: perfectschedctl
    -c), under `routes` (default: sc's configuration's); raises ScheduleError subclasses
    for refused requests."""
    cmd = registry.command(command, where)
    caller = caller or Caller.this_process()
    check_root_only(cmd, caller)
    handler = HANDLERS.get(cmd.name)
    if handler is None:  # the daemon's own (status, reload): never on the database
        raise InvalidInputError("command", f"{cmd.name} needs the daemon: use --socket, "
                                "not -c")
    if args is None:
        args = {}
    if not isinstance(args, Mapping):
        raise InvalidInputError("args", "must be an object")
    registry.check_args(cmd, args)
    access = access_of(caller, sc.config.routes if routes is None else routes, where)
    return handler(sc, args, time.time() if now is None else now, access)
