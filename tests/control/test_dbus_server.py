"""D-Bus interface org.perfectsched1.Manager, on private dbus-daemons started by the tests.

dbus-next is the client.  One bus lets anyone connect (so the daemon's own caller check is
what refuses); another applies etc/dbus-1/org.perfectsched1.conf as a system bus would,
with its user and group renamed to ones that exist here.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import Daemon, foreign_python
from dbus_next import DBusError, Variant
from dbus_next.aio import MessageBus

import perfectschedd
from perfectschedd.control import protocol
from perfectschedd.control.dbus_server import BUS_NAME, INTERFACE, OBJECT_PATH

REPO = Path(__file__).resolve().parents[2]
POLICY = REPO / "etc" / "dbus-1" / "org.perfectsched1.conf"
ERR = "org.perfectsched1.Error."
T2030 = 1893456000

pytestmark = pytest.mark.skipif(shutil.which("dbus-daemon") is None,
                                reason="dbus-daemon is not installed")

DOCTYPE = ('<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-BUS Bus Configuration 1.0//EN"\n'
           ' "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">\n')
OPEN_POLICY = """
  <policy context="default">
    <allow user="*"/>
    <allow own="*"/>
    <allow send_destination="*"/>
    <allow receive_sender="*"/>
  </policy>"""
# What Debian's system.conf says, for the parts that matter here.
SYSTEM_POLICY = """
  <policy context="default">
    <allow user="*"/>
    <deny own="*"/>
    <deny send_type="method_call"/>
    <allow send_type="signal"/>
    <allow send_requested_reply="true" send_type="method_return"/>
    <allow send_requested_reply="true" send_type="error"/>
    <allow receive_type="method_call"/>
    <allow receive_type="method_return"/>
    <allow receive_type="error"/>
    <allow receive_type="signal"/>
    <allow send_destination="org.freedesktop.DBus" send_interface="org.freedesktop.DBus"/>
    <allow send_destination="org.freedesktop.DBus"
           send_interface="org.freedesktop.DBus.Introspectable"/>
  </policy>
  <include>policy.conf</include>"""

CLIENT = """
import asyncio, sys
from dbus_next import Message, MessageType
from dbus_next.aio import MessageBus

NAME, PATH, IFACE = sys.argv[2:5]


async def main():
    bus = await MessageBus(bus_address=sys.argv[1]).connect()
    reply = await bus.call(Message(destination=NAME, path=PATH, interface=IFACE,
                                   member="Status"))
    print(reply.error_name if reply.message_type == MessageType.ERROR else "OK")
    print(reply.body[0] if reply.body else "")

asyncio.run(main())
"""


class Bus:
    def __init__(self, directory: Path, policy: str) -> None:
        self.dir = directory
        sock = directory / "bus.sock"
        conf = directory / "bus.conf"
        conf.write_text(f"{DOCTYPE}<busconfig>\n  <listen>unix:path={sock}</listen>\n"
                        f"  <auth>EXTERNAL</auth>{policy}\n</busconfig>\n")
        self.proc = subprocess.Popen(["dbus-daemon", f"--config-file={conf}", "--nofork",
                                      "--nosyslog", "--print-address=1"],
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        self.address = self.proc.stdout.readline().strip()
        assert self.address.startswith("unix:"), self.address

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory other users can traverse (pytest's tmp_path is private to root)."""
    path = Path(tempfile.mkdtemp(prefix="psched-dbus-"))
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def open_bus(open_dir: Path) -> Iterator[Bus]:
    bus = Bus(open_dir, OPEN_POLICY)
    yield bus
    bus.stop()


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 30))


async def manager(address: str) -> tuple[MessageBus, Any]:
    bus = await MessageBus(bus_address=address).connect()
    intro = await bus.introspect(BUS_NAME, OBJECT_PATH)
    return bus, bus.get_proxy_object(BUS_NAME, OBJECT_PATH, intro).get_interface(INTERFACE)


async def refused(coro: Any, error: str, text: str) -> None:
    with pytest.raises(DBusError) as info:
        await coro
    assert info.value.type == ERR + error, (info.value.type, info.value.text)
    assert text in info.value.text and "\n" not in info.value.text


