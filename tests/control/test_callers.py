"""Who may do what (issue #25): perfectschedd/callers.py's rules, as users meet them.

Every rule is tested against a real daemon: through its socket with perfectschedctl run
as another user (setpriv), and over D-Bus on a private bus where the D-Bus tests do it.
A refusal is one line, and a refused request changes nothing stored.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import test_dbus_server
from daemon_harness import Daemon, foreign_ctl, foreign_python

import perfectschedd
from perfectschedd.control.auth import Caller, admission
from perfectschedd.control.dbus_server import BUS_NAME, INTERFACE, OBJECT_PATH
from perfectschedd.errors import InvalidInputError

needs_root = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                                reason="needs root and setpriv")
needs_dbus = pytest.mark.skipif(shutil.which("dbus-daemon") is None,
                                reason="dbus-daemon is not installed")

NOBODY, NOGROUP, DAEMON_UID = 65534, 65534, 1
AS_NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
AS_DAEMON = ["setpriv", "--reuid=daemon", "--regid=daemon", "--clear-groups"]


# -- D-Bus, as another user ---------------------------------------------------------------

# Calls one method of the Manager: argv address, method (as dbus-next names it: add,
# modify, call...), JSON list of arguments (an
# object is an a{sv}, each value [signature, value]); prints "OK <result>" or
# "<error name> <message>".
DBUS_CLIENT = """
import asyncio, json, sys
from dbus_next import DBusError, Variant
from dbus_next.aio import MessageBus

NAME, PATH, IFACE = sys.argv[4:7]


async def main():
    bus = await MessageBus(bus_address=sys.argv[1]).connect()
    intro = await bus.introspect(NAME, PATH)
    m = bus.get_proxy_object(NAME, PATH, intro).get_interface(IFACE)
    args = [{k: Variant(*v) for k, v in a.items()} if isinstance(a, dict) else a
            for a in json.loads(sys.argv[3])]
    try:
        print("OK", await getattr(m, "call_" + sys.argv[2])(*args))
    except DBusError as exc:
        print(exc.type, exc.text)

