"""Who may read what (issue #38): a schedule's data and its runs' output and error lines
go to root, the daemon's user, the schedule's creator and its route's allow: only
(auth.Access.may_read); every member still lists every key and state.  Terminal output
escapes control characters unless --raw, root's only.  And the changes that need more
than membership: a route's allow: on pause/resume/delete, root's forced changes.

A real daemon, its real socket and a private bus, called as other users with setpriv
(test_callers.py's helpers).  The runs are written to the daemon's database as a worker
writes them (store.record_runs): what a run printed, not how it ran, is under test.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import test_callers
from daemon_harness import Daemon, wait_until
from test_callers import (
    AS_DAEMON_IN_GROUP,
    AS_NOBODY,
    TRUE,
    Bus,
    ctl_as,
    direct_ctl,
    entries,
    needs_dbus,
    needs_root,
    ok,
    refused,
)

import perfectschedd

open_dir, bus = test_callers.open_dir, test_callers.bus  # the fixtures

T0 = 1_893_456_000
# What a hostile job prints: a clipboard write (OSC 52), a colour, a carriage return that
# hides the line before it, a bidi override.
HOSTILE = "pw=hunter2\n\x1b]52;c;ZXZpbA==\x07\x1b[31mred\rtab\there\u202eevil\n"
ESCAPED = "pw=hunter2\n\\e]52;c;ZXZpbA==\\x07\\e[31mred\\rtab\there\\u202eevil\n"
WITHHELD = ("withheld: a schedule's data and its runs' output are shown to root, its "
            "creator and its route's allow: only")
SECRETS = ("root-secret", "nobody-secret", "hunter2")
# The member of the group who is neither a creator nor named by an allow: (uid daemon).
STRANGER = AS_DAEMON_IN_GROUP


def record_run(d: Daemon, key: str, output: str, error: str) -> None:
    """A failed run of `key`, as a worker records it."""
    with perfectschedd.open(str(d.config_path)) as sc:
        sc.store.record_runs([{
            "key": key, "type": "t", "scheduled_time": T0, "attempt": 1,
            "started_at": T0, "finished_at": T0 + 1, "outcome": "failed", "worker": "h:1",
            "exit_code": 1, "duration": 1.0, "output": output, "error": error}])


def secret_free(text: str) -> bool:
    return not any(s in text for s in SECRETS)


def raw_stdout(d: Daemon, *args: str) -> str:
    """What perfectschedctl (as root) wrote, byte for byte (text mode would turn \r
    into \n)."""
    res = subprocess.run([*d.ctl_command, "--socket", d.socket_path, *args],
                         capture_output=True, timeout=60, check=True)
    return res.stdout.decode()


def member_json(d: Daemon, user: list[str], *args: str) -> Any:
    return json.loads(ok(ctl_as(d, user, "--json", *args)))


@pytest.fixture
def daemon(open_dir: Path, bus: Bus) -> Any:
    d = Daemon(open_dir, {"control_group": "nogroup", "dbus": True,
                          "dbus_address": bus.address, "routes": [
                              # nobody is named by its allow:, the stranger is not
                              {"type": "secret", "exec": TRUE, "user": "daemon",
                               "allow": ["nobody"]}]})
    d.start()
    os.chmod(d.dir, 0o755)
    # root's schedule of the route; a member's (nobody's) of a type no route takes here;
    # a schedule deleted since (its runs stay in history)
    d.ctl("add", "rootjob", "secret", "0 0 1 1 *", '{"pw": "root-secret"}')
    ok(ctl_as(d, AS_NOBODY, "add", "mine", "t", "0 0 1 1 *", '{"pw": "nobody-secret"}'))
    d.ctl("add", "gone", "t", "0 0 1 1 *")
    for key in ("rootjob", "mine", "gone"):
        record_run(d, key, f"{key}: {HOSTILE}", f"exit status 1: {key} pw=hunter2")
    d.ctl("delete", "gone")
    try:
        yield d
    finally:
        d.kill()


@needs_root
@needs_dbus
def test_a_member_is_refused_another_s_output_and_data(daemon: Daemon, bus: Bus) -> None:
    d = daemon
    # Listing is everyone's: every key and state, the data only to its readers.
    listed = {r["key"]: r for r in member_json(d, STRANGER, "list")}
    assert set(listed) == {"rootjob", "mine"}
    assert all(r["data"] is None and r["withheld"] == WITHHELD for r in listed.values())
    assert listed["mine"]["state"] == "failed"
    table = ok(ctl_as(d, STRANGER, "list"))
    assert "rootjob" in table and "mine" in table and "(withheld)" in table
    assert secret_free(table)
    wait_until(lambda: {f["key"] for f in d.status().get("failing", [])} >= {"mine"})
    status = member_json(d, STRANGER, "status")
    failing = {f["key"]: f for f in status["failing"]}
    assert failing["mine"]["error"] is None and failing["mine"]["withheld"] == WITHHELD
    assert secret_free(ok(ctl_as(d, STRANGER, "status")))

    for key in ("rootjob", "mine"):
        shown = member_json(d, STRANGER, "show", key)
        assert shown["key"] == key and shown["data"] is None
        assert secret_free(ok(ctl_as(d, STRANGER, "show", key)))
        runs = member_json(d, STRANGER, "history", key)
        assert [(r["outcome"], r["exit_code"], r["output"], r["error"]) for r in runs] == [
            ("failed", 1, None, None)]
        text = ok(ctl_as(d, STRANGER, "history", key))
        assert "failed" in text and secret_free(text)
        refused(ctl_as(d, STRANGER, "logs", key), f"{key}: output {WITHHELD}")
    # D-Bus: the same rule, in the same place
    for method, args in (("show", ["mine"]), ("history", ["mine", 5]), ("list", [""]),
                         ("call", ["history", json.dumps({"key": "rootjob"})])):
        name, result = bus.call(STRANGER, method, *args)
        assert name == "OK" and secret_free(result) and WITHHELD in result, (method, result)
    # A deleted schedule names no creator: its history is root's.
    refused(ctl_as(d, STRANGER, "history", "gone"), "schedule 'gone' not found (the "
            "history of a deleted schedule is shown to root only)")
    refused(ctl_as(d, AS_NOBODY, "logs", "gone"), "schedule 'gone' not found")
    name, message = bus.call(AS_NOBODY, "history", "gone", 5)
    assert name.endswith("NotFoundError") and "shown to root only" in message

    # Deleted and added again, by someone else: the key's earlier runs are not the new
    # schedule's (one add, and a batch); root still reads them.
    ok(ctl_as(d, STRANGER, "delete", "mine"))
    ok(ctl_as(d, STRANGER, "add", "mine", "t", "0 0 1 1 *"))
    d.ctl("delete", "rootjob")
    name, _ = bus.call(STRANGER, "call", "add_many", json.dumps({"schedules": [
        {"key": "rootjob", "type": "t", "cron": "0 0 1 1 *"}]}))
    assert name == "OK"
    for key in ("mine", "rootjob"):
        assert member_json(d, STRANGER, "history", key) == []
        refused(ctl_as(d, STRANGER, "logs", key), f"{key}: no run in its history")
        assert [r["output"] for r in d.ctl_json("history", key)] == [f"{key}: {HOSTILE}"]
    record_run(d, "mine", "new\n", "exit status 1")
    assert ok(ctl_as(d, STRANGER, "logs", "mine")) == "new\n"


@needs_root
@needs_dbus
def test_root_the_creator_and_the_allow_list_read(daemon: Daemon, bus: Bus) -> None:
    d = daemon
    # the creator
    assert member_json(d, AS_NOBODY, "show", "mine")["data"] == {"pw": "nobody-secret"}
    assert ok(ctl_as(d, AS_NOBODY, "logs", "mine")) == f"mine: {ESCAPED}"
    name, result = bus.call(AS_NOBODY, "history", "mine", 5)
    assert name == "OK" and json.loads(result)[0]["output"] == f"mine: {HOSTILE}"
    # a user the route's allow: names (not the creator: root is)
    assert member_json(d, AS_NOBODY, "show", "rootjob")["data"] == {"pw": "root-secret"}
    assert member_json(d, AS_NOBODY, "history", "rootjob")[0]["error"] == \
        "exit status 1: rootjob pw=hunter2"
    listed = {r["key"]: r for r in member_json(d, AS_NOBODY, "list")}
    assert listed["rootjob"]["data"] == {"pw": "root-secret"} and "withheld" not in \
        listed["rootjob"]
    # root: everything, a deleted schedule's runs too
    assert d.ctl_json("show", "mine")["data"] == {"pw": "nobody-secret"}
    assert d.ctl("logs", "gone").stdout == f"gone: {ESCAPED}"
    assert d.ctl_json("history", "gone")[0]["output"] == f"gone: {HOSTILE}"
    failing = {f["key"]: f for f in wait_until(lambda: d.status().get("failing"))}
    assert failing["mine"]["error"] == "exit status 1: mine pw=hunter2"
    # direct mode holds the database's credentials: it reads as root does
    res = direct_ctl(d, "logs", "gone")
    assert res.returncode == 0 and res.stdout == f"gone: {ESCAPED}"


@needs_root
@needs_dbus
def test_control_characters_are_escaped_and_raw_is_root_s(daemon: Daemon) -> None:
    d = daemon
    assert d.ctl("logs", "rootjob").stdout == f"rootjob: {ESCAPED}"
    assert raw_stdout(d, "logs", "rootjob", "--raw") == f"rootjob: {HOSTILE}"
    # -n counts lines as the terminal shows them: a \r ends none
    assert d.ctl("logs", "rootjob", "-n", "1").stdout == \
        "\\e]52;c;ZXZpbA==\\x07\\e[31mred\\rtab\there\\u202eevil\n"
    # the history table: one row a run, its error line escaped
    record_run(d, "rootjob", "x", "exit status 1: \x1b]52;c;ZXZpbA==\x07")
    table = d.ctl("history", "rootjob").stdout
    assert "\x1b" not in table and "\\e]52;c;ZXZpbA==\\x07" in table
    assert "\x1b]52;c;ZXZpbA==\x07" in raw_stdout(d, "history", "rootjob", "--raw")
    # --raw is root's, refused in one line to the creator and to an allow:-listed user
    for args in (["logs", "mine", "--raw"], ["logs", "rootjob", "--raw"],
                 ["history", "mine", "--raw"]):
        refused(ctl_as(d, AS_NOBODY, *args), "--raw: only root may read output "
                "unescaped, not nobody")


@needs_root
@needs_dbus
def test_a_route_s_allow_list_guards_pause_resume_and_delete(daemon: Daemon) -> None:
    d = daemon
    before = d.ctl_json("show", "rootjob")
    for args in (["pause", "rootjob"], ["resume", "rootjob"], ["delete", "rootjob"],
                 ["pause", "rootjob", "mine"], ["pause", "--prefix", "root"]):
        refused(ctl_as(d, STRANGER, *args), "rootjob: type secret runs as user daemon: "
                "only root and nobody may schedule it (its route's allow:), not daemon")
    assert d.ctl_json("show", "rootjob") == before
    assert d.ctl_json("show", "mine")["paused"] is False
    # the user its allow: names may
    assert member_json(d, AS_NOBODY, "pause", "rootjob")["paused"] is True
    assert member_json(d, AS_NOBODY, "resume", "rootjob")["paused"] is False
    ok(ctl_as(d, AS_NOBODY, "delete", "rootjob"))
    # the group's brake stays the group's
    ok(ctl_as(d, STRANGER, "pause", "--all"))
    ok(ctl_as(d, STRANGER, "resume", "--all"))


@needs_root
def test_a_member_cannot_undo_root_s_forced_change(open_dir: Path) -> None:
    files = open_dir / "schedules.d"
    files.mkdir()
    entries(files / "backup.yml", {"key": "nightly", "cron": "0 3 * * *", "type": "t"})
    d = Daemon(open_dir, {"control_group": "nogroup", "schedules_dir": str(files)})
    try:
        d.start()
        os.chmod(d.dir, 0o755)
        assert d.ctl_json("pause", "nightly", "--force")["source"] == "forced:file:backup.yml"
        before = d.ctl_json("show", "nightly")
        forced = (f"nightly was changed by root with --force (detached from "
                  f"{files / 'backup.yml'}): only root may change it, not nobody")
        for args in (["resume", "nightly"], ["delete", "nightly"], ["pause", "nightly"],
                     ["modify", "nightly", "--cron", "@hourly"],
                     ["resume", "--prefix", "night"]):
            refused(ctl_as(d, AS_NOBODY, *args), forced)
        assert d.ctl_json("show", "nightly") == before
        # an extra run is no change (as for a file's schedule); resume --all releases only
        # what pause --all held
        ok(ctl_as(d, AS_NOBODY, "run", "nightly"))
        ok(ctl_as(d, AS_NOBODY, "resume", "--all"))
        assert d.ctl_json("show", "nightly")["paused"] is True
        # root changes it again with no --force: it is no file's any more
        assert d.ctl_json("resume", "nightly")["paused"] is False
        d.ctl("delete", "nightly")
    finally:
        d.kill()
