"""Table-driven fuzz of every command's arguments (issue #19), with a fixed seed: through
the control socket (10,000 requests), D-Bus (2,000) and direct mode (10,000 through the
function `perfectschedctl -c` calls, plus real `-c` command lines).  Zero InternalError
answers, zero tracebacks in the daemon's log, zero rows changed by a refused request."""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import shutil
import socket
import sqlite3
import subprocess
from pathlib import Path
from typing import Any

import pytest
from ctl_batch import run_batch
from daemon_harness import CTL, Daemon

import perfectschedd
from perfectschedd.control import commands, protocol, registry
from perfectschedd.errors import ScheduleError

SEED = 19
UNROUTED = "zz-never-routed"  # the daemon's only route: no worker touches what we store

DEEP_TEXT = "[" * 5000 + "]" * 5000
DEEP_DICT = json.loads('{"a":' * 70 + "1" + "}" * 70)
KEYS: list[Any] = ["k1", "k2", "k3", "k1@run-1-x", "-rf", "a\u2028b", "\ud800", "x" * 300,
                   "", " ", "k\x00", "bidi\u202e", "über", 7, None, [], {"a": 1}, True]
TYPES: list[Any] = ["t", "backup", "", "y" * 300, "tab\t", 0, None, ["t"]]
CRONS: list[Any] = ["@daily", "* * * * *", "0 3 * * MON", "61 * * * *", "R * * * *",
                    "H H * * *", "0 0 30 2 *", "", "@reboot", "* * * *", "0 0 1 1 * *",
                    "*/0 * * * *", "0 0 L * *", "0 0 1W * *", "0 0 * * 5#3", "c" * 300, 3,
                    None, ["@daily"]]
ZONES: list[Any] = ["UTC", "Asia/Tokyo", "Asia", "../../etc/passwd", "Nope/Zone", "",
                    "posixrules", "UTC\x00", 5, None]
NUMBERS: list[Any] = [0, 1, -1, 59, 86400, 2 ** 31, 2 ** 53, 2 ** 63, 2 ** 70, -2 ** 63, 1.5,
                      1e308, -0.0, True, False, "10", None, [], {}]
DATAS: list[Any] = [{}, {"a": 1}, "{}", '{"a": [1, 2]}', "[]", '{"a":', DEEP_TEXT, DEEP_DICT,
                    "x" * 70_000, {"big": "x" * 70_000}, '{"a": NaN}', '{"s": "\\ud800"}',
                    {"s": "\ud800"}, 5, None, [1], "null"]
FIELDS = ["key", "type", "cron", "delay", "timezone", "start", "at", "data", "prefix",
          "limit", "verbose", "after", "schedules", "bogus", "", "cmd"]
COMMAND_NAMES = [*registry.COMMANDS, "frobnicate", "", "LIST", "init "]


def _value(rng: random.Random, field: str) -> Any:
    pools = {"key": KEYS, "type": TYPES, "cron": CRONS, "timezone": ZONES, "data": DATAS,
             "prefix": KEYS, "after": KEYS}
    if field == "schedules":
        n = rng.choice([0, 1, 2, 5])
        return rng.choice([[_schedule(rng) for _ in range(n)], "x", None, [1, 2], {"a": 1}])
    pool = pools.get(field)
    if pool is None or rng.random() < 0.1:
        pool = NUMBERS if field not in pools else [*NUMBERS, *KEYS[:3]]
    return rng.choice(pool)


def _schedule(rng: random.Random) -> dict[str, Any]:
    item = {"key": rng.choice(KEYS), "type": rng.choice(TYPES), "cron": rng.choice(CRONS)}
    for field in rng.sample(["delay", "timezone", "start", "at", "data", "bogus"], 2):
        item[field] = _value(rng, field)
    return item