def test_every_operation_over_dbus(daemon_factory: Any, open_bus: Bus) -> None:
    d: Daemon = daemon_factory({"dbus": True, "dbus_address": open_bus.address}).start()

    async def scenario() -> None:
        bus, m = await manager(open_bus.address)
        changes: list[tuple[str, str]] = []
        m.on_schedule_changed(lambda key, change: changes.append((key, change)))

        assert await m.get_version() == perfectschedd.__version__
        added = json.loads(await m.call_add(
            "k1", "backup", "0 3 * * *", '{"a": 1}',
            {"timezone": Variant("s", "Asia/Tokyo"), "start": Variant("x", T2030),
             "delay": Variant("u", 30)}))
        assert (added["key"], added["timezone"], added["delay"], added["data"]) == (
            "k1", "Asia/Tokyo", 30, {"a": 1})
        assert added["next_time"] == T2030 + 18 * 3600
        assert json.loads(await m.call_list("")) == d.ctl_json("list")

        # refusals: a D-Bus error named after the socket's error type; nothing changes
        await refused(m.call_add("k1", "t", "@daily", "", {}), "AlreadyExistsError", "k1")
        await refused(m.call_add("k2", "t", "61 * * * *", "", {}), "InvalidInputError", "cron")
        await refused(m.call_add("k2", "t", "@daily", "[1]", {}), "InvalidInputError", "data")
        await refused(m.call_add("k2", "t", "@daily", "", {"color": Variant("s", "red")}),
                      "InvalidInputError", "color")
        await refused(m.call_show("nope"), "NotFoundError", "'nope' not found")
        await refused(m.call_modify("k1", {}), "InvalidInputError", "nothing to change")
        await refused(m.call_call("frobnicate", "{}"), "InvalidInputError", "frobnicate")
        await refused(m.call_call("list", "[oops"), "ProtocolError", "invalid JSON")
        await refused(m.call_history("k1", 5000), "InvalidInputError", "limit")
        assert [r["key"] for r in json.loads(await m.call_list(""))] == ["k1"]

        shown = json.loads(await m.call_show("k1"))
        assert shown["paused"] is False and shown["next_run_time"] == T2030 + 18 * 3600 + 30
        modified = json.loads(await m.call_modify("k1", {"delay": Variant("x", 5),
                                                         "data": Variant("s", '{"b": 2}')}))
        assert (modified["delay"], modified["data"]) == (5, {"b": 2})
        assert json.loads(await m.call_pause("k1"))["paused"] is True
        assert json.loads(await m.call_resume("k1"))["paused"] is False
        ran = json.loads(await m.call_run("k1"))
        assert ran["key"] == "k1" and ran["run_key"].startswith("k1@run-")
        assert json.loads(await m.call_show("k1"))["next_time"] == T2030 + 18 * 3600
        assert json.loads(await m.call_history("k1", 5)) == []
        status = json.loads(await m.call_status())
        assert status["state"] == "running" and len(status["workers"]) == 2
        assert json.loads(await m.call_call("show", '{"key": "k1"}'))["key"] == "k1"

        # a change through the socket is signalled too
        d.ctl("add", "by-socket", "t", "@hourly")
        assert json.loads(await m.call_delete("k1")) == {"key": "k1", "deleted": True,
                                                          "extra_runs": 1}  # run above
        assert json.loads(await m.call_reload())["reload"] == "done"
        for _ in range(100):
            if ("k1", "deleted") in changes:
                break
            await asyncio.sleep(0.05)
        assert changes == [("k1", "added"), ("k1", "modified"), ("k1", "paused"),
                           ("k1", "resumed"), ("k1", "run"), ("by-socket", "added"),
                           ("k1", "deleted")]
        bus.disconnect()

    run(scenario())
    d.wait_log("reloading")
    keys = [r["key"] for r in d.ctl_json("list")]
    assert d.alive() and [k for k in keys if "@run-" not in k] == ["by-socket"]


def test_dbus_is_optional(daemon_factory: Any, open_bus: Bus, tmp_path: Path) -> None:
    # The name is taken: the daemon logs why and runs on without D-Bus.
    first = daemon_factory({"dbus": True, "dbus_address": open_bus.address}).start()
    second = daemon_factory({"dbus": True, "dbus_address": open_bus.address}).start()
    # The master's lines go through its log writer thread: waited for, not read at once.
    second.wait_log("D-Bus interface not available")
    assert "owned by another process" in second.log()
    second.ctl("add", "x", "t", "@daily")
    # No bus at all: the same.
    third = daemon_factory({"dbus": True,
                            "dbus_address": f"unix:path={tmp_path}/no-bus.sock"}).start()
    third.wait_log("D-Bus interface not available")
    assert third.ctl_json("list") == []
    assert first.alive() and json.loads(run(_status(open_bus.address)))["state"] == "running"


