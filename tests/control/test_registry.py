"""The command registry (perfectschedd/registry.py) is the one list of commands: the CLI's
parser, the daemon's dispatch, direct mode, D-Bus and the protocol document all follow
it, so a command added there is everywhere, and nowhere else can one be added."""

from __future__ import annotations

import argparse
import inspect
import re
from pathlib import Path
from typing import Any

import pytest

from perfectschedctl import cli
from perfectschedd.control import commands, dbus_server, protocol, registry
from perfectschedd.errors import InvalidInputError

DOCS = Path(__file__).resolve().parents[2] / "docs"


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_the_cli_is_the_registry() -> None:
    parsers = subcommands()
    assert list(parsers) == [c.name for c in registry.COMMANDS.values() if c.in_cli]
    for name, sp in parsers.items():
        dests = {a.dest for a in sp._actions} - {"help", "json"}
        assert dests == {a.dest for a in registry.COMMANDS[name].cli}, name


@pytest.mark.parametrize("argv", [
    ["add", "k", "t", "* * * * *", "-t", "Europe/Paris", '{"a": 1}', "--jitter", "30"],
    ["--socket", "/s", "--json", "list", "--prefix", "app.", "-n", "3"],
    ["-c", "cfg.yml", "pause", "a", "b", "--force"],
    ["next", "--cron", "@daily", "-n", "2", "--json"],
    ["add", "--", "-odd-key", "t", "@daily"],
])
def test_the_lazy_parser_reads_a_command_line_as_the_full_one(argv: list[str]) -> None:
    """main's parser adds a command's arguments only when that command is parsed."""
    assert vars(cli.build_parser(lazy=True).parse_args(argv)) == \
        vars(cli.build_parser().parse_args(argv))


def test_the_lazy_parser_gives_a_command_s_help_and_refuses_as_the_full_one(
        capsys: pytest.CaptureFixture[str]) -> None:
    said = []
    for lazy in (True, False):
        for argv in (["add", "--help"], ["add", "k", "--bogus"], ["history", "k", "-n", "0"]):
            with pytest.raises(SystemExit) as exc:
                cli.build_parser(lazy=lazy).parse_args(argv)
            out = capsys.readouterr()
            said.append((exc.value.code, out.out, out.err))
    assert said[:3] == said[3:]
    assert "--max-attempts" in said[0][1] and said[0][0] == 0
    assert [s[0] for s in said[1:3]] == [cli.EXIT_USAGE] * 2


def test_add_and_modify_have_a_flag_for_each_policy_option() -> None:
    """The registry lists the policy flags itself (it must not import the schedule code:
    perfectschedctl reads it at every start); an option added to policy.OPTIONS without
    its flag fails here."""
    from perfectschedd.schedules import policy
    from perfectschedd.vocabulary.fields import PREVIEW_COUNT, PREVIEW_MAX

    assert {a.dest for a in registry.POLICIES} == set(policy.OPTIONS)
    for name in ("add", "modify"):
        assert set(policy.OPTIONS) <= set(registry.COMMANDS[name].args), name
    count = next(a for a in registry.COMMANDS["next"].cli if a.dest == "count")
    assert count.default == PREVIEW_COUNT and f"1-{PREVIEW_MAX}," in count.help


def test_every_database_command_has_a_handler_and_no_other_does() -> None:
    runs_on_database = {c.name for c in registry.COMMANDS.values()
                        if c.where & {registry.DAEMON, registry.DIRECT}
                        and c.name not in ("status", "reload")}
    assert set(commands.HANDLERS) == runs_on_database
    for name in ("status", "reload"):  # the daemon's own answers
        assert registry.COMMANDS[name].where == {registry.DAEMON}


@pytest.mark.parametrize("name,where,message", [
    ("init", registry.DAEMON, "init opens the database directly: give -c CONFIG"),
    ("status", registry.DIRECT, "status needs the daemon: use --socket, not -c"),
    ("import-crontab", registry.DAEMON, "import-crontab runs in perfectschedctl only"),
    ("import-legacy", registry.DIRECT, "import-legacy runs in perfectschedctl only"),
    ("frobnicate", registry.DAEMON, "unknown command 'frobnicate'"),
    (None, registry.DAEMON, "unknown command None"),
])
def test_where_a_command_may_run(name: Any, where: str, message: str) -> None:
    with pytest.raises(InvalidInputError, match=re.escape(f"command: {message}")):
        registry.command(name, where)


def test_arguments_are_the_registry_s() -> None:
    add = registry.COMMANDS["add"]
    with pytest.raises(InvalidInputError, match="unknown argument.*: colour"):
        registry.check_args(add, {"key": "k", "type": "t", "cron": "@daily", "colour": 1})
    with pytest.raises(InvalidInputError, match="^cron: required"):
        registry.check_args(add, {"key": "k", "type": "t"})
    # D-Bus takes add's and modify's options from the same place.
    src = inspect.getsource(dbus_server.Manager)
    assert "_ADD.args" in src and "_MODIFY.args" in src
    assert dbus_server._ADD is add


def test_the_protocol_document_lists_every_daemon_command_and_refusal() -> None:
    text = (DOCS / "protocol.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    for c in registry.COMMANDS.values():
        if registry.DAEMON in c.where:
            assert any(line.split("|")[1].count(f"`{c.name}`") for line in rows), c.name
    for name in protocol.REFUSALS:
        assert f"`{name}`" in text, name


def test_refusals_map_to_exit_statuses_and_dbus_names() -> None:
    for name, r in protocol.REFUSALS.items():
        assert r.exit_status == 1 and r.dbus_name == f"org.perfectsched1.Error.{name}"
    assert protocol.refusal("NoSuchThing") == protocol.REFUSALS["InternalError"]
    err = dbus_server._error("NotFoundError", "schedule 'x' not found\nsecond line")
    assert (err.type, err.text) == ("org.perfectsched1.Error.NotFoundError",
                                    "schedule 'x' not found")