asyncio.run(main())
"""


open_dir = test_dbus_server.open_dir  # the fixture: a directory other users can traverse


class Bus(test_dbus_server.Bus):
    """A private bus anyone may use (the D-Bus tests' own), and calls made on it as
    another user."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory, test_dbus_server.OPEN_POLICY)

    def call(self, user: list[str], method: str, *args: Any) -> tuple[str, str]:
        """(error name or "OK", the result or message) of one call made as `user`."""
        res = subprocess.run([*user, *foreign_python(), "-c", DBUS_CLIENT, self.address,
                              method, json.dumps(args), BUS_NAME, OBJECT_PATH, INTERFACE],
                             capture_output=True, text=True, timeout=60, cwd="/")
        assert res.returncode == 0 and len(res.stdout.splitlines()) == 1, res
        name, _, rest = res.stdout.strip().partition(" ")
        return name, rest

@pytest.fixture
def bus(open_dir: Path) -> Iterator[Bus]:
    b = Bus(open_dir)
    yield b
    b.stop()


def ctl_as(d: Daemon, user: list[str], *args: str) -> subprocess.CompletedProcess[str]:
    """perfectschedctl --socket of daemon `d`, run as `user` (a setpriv command)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PERFECTSCHED_")}
    return subprocess.run([*user, *foreign_ctl(), "--socket", d.socket_path, *args],
                          capture_output=True, text=True, timeout=60, env=env, cwd="/")


def ok(res: subprocess.CompletedProcess[str]) -> str:
    assert res.returncode == 0, (res.returncode, res.stdout, res.stderr)
    return res.stdout


def refused(res: subprocess.CompletedProcess[str], *texts: str) -> str:
    """Exit 1, nothing on stdout, one line on stderr holding every text; the line."""
    assert res.returncode == 1, (res.returncode, res.stdout, res.stderr)
    assert res.stdout == ""
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("perfectschedctl: "), res.stderr
    for text in texts:
        assert text in lines[0], (text, lines[0])
    return lines[0].removeprefix("perfectschedctl: ")


# -- who may talk to the daemon: one rule, one wording -------------------------------------

def test_admission_rule() -> None:
    daemon_uid, group = 999, 998
    assert admission(Caller(0, frozenset()), daemon_uid, group) is None
    assert admission(Caller(daemon_uid, frozenset()), daemon_uid, group) is None
    assert admission(Caller(1000, frozenset({5, group})), daemon_uid, group) is None
    why = admission(Caller(NOBODY, frozenset({NOGROUP})), daemon_uid, group)
    assert why is not None and why.startswith("permission denied: nobody may not control "
                                              "perfectschedd (allowed: root, ")
    assert "\n" not in why and "uid 999" in why and "members of group" in why


@needs_root
@needs_dbus
def test_socket_and_dbus_refuse_a_stranger_in_the_same_words(open_dir: Path, bus: Bus) -> None:
    d = Daemon(open_dir, {"control_group": "nogroup", "dbus": True,
                          "dbus_address": bus.address})
    try:
        d.start()
        os.chmod(d.dir, 0o755)
        os.chmod(d.socket_path, 0o666)  # past the file mode: the daemon's own check
        on_socket = refused(d.ctl("status", as_user="daemon", check=False),
                            "permission denied")
        name, on_dbus = bus.call(AS_DAEMON, "status")
        assert name == "org.perfectsched1.Error.PermissionDenied"
        assert on_dbus == on_socket == ("permission denied: daemon may not control "
                                        "perfectschedd (allowed: root and members of group "
                                        "nogroup)")
        assert bus.call(AS_NOBODY, "status")[0] == "OK"
    finally:
        d.kill()


# -- each schedule records who made it ------------------------------------------------------

def direct_ctl(d: Daemon, *args: str) -> subprocess.CompletedProcess[str]:
    """perfectschedctl -c (the daemon's config: its database, no daemon), as root."""
    return subprocess.run([*d.ctl_command, "-c", str(d.config_path), *args],
                          capture_output=True, text=True, timeout=60)


@needs_root
@needs_dbus
def test_each_schedule_records_its_creator(open_dir: Path, bus: Bus) -> None:
    files = open_dir / "schedules.d"
    files.mkdir()
    (files / "root.yml").write_text("- {key: from-file, cron: '@daily', type: t}\n")
    d = Daemon(open_dir, {"control_group": "nogroup", "dbus": True,
                          "dbus_address": bus.address, "schedules_dir": str(files)})
    try:
        d.start()
        os.chmod(d.dir, 0o755)
        d.ctl("add", "by-root", "t", "@daily")
        ok(ctl_as(d, AS_NOBODY, "add", "by-nobody", "t", "@daily"))
        ok(ctl_as(d, AS_NOBODY, "run", "by-root"))
        assert bus.call(AS_NOBODY, "add", "by-dbus", "t", "@daily", "", {})[0] == "OK"
        assert direct_ctl(d, "add", "by-direct", "t", "@daily").returncode == 0

        listed = {r["key"]: r["creator"] for r in d.ctl_json("list")}
        run_key = next(k for k in listed if k.startswith("by-root@run-"))
        assert listed == {"by-root": 0, "by-nobody": NOBODY, "by-dbus": NOBODY,
                          "by-direct": 0, "from-file": 0, run_key: NOBODY}
        shown = d.ctl_json("show", "by-nobody")
        assert (shown["creator"], shown["creator_name"]) == (NOBODY, "nobody")
        assert d.ctl_json("show", "from-file")["creator_name"] == "root"
        text = d.ctl("show", "by-dbus").stdout
        assert any(line.split() == ["creator", str(NOBODY)] for line in text.splitlines())
        assert any(line.split() == ["creator_name", "nobody"] for line in text.splitlines())
    finally:
        d.kill()


# -- the exec: prefix is the schedules files' ------------------------------------------------

ROOTJOB = ("- {key: rootjob, cron: '0 0 1 1 *', exec: 'echo $PERFECTSCHED_KEY', "
           "user: root}\n")
EXEC_KEPT = "type: 'exec:' is kept for the exec entries of schedules files"


def fingerprint(d: Daemon) -> list[dict[str, Any]]:
    """Every schedule as `list --json` shows it (what a refused request must not change)."""
    return [s for s in d.ctl_json("list")]


@needs_root
@needs_dbus
def test_the_exec_prefix_is_refused_outside_schedules_files(open_dir: Path, bus: Bus) -> None:
    files = open_dir / "schedules.d"
    files.mkdir()
    (files / "root.yml").write_text(ROOTJOB)
    legacy = open_dir / "legacy.db"
    with sqlite3.connect(legacy) as con:
        con.execute("CREATE TABLE perfectsched (id VARCHAR(255) NOT NULL, timeout INT NOT "
                    "NULL, next_time INT NOT NULL, cron VARCHAR(128) NOT NULL, delay INT NOT "
                    "NULL, data LONGBLOB NOT NULL, timezone VARCHAR(255) NULL, PRIMARY KEY "
                    "(id))")
        con.execute("INSERT INTO perfectsched VALUES ('sneaky', 0, 0, '@daily', 0, "
                    "'{\"type\": \"exec:rootjob\", \"evil\": 1}', NULL)")
    os.chmod(legacy, 0o644)
    mine = open_dir / "mine.yml"
    mine.write_text(ROOTJOB.replace("rootjob", "minejob"))
    os.chmod(mine, 0o644)
    d = Daemon(open_dir, {"control_group": "nogroup", "dbus": True,
                          "dbus_address": bus.address, "schedules_dir": str(files)})
    try:
        d.start()
        os.chmod(d.dir, 0o755)
        d.ctl("add", "plain", "t", "@daily")
        before = fingerprint(d)
        assert {s["key"]: s["type"] for s in before} == {"rootjob": "exec:rootjob",
                                                          "plain": "t"}

        # perfectschedctl, as a member of the group and as root
        for user in (AS_NOBODY, []):
            refused(ctl_as(d, user, "add", "rootjob2", "exec:rootjob", "@daily", '{"a": 1}')
                    if user else d.ctl("add", "k", "exec:rootjob", "@daily", check=False),
                    EXEC_KEPT)
            refused(ctl_as(d, user, "modify", "plain", "--type", "exec:rootjob") if user
                    else d.ctl("modify", "plain", "--type", "exec:x", check=False), EXEC_KEPT)
        refused(ctl_as(d, AS_NOBODY, "import-legacy", f"sqlite:///{legacy}"),
                "cannot import 'sneaky': " + EXEC_KEPT)
        # apply sends an exec entry as its type (exec:KEY): root's files only
        refused(ctl_as(d, AS_NOBODY, "apply", str(mine)), "minejob: an exec entry "
                "(type exec:minejob) is applied by root only")
        # a request no perfectschedctl makes
        for cmd, args in (("add_many", {"schedules": [{"key": "s", "type": "exec:rootjob",
                                                       "cron": "@daily"}]}),
                          ("run", {"key": "plain", "type": "exec:rootjob"})):
            name, message = bus.call(AS_NOBODY, "call", cmd, json.dumps(args))
            assert name.startswith("org.perfectsched1.Error.InvalidInputError"), message
        # D-Bus methods
        name, message = bus.call(AS_NOBODY, "add", "k", "exec:rootjob", "@daily", "", {})
        assert (name, message) == ("org.perfectsched1.Error.InvalidInputError",
                                   EXEC_KEPT + " (exec:KEY runs the command their file "
                                   "holds)")
        name, message = bus.call(AS_NOBODY, "modify", "plain", {"type": ["s", "exec:k"]})
        assert EXEC_KEPT in message and name.endswith("InvalidInputError")
        name, message = bus.call(AS_NOBODY, "call", "add", json.dumps(
            {"key": "k", "type": "exec:rootjob", "cron": "@daily"}))
        assert EXEC_KEPT in message
        assert fingerprint(d) == before

        # the library, too (this process: root)
        with perfectschedd.open(str(d.config_path)) as sc:
            with pytest.raises(InvalidInputError, match=EXEC_KEPT):
                sc.add("k", "exec:rootjob", "@daily")
            with pytest.raises(InvalidInputError, match=EXEC_KEPT):
                sc["plain"].modify(type="exec:plain")
            with pytest.raises(InvalidInputError, match=EXEC_KEPT):
                sc.add_many([{"key": "k", "type": "exec:k", "cron": "@daily"}])
        assert fingerprint(d) == before
        # root writes the files: root's apply of one stores its exec entry's type
        assert d.ctl("apply", str(mine)).stdout == "added minejob\n"
        assert d.ctl_json("show", "minejob")["type"] == "exec:minejob"
    finally:
        d.kill()


# -- a schedules file's schedules change through the file -----------------------------------

def from_file(path: Path) -> str:
    return (f"nightly is managed by {path}: edit it and reload (root may --force the "
            "change, which detaches it from the file)")
NOT_ROOT_FORCE = "force: only root may force a change of a schedules file's schedule"


def entries(path: Path, *items: dict[str, Any]) -> Path:
    path.write_text(json.dumps(list(items)))  # JSON is YAML
    os.chmod(path, 0o644)
    return path


@needs_root
@needs_dbus
def test_a_schedules_file_s_schedules_change_through_the_file(open_dir: Path,
                                                               bus: Bus) -> None:
    files = open_dir / "schedules.d"
    files.mkdir()
    entries(files / "backup.yml", {"key": "nightly", "cron": "0 3 * * *", "type": "t"},
            {"key": "weekly", "cron": "@weekly", "type": "t"})
    d = Daemon(open_dir, {"control_group": "nogroup", "dbus": True,
                          "dbus_address": bus.address, "schedules_dir": str(files)})
    try:
        d.start()
        os.chmod(d.dir, 0o755)
        ok(ctl_as(d, AS_NOBODY, "add", "mine", "t", "@daily"))
        before = fingerprint(d)
        FROM_FILE = from_file(files / "backup.yml")

        for args in (["modify", "nightly", "--cron", "@hourly"], ["pause", "nightly"],
                     ["resume", "nightly"], ["delete", "nightly"]):
            refused(ctl_as(d, AS_NOBODY, *args), FROM_FILE)
            refused(d.ctl(*args, check=False), FROM_FILE)  # root, without --force
            refused(ctl_as(d, AS_NOBODY, *args, "--force"), NOT_ROOT_FORCE)
        refused(ctl_as(d, AS_NOBODY, "pause", "mine", "--force"), NOT_ROOT_FORCE)
        for method, args in (("modify", ["nightly", {"cron": ["s", "@hourly"]}]),
                             ("pause", ["nightly"]), ("resume", ["nightly"]),
                             ("delete", ["nightly"])):
            name, message = bus.call(AS_NOBODY, method, *args)
            assert (name, message) == ("org.perfectsched1.Error.PermissionDeniedError",
                                       FROM_FILE)
        name, message = bus.call(AS_NOBODY, "modify", "nightly", {
            "cron": ["s", "@hourly"], "force": ["b", True]})
        assert name.endswith("PermissionDeniedError") and message.startswith(NOT_ROOT_FORCE)
        name, message = bus.call(AS_NOBODY, "call", "delete", json.dumps(
            {"key": "nightly", "force": True}))
        assert name.endswith("PermissionDeniedError") and message.startswith(NOT_ROOT_FORCE)
        assert fingerprint(d) == before

        # An extra run is no change of the file: the schedule does not move, and the run
        # is the file's own (its type, its data), at a time of the member's choosing.
        assert "queued a run of nightly" in ok(ctl_as(d, AS_NOBODY, "run", "nightly"))
        # Plain schedules stay the group's.
        ok(ctl_as(d, AS_NOBODY, "pause", "mine"))
        ok(ctl_as(d, AS_NOBODY, "delete", "mine"))

        # Root may force a change (until the file changes: see perfectschedctl(1)).
        assert d.ctl_json("pause", "nightly", "--force")["paused"] is True
        assert d.ctl_json("resume", "nightly", "--force")["paused"] is False
        assert d.ctl_json("modify", "nightly", "--force", "--delay", "7")["delay"] == 7
        name, result = bus.call([], "modify", "nightly", {"delay": ["x", 9],
                                                          "force": ["b", True]})
        assert name == "OK" and json.loads(result)["delay"] == 9
        name, result = bus.call([], "call", "pause", json.dumps({"key": "nightly",
                                                                 "force": True}))
        assert name == "OK" and json.loads(result)["paused"] is True
        d.ctl("delete", "weekly", "--force")
        keys = {s["key"] for s in d.ctl_json("list")}
        assert "nightly" in keys and "weekly" not in keys
    finally:
        d.kill()


@needs_root
def test_apply_by_a_member_changes_and_prunes_only_its_own(open_dir: Path) -> None:
    files = open_dir / "schedules.d"
    files.mkdir()
    entries(files / "backup.yml", {"key": "nightly", "cron": "0 3 * * *", "type": "t"})
    d = Daemon(open_dir, {"control_group": "nogroup", "schedules_dir": str(files)})
    try:
        d.start()
        os.chmod(d.dir, 0o755)
        team = entries(open_dir / "team.yml", {"key": "team1", "cron": "@daily", "type": "t"},
                       {"key": "team2", "cron": "@daily", "type": "t"})
        assert ok(ctl_as(d, AS_NOBODY, "apply", str(team))).splitlines() == [
            "added team1", "added team2"]
        assert d.ctl_json("show", "team1")["creator"] == NOBODY
        entries(team, {"key": "team1", "cron": "@hourly", "type": "t"})
        # --prune: the member's own schedules that its files no longer hold go; root's
        # file's (nightly) stay, unmentioned.
        assert ok(ctl_as(d, AS_NOBODY, "apply", "--prune", str(team))).splitlines() == [
            "changed team1 (cron)", "removed team2"]
        assert {s["key"] for s in d.ctl_json("list")} == {"nightly", "team1"}
        # A file of the same name as root's may not change root's file's schedules.
        theirs = open_dir / "other"
        theirs.mkdir(mode=0o755)
        entries(theirs / "backup.yml", {"key": "nightly", "cron": "@hourly", "type": "t"})
        before = fingerprint(d)
        refused(ctl_as(d, AS_NOBODY, "apply", str(theirs / "backup.yml")),
                "refused nightly (the key belongs to file:backup.yml, made by root)")
        assert fingerprint(d) == before
        # Root's apply may (root writes the files).
        assert d.ctl("apply", str(theirs / "backup.yml")).stdout == "changed nightly (cron)\n"
    finally:
        d.kill()


# -- a route that runs as another user: root and its allow: list ---------------------------

AS_DAEMON_IN_GROUP = ["setpriv", "--reuid=daemon", "--regid=daemon", "--groups=nogroup"]
TRUE = ["/bin/true"]


@needs_root
@needs_dbus
def test_a_route_with_a_user_is_scheduled_by_root_and_its_allow_list(open_dir: Path,
                                                                      bus: Bus) -> None:
    d = Daemon(open_dir, {"control_group": "nogroup", "dbus": True,
                          "dbus_address": bus.address, "routes": [
                              {"type": "secret", "exec": TRUE, "user": "backup"},
                              {"type": "ops", "exec": TRUE, "user": "backup",
                               "allow": ["@nogroup"]},
                              {"type": "/^named-/", "exec": TRUE, "user": "backup",
                               "allow": ["nobody", "no-such-user", "@no-such-group"]},
                              {"type": "plain", "exec": TRUE}]})
    try:
        d.start()
        os.chmod(d.dir, 0o755)
        d.ctl("add", "root-secret", "secret", "@daily")  # root may
        ok(ctl_as(d, AS_NOBODY, "add", "plain1", "plain", "@daily"))
        before = fingerprint(d)

        only_root = ("k: type secret runs as user backup: only root may schedule it (its "
                     "route's allow:), not nobody")
        refused(ctl_as(d, AS_NOBODY, "add", "k", "secret", "@daily"), only_root)
        refused(ctl_as(d, AS_NOBODY, "run", "root-secret"), "root-secret: type secret runs "
                "as user backup: only root may schedule it")
        refused(ctl_as(d, AS_NOBODY, "modify", "root-secret", "--delay", "5"),
                "root-secret: type secret runs as user backup")
        refused(ctl_as(d, AS_NOBODY, "modify", "plain1", "--type", "secret"),
                "plain1: type secret runs as user backup")
        refused(ctl_as(d, AS_DAEMON_IN_GROUP, "add", "k", "named-x", "@daily"),
                "k: type named-x runs as user backup: only root and nobody, no-such-user, "
                "@no-such-group may schedule it (its route's allow:), not daemon")
        team = entries(open_dir / "team.yml", {"key": "k", "cron": "@daily", "type": "secret"})
        refused(ctl_as(d, AS_NOBODY, "apply", str(team)), "k: type secret runs as user backup")
        assert bus.call(AS_NOBODY, "add", "k", "secret", "@daily", "", {}) == (
            "org.perfectsched1.Error.PermissionDeniedError", only_root)
        name, message = bus.call(AS_NOBODY, "call", "add_many", json.dumps({"schedules": [
            {"key": "j", "type": "plain", "cron": "@daily"},
            {"key": "k", "type": "secret", "cron": "@daily"}]}))
        assert (name, message) == ("org.perfectsched1.Error.PermissionDeniedError",
                                   only_root)
        name, message = bus.call(AS_NOBODY, "modify", "plain1", {"type": ["s", "secret"]})
        assert name.endswith("PermissionDeniedError"), message
        name, message = bus.call(AS_NOBODY, "run", "root-secret")
        assert name.endswith("PermissionDeniedError"), message
        assert fingerprint(d) == before

        # allow: ["@nogroup"]: the group the caller's process holds, primary or not
        ok(ctl_as(d, AS_NOBODY, "add", "o1", "ops", "@daily"))
        ok(ctl_as(d, AS_DAEMON_IN_GROUP, "add", "o2", "ops", "@daily"))
        ok(ctl_as(d, AS_NOBODY, "modify", "plain1", "--type", "ops"))
        ok(ctl_as(d, AS_DAEMON_IN_GROUP, "run", "o1"))
        # allow: ["nobody", ...]: that user
        ok(ctl_as(d, AS_NOBODY, "add", "n1", "named-1", "@daily"))
        assert bus.call(AS_NOBODY, "add", "n2", "named-2", "@daily", "", {})[0] == "OK"
        # root: everything
        d.ctl("run", "root-secret")
        d.ctl("modify", "o2", "--type", "secret")
        keys = {s["key"] for s in d.ctl_json("list")}
        assert {"root-secret", "plain1", "o1", "o2", "n1", "n2"} <= keys
        assert not keys & {"k", "j"}
    finally:
        d.kill()


# -- the documents say what the code does ---------------------------------------------------

def test_force_is_documented_where_the_registry_takes_it() -> None:
    from test_docs import command_entries, tagged_flags

    from perfectschedd.control import registry

    forced = {c.name for c in registry.COMMANDS.values() if "force" in c.args}
    assert forced == {"modify", "pause", "resume", "delete"}
    repo = Path(__file__).resolve().parents[2]
    # each command's entry in perfectschedctl(1) has its --force entry (tests/test_docs.py)
    entries = command_entries((repo / "docs" / "man" / "perfectschedctl.1").read_text())
    for name in forced:
        assert "--force" in tagged_flags(entries[name][1]), name
    security = (repo / "docs" / "security.md").read_text()
    row = next(line for line in security.splitlines() if "with `--force`" in line)
    assert all(f"`{name}`" in row for name in forced) and "`run`" not in row
    assert "## Who can make what run as whom" in security