async def _status(address: str) -> str:
    bus, m = await manager(address)
    try:
        return str(await m.call_status())
    finally:
        bus.disconnect()


def _packaged_policy() -> str:
    """The packaged policy, with its user (the owner) and group renamed to ones that exist."""
    return POLICY.read_text().replace('user="perfectsched"', 'user="root"') \
        .replace('group="perfectsched"', 'group="nogroup"')


def _bus_and_daemon(open_dir: Path) -> tuple[Bus, Daemon]:
    """A system-like bus reading open_dir/policy.conf, and a daemon (not started) on it
    whose control group is nogroup."""
    bus = Bus(open_dir, SYSTEM_POLICY)
    return bus, Daemon(open_dir, {"dbus": True, "dbus_address": bus.address,
                                  "control_group": "nogroup"})


def _client_as(user: list[str], address: str) -> list[str]:
    res = subprocess.run([*user, *foreign_python(), "-c", CLIENT, address, BUS_NAME,
                          OBJECT_PATH, INTERFACE], capture_output=True, text=True, timeout=60,
                         cwd="/")
    assert res.returncode == 0, res.stderr
    return res.stdout.splitlines()


needs_root = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                                reason="needs root and setpriv")
AS_NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
AS_DAEMON = ["setpriv", "--reuid=daemon", "--regid=daemon", "--clear-groups"]


@needs_root
def test_the_daemon_checks_its_callers(open_dir: Path, open_bus: Bus) -> None:
    # This bus lets anyone call; the daemon itself admits root, its user and its group.
    d = Daemon(open_dir, {"dbus": True, "dbus_address": open_bus.address,
                          "control_group": "nogroup"})
    try:
        d.start()
        assert _client_as(AS_NOBODY, open_bus.address)[0] == "OK"
        name, message = _client_as(AS_DAEMON, open_bus.address)
        assert name == ERR + "PermissionDenied"
        assert "daemon may not control perfectschedd" in message
        d.wait_log("D-Bus: refused daemon")
    finally:
        d.kill()


def test_policy_file_says_who_may_own_and_call() -> None:
    root = ET.parse(POLICY).getroot()
    rules = {(p.attrib.get("user") or p.attrib.get("group") and "@" + p.attrib["group"]
              or p.attrib.get("context")): [(r.tag, dict(r.attrib)) for r in p]
             for p in root.iter("policy")}
    assert ("allow", {"own": BUS_NAME}) in rules["perfectsched"]
    for who in ("perfectsched", "root", "@perfectsched"):
        assert ("allow", {"send_destination": BUS_NAME}) in rules[who]
        assert all(r[0] != "allow" or "own" not in r[1] for r in rules[who]
                   if who != "perfectsched")
    assert ("deny", {"send_destination": BUS_NAME}) in rules["default"]
    assert ("deny", {"own": BUS_NAME}) in rules["default"]


@needs_root
def test_policy_file_on_a_system_like_bus(open_dir: Path) -> None:
    (open_dir / "policy.conf").write_text(_packaged_policy())
    bus, d = _bus_and_daemon(open_dir)
    try:
        d.start()
        d.wait_log("D-Bus interface org.perfectsched1")  # root may own the name
        assert _client_as(AS_NOBODY, bus.address)[0] == "OK"  # the group may call
        name, message = _client_as(AS_DAEMON, bus.address)  # others are stopped by the bus
        assert name == "org.freedesktop.DBus.Error.AccessDenied", (name, message)
    finally:
        d.kill()
        bus.stop()