def case(rng: random.Random) -> tuple[str, dict[str, Any]]:
    cmd = rng.choice(COMMAND_NAMES)
    known = sorted(registry.COMMANDS[cmd].args) if cmd in registry.COMMANDS else []
    if known and rng.random() < 0.8:
        names = rng.sample(known, rng.randint(1, len(known)))
    else:
        names = rng.sample(FIELDS, rng.randint(0, 3))
    return cmd, {n: _value(rng, n) for n in names}


def cases(n: int, seed: int) -> list[tuple[str, dict[str, Any]]]:
    rng = random.Random(seed)
    out = [case(rng) for _ in range(n)]
    return [(c, a) for c, a in out if c not in ("init", "reload")]  # daemon-wide actions


def fingerprint(db: str) -> str:
    """Everything stored, as one digest."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
        h = hashlib.sha256()
        for table in ("perfectsched", "perfectsched_history"):
            for row in con.execute(f"SELECT * FROM {table} ORDER BY 1"):  # noqa: S608
                h.update(repr(row).encode())
    return h.hexdigest()


def encode(cmd: str, args: dict[str, Any]) -> bytes:
    # ensure_ascii (the default) carries lone surrogates as \ud800 escapes, as a client
    # in another language could send them.
    return json.dumps({"cmd": cmd, "args": args}).encode() + b"\n"


class Tally:
    def __init__(self) -> None:
        self.ok = 0
        self.refused: dict[str, int] = {}
        self.internal: list[str] = []
        self.changed: list[str] = []

    def refusal(self, type_: str, what: str) -> None:
        self.refused[type_] = self.refused.get(type_, 0) + 1
        if type_ == "InternalError":
            self.internal.append(what)

    def check(self, label: str) -> None:
        print(f"{label}: {self.ok} accepted, refused {self.refused}")
        assert not self.internal, f"{len(self.internal)} InternalError: {self.internal[:5]}"
        assert not self.changed, f"refused requests changed rows: {self.changed[:5]}"
        total = self.ok + sum(self.refused.values())
        # Both kinds were tried: some requests were good, most were not.
        assert self.ok >= total // 100 and sum(self.refused.values()) >= total // 2


def _daemon(daemon_factory: Any, **overrides: Any) -> Daemon:
    return daemon_factory({"routes": [{"type": UNROUTED, "exec": ["true"], "user": "root"}],
                           "history_limit": 0, **overrides}).start()


def test_fuzz_the_control_socket(daemon_factory: Any) -> None:
    d = _daemon(daemon_factory)
    db = d.config["url"].removeprefix("sqlite:///")
    tally = Tally()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect(d.socket_path)
    reader = sock.makefile("rb")
    before = fingerprint(db)
    for i, (cmd, args) in enumerate(cases(10_000, SEED)):
        sock.sendall(encode(cmd, args))
        line = reader.readline()
        assert line, f"connection closed at case {i}: {cmd} {args!r:.200}"
        answer = json.loads(line)
        if answer["ok"]:
            tally.ok += 1
            before = fingerprint(db)
            continue
        tally.refusal(answer["error"]["type"], f"{cmd} {args!r:.200}: {answer['error']}")
        after = fingerprint(db)
        if after != before:
            tally.changed.append(f"{cmd} {args!r:.200}")
            before = after
    sock.close()
    tally.check("socket")
    assert "Traceback" not in d.log() and d.alive()


@pytest.mark.skipif(shutil.which("dbus-daemon") is None, reason="dbus-daemon is not installed")
def test_fuzz_dbus(daemon_factory: Any, tmp_path: Path) -> None:
    from dbus_next import DBusError
    from test_dbus_server import OPEN_POLICY, Bus, manager

    bus = Bus(tmp_path, OPEN_POLICY)
    try:
        d = _daemon(daemon_factory, dbus=True, dbus_address=bus.address)
        db = d.config["url"].removeprefix("sqlite:///")
        tally = Tally()

        async def scenario() -> None:
            conn, m = await manager(bus.address)
            before = fingerprint(db)
            for cmd, args in cases(2_000, SEED + 1):
                text = json.dumps(args)
                try:
                    await m.call_call(cmd, text)
                except DBusError as exc:
                    tally.refusal(exc.type.rsplit(".", 1)[-1], f"{cmd} {text:.200}: {exc.text}")
                    after = fingerprint(db)
                    if after != before:
                        tally.changed.append(f"{cmd} {text:.200}")
                        before = after
                    continue
                tally.ok += 1
                before = fingerprint(db)
            conn.disconnect()

        asyncio.run(asyncio.wait_for(scenario(), 600))
        tally.check("D-Bus")
        assert "Traceback" not in d.log() and d.alive()
    finally:
        bus.stop()


def test_fuzz_direct_mode(tmp_path: Path) -> None:
    """What `perfectschedctl -c` runs: commands.execute on the database itself."""
    db = str(tmp_path / "direct.db")
    tally = Tally()
    with perfectschedd.open({"type": "rdb_compat", "url": f"sqlite:///{db}"}) as sc:
        sc.init()
        before = fingerprint(db)
        for cmd, args in cases(10_000, SEED + 2):
            try:
                commands.execute(sc, cmd, args)
            except ScheduleError as exc:
                tally.refusal(protocol.error_type(exc), f"{cmd} {args!r:.200}: {exc}")
                after = fingerprint(db)
                if after != before:
                    tally.changed.append(f"{cmd} {args!r:.200}")
                    before = after
                continue
            except Exception as exc:  # noqa: BLE001 - the finding: anything else is internal
                tally.refusal("InternalError", f"{cmd} {args!r:.200}: {type(exc).__name__} {exc}")
                continue
            tally.ok += 1
            before = fingerprint(db)
    tally.check("direct")


def test_fuzz_direct_mode_command_lines(tmp_path: Path) -> None:
    """Real `perfectschedctl -c` command lines with odd argument vectors: one line on
    stderr, exit 0, 1 (refused) or 2 (usage), never a traceback.  All of them run in one
    process (tests/ctl_batch.py), and a few of them each in a process of its own as well."""
    config = tmp_path / "c.yml"
    config.write_text(json.dumps({"type": "rdb_compat", "url": f"sqlite:///{tmp_path}/c.db"}))
    subprocess.run([*CTL, "-c", str(config), "init"], check=True, capture_output=True)
    rng = random.Random(SEED + 3)
    words = ["add", "modify", "list", "show", "delete", "run", "history", "pause", "-n",
             "--data", "-s", "-a", "-d", "-t", "--cron", "--prefix", "k", "-k", "--", "t",
             "@daily", "61 * * * *", "{}", "[", "Asia", "1e400", "-1", "99999999999999999999",
             "9" * 400, "\u2028", "x" * 300]
    argvs = [[rng.choice(words[:9]), *rng.sample(words, rng.randint(0, 5))]
             for _ in range(60)]

    def check(argv: list[str], res: Any) -> None:
        assert res.returncode in (0, 1, 2), (argv, res)
        assert "Traceback" not in res.stderr, (argv, res.stderr)
        if res.returncode == 1:
            assert len(res.stderr.strip().splitlines()) == 1, (argv, res.stderr)

    results = run_batch(CTL[:-2], [["-c", str(config), *a] for a in argvs]).results
    assert len(results) == len(argvs)
    for argv, res in zip(argvs, results, strict=True):
        check(argv, res)
    # The batch saw every kind of ending, so it did run the programme each time.
    assert {r.returncode for r in results} == {0, 1, 2}, results
    # The same checks on processes of their own: 6 vectors, one of each ending and the rest
    # spread over the list.
    firsts = {r.returncode: i for i, r in reversed(list(enumerate(results)))}
    for i in sorted({*firsts.values(), *range(0, len(argvs), 20)}):
        res = subprocess.run([*CTL, "-c", str(config), *argvs[i]], capture_output=True,
                             text=True, timeout=60)
        check(argvs[i], res)
