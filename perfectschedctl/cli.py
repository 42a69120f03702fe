"""perfectschedctl: parse arguments, send one request, print the answer.

Exit status: 0 success, 1 a refused request (one line on stderr), 2 usage.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from perfectschedd import ConfigError, ScheduleError, __version__, protocol
from perfectschedd.config import DEFAULT_SOCKET
from perfectschedd.protocol import HISTORY_MAX

from .client import DaemonUnavailable, SocketClient
from .output import print_result

EXIT_OK, EXIT_REFUSED, EXIT_USAGE = 0, 1, 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _unix_time(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a Unix time in seconds: {text!r}") from None


def _seconds(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number of seconds: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative: {text!r}")
    return value


def _limit(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if not 1 <= value <= HISTORY_MAX:
        raise argparse.ArgumentTypeError(f"must be from 1 to {HISTORY_MAX}: {text!r}")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more: {text!r}")
    return value


# Schedule policies (SPEC "Schedule policies"): checked by the daemon, which names a bad
# one in its refusal (exit 1).
POLICY_FLAGS = {
    "misfire": ("--misfire", "after downtime: all (default), latest or skip"),
    "grace": ("--grace", "skip an occurrence that cannot start within SEC of its time"),
    "max_attempts": ("--max-attempts", "give an occurrence up after N failed attempts "
                     "(0: never)"),
    "retry_wait": ("--retry-wait", "seconds before the 2nd attempt, doubling per attempt"),
    "jitter": ("--jitter", "start each occurrence a fixed per-key 0..SEC later"),
    "timeout": ("--timeout", "stop a run after SEC (default: the route's)"),
}


def _policy_options(parser: argparse.ArgumentParser) -> None:
    for dest, (flag, text) in POLICY_FLAGS.items():
        parser.add_argument(flag, dest=dest, type=_policy_value, help=text)


def _policy_value(text: str) -> Any:
    """A number when it reads as one; else the text, for the daemon to refuse by name."""
    for kind in (int, float):
        try:
            value = kind(text)
        except ValueError:
            continue
        return value if math.isfinite(value) else text
    return text


def _policies(ns: argparse.Namespace) -> dict[str, Any]:
    return {k: getattr(ns, k) for k in POLICY_FLAGS if getattr(ns, k, None) is not None}


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="perfectschedctl", description="Control PerfectSched schedules.")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--socket", metavar="PATH",
                       help=f"daemon control socket (default $PERFECTSCHED_SOCKET or "
                            f"{DEFAULT_SOCKET})")
    where.add_argument("-c", "--config", metavar="CONFIG",
                       help="open the database of this config directly, without the daemon")
    p.add_argument("-e", "--environment", metavar="ENV", help="section of a multi-env config")
    p.add_argument("--json", action="store_true", help="print JSON for programs")
    p.add_argument("--version", action="version", version=f"perfectschedctl {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    def command(name: str, help_: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_, description=help_)
        sp.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                        help="print JSON for programs")
        return sp

    def key_cmd(name: str, help_: str) -> argparse.ArgumentParser:
        sp = command(name, help_)
        sp.add_argument("key")
        return sp

    add = command("add", "register a schedule")
    add.add_argument("key")
    add.add_argument("type")
    add.add_argument("cron", help="five cron fields or @hourly-style alias")
    add.add_argument("data", nargs="?", default=None, help="JSON object (default {})")
    add.add_argument("-d", "--delay", type=_seconds, default=0)
    add.add_argument("-t", "--timezone")
    add.add_argument("-s", "--start", type=_unix_time)
    add.add_argument("-a", "--at", type=_unix_time)
    _policy_options(add)

    ls = command("list", "list schedules")
    ls.add_argument("--prefix", help="only keys starting with this")
    ls.add_argument("-n", "--limit", type=_count, help="at most this many (default: all)")

    key_cmd("show", "show one schedule in full")
    key_cmd("delete", "remove a schedule")
    key_cmd("pause", "stop a schedule from firing")
    key_cmd("resume", "let a paused schedule fire again (missed occurrences run)")
    key_cmd("run", "run one occurrence now without moving the schedule")

    mod = key_cmd("modify", "change a schedule (new cron/timezone recompute its next time)")
    mod.add_argument("--type")
    mod.add_argument("--cron")
    mod.add_argument("-d", "--delay", type=_seconds)
    mod.add_argument("-t", "--timezone")
    mod.add_argument("--data", help="JSON object replacing the data")
    _policy_options(mod)

    hist = key_cmd("history", "recent runs of a schedule")
    hist.add_argument("-n", "--limit", type=_limit, default=20,
                      help=f"at most this many runs, newest first (1-{HISTORY_MAX}, default 20)")

    app = command("apply", "converge the database to schedules files (added|changed|"
                           "removed|unchanged KEY)")
    app.add_argument("paths", nargs="+", metavar="FILE|DIR",
                     help="schedules files, or directories of *.yml files")
    app.add_argument("--dry-run", action="store_true", help="say what would change, write "
                     "nothing")
    app.add_argument("--prune", action="store_true", help="also remove schedules from "
                     "schedules files (source file:*) that these files do not hold")

    imp = command("import-crontab", "print a schedules file made from a crontab "
                                    "(nothing is written)")
    imp.add_argument("file", nargs="?", default="-", metavar="FILE|-",
                     help="a user crontab, /etc/crontab or an /etc/cron.d file (default: "
                          "standard input)")
    imp.add_argument("--user", metavar="NAME", help="the owner of a user crontab: its "
                     "entries run as NAME")
    imp.add_argument("--system", action="store_true", help="the lines have a user column "
                     "(implied for /etc/crontab and /etc/cron.d/*)")

    leg = command("import-legacy", "copy the schedules of a Ruby PerfectSched table into "
                                   "this one (keys that exist are refused)")
    leg.add_argument("url", help="the legacy database (SQLAlchemy URL, read only)")
    leg.add_argument("--table", default="perfectsched", help="the legacy table (default "
                     "perfectsched)")
    leg.add_argument("--dry-run", action="store_true", help="say what would be imported")

    command("status", "daemon status: workers, running tasks, backlog")
    command("reload", "reload the daemon's configuration (like SIGHUP)")
    command("init", "create the table (with -c)")
    return p


def request_of(ns: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    cmd = ns.command
    if cmd == "add":
        args = {"key": ns.key, "type": ns.type, "cron": ns.cron, "delay": ns.delay}
        if ns.data is not None:
            args["data"] = _json_arg("DATA", ns.data)
        for opt in ("timezone", "start", "at"):
            if getattr(ns, opt) is not None:
                args[opt] = getattr(ns, opt)
        args.update(_policies(ns))
        return cmd, args
    if cmd == "list":
        args = {"prefix": ns.prefix} if ns.prefix else {}
        if ns.limit is not None:
            args["limit"] = ns.limit
        return cmd, args
    if cmd == "modify":
        args = {"key": ns.key}
        for opt in ("type", "cron", "delay", "timezone"):
            if getattr(ns, opt) is not None:
                args[opt] = getattr(ns, opt)
        if ns.data is not None:
            args["data"] = _json_arg("--data", ns.data)
        args.update(_policies(ns))
        return cmd, args
    if cmd == "history":
        return cmd, {"key": ns.key, "limit": ns.limit}
    if cmd in ("show", "delete", "pause", "resume", "run"):
        return cmd, {"key": ns.key}
    if cmd == "apply":
        return cmd, _apply_request(ns)
    return cmd, {}


def _apply_request(ns: argparse.Namespace) -> dict[str, Any]:
    """Read and check the files here; only what is stored travels (no command, env or
    user).  Every problem is a line on stderr, and nothing is sent."""
    from perfectschedd import converge, schedfiles

    missing = [p for p in ns.paths if not os.path.exists(p)]
    if missing:
        raise _BadArgument(f"{missing[0]}: no such file or directory")
    loaded = schedfiles.load(ns.paths, need_user_support=False)
    if loaded.errors:
        raise _BadArgument("\n".join(f"perfectschedctl: {e}" for e in loaded.errors)
                           .removeprefix("perfectschedctl: "))
    execs = sum(e.exec is not None for e in loaded.entries.values())
    if execs:
        print(f"perfectschedctl: note: {execs} exec entr{'y runs' if execs == 1 else 'ies run'}"
              " only on hosts whose schedules_dir holds the file", file=sys.stderr)
    return {"entries": converge.to_wire(loaded.entries), "prune": ns.prune,
            "dry_run": ns.dry_run}


class _BadArgument(Exception):
    pass


def _json_arg(name: str, text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise _BadArgument(f"{name}: not valid JSON: {exc.msg}") from None


def _direct(ns: argparse.Namespace, cmd: str, args: dict[str, Any]) -> Any:
    from perfectschedd import commands, schedules

    if cmd in ("status", "reload"):
        raise _BadArgument(f"{cmd} needs the daemon: use --socket, not -c")
    with schedules.open(ns.config, ns.environment) as sc:
        return commands.execute(sc, cmd, args)


def _import_crontab(ns: argparse.Namespace) -> int:
    """Local only: reads a file, prints a schedules file, talks to no daemon."""
    from perfectschedd import crontab

    if ns.system and ns.user:
        raise _BadArgument("--user is for a user crontab; a system crontab names its users")
    try:
        text, name = crontab.read(ns.file)
    except OSError as exc:
        raise _BadArgument(f"{ns.file}: {exc.strerror}") from None
    system = ns.system or (ns.file != "-" and crontab.is_system_path(ns.file))
    done = crontab.convert(text, name=name, system=system, user=ns.user,
                           default_timezone=crontab.system_timezone())
    sys.stdout.write(done.text)
    for warning in done.warnings:
        print(f"perfectschedctl: warning: {warning}", file=sys.stderr)
    return EXIT_OK


IMPORT_BATCH = 500  # schedules per add_many request (well inside a request's size)


def _existing_keys(send: Callable[[str, dict[str, Any]], Any]) -> set[str]:
    keys: set[str] = set()
    after: str | None = None
    while True:
        page = send("list", {"limit": protocol.LIST_PAGE, **({"after": after} if after
                                                              else {})})
        keys.update(s["key"] for s in page)
        if len(page) < protocol.LIST_PAGE:
            return keys
        after = page[-1]["key"]


def _import_legacy(ns: argparse.Namespace, send: Callable[[str, dict[str, Any]], Any]
                   ) -> int:
    """Read the legacy table here; add its schedules through the usual channel (the
    daemon, or the database of -c), all checked before the first is written."""
    from perfectschedd import legacy

    found, problems = legacy.read(ns.url, ns.table)
    if problems:
        raise _BadArgument("\n".join(f"perfectschedctl: cannot import {p}" for p in problems)
                           .removeprefix("perfectschedctl: "))
    taken = sorted(_existing_keys(send) & {s.key for s in found})
    if taken:
        raise _BadArgument("\n".join(f"perfectschedctl: exists {k} (nothing imported)"
                                     for k in taken).removeprefix("perfectschedctl: "))
    for s in found:
        if s.data_note is not None:
            print(f"perfectschedctl: warning: {s.key}: data {s.data_note}; imported as {{}}"
                  " (as the Ruby gem read it)", file=sys.stderr)
    verb = "would import" if ns.dry_run else "imported"
    if not ns.dry_run:
        for i in range(0, len(found), IMPORT_BATCH):
            send("add_many", {"schedules": [s.request()
                                            for s in found[i:i + IMPORT_BATCH]]})
    for s in found:
        print(f"{verb} {s.key} (type {s.type}, cron {s.cron}, next run {s.next_run_time})")
    print(f"{len(found)} schedule(s) {verb} from table {ns.table}")
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.command == "import-crontab":
        try:
            return _import_crontab(ns)
        except _BadArgument as exc:
            print(f"perfectschedctl: {exc}", file=sys.stderr)
            return EXIT_REFUSED
    try:
        cmd, args = request_of(ns)
        if ns.config:
            def send(cmd: str, args: dict[str, Any]) -> Any:
                return _direct(ns, cmd, args)
        else:
            if cmd == "init":
                raise _BadArgument("init opens the database directly: give -c CONFIG")
            if ns.environment:
                raise _BadArgument("-e needs -c CONFIG")
            path = ns.socket or os.environ.get("PERFECTSCHED_SOCKET") or DEFAULT_SOCKET
            send = SocketClient(path).call
        if cmd == "import-legacy":
            return _import_legacy(ns, send)
        if cmd == "apply" and not args["dry_run"]:
            # A key that belongs elsewhere refuses the whole apply before anything is
            # written (asked first as a dry run).
            refused = [c for c in send(cmd, {**args, "dry_run": True})["changes"]
                       if c.startswith("refused ")]
            if refused:
                raise _BadArgument("\n".join(f"perfectschedctl: {c}" for c in refused)
                                   .removeprefix("perfectschedctl: "))
        result = send(cmd, args)
    except (_BadArgument, ScheduleError, ConfigError, DaemonUnavailable,
            protocol.ProtocolError, protocol.RemoteError) as exc:
        print(f"perfectschedctl: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    except Exception as exc:  # noqa: BLE001 - database errors in direct mode, one line
        print(f"perfectschedctl: {type(exc).__name__}: {str(exc).splitlines()[0]}",
              file=sys.stderr)
        return EXIT_REFUSED
    print_result(cmd, result, as_json=ns.json)
    return EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main())
