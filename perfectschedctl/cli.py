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

from perfectschedd import __version__
from perfectschedd.control import protocol, registry
from perfectschedd.control.protocol import HISTORY_MAX
from perfectschedd.errors import ConfigError, InvalidInputError, ScheduleError
from perfectschedd.paths import DEFAULT_SOCKET
from perfectschedd.vocabulary.fields import MAX_DEPTH, PREVIEW_MAX, json_depth

from .client import DaemonUnavailable, SocketClient
from .output import format_time, print_result, terminal_text

EXIT_OK, EXIT_REFUSED, EXIT_USAGE = 0, protocol.EXIT_REFUSED, 2


def _columns() -> int:
    """The terminal's width, as shutil.get_terminal_size says it ($COLUMNS, else the
    terminal of stdout, else 80)."""
    try:
        columns = int(os.environ.get("COLUMNS", "0"))
    except ValueError:
        columns = 0
    if columns <= 0:
        try:
            columns = os.get_terminal_size(sys.__stdout__.fileno()).columns  # type: ignore[union-attr]
        except (AttributeError, ValueError, OSError):
            columns = 0
    return columns or 80


class _Formatter(argparse.HelpFormatter):
    """argparse's, told the width: argparse makes one for every argument it adds (help
    or not), and its own way to the width imports shutil, which imports bz2 and lzma:
    2-3 ms of every start."""

    def __init__(self, prog: str, *args: Any, width: int | None = None,
                 **kwargs: Any) -> None:
        super().__init__(prog, *args, width=_columns() - 2 if width is None else width,
                         **kwargs)


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


class _CommandParser(_Parser):
    """One command's parser: its positionals and options in any order, as people type
    them (`add KEY TYPE CRON -t ZONE '{"full": true}'`, DATA after the options).

    The subcommand action calls parse_known_args; argparse's intermixed parsing calls it
    again, itself, for each of its two passes (options, then positionals).  Built lazy
    (build_parser), it adds its command's arguments there, before the first pass."""

    _intermixing = False
    # The command whose arguments are still to be added (lazy), then None.
    pending: registry.Command | None = None

    def add_command_arguments(self, command: registry.Command) -> None:
        self.pending = None
        self.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                          help="print JSON for programs")
        for arg in command.cli:
            _add_argument(self, arg)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        if self.pending is not None:
            self.add_command_arguments(self.pending)
        if self._intermixing or (args is not None and "--" in args):
            # After `--` everything is positional (`add -- -key ...`), which the
            # intermixed passes lose: the second one reads `-key` as an option again.
            return super().parse_known_args(args, namespace)
        self._intermixing = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._intermixing = False


# Past every bound an option has (a whole number past it is compared as this): check_int
# takes JSON's numbers, floats too, and a float holds no larger ones.
_EDGE = 1 << 63


def _whole_number(not_one: str, minimum: int | None = None, maximum: int | None = None,
                  out_of_bounds: str = "") -> Callable[[str], int]:
    """An argparse type: the text as a whole number (else "`not_one`: 'TEXT'") from
    `minimum` to `maximum`, by the daemon's own rule (validate.check_int; else
    "`out_of_bounds`: 'TEXT'").  No minimum: any whole number, for the daemon to bound;
    no maximum: as large as the daemon takes (it refuses more, naming the field)."""

    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{not_one}: {text!r}") from None
        if minimum is None:
            return value
        # Only here: validate's regular expressions would take ms of every start.
        from perfectschedd.schedules.validate import check_int

        try:
            check_int(not_one, max(-_EDGE, min(value, _EDGE)), minimum=minimum,
                      maximum=_EDGE if maximum is None else maximum)
        except InvalidInputError:
            raise argparse.ArgumentTypeError(f"{out_of_bounds}: {text!r}") from None
        return value

    return convert


def _policy_value(text: str) -> Any:
    """A number when it reads as one; else the text, for the daemon to refuse by name."""
    for kind in (int, float):
        try:
            value = kind(text)
        except ValueError:
            continue
        return value if math.isfinite(value) else text
    return text


_NOT_WHOLE = "not a whole number"
# How perfectschedctl reads each kind of argument (registry.Arg.kind).
_TYPES: dict[str, Any] = {
    "seconds": _whole_number("not a whole number of seconds", 0,
                             out_of_bounds="must not be negative"),
    "unix_time": _whole_number("not a Unix time in seconds"),
    "limit": _whole_number(_NOT_WHOLE, 1, HISTORY_MAX, f"must be from 1 to {HISTORY_MAX}"),
    "count": _whole_number(_NOT_WHOLE, 0, out_of_bounds="must be 0 or more"),
    "attempt": _whole_number(_NOT_WHOLE, 1, protocol.ATTEMPT_MAX,
                             "must be 1 or more (1 is the first try)"),
    "iterations": _whole_number(_NOT_WHOLE, 1, PREVIEW_MAX, f"must be from 1 to {PREVIEW_MAX}"),
    "policy": _policy_value,
}