@needs_root
def test_the_name_is_owned_once_the_bus_reads_the_policy(open_dir: Path) -> None:
    """Right after `apt install`, the system bus has not read the package's policy yet:
    the daemon keeps trying, and owns the name once the bus reloads its configuration."""
    (open_dir / "policy.conf").write_text(f"{DOCTYPE}<busconfig/>\n")
    bus, d = _bus_and_daemon(open_dir)
    try:
        d.start()
        d.wait_log("D-Bus interface not available")
        assert "trying again with back-off" in d.log()
        (open_dir / "policy.conf").write_text(_packaged_policy())
        subprocess.run(["dbus-send", f"--bus={bus.address}", "--print-reply",
                        "--dest=org.freedesktop.DBus", "/org/freedesktop/DBus",
                        "org.freedesktop.DBus.ReloadConfig"], check=True, timeout=10,
                       capture_output=True)
        d.wait_log("D-Bus interface org.perfectsched1 on", timeout=40)
        assert _client_as(AS_NOBODY, bus.address)[0] == "OK"
        assert d.alive()
    finally:
        d.kill()
        bus.stop()


def test_hostile_requests_over_dbus(daemon_factory: Any, open_bus: Bus) -> None:
    """Issue #19: the depth limits hold on D-Bus too (Call had none), and List is a page."""
    d: Daemon = daemon_factory({"dbus": True, "dbus_address": open_bus.address}).start()
    d.ctl("add", "keep", "t", "@daily")
    deep = "[" * 100_000 + "]" * 100_000
    nested = json.dumps({"key": "k", "type": "t", "cron": "@daily",
                         "data": {"a": json.loads("[" * 70 + "]" * 70)}})

    async def scenario() -> None:
        bus, m = await manager(open_bus.address)
        await refused(m.call_call("add", '{"key":"k","type":"t","cron":"@daily","data":'
                                  + json.dumps(deep) + "}"), "InvalidInputError", "data")
        await refused(m.call_call("add", nested), "ProtocolError", "nested deeper")
        await refused(m.call_call("list", deep), "ProtocolError", "nested deeper")
        await refused(m.call_call("list", '{"limit": NaN}'), "ProtocolError", "NaN")
        await refused(m.call_add("k", "t", "@daily", deep, {}), "InvalidInputError", "data")
        await refused(m.call_add("k", "t", "@daily", "", {"at": Variant("t", 2 ** 63)}),
                      "InvalidInputError", "at")
        many = [{"key": f"m{i:04d}", "type": "t", "cron": "@daily"}
                for i in range(protocol.LIST_PAGE + 50)]
        await m.call_call("add_many", json.dumps({"schedules": many}))
        page = json.loads(await m.call_list(""))
        assert len(page) == protocol.LIST_PAGE
        rest = json.loads(await m.call_call("list", json.dumps({"after": page[-1]["key"]})))
        assert len(page) + len(rest) == protocol.LIST_PAGE + 51
        bus.disconnect()

    run(scenario())
    assert d.alive() and "Traceback" not in d.log()
    assert "k" not in {s["key"] for s in d.ctl_json("list")}


# Counts ScheduleChanged signals; prints the count once it has `expected` of them, or
# when the test closes its stdin (an outsider, who must get none, is asked then).
LISTENER = """
import asyncio, sys
from dbus_next.aio import MessageBus
from dbus_next import Message

async def main():
    bus = await MessageBus(bus_address=sys.argv[1]).connect()
    expected = int(sys.argv[2])
    got = []
    enough = asyncio.Event()

    def on_message(m):
        if m.member == "ScheduleChanged":
            got.append(m.body)
            if len(got) >= expected:
                enough.set()

    bus.add_message_handler(on_message)
    await bus.call(Message(destination="org.freedesktop.DBus", path="/org/freedesktop/DBus",
                           interface="org.freedesktop.DBus", member="AddMatch", signature="s",
                           body=["type='signal',interface='org.perfectsched1.Manager'"]))
    print("READY", flush=True)
    loop = asyncio.get_running_loop()
    stdin_closed = loop.run_in_executor(None, sys.stdin.read)
    await asyncio.wait([asyncio.ensure_future(enough.wait()), stdin_closed], timeout=60,
                       return_when=asyncio.FIRST_COMPLETED)
    print(len(got), flush=True)

asyncio.run(main())
"""


