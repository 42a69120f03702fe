"""Print results: tables for people, JSON for programs."""

from __future__ import annotations

import json
import re
import signal
import time
from collections.abc import Sequence
from datetime import UTC, datetime, tzinfo
from typing import Any

LIST_COLUMNS = ("key", "type", "cron", "delay", "timezone", "next_time", "next_run_time", "data",
                "state", "source")
# Fields a reader who may not read a schedule gets as null (with a `withheld` note).
WITHHELD_FIELDS = ("data", "output", "error")
HISTORY_COLUMNS = ("scheduled_time", "started_at", "outcome", "attempt", "exit", "duration",
                   "worker", "unit", "error")
TOKEN_COLUMNS = ("name", "role", "created", "created_by", "expires", "state")


# What a terminal would act on rather than show: C0 and C1 controls (ESC starts colour
# changes, cursor moves, OSC 52 clipboard writes; \r overwrites a line), DEL, and the
# bidi and line-separator characters that reorder or split what is shown.  Newlines and
# tabs are output's own, kept where output is printed whole (terminal_text).
_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e"
                       "\u2066-\u2069]")
_CONTROLS_AND_LINES = re.compile(f"[\t\n{_CONTROLS.pattern[1:-1]}]")
_NAMED = {"\t": "\\t", "\n": "\\n", "\r": "\\r", "\x1b": "\\e"}


