"""Every control command, in one table: its name and help, its arguments (as requests
carry them and as perfectschedctl reads them), where it may run and so who may call it,
what it changes.  How refusals reach each client (socket error types, perfectschedctl exit
statuses, D-Bus error names) is protocol.REFUSALS, one table for every command.

The control socket, D-Bus, the daemon's dispatch and perfectschedctl (its parser, its
requests, its direct mode) all read this table; none keeps a list of its own.  The
handlers themselves are commands.py's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from perfectschedd.control.protocol import HISTORY_MAX
from perfectschedd.errors import InvalidInputError
from perfectschedd.vocabulary.fields import PREVIEW_COUNT, PREVIEW_MAX

# The limits only, never the schedule code: perfectschedctl reads this table at every start
# and must not load croniter to do so (tests/test_client_imports.py).

# -- who may call a command ----------------------------------------------------------------
# DAEMON: through the daemon (control socket, D-Bus): root, the daemon's user and members
#   of control_group (the socket's and the bus policy's rule).
# DIRECT: perfectschedctl -c CONFIG, on the database itself: whoever can read the config
#   and reach the database.
# LOCAL: perfectschedctl alone, reading local files; it talks to the daemon (or the
#   database) only through other commands.
DAEMON, DIRECT, LOCAL = "daemon", "direct", "local"


class Arg(NamedTuple):  # not a dataclass: see protocol.Refusal
    """One argument as perfectschedctl reads it (`flags`) and as the request carries it
    (`dest`; `sent=False`: read by perfectschedctl only)."""

    flags: tuple[str, ...]
    dest: str
    help: str = ""
    # How perfectschedctl reads it: text, json, seconds, unix_time, limit, count, attempt
    # (1 or more), iterations (1 to fields.PREVIEW_MAX), policy (a number, or text the
    # daemon refuses by name), flag, paths (one or more), keys (none or more: one is sent
    # as `key`, several as `keys`).
    kind: str = "text"
    default: Any = None
    optional: bool = False  # a positional that may be left out
    sent: bool = True
    metavar: str | None = None

    @property
    def positional(self) -> bool:
        return not self.flags[0].startswith("-")


class Command(NamedTuple):
    name: str
    help: str
    cli: tuple[Arg, ...] = ()
    # Request arguments accepted besides the CLI's (programs' own: paging, verbose...).
    extra_args: frozenset[str] = frozenset()
    required: frozenset[str] = frozenset()
    where: frozenset[str] = frozenset({DAEMON, DIRECT})
    quick: bool = False         # answered from the daemon's own state, never the database
    wakes: bool = False         # changes what workers do next: wake them at once
    change: str | None = None   # its word in D-Bus ScheduleChanged signals
    in_cli: bool = True         # a perfectschedctl command (else for programs only)
    # Root's only, wherever it runs (auth.check_root_only): what it does, for the refusal.
    root_only: str | None = None

    @property
    def args(self) -> frozenset[str]:
        return frozenset(a.dest for a in self.cli if a.sent) | self.extra_args

    def changes(self, args: Mapping[str, Any], result: Any) -> list[tuple[str, str]]:
        """(key, change) for each schedule a successful call changed (D-Bus signals)."""
        if self.change is None:
            return []
        if self.name == "add_many":
            return [(str(i.get("key")), self.change) for i in args.get("schedules", [])]
        if self.name in ("pause", "resume") and isinstance(result, Mapping):
            if result.get("all"):
                return [("*", self.change)]  # every schedule: one signal, not thousands
            if "count" in result:
                return [(str(k), self.change) for k in result.get(self.change, [])]
        if self.name == "apply":
            words = {"added": "added", "changed": "modified", "removed": "deleted"}
            return [(parts[1], words[parts[0]]) for line in result.get("changes", [])
                    if (parts := line.split()) and parts[0] in words]
        return [(str(args.get("key")), self.change)]


def _policy_args() -> tuple[Arg, ...]:
    # One flag for each of policy.OPTIONS (tests/control/test_registry.py holds them to
    # it: importing policy here would load it in every perfectschedctl).
    texts = {
        "misfire": ("--misfire", "after downtime: all (default), latest or skip"),
        "grace": ("--grace", "skip an occurrence that cannot start within SEC of its time"),
        "max_attempts": ("--max-attempts", "give an occurrence up after N failed attempts "
                         "(0: never)"),
        "retry_wait": ("--retry-wait", "seconds before the 2nd attempt, doubling per "
                       "attempt"),
        "jitter": ("--jitter", "start each occurrence a fixed per-key 0..SEC later"),
        "timeout": ("--timeout", "stop a run after SEC (default: the route's)"),
        "notify": ("--notify", "NAME of the daemon's notifiers: told of failures and "
                   "recoveries ('' or none: the route's, else the config's)"),
        "concurrency": ("--concurrency", "a due occurrence while one runs: forbid "
                        "(default: it waits), allow (it runs beside it) or replace (the "
                        "running one is stopped)"),
        "metrics": ("--metrics", "series of its own on /metrics: true, false, or default "
                    "(the route's)"),
    }
    return tuple(Arg((flag,), dest, text, kind="policy") for dest, (flag, text) in
                 texts.items())


POLICIES = _policy_args()
KEY = Arg(("key",), "key")
# A schedule from a schedules file changes through its file; root may force it.
FORCE = Arg(("--force",), "force", "change a schedule from a schedules file (root only): "
            "it is detached from the file (source forced:file:NAME), whose entry no "
            "reload or apply writes back", kind="flag")
# Output as the run printed it, control characters and all (the terminal escapes them
# otherwise); root's only: sent, so that the daemon refuses it to anyone else.
RAW = Arg(("--raw",), "raw", "print output as stored, control characters unescaped "
          "(root only)", kind="flag")
_EVERYWHERE = frozenset({DAEMON, DIRECT})
# What pause and resume act on: one of these (a request may also carry one `key`, as
# 0.1.0 clients and D-Bus Pause/Resume send it).
_PAUSED = (
    Arg(("keys",), "keys", "schedules, by key", kind="keys", metavar="KEY"),
    Arg(("--prefix",), "prefix", "every schedule whose key starts with P", metavar="P"),
    Arg(("--all",), "all", "every schedule (pause: also those added while paused; "
        "resume: those paused on their own stay paused)", kind="flag"),
)

COMMANDS: dict[str, Command] = {c.name: c for c in (
    Command("add", "register a schedule", (
        KEY, Arg(("type",), "type"),
        Arg(("cron",), "cron", "five cron fields or @hourly-style alias"),
        Arg(("data",), "data", "JSON object (default {})", kind="json", optional=True),
        Arg(("-d", "--delay"), "delay", kind="seconds", default=0),
        Arg(("-t", "--timezone"), "timezone"),
        Arg(("-s", "--start"), "start", kind="unix_time"),
        Arg(("-a", "--at"), "at", kind="unix_time"),
        *POLICIES), required=frozenset({"key", "type", "cron"}), wakes=True,
        change="added"),
    Command("add_many", "register many schedules at once (all or nothing)",
            extra_args=frozenset({"schedules"}), required=frozenset({"schedules"}),
            wakes=True, change="added", in_cli=False),
    Command("list", "list schedules", (
        Arg(("--prefix",), "prefix", "only keys starting with this"),
        Arg(("-n", "--limit"), "limit", "at most this many (default: all)", kind="count")),
        extra_args=frozenset({"verbose", "after"})),
    Command("show", "show one schedule in full", (KEY,), required=frozenset({"key"})),
    Command("delete", "remove a schedule", (KEY, FORCE), required=frozenset({"key"}),
            change="deleted"),
    Command("pause", "stop schedules from firing: KEY..., --prefix P, or --all (every "
                     "schedule, on every host, until resume --all)", (
        *_PAUSED, FORCE), extra_args=frozenset({"key"}), change="paused"),
    Command("resume", "let paused schedules fire again (missed occurrences run, as "
                      "their misfire policy says)", (
        *_PAUSED, FORCE,
        Arg(("--skip-missed",), "skip_missed", "run none of the occurrences missed while "
            "paused (recorded as skipped); the next one runs on time", kind="flag")),
        extra_args=frozenset({"key"}), wakes=True, change="resumed"),
    Command("run", "run one occurrence now without moving the schedule", (KEY,),
            required=frozenset({"key"}), wakes=True, change="run"),
    Command("modify", "change a schedule (new cron/timezone recompute its next time)", (
        KEY, Arg(("--type",), "type"), Arg(("--cron",), "cron"),
        Arg(("-d", "--delay"), "delay", kind="seconds"),
        Arg(("-t", "--timezone"), "timezone"),
        Arg(("--data",), "data", "JSON object replacing the data", kind="json"),
        *POLICIES, FORCE),
        # at: the next run at that Unix time (programs': /periodic/'s replace of a job).
        extra_args=frozenset({"at"}), required=frozenset({"key"}), wakes=True,
        change="modified"),
    Command("history", "recent runs of a schedule: outcome, exit status or signal, "
                       "duration, error (--json: and the output's tail)", (
        KEY, Arg(("-n", "--limit"), "limit", f"at most this many runs, newest first "
                 f"(1-{HISTORY_MAX}, default 20)", kind="limit", default=20), RAW),
        # attempt: only the runs that were that attempt of their occurrence (logs).
        extra_args=frozenset({"attempt"}), required=frozenset({"key"})),
    Command("logs", "print the output of a schedule's newest run (its stored tail; for "
                    "executor: systemd, its journal)", (
        Arg(("key",), "key", sent=False),
        Arg(("--attempt",), "attempt", "that attempt of the newest occurrence that had "
            "one (1 is the first try)", kind="attempt", sent=False, metavar="N"),
        Arg(("-n", "--lines"), "lines", "only the last N lines (default: the whole run)",
            kind="count", sent=False),
        RAW._replace(sent=False)),  # sent in logs' history request
        where=frozenset({LOCAL})),
    Command("apply", "converge the database to schedules files "
                     "(added|changed|removed|unchanged KEY)", (
        Arg(("paths",), "paths", "schedules files, or directories of *.yml files",
            kind="paths", sent=False, metavar="FILE|DIR"),
        Arg(("--dry-run",), "dry_run", "say what would change, write nothing", kind="flag"),
        Arg(("--prune",), "prune", "also remove schedules from schedules files (source "
            "file:*) that these files do not hold", kind="flag")),
        extra_args=frozenset({"entries"}), required=frozenset({"entries"}), wakes=True,
        change="applied"),
    Command("import-crontab", "print a schedules file made from a crontab (nothing is "
                              "written)", (
        Arg(("file",), "file", "a user crontab, /etc/crontab or an /etc/cron.d file "
            "(default: standard input)", optional=True, default="-", sent=False,
            metavar="FILE|-"),
        Arg(("--user",), "user", "the owner of a user crontab: its entries run as NAME "
            "(needed unless FILE is /var/spool/cron/crontabs/NAME)", sent=False,
            metavar="NAME"),
        Arg(("--system",), "system", "the lines have a user column (implied for "
            "/etc/crontab and /etc/cron.d/*)", kind="flag", sent=False)),
        where=frozenset({LOCAL})),
    Command("import-legacy", "copy the schedules of a Ruby PerfectSched table into this "
                             "one (keys that exist are refused)", (
        Arg(("url",), "url", "the legacy database (SQLAlchemy URL, read only)", sent=False),
        Arg(("--table",), "table", "the legacy table (default perfectsched)",
            default="perfectsched", sent=False),
        Arg(("--dry-run",), "dry_run", "say what would be imported", kind="flag",
            sent=False)),
        where=frozenset({LOCAL})),
    # KEY: perfectschedctl reads the schedule (show, through the daemon or -c) and works
    # the times out itself; --cron needs neither daemon nor database.
    Command("next", "print the next fire times of a schedule (delay and jitter applied) "
                    "or of a cron expression, with their UTC offsets and DST marks", (
        Arg(("key",), "key", "a schedule (read through the daemon, or -c)", optional=True,
            sent=False),
        Arg(("--cron",), "cron", "an expression instead of a schedule (no daemon needed)",
            sent=False, metavar="EXPR"),
        Arg(("-t", "--timezone"), "timezone", "the zone of --cron (default UTC)",
            sent=False, metavar="ZONE"),
        Arg(("-s", "--start"), "start", "with --cron: times at or after this (default now)",
            kind="unix_time", sent=False, metavar="UNIXTIME"),
        Arg(("-n", "--count"), "count", f"how many times (1-{PREVIEW_MAX}, default "
            f"{PREVIEW_COUNT})", kind="iterations", default=PREVIEW_COUNT, sent=False,
            metavar="N")),
        where=frozenset({LOCAL})),
    # For programs (Periodic's interface at /periodic/): how many schedules each task
    # type has, counted by the database.
    Command("types", "schedules by task type", extra_args=frozenset({"type"}),
            in_cli=False),
    # fresh: false answers from the latest reading as it is (read_at says its age),
    # without asking for a new one: what the HTTP API's pollers get.
    Command("status", "daemon status: workers, running tasks, backlog",
            extra_args=frozenset({"fresh"}), where=frozenset({DAEMON}), quick=True),
    Command("reload", "reload the daemon's configuration (like SIGHUP)",
            where=frozenset({DAEMON})),
    Command("init", "create the table (with -c)", where=frozenset({DIRECT})),
    # The roles are vocabulary/tokens.ROLES (tests/control/test_tokens.py holds the help to
    # them: importing that module here would load hashlib in every perfectschedctl).
    Command("token", "manage the HTTP API's tokens (root only): add NAME --role ROLE "
                     "prints its secret once; list; revoke NAME", (
        Arg(("action",), "action", "add, list or revoke", metavar="add|list|revoke"),
        Arg(("name",), "name", "the token (add, revoke): 1-64 letters, digits, '.', '_', "
            "'-'", optional=True, metavar="NAME"),
        Arg(("--role",), "role", "add: viewer, operator or admin", metavar="ROLE"),
        Arg(("--expires",), "expires", "add: it stops working after DURATION (90d, 12h, "
            "30m, or seconds); default never", metavar="DURATION")),
        required=frozenset({"action"}), root_only="manages API tokens"),
)}


def command(name: Any, where: str) -> Command:
    """The command `name` as a caller reaching it `where` (DAEMON or DIRECT) may run it;
    InvalidInputError (naming what to do instead) otherwise."""
    cmd = COMMANDS.get(name) if isinstance(name, str) else None
    if cmd is None:
        raise InvalidInputError("command", f"unknown command {name!r}")
    if where not in cmd.where:
        if DIRECT in cmd.where:
            raise InvalidInputError("command", f"{cmd.name} opens the database directly: "
                                    f"give -c CONFIG (perfectschedctl -c CONFIG {cmd.name}), "
                                    "not the daemon")
        if DAEMON in cmd.where:
            raise InvalidInputError("command", f"{cmd.name} needs the daemon: use "
                                    "--socket, not -c")
        raise InvalidInputError("command", f"{cmd.name} runs in perfectschedctl only")
    return cmd


def check_args(cmd: Command, args: Mapping[str, Any]) -> None:
    """Refuse arguments a command does not know, naming them (a typo never goes unseen),
    and required ones that are missing."""
    unknown = set(args) - cmd.args
    if unknown:
        raise InvalidInputError(
            "args", f"unknown argument(s) for {cmd.name}: "
                    f"{', '.join(sorted(map(str, unknown)))}")
    missing = sorted(cmd.required - set(args))
    if missing:
        raise InvalidInputError(missing[0], "required")