def _listen_as(user: list[str], address: str, expected: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen([*user, *foreign_python(), "-c", LISTENER, address, str(expected)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd="/")
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "READY", proc.stderr.read() if proc.stderr else ""
    return proc


@needs_root
def test_signals_reach_only_root_and_the_group(open_dir: Path) -> None:
    """With the packaged policy, ScheduleChanged (every key added, paused, deleted) is not
    broadcast to every local user."""
    (open_dir / "policy.conf").write_text(_packaged_policy())
    bus, d = _bus_and_daemon(open_dir)
    try:
        d.start()
        # The bus is joined after the socket answers: signals before that go nowhere.
        d.wait_log("D-Bus interface org.perfectsched1 on")
        member = _listen_as(AS_NOBODY, bus.address, 3)
        outsider = _listen_as(AS_DAEMON, bus.address, 1)
        for i in range(3):
            d.ctl("add", f"secret-{i}", "t", "@daily")
        assert member.communicate(timeout=70)[0].split()[-1] == "3"
        # The bus has routed all three to every match by the time the member has them.
        time.sleep(0.5)
        assert outsider.communicate("", timeout=30)[0].split()[-1] == "0"
    finally:
        d.kill()
        bus.stop()


@needs_root
def test_callers_are_judged_by_the_groups_their_process_holds(open_dir: Path,
                                                              open_bus: Bus) -> None:
    """The group database says user `daemon` is in group `daemon`; a process of that user
    that dropped the group is refused, and a process of `nobody` holding it is let in."""
    d = Daemon(open_dir, {"dbus": True, "dbus_address": open_bus.address,
                          "control_group": "daemon"})
    try:
        d.start()
        dropped = ["setpriv", "--reuid=daemon", "--regid=nogroup", "--clear-groups"]
        name, message = _client_as(dropped, open_bus.address)
        assert name == ERR + "PermissionDenied", (name, message)
        holding = ["setpriv", "--reuid=nobody", "--regid=daemon", "--clear-groups"]
        assert _client_as(holding, open_bus.address)[0] == "OK"
    finally:
        d.kill()


def test_a_recycled_pid_lends_no_groups() -> None:
    """The bus names the caller's PID; if another user's process has it by now, its
    groups are not the caller's."""
    from perfectschedd.control.dbus_server import process_groups

    me = os.getpid()
    assert os.getegid() in process_groups(me, os.geteuid())
    assert process_groups(me, 65534) == set()  # "nobody" asked, root's process found
    assert process_groups(2**22 + 7, os.geteuid()) == set()  # gone


def test_pause_and_resume_many_over_dbus(daemon_factory: Any, open_bus: Bus) -> None:
    """Call reaches pause/resume of several keys, a prefix and everything through the
    one registry: the same answers, refusals and signals as the socket's."""
    d: Daemon = daemon_factory({"dbus": True, "dbus_address": open_bus.address}).start()
    for key in ("a", "b", "app.x"):
        d.ctl("add", key, "t", "@daily")

    async def scenario() -> None:
        bus, m = await manager(open_bus.address)
        changes: list[tuple[str, str]] = []
        m.on_schedule_changed(lambda key, change: changes.append((key, change)))
        got = json.loads(await m.call_call("pause", '{"keys": ["a", "b"]}'))
        assert got == {"paused": ["a", "b"], "count": 2}
        await refused(m.call_call("resume", '{"keys": ["a", "nope"]}'), "NotFoundError",
                      "nope; nothing changed")
        await refused(m.call_call("pause", '{"prefix": "app.", "all": true}'),
                      "InvalidInputError", "not --prefix and --all")
        await refused(m.call_call("pause", "{}"), "InvalidInputError", "pause what?")
        assert json.loads(await m.call_call("pause", '{"all": true}'))["paused"] == 1
        status = json.loads(await m.call_status())
        assert status["paused_all"]["schedules"] == 1
        done = json.loads(await m.call_call("resume", '{"all": true}'))
        assert (done["resumed"], done["paused_on_their_own"]) == (1, 2)
        assert json.loads(await m.call_resume("a"))["paused"] is False  # Resume(key)
        want = [("a", "paused"), ("b", "paused"), ("*", "paused"), ("*", "resumed"),
                ("a", "resumed")]
        for _ in range(100):
            if len(changes) >= len(want):
                break
            await asyncio.sleep(0.05)
        assert changes == want
        bus.disconnect()

    run(scenario())
    paused = {s["key"]: s["paused"] for s in d.ctl_json("list")}
    assert paused == {"a": False, "b": True, "app.x": False} and d.alive()