def _add_argument(parser: argparse.ArgumentParser, arg: registry.Arg) -> None:
    kwargs: dict[str, Any] = {"help": arg.help or None}
    if arg.metavar:
        kwargs["metavar"] = arg.metavar
    if arg.kind == "flag":
        kwargs["action"] = "store_true"
    elif arg.kind == "paths":
        kwargs["nargs"] = "+"
    elif arg.kind == "keys":
        kwargs["nargs"] = "*"
    else:
        if arg.kind in _TYPES:
            kwargs["type"] = _TYPES[arg.kind]
        if arg.optional:
            kwargs["nargs"] = "?"
        kwargs["default"] = arg.default
    if arg.positional:
        parser.add_argument(arg.dest, **kwargs)
    else:
        parser.add_argument(*arg.flags, dest=arg.dest, **kwargs)


def build_parser(*, lazy: bool = False) -> argparse.ArgumentParser:
    """The command line.  lazy: each command's arguments are added only when that command
    is parsed (main: one command a process; the others' seventy-odd arguments would take
    several ms of every start)."""
    p = _Parser(prog="perfectschedctl", description="Control PerfectSched schedules.")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--socket", metavar="PATH",
                       help=f"daemon control socket (default $PERFECTSCHED_SOCKET or "
                            f"{DEFAULT_SOCKET})")
    where.add_argument("-c", "--config", metavar="CONFIG",
                       help="open the database of this config directly, without the daemon")
    # dest: not `url`, import-legacy's argument
    where.add_argument("--url", dest="api_url", metavar="URL",
                       help="a daemon's HTTP API, https://HOST:PORT, from any machine "
                            "(default $PERFECTSCHED_URL)")
    p.add_argument("-e", "--environment", metavar="ENV", help="section of a multi-env config")
    p.add_argument("--token-file", metavar="FILE",
                   help="with --url: the API token (default $PERFECTSCHED_TOKEN_FILE)")
    p.add_argument("--ca-file", metavar="FILE",
                   help="with an https:// --url: trust this CA, not the system's "
                        "(default $PERFECTSCHED_CA_FILE)")
    p.add_argument("--insecure", action="store_true",
                   help="with --url: allow http:// to another host (the token in clear)")
    p.add_argument("--json", action="store_true", help="print JSON for programs")
    p.add_argument("--version", action="version", version=f"perfectschedctl {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_CommandParser)
    sub.required = True
    for command in registry.COMMANDS.values():
        if not command.in_cli:
            continue
        sp = sub.add_parser(command.name, help=command.help, description=command.help)
        assert isinstance(sp, _CommandParser)
        if lazy:
            sp.pending = command
        else:
            sp.add_command_arguments(command)
    return p


def request_of(ns: argparse.Namespace, daemon_status: dict[str, Any] | None = None
               ) -> tuple[str, dict[str, Any]]:
    """The request of the command line; `daemon_status`: apply's (_apply_request)."""
    command = registry.COMMANDS[ns.command]
    if command.name == "apply":
        return command.name, _apply_request(ns, daemon_status)
    args: dict[str, Any] = {}
    for arg in command.cli:
        value = getattr(ns, arg.dest, None)
        if not arg.sent or value is None or (arg.kind == "flag" and not value) or \
                (arg.dest == "prefix" and value == "") or (arg.kind == "keys" and not value):
            continue
        if arg.kind == "keys" and len(value) == 1:
            args["key"] = value[0]  # one key, as every daemon since 0.1.0 reads it
            continue
        args[arg.dest] = _json_arg(arg.flags[-1].upper() if arg.positional else
                                   arg.flags[-1], value) if arg.kind == "json" else value
    return command.name, args


def _apply_request(ns: argparse.Namespace, daemon_status: dict[str, Any] | None
                   ) -> dict[str, Any]:
    """Read and check the files here; only what is stored travels (no command, env or
    user).  Every problem is a line on stderr, and nothing is sent.

    Through the daemon (`daemon_status`: its status answer), the files are checked as
    that daemon checks its schedules_dir, by the same function (files.check): a file it
    would reject on reload fails here for the same reason.  With -c (no daemon asked),
    or a daemon that does not say how it checks (older than 0.2.0), only what the
    database stores is checked."""
    from perfectschedd.schedules import converge, files

    missing = [p for p in ns.paths if not os.path.exists(p)]
    if missing:
        raise _BadArgument(f"{missing[0]}: no such file or directory")
    host = None if daemon_status is None else \
        files.HostChecks.of_status(daemon_status, os.geteuid())
    loaded = files.check(ns.paths, host) if host is not None else \
        files.load(ns.paths, need_user_support=False)
    problems = loaded.problems()
    if problems:
        raise _BadArgument("\n".join(f"perfectschedctl: {e}" for e in problems)
                           .removeprefix("perfectschedctl: "))
    return {"entries": converge.to_wire(loaded.entries), "prune": ns.prune,
            "dry_run": ns.dry_run}


def _note_exec_entries(entries: list[dict[str, Any]], paths: list[str],
                       schedules_dir: Any = None) -> None:
    """After an apply: where its exec entries run (said once it was taken, so that a
    refusal stays one line), unless the files are the daemon's own already (in its
    `schedules_dir`: a reload reads them there)."""
    from perfectschedd.vocabulary.fields import EXEC_TYPE

    if isinstance(schedules_dir, str) and paths and all(
            os.path.dirname(os.path.realpath(p)) == os.path.realpath(schedules_dir)
            for p in paths):
        return
    execs = sum(str(e.get("type")).startswith(EXEC_TYPE) for e in entries)
    if execs:
        print(f"perfectschedctl: note: {execs} exec entr{'y runs' if execs == 1 else 'ies run'}"
              " only on hosts whose schedules_dir holds the file", file=sys.stderr)


class _BadArgument(Exception):
    pass


def _json_arg(name: str, text: str) -> Any:
    # The depth is checked here, not only by the daemon: there the request around the
    # value is deeper than the value, and the error would name the request.
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _BadArgument(f"{name}: not valid JSON: {exc.msg}") from None
    except RecursionError:
        raise _BadArgument(f"{name}: nested deeper than {MAX_DEPTH} levels") from None
    if json_depth(value) > MAX_DEPTH:
        raise _BadArgument(f"{name}: nested deeper than {MAX_DEPTH} levels")
    return value


def _direct(ns: argparse.Namespace, cmd: str, args: dict[str, Any]) -> Any:
    from perfectschedd.control import auth, commands
    from perfectschedd.schedules import collection

    # Before opening anything: a root-only command is refused to anyone else here too.
    auth.check_root_only(registry.command(cmd, registry.DIRECT), auth.Caller.this_process())
    with collection.open(ns.config, ns.environment) as sc:
        return commands.execute(sc, cmd, args, where=registry.DIRECT)


def _import_crontab(ns: argparse.Namespace) -> int:
    """Local only: reads a file, prints a schedules file, talks to no daemon."""
    from perfectschedd.schedules import from_crontab

    try:
        tab = from_crontab.read(ns.file, user=ns.user, system=ns.system)
    except from_crontab.CrontabRefused as exc:
        raise _BadArgument(str(exc)) from None
    except OSError as exc:
        raise _BadArgument(f"{ns.file}: {exc.strerror}") from None
    done = from_crontab.convert(tab.text, name=tab.name, system=tab.system, user=tab.user,
                           default_timezone=from_crontab.system_timezone())
    sys.stdout.write(done.text)
    for warning in done.warnings:
        print(f"perfectschedctl: warning: {warning}", file=sys.stderr)
    return EXIT_OK


def _next(ns: argparse.Namespace, send: Callable[[str, dict[str, Any]], Any] | None,
          remote: bool = False) -> dict[str, Any]:
    """The next fire times of KEY (its schedule read through `send`: the daemon, or the
    database of -c; `remote`, --url: worked out by the daemon) or of --cron EXPR (nothing
    read)."""
    import time

    from perfectschedd.schedules import preview

    if (ns.key is None) == (ns.cron is None):
        raise _BadArgument("next: give a KEY or --cron EXPR (one of them)")
    if ns.cron is None and (ns.timezone is not None or ns.start is not None):
        raise _BadArgument("next: -t and -s go with --cron (a schedule has its own)")
    if ns.cron is not None:
        tz = ns.timezone if ns.timezone is not None else "UTC"
        start = ns.start if ns.start is not None else int(time.time())
        return preview.of_expression_shown(ns.cron, tz, start, ns.count)
    assert send is not None
    if remote:
        return dict(send("next", {"key": ns.key, "count": ns.count}))
    return preview.of_schedule_shown(send("show", {"key": ns.key}), ns.count)


# How many of a schedule's newest history rows `logs` looks through for its newest run
# (skipped occurrences are rows too).
LOGS_LOOK_BACK = 100


def _logs(ns: argparse.Namespace, send: Callable[[str, dict[str, Any]], Any],
          remote: bool = False) -> int:
    """The output of the newest run of KEY (or, with --attempt N, of the newest run that
    was attempt N): the tail its history row holds, or for a run as a systemd unit its
    journal (journalctl prints it; reading the journal needs what journalctl needs: root,
    or the adm/systemd-journal group; over --url it is on that host, not here).  History
    comes through the daemon, or the database of -c.  What the run printed is shown with
    its control characters escaped, unless --raw (root's only: the daemon refuses it to
    anyone else)."""
    args: dict[str, Any] = {"key": ns.key, "limit": LOGS_LOOK_BACK}
    if ns.attempt is not None:
        args.update(attempt=ns.attempt, limit=1)
    if ns.raw:
        args["raw"] = True
    runs = send("history", args)
    run = next((r for r in runs if r.get("outcome") != "skipped"), None)
    if run is None:
        which = f"attempt {ns.attempt}" if ns.attempt is not None else "run"
        raise _BadArgument(f"{ns.key}: no {which} in its history")
    if run.get("withheld"):
        # One line, as any refusal: the runs are this caller's to list, not to read.
        raise _BadArgument(f"{ns.key}: output {run['withheld']}")
    if run.get("unit") and remote:
        # Its journal is on the host that ran it, not here (--url).
        raise _BadArgument(f"{ns.key}: its run was the systemd unit {run['unit']} (worker "
                           f"{run.get('worker')}): its output is in that host's journal "
                           f"(journalctl --unit {run['unit']}, there)")
    if run.get("unit"):
        argv = ["journalctl", "--no-pager", "--unit", run["unit"]]
        if ns.lines is not None:
            argv += ["--lines", str(ns.lines)]
        import subprocess  # only here, for a run's journal: it takes ms of every start

        sys.stdout.flush()
        try:
            code = subprocess.run(argv, check=False).returncode
            # Killed by a signal (SIGPIPE under `| head`): the shell's 128 + N.
            return 128 - code if code < 0 else code
        except OSError as exc:
            raise _BadArgument(f"cannot run journalctl: {exc.strerror or exc}") from None
    output = run.get("output")
    if output is None:
        # Said on stderr: stdout holds only what the run printed.
        print(f"perfectschedctl: {ns.key}: attempt {run.get('attempt')} of the occurrence "
              f"of {format_time(run.get('scheduled_time'))} ({run.get('outcome')}) has no "
              "output recorded"
              + (f": {run['error']}" if run.get("error") else ""), file=sys.stderr)
        return EXIT_OK
    if ns.lines is not None:
        # Lines end at \n only: a \r (or another control character splitlines takes
        # for a line end) is shown escaped, within its line.
        import re

        lines = re.findall(r"[^\n]*\n|[^\n]+$", output)
        output = "".join(lines[-ns.lines:] if ns.lines else [])
    sys.stdout.write(output if ns.raw else terminal_text(output))
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
    from perfectschedd.schedules import from_legacy

    found, problems = from_legacy.read(ns.url, ns.table)
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
        print(f"{verb} {s.key} (type {s.type}, cron {s.cron}, next run "
              f"{format_time(s.next_run_time, s.timezone)})")
    print(f"{len(found)} schedule(s) {verb} from table {ns.table}")
    return EXIT_OK


def _url(ns: argparse.Namespace) -> str | None:
    """The daemon's API that the commands go to (--url, else $PERFECTSCHED_URL unless
    --socket or -c is given), or None: its socket, or the database."""
    url = ns.api_url or (None if ns.socket or ns.config else
                         os.environ.get("PERFECTSCHED_URL") or None)
    if url is None and (ns.token_file or ns.ca_file or ns.insecure):
        raise _BadArgument("--token-file, --ca-file and --insecure go with --url")
    return url


def _option(value: str | None, flag: str, variable: str) -> tuple[str | None, str]:
    """An option's value and where it was given: the flag, else the variable."""
    if value:
        return value, flag
    return os.environ.get(variable) or None, variable


def _http_client(ns: argparse.Namespace) -> Any:
    """The HTTP API's client (http_client.HttpClient), flags before the environment."""
    from . import http_client

    url, url_from = _option(ns.api_url, "--url", "PERFECTSCHED_URL")
    assert url is not None
    return http_client.HttpClient.of_options(
        (url, url_from), _option(ns.token_file, "--token-file", "PERFECTSCHED_TOKEN_FILE"),
        _option(ns.ca_file, "--ca-file", "PERFECTSCHED_CA_FILE"), ns.insecure)


# The exit status of a command whose reader went away (`show KEY | head -1`): as a
# shell tool killed by SIGPIPE.
EXIT_BROKEN_PIPE = 128 + 13


def main(argv: Sequence[str] | None = None) -> int:
    try:
        code = _main(argv)
        sys.stdout.flush()  # here, where a closed pipe can still be answered quietly
        return code
    except BrokenPipeError:
        # What the reader did not read is not wanted; no traceback, and nothing more
        # written.  Python's advice: stdout onto /dev/null, or its flush at exit fails
        # again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser(lazy=True)
    ns = parser.parse_args(argv)
    try:
        url = _url(ns)
        if url is not None:
            from . import http_client  # only here: http.client and ssl slow every start

            http_client.check_command(ns.command)
        if ns.command == "import-crontab":
            return _import_crontab(ns)
        if ns.command == "next" and ns.cron is not None:
            print_result("next", _next(ns, None), as_json=ns.json)
            return EXIT_OK
        cmd = ns.command
        args: dict[str, Any] = {}
        local = registry.LOCAL in registry.COMMANDS[cmd].where  # import-legacy, logs
        if ns.config:
            if not local:
                registry.command(cmd, registry.DIRECT)

            def send(cmd: str, args: dict[str, Any]) -> Any:
                return _direct(ns, cmd, args)
        else:
            if not local:
                registry.command(cmd, registry.DAEMON)
            if ns.environment:
                raise _BadArgument("-e needs -c CONFIG")
            if url is not None:
                send = _http_client(ns).call
            else:
                path = ns.socket or os.environ.get("PERFECTSCHED_SOCKET") or DEFAULT_SOCKET
                send = SocketClient(path).call
        # apply checks its files as the daemon will (_apply_request): asked first.
        daemon_status = send("status", {}) if cmd == "apply" and not ns.config else None
        cmd, args = request_of(ns, daemon_status)
        if cmd == "import-legacy":
            return _import_legacy(ns, send)
        if cmd == "logs":
            return _logs(ns, send, remote=url is not None)
        if cmd == "next":
            result = _next(ns, send, remote=url is not None)
        if cmd == "apply":
            # All or nothing: a key that belongs elsewhere refuses the whole apply before
            # anything is written (asked first as a dry run), and --dry-run says just that.
            result = send(cmd, {**args, "dry_run": True})
            refused = [c for c in result["changes"] if c.startswith("refused ")]
            if refused:
                raise _BadArgument("\n".join(f"perfectschedctl: {c}" for c in refused)
                                   .removeprefix("perfectschedctl: "))
        if cmd != "next" and not (cmd == "apply" and args["dry_run"]):
            result = send(cmd, args)
        if cmd == "apply":
            _note_exec_entries(args["entries"], list(ns.paths),
                               (daemon_status or {}).get("schedules_dir"))
    except protocol.RemoteError as exc:
        print(f"perfectschedctl: {exc}", file=sys.stderr)
        return protocol.refusal(exc.type).exit_status
    except (_BadArgument, ScheduleError, ConfigError, DaemonUnavailable,
            protocol.ProtocolError) as exc:
        print(f"perfectschedctl: {exc}", file=sys.stderr)
        return protocol.refusal(protocol.error_type(exc)).exit_status if isinstance(
            exc, ScheduleError) else EXIT_REFUSED
    except BrokenPipeError:
        raise  # the reader of our output went away (main)
    except Exception as exc:  # noqa: BLE001 - database errors in direct mode, one line
        print(f"perfectschedctl: {type(exc).__name__}: {str(exc).splitlines()[0]}",
              file=sys.stderr)
        return EXIT_REFUSED
    print_result(cmd, result, as_json=ns.json, raw=bool(getattr(ns, "raw", False)))
    if cmd == "reload" and isinstance(result, dict):
        if result.get("files_applied") is False:
            print("perfectschedctl: note: the schedules files are not applied yet (the "
                  "database is slow); `perfectschedctl status` will show any refusal",
                  file=sys.stderr)
        if result.get("refused"):
            # The rest of the configuration runs; what this host refused is an error still
            # (systemctl reload fails with these lines), until a reload takes everything.
            for why in result["refused"]:
                print(f"perfectschedctl: refused: {why}", file=sys.stderr)
            return EXIT_REFUSED
    return EXIT_OK


if __name__ == "__main__":
    raise SystemExit(main())