def _escape(match: re.Match[str]) -> str:
    c = match.group()
    return _NAMED.get(c) or (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")


def terminal_text(text: str) -> str:
    """`text` (a run's output) safe to print on a terminal: every control character
    shown as an escape (ESC as \\e, \\r, \\x07, \\u202e...), newlines and tabs kept."""
    return _CONTROLS.sub(_escape, text)


def terminal_cell(text: str) -> str:
    """One table cell or line safe to print: as terminal_text, newlines and tabs escaped
    too (a cell stays on its row)."""
    return _CONTROLS_AND_LINES.sub(_escape, text)


def format_time(ts: float | None, tz: str = "UTC") -> str:
    if ts is None:
        return "-"
    zone: tzinfo = UTC
    if tz != "UTC":
        # Here: zoneinfo loads sysconfig (1-2 ms), which --version and UTC times skip.
        from zoneinfo import ZoneInfo

        try:
            zone = ZoneInfo(tz)
        except Exception:  # noqa: BLE001 - a bad zone never stops printing
            pass
    return datetime.fromtimestamp(ts, UTC).astimezone(zone).strftime("%Y-%m-%d %H:%M:%S %z")


def _cell(column: str, row: dict[str, Any]) -> str:
    return terminal_cell(_cell_text(column, row))


def _cell_text(column: str, row: dict[str, Any]) -> str:
    value = row.get(column)
    if value is None and row.get("withheld") and column in WITHHELD_FIELDS:
        return "(withheld)"
    if column in ("next_time", "next_run_time", "scheduled_time", "claimed_at"):
        return format_time(value, row.get("timezone", "UTC"))
    if column in ("started_at", "finished_at"):
        return format_time(value)
    if column == "data" or isinstance(value, list | dict):  # show's extra_runs: not a repr
        return json.dumps(value, separators=(",", ":"), sort_keys=True)
    if value is None:
        return "-"
    return str(value)


def table(rows: Sequence[dict[str, Any]], columns: Sequence[str], raw: bool = False) -> str:
    """Rows under their column names; `raw`: cells as they are, control characters
    unescaped (--raw)."""
    cell = _cell_text if raw else _cell
    cells = [[cell(c, r) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    lines = [" ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip()]
    for r in cells:
        lines.append(" ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip())
    return "\n".join(lines)


def _history_row(run: dict[str, Any]) -> dict[str, Any]:
    """A run as the history table shows it: the exit status, or the signal that killed
    it (SIGKILL), the duration in seconds, and the first line of its error (from a
    daemon older than 0.2.0: dashes)."""
    exit_code, sig, duration = run.get("exit_code"), run.get("signal"), run.get("duration")
    if sig is not None:
        try:
            shown = signal.Signals(sig).name
        except ValueError:
            shown = f"signal {sig}"
    else:
        shown = None if exit_code is None else str(exit_code)
    error = run.get("error")
    return {**run, "exit": shown,
            "duration": None if duration is None else f"{duration:.3f}s",
            "error": error.splitlines()[0] if error else None}


def _host_row(h: dict[str, Any]) -> dict[str, Any]:
    seen = h.get("last_seen")
    if seen is None:  # a release before 0.2.0 records no host row: seen at work only
        return {"host": h.get("name"), "version": f"{h.get('version')} (or older)",
                "last_seen": "-", "state": "at work"}
    return {"host": h.get("name"), "version": h.get("version"),
            "last_seen": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(seen))),
            "state": "live" if h.get("live") else "silent"}


def _state_counts(result: dict[str, Any]) -> str:
    states = result.get("states") or {}
    shown = [f"{states[s]} {s}" for s in ("retrying", "failed") if states.get(s)]
    overdue = float(result.get("oldest_overdue") or 0)
    if overdue:
        shown.append(f"oldest overdue {int(overdue)}s")
    return f", {', '.join(shown)}" if shown else ""


def _status(result: dict[str, Any]) -> str:
    lines = [
        f"perfectschedd {result.get('version', '?')} on {result.get('host', '?')}, "
        f"pid {result.get('pid', '?')}, up {int(result.get('uptime', 0))}s",
        f"state: {result.get('state', '?')}",
        f"workers: {result.get('workers_alive', 0)}/{result.get('workers_configured', 0)} alive",
        f"schedules: {result.get('schedules', 0)} ({result.get('paused', 0)} paused), "
        f"due now: {result.get('due', 0)}" + _state_counts(result),
    ]
    paused_all = result.get("paused_all")
    if paused_all:
        lines.append(f"everything paused (pause --all) since "
                     f"{format_time(paused_all.get('since'))} by {paused_all.get('by')}: "
                     f"{paused_all.get('schedules', 0)} schedule(s) held, on every host; "
                     "resume --all ends it")
    database = result.get("database") or {}
    if database.get("unreachable_since") is not None:
        since = time.strftime("%Y-%m-%d %H:%M:%S",
                              time.localtime(float(database["unreachable_since"])))
        lines.append(f"database: unreachable since {since} ({database.get('error')}); "
                     "figures below are from before")
    elif database.get("ok") is False:
        lines.append("database: a worker cannot reach it")
    refused = result.get("refused") or []
    if result.get("last_error") and not (refused and result["last_error"] ==
                                         "; ".join(refused)[:len(result["last_error"])]):
        lines.append(f"last error: {result['last_error']}")  # else: the lines below
    if result.get("unit_grant") and result.get("host"):
        lines.append("polkit grant to start units: held (no job runs as the daemon's user)")
    for why in result.get("refused_routes") or []:
        lines.append(f"refused route (the others run): {why}")
    for why in refused:
        if why not in (result.get("refused_routes") or []):
            lines.append(f"refused (the rest runs): {why}")
    hosts = result.get("hosts") or []
    if hosts:
        lines.append(table([_host_row(h) for h in hosts],
                           ("host", "version", "last_seen", "state")))
    workers = result.get("workers") or []
    if workers:
        lines.append(table(workers, ("pid", "index", "generation", "age", "running",
                                     "draining", "db_ok")))
    if result.get("reload_pending"):
        lines.append("reload pending: the new configuration's workers start once drains end")
    for w in result.get("draining") or []:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(w["since"])))
        lines.append(f"draining since {since}: worker pid {w.get('pid')} (generation "
                     f"{w.get('generation')}), running: {' '.join(w.get('keys') or []) or '-'}")
    for row in result.get("refused_rows") or []:
        creator = row.get("creator")
        lines.append(f"refused schedule, paused, never runs: {row.get('key')!r} (type "
                     f"{row.get('type')}, creator "
                     f"{'unknown' if creator is None else f'uid {creator}'}): "
                     f"{row.get('reason')}")
    for bad in result.get("keys_to_rename") or []:
        lines.append(f"key to rename: {bad.get('key')!r}: {bad.get('why')}")
    for u in result.get("unclaimed") or []:
        where = "" if u.get("routed_here") else "; no route on this host"
        lines.append(f"unclaimed for over a minute: {u.get('occurrences')} occurrence(s) of "
                     f"type {u.get('type')!r}{where}")
    lines += _failing_lines(result)
    running = result.get("running") or []
    lines.append(f"running: {len(running)}")
    if running:
        lines.append(table(running, ("key", "type", "scheduled_time", "age", "owner")))
    queued = result.get("queued") or []
    if queued:
        lines.append(f"queued behind a running occurrence of their schedule: {len(queued)}")
        lines.append(table(queued, ("key", "type", "age", "owner")))
    return "\n".join(lines)


def _failing_lines(result: dict[str, Any]) -> list[str]:
    """Schedules retrying or failed, and those overdue by more than their period: never
    invisible in status (a daemon before 0.2.0 sends none of this)."""
    lines: list[str] = []
    failing = result.get("failing") or []
    total = int(result.get("failing_total") or len(failing))
    if total:
        lines.append(f"failing: {total}" + (f" (the first {len(failing)} by key)"
                                             if total > len(failing) else ""))
    for f in failing:
        tz = f.get("timezone") or "UTC"
        if f.get("state") == "retrying":
            what = (f"retrying (attempt {f.get('attempt')} failed) the occurrence of "
                    f"{format_time(f.get('scheduled_time'), tz)}, due since "
                    f"{format_time(f.get('since'), tz)}; next try "
                    f"{format_time(f.get('next_try'), tz)}")
        else:
            outcome = f.get("last_outcome")
            how = f" ({outcome})" if outcome not in (None, "failed") else ""  # timeout, lost
            what = (f"failed{how} at {format_time(f.get('since'), tz)}; given up, the "
                    "schedule moved on")
        lines.append(f"  {f.get('key')}: {what}")
        if f.get("error"):
            lines.append(f"    error: {f['error']}")
    beyond = result.get("overdue_beyond_period") or []
    total = int(result.get("overdue_beyond_period_total") or len(beyond))
    if total:
        lines.append(f"overdue by more than their period: {total}")
    for b in beyond:
        lines.append(f"  {b.get('key')}: due {format_time(b.get('due'))}, overdue by "
                     f"{int(b.get('overdue_by') or 0)}s (period {b.get('period')}s)")
    return lines


def _next_times(result: dict[str, Any]) -> str:
    """One line per fire time: the local time with its UTC offset, Unix seconds, the
    nominal time when delay or jitter move it, and the DST marks; a line before a time
    for each local time a DST gap skipped."""
    lines: list[str] = []
    tz = result.get("timezone") or "UTC"
    for t in result.get("times") or []:
        for wall in t.get("skipped_before") or []:
            lines.append(f"skipped {wall}: no such local time in {tz} (DST gap)")
        line = f"{t['run_local']}  {t['run_time']}"
        if t["run_time"] != t["scheduled_time"]:
            line += f"  nominal {t['scheduled_local']}"
        if t.get("repeated"):
            line += ("  (repeated local time, first of two)" if t["repeated"] == 1
                     else "  (repeated local time, second of two)")
        lines.append(line)
    if result.get("running"):
        lines.insert(0, f"{result.get('key')}: an occurrence runs now; the next ones:")
    if result.get("paused"):
        lines.append(f"{result.get('key')} is paused: none of these runs until it is resumed")
    return "\n".join(lines)


def _paused(cmd: str, result: dict[str, Any]) -> str:
    """What pause/resume of keys, a prefix or --all did, in one line.  One key's answer
    is the schedule as `show` gives it (--json prints that); it is told as one of many."""
    skipped = result.get("skipped_occurrences")
    skipped_line = (f"; {skipped} missed occurrence(s) skipped" if skipped is not None
                    else "")
    if not result.get("all"):
        verb = "paused" if cmd == "pause" else "resumed"
        keys = (result.get(verb) or []) if "count" in result else [str(result.get("key"))]
        return f"{verb} {len(keys)} schedule(s): {' '.join(keys)}{skipped_line}"
    if cmd == "pause":
        return (f"paused everything (since {format_time(result.get('since'))}, by "
                f"{result.get('by')}): {result.get('paused', 0)} schedule(s) more paused; "
                "schedules added from now on are paused too, until resume --all")
    own = result.get("paused_on_their_own") or 0
    return (f"resumed everything: {result.get('resumed', 0)} schedule(s)"
            + skipped_line
            + (f"; {own} paused on their own stay paused" if own else ""))


def _token(result: Any) -> str:
    """What `token add|list|revoke` did: add's secret on a line of its own (once: the
    database keeps only its hash), list's table (never a hash), revoke's one line."""
    if isinstance(result, list):
        rows = [{"name": t.get("name"), "role": t.get("role"),
                 "created": format_time(t.get("created_at")),
                 "created_by": t.get("created_by"),
                 "expires": "never" if t.get("expires_at") is None
                 else format_time(t["expires_at"]), "state": t.get("state")}
                for t in result]
        return f"{table(rows, TOKEN_COLUMNS)}\n{len(result)} tokens."
    name = terminal_cell(str(result.get("name")))
    if result.get("revoked"):
        return f"revoked token {name}"
    expires = result.get("expires_at")
    return (f"added token {name} (role {terminal_cell(str(result.get('role')))}, "
            f"expires {'never' if expires is None else format_time(expires)})\n"
            f"{terminal_cell(str(result.get('secret')))}\n"
            "this secret is not shown again: keep it now (the database keeps only a hash "
            "of it)")


def print_result(cmd: str, result: Any, *, as_json: bool, raw: bool = False) -> None:
    """`result` for people (control characters escaped unless `raw`), or as JSON (which
    escapes them itself)."""
    if as_json:
        print(json.dumps(result, indent=None if cmd == "list" else 2, sort_keys=False))
        return
    if cmd == "list":
        print(table(result, LIST_COLUMNS))
        print(f"{len(result)} entries.")
    elif cmd == "history":
        print(table([_history_row(r) for r in result], HISTORY_COLUMNS, raw=raw))
        print(f"{len(result)} runs.")
    elif cmd == "status":
        print(terminal_text(_status(result)))
    elif cmd in ("pause", "resume"):
        print(_paused(cmd, result))
    elif cmd in ("show", "modify"):
        width = max(len(k) for k in result)
        for k in result:
            print(f"{k.ljust(width)}  {_cell(k, result)}")
    elif cmd == "add":
        when = format_time(result["next_run_time"], result["timezone"])
        print(f"added {result['key']}: next run {when}")
    elif cmd == "delete":
        extra = result.get("extra_runs") or 0
        print(f"deleted {result['key']}" + (f" and {extra} extra run(s) of it" if extra else ""))
    elif cmd == "run":
        when = ("once its running occurrence has ended" if result.get("after_running")
                else "now, stopping its running occurrence" if result.get("replaces")
                else "now")
        print(f"queued a run of {result['key']} {when} (as {result['run_key']})")
    elif cmd == "init":
        # Not "ready": scripts and people wait for the daemon's "ready" line.
        print(f"created table {result['table']}" if result.get("created")
              else f"table {result['table']} exists")
    elif cmd == "apply":
        for line in result.get("changes", []):
            print(line)
    elif cmd == "next":
        print(_next_times(result))
    elif cmd == "token":
        print(_token(result))
    elif cmd == "reload":
        if result.get("reload") == "done":
            print(f"reloaded: the new configuration runs, {result.get('workers')} new "
                  "worker(s) starting" + _drain_note(result))
        elif result.get("reload") == "partial":
            # The refusals themselves go to stderr, one line each (cli.main).
            print(f"reloaded with refusals: the rest of the new configuration runs, "
                  f"{result.get('workers')} new worker(s) starting" + _drain_note(result))
        else:
            print("reload requested (the daemon is busy; its log will say how it went)")
    else:
        print(json.dumps(result, indent=2))


def _drain_note(result: dict[str, Any]) -> str:
    """What a reload's answer adds when its workers wait for drains to end."""
    if not result.get("pending"):
        return ""
    return f" once fewer workers drain ({result.get('draining')} now)"
