"""Upgrading a database from release 0.1.0 (SPEC "Upgrades"), on every backend.

Release 0.1.0 (tests/old_release.py: taken from git history) makes the database itself:
`init`, schedules of every kind through its own perfectschedctl, a schedules file, and
history written by its own daemon.  What its CLI shows is recorded; then this tree's
daemon starts on the same database, without `init`, and must keep every field of every
schedule and every history row, carry on exactly where 0.1.0 stopped, and leave a
database that 0.1.0's CLI still reads the same way.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import yaml
from ctl_batch import run_batch
from daemon_harness import CTL, Daemon, sh, wait_until
from dbservers import driver_url
from old_release import OldRelease

from perfectschedctl import cli
from perfectschedd.control import commands
from perfectschedd.schedules import collection, cron
from perfectschedd.store.version import SCHEMA_VERSION

TABLE = "perfectsched"
HISTORY_ALL = "1000"  # protocol.HISTORY_MAX: every row the database keeps

JOBS = '''\
import time

from perfectschedd import Application


class Work(Application):
    """Takes data["sleep"] seconds, then finishes."""

    def run(self):
        time.sleep(float(self.task.data.get("sleep", 0)))
'''

FILE_ENTRIES = [
    {"key": "file-report", "cron": "15 4 * * *", "type": "t", "timezone": "Europe/Paris",
     "delay": 30, "data": {"format": "pdf"}, "misfire": "latest", "grace": 900,
     "max_attempts": 2, "retry_wait": 60, "jitter": 10, "timeout": 120},
    {"key": "file-exec", "cron": "@hourly", "exec": "true", "user": "root"},
]

# Fields of a schedule that no run changes (a run moves its times, attempt and lease).
STATIC = ("key", "type", "cron", "delay", "timezone", "data", "misfire", "grace",
          "max_attempts", "retry_wait", "jitter", "timeout", "source", "paused",
          "paused_reason")

Snapshot = dict[str, Any]  # {"list": [...], "show": {key: ...}, "history": {key: [...]}}
Many = Callable[[list[list[str]]], list[Any]]  # argument vectors -> their JSON answers



def ctl_many(command: list[str], prefix: list[str], home: Path | None = None) -> Many:
    """`command` (`[..., python, "-m", "perfectschedctl"]`) with `prefix` and `--json`
    before each argument vector, all of them in one process (ctl_batch); each must exit 0.
    With `home`, the perfectschedctl imported must be the one in that directory."""
    assert command[-2:] == ["-m", "perfectschedctl"], command

    def many(argvs: list[list[str]]) -> list[Any]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PERFECTSCHED_")}
        batch = run_batch(command[:-2], [[*prefix, "--json", *a] for a in argvs], env=env,
                          cwd=home)
        if home is not None:
            assert Path(batch.file).resolve().is_relative_to(home.resolve()), batch.file
        answers = []
        for argv, res in zip(argvs, batch.results, strict=True):
            assert res.returncode == 0, (f"perfectschedctl {' '.join(argv)} -> "
                                         f"{res.returncode}\n{res.stdout}{res.stderr}")
            answers.append(json.loads(res.stdout))
        return answers
    return many


def snapshot(many: Many, histories_of: set[str] | None = None) -> Snapshot:
    """Everything a CLI shows: `list`, and `show` and `history` of each key listed (or
    of `histories_of` only)."""
    [listed] = many([["list"]])
    keys = [s["key"] for s in listed]
    hkeys = [k for k in keys if histories_of is None or k in histories_of]
    answers = many([*(["show", k] for k in keys),
                    *(["history", k, "-n", HISTORY_ALL] for k in hkeys)])
    shows, histories = answers[:len(keys)], answers[len(keys):]
    return {"list": listed, "show": dict(zip(keys, shows, strict=True)),
            "history": dict(zip(hkeys, histories, strict=True))}


@contextmanager
def direct_ctl(config: Path) -> Iterator[Many]:
    """This tree's `perfectschedctl --json -c CONFIG ...` without a process per call: its
    parser, its request and the commands it runs on the database, printed as JSON."""
    with collection.open(str(config)) as sc:
        def call(argvs: list[list[str]]) -> list[Any]:
            answers = []
            for args in argvs:
                cmd, req = cli.request_of(cli.build_parser().parse_args(["-c", str(config),
                                                                         *args]))
                answers.append(json.loads(json.dumps(commands.execute(sc, cmd, req))))
            return answers
        yield call


def projected(new: dict[str, Any], old: dict[str, Any]) -> dict[str, Any]:
    """`new` cut to the fields `old` has (fields a newer version adds may be extra);
    a field `old` has and `new` lacks shows as missing.  0.1.0 showed an unset
    max_attempts as 0 (retry until success); now it shows as unset (null: the config's
    default, 0 unless set), which means the same."""
    cut = {k: new.get(k, "<missing>") for k in old}
    if cut.get("max_attempts") is None and old.get("max_attempts") == 0:
        cut["max_attempts"] = 0
    return cut


def meta(url: str) -> dict[str, str] | None:
    """The rows of <table>_meta, or None when the table does not exist (schema 1)."""
    engine = sa.create_engine(driver_url(url))
    try:
        if not sa.inspect(engine).has_table(f"{TABLE}_meta"):
            return None
        with engine.connect() as conn:
            rows = conn.execute(sa.text(f"SELECT name, value FROM {TABLE}_meta")).all()
        return {str(name): str(value) for name, value in rows}
    finally:
        engine.dispose()


@pytest.mark.slow_on_servers
def test_new_daemon_keeps_and_runs_a_database_of_0_1_0(
        db_url: str, old_release: OldRelease, daemon_factory: Any, tmp_path: Path) -> None:
    old = old_release
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "upgradejobs.py").write_text(JOBS)
    sdir = tmp_path / "schedules.d"
    sdir.mkdir()
    (sdir / "jobs.yml").write_text(yaml.safe_dump(FILE_ENTRIES, sort_keys=False))
    py = {"type": "py", "python": "upgradejobs:Work"}
    fail = sh("fail", "echo planned failure; exit 3")
    # 0.1.0 routes py and fail; type t (most schedules) has no route there.
    d_old: Daemon = daemon_factory(
        {"node_name": "old-host", "schedules_dir": str(sdir), "routes": [py, fail]},
        url=db_url, extra_args=["-I", str(mods)],
        command=old.daemon_command, ctl_command=old.ctl_command)
    conf_old = str(d_old.config_path)

    # -- 0.1.0 makes the database and its schedules ------------------------------------
    assert "created table perfectsched" in old.ctl("-c", conf_old, "init").stdout
    now = int(time.time())
    direct: list[list[str]] = [
        ["add", "plain", "t", "*/5 * * * *"],
        ["add", "zoned", "t", "30 6 * * 1-5", "-t", "Asia/Tokyo", "-d", "45"],
        ["add", "policies", "t", "0 */2 * * *", "--misfire", "latest", "--grace", "600",
         "--max-attempts", "3", "--retry-wait", "30", "--jitter", "20", "--timeout", "90"],
        ["add", "paused", "t", "@daily", "-t", "America/New_York"],
    ]
    # perfectschedctl -c: on the database, no daemon (one process for the four).
    old_direct = ctl_many(old.ctl_command, ["-c", conf_old], home=old.path)
    old_direct(direct)
    d_old.start()
    start = now - 1800
    via_socket: list[list[str]] = [
        ["pause", "paused"],
        ["add", "once", "t", "@once", '{"why": "later"}', "--at", str(now + 86400)],
        ["add", "data", "t", "@weekly",
         '{"s": "caf\\u00e9 \\u2713", "n": [1, 2.5, null, true, false],'
         ' "o": {"deep": {"er": [{}, []]}}, "empty": ""}'],
        # 30 missed minutes (misfire all), 0.15 s each: still catching up at the upgrade
        # (0.1.0 runs some 5 of them before it stops; each the new daemon runs is time).
        ["add", "ticking", "py", "* * * * *", '{"sleep": 0.15}', "-s", str(start)],
        # misfire latest: the missed ones are recorded skipped, the latest runs.
        ["add", "latest", "py", "* * * * *", "-s", str(now - 600), "--misfire", "latest"],
        # fails each time; after 1 attempt each occurrence is recorded failed.
        ["add", "failing", "fail", "* * * * *", "-s", str(now - 180), "--max-attempts", "1"],
        # an extra run that no 0.1.0 host routes: it waits for a host that does.
        ["run", "plain"],
    ]
    for args in via_socket:
        d_old.ctl(*args)

    old_socket = ctl_many(old.ctl_command, ["--socket", d_old.socket_path], home=old.path)

    def first_runs() -> bool:
        ticking, latest, failing, listed = old_socket(
            [["history", k, "-n", HISTORY_ALL] for k in ("ticking", "latest", "failing")]
            + [["list"]])
        return len(ticking) >= 3 and any(r["outcome"] == "success" for r in latest) and \
            len(failing) >= 2 and {"file-report", "file-exec"} <= {s["key"] for s in listed}
    wait_until(first_runs, timeout=30, interval=0.2,
               what="0.1.0's first runs and its schedules file")
    assert d_old.stop() == 0, d_old.log()[-3000:]
    assert "Traceback" not in d_old.log(), d_old.log()[-3000:]

    # -- what 0.1.0 sees ------------------------------------------------------------------
    before = snapshot(old_direct)
    shown, runs = before["show"], before["history"]
    extra_runs = [k for k in shown if k.startswith("plain@run-")]
    assert set(shown) - set(extra_runs) == {
        "plain", "zoned", "policies", "paused", "once", "data", "ticking", "latest", "failing",
        "file-report", "file-exec"} and len(extra_runs) == 1, set(shown)
    # (It really is 0.1.0's database with all of that in it.)
    assert meta(db_url) is None, "0.1.0 made a meta table: not a schema-1 database"
    assert shown["paused"]["paused"] is True
    assert shown["policies"]["misfire"] == "latest" and shown["policies"]["jitter"] == 20
    assert shown["zoned"]["timezone"] == "Asia/Tokyo" and shown["zoned"]["delay"] == 45
    assert shown["once"]["next_run_time"] == now + 86400
    assert shown["data"]["data"]["o"] == {"deep": {"er": [{}, []]}}
    assert shown["file-report"]["source"] == "file:jobs.yml"
    assert shown["file-exec"]["type"] == "exec:file-exec"
    run_key = extra_runs[0]  # a row of its own, listed, until it has run
    assert [r["run_key"] for r in shown["plain"]["extra_runs"]] == [run_key]
    assert shown[run_key]["type"] == "t" and shown[run_key]["cron"] is None
    kept = set(shown) - {run_key}  # the extra run goes once it has run
    assert {r["outcome"] for r in runs["ticking"]} == {"success"}
    assert {"skipped", "success"} <= {r["outcome"] for r in runs["latest"]}
    assert {r["outcome"] for r in runs["failing"]} == {"failed"}
    backlog = shown["ticking"]["next_time"]
    assert backlog < time.time() - 60, "ticking caught up under 0.1.0: nothing in flight"

    # -- the new daemon on it, without init -----------------------------------------------
    t_upgrade = time.time()
    d_new: Daemon = daemon_factory(
        {"node_name": "new-host", "schedules_dir": str(sdir),
         # This version runs a python route under root only as its user: says.
         "routes": [{**py, "user": "root"}, fail, sh("t", "true")]},
        url=db_url, extra_args=["-I", str(mods)]).start()

    new_socket = ctl_many(CTL, ["--socket", d_new.socket_path])

    def caught_up() -> bool:
        s, plain = new_socket([["show", "ticking"], ["history", "plain"]])
        return s["next_time"] > time.time() - 60 and s["owner"] is None and \
            any(r["key"] == run_key for r in plain)
    wait_until(caught_up, timeout=40, interval=0.5,
               what="the backlog of ticking and the extra run of plain, on the new daemon")
    # 0.1.0's CLI reads the database while the new daemon works on it.
    assert {s["key"] for s in old.ctl_json("-c", conf_old, "list")} == kept
    after = snapshot(new_socket)

    # Every schedule is kept, every field of it (extra fields may be new).
    assert set(after["show"]) == kept, set(after["show"]) ^ kept
    listed_after = {s["key"]: s for s in after["list"]}
    for key in sorted(kept):
        was = shown[key]
        now_runs = after["history"][key]
        assert len(now_runs) >= len(runs[key]), (key, now_runs, runs[key])
        new_runs = now_runs[:len(now_runs) - len(runs[key])]
        # History: 0.1.0's rows, unchanged and in order, after (below) the new ones.
        assert [projected(r, o) for r, o in zip(now_runs[len(new_runs):], runs[key],
                                                strict=True)] == runs[key], key
        assert all(r["worker"].startswith("new-host:") and r["started_at"] >= t_upgrade - 1
                   for r in new_runs), (key, new_runs)
        is_ = after["show"][key]
        # It ran since (its times moved on; its history row may still wait in the
        # worker's batch, written every HISTORY_FLUSH): compare what a run leaves alone.
        if new_runs or is_["owner"] is not None or is_["next_time"] > was["next_time"]:
            static = {f: was[f] for f in STATIC}
            assert projected(is_, static) == static, key
            assert is_["next_time"] >= was["next_time"], key
        else:
            was = {**was, "extra_runs": is_["extra_runs"]} if key == "plain" else was
            assert projected(is_, was) == was, key
        listed = next(s for s in before["list"] if s["key"] == key)
        if not new_runs and is_["owner"] is None:
            assert projected(listed_after[key], listed) == listed, key

    # The next occurrences ran: the extra run 0.1.0 queued, and ticking's backlog, from
    # exactly where 0.1.0 stopped (no gap, no second run of an occurrence).
    extra = [r for r in after["history"]["plain"] if r["key"] == run_key]
    assert [r["outcome"] for r in extra] == ["success"], extra
    assert after["show"]["plain"]["extra_runs"] == []
    ticks = sorted(r["scheduled_time"] for r in after["history"]["ticking"])
    first = cron.first_at_or_after("* * * * *", "UTC", start)
    assert ticks == list(range(first, ticks[-1] + 1, 60)), ticks
    assert ticks[-1] >= int(time.time()) - 120 and backlog in ticks
    assert {r["outcome"] for r in after["history"]["ticking"]} == {"success"}
    tick_new = [r for r in after["history"]["ticking"] if r["worker"].startswith("new-host:")]
    assert min(r["scheduled_time"] for r in tick_new) == backlog
    assert "Traceback" not in d_new.log(), d_new.log()[-3000:]
    assert d_new.stop() == 0, d_new.log()[-3000:]

    # -- expand-only: 0.1.0's CLI reads all of it as the new one does --------------------
    with direct_ctl(d_new.config_path) as new_ctl_json:
        new_view = snapshot(new_ctl_json)
    old_view = snapshot(old_direct, histories_of={
        k for k, runs in new_view["history"].items() if runs})
    assert {s["key"] for s in old_view["list"]} == set(new_view["show"]) >= kept
    new_listed = {s["key"]: s for s in new_view["list"]}
    for was in old_view["list"]:
        assert projected(new_listed[was["key"]], was) == was, was["key"]
    for key, was in old_view["show"].items():
        assert projected(new_view["show"][key], was) == was, key
    assert set(old_view["history"]) >= {"ticking", "latest", "failing", "plain"}
    for key, was_runs in old_view["history"].items():
        assert [projected(n, o) for n, o in zip(new_view["history"][key], was_runs,
                                                strict=True)] == was_runs, key

    # The new daemon recorded the schema it brought the database to (versioned schema).
    rows = meta(db_url)
    assert rows is not None and rows.get("schema_version") == str(SCHEMA_VERSION), rows


@pytest.mark.slow_on_servers
def test_new_daemon_keeps_and_runs_a_database_of_0_2_0(
        db_url: str, release_0_2_0: OldRelease, daemon_factory: Any, tmp_path: Path) -> None:
    """0.2.0's own schema and what only 0.2.0 stores (concurrency policies, @every, a
    paused schedule with its reason, a forced delete of a file's entry, creators) are
    kept by this release's daemon, which carries on where 0.2.0 stopped."""
    old = release_0_2_0
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "upgradejobs.py").write_text(JOBS)
    sdir = tmp_path / "schedules.d"
    sdir.mkdir()
    (sdir / "jobs.yml").write_text(yaml.safe_dump(FILE_ENTRIES, sort_keys=False))
    py = {"type": "py", "python": "upgradejobs:Work"}
    fail = sh("fail", "echo planned failure; exit 3")
    d_old: Daemon = daemon_factory(
        {"node_name": "old-host", "schedules_dir": str(sdir), "routes": [py, fail]},
        url=db_url, extra_args=["-I", str(mods)],
        command=old.daemon_command, ctl_command=old.ctl_command)
    old.ctl("-c", str(d_old.config_path), "init")
    d_old.start()
    now = int(time.time())
    for args in (
            ["add", "plain", "t", "*/5 * * * *", '{"n": [1, 2.5, null]}'],
            ["add", "every", "t", "@every 7s", "-s", str(now + 3600)],
            ["add", "allowing", "t", "0 3 * * *", "--concurrency", "allow"],
            ["add", "held", "t", "@daily", "-t", "America/New_York"],
            ["pause", "held"],
            ["add", "ticking", "py", "* * * * *", '{"sleep": 0.1}', "-s", str(now - 600)],
            ["add", "failing", "fail", "* * * * *", "-s", str(now - 180),
             "--max-attempts", "1"],
            ["delete", "--force", "file-report"],
            ["run", "plain"]):
        d_old.ctl(*args)
    old_socket = ctl_many(old.ctl_command, ["--socket", d_old.socket_path], home=old.path)

    def first_runs() -> bool:
        ticking, failing = old_socket([["history", k, "-n", HISTORY_ALL]
                                       for k in ("ticking", "failing")])
        return len(ticking) >= 3 and len(failing) >= 2
    wait_until(first_runs, timeout=30, interval=0.2, what="0.2.0's first runs")
    assert d_old.stop() == 0, d_old.log()[-3000:]
    assert "Traceback" not in d_old.log(), d_old.log()[-3000:]
    before = snapshot(ctl_many(old.ctl_command, ["-c", str(d_old.config_path)],
                               home=old.path))
    shown, runs = before["show"], before["history"]
    run_key = next(k for k in shown if k.startswith("plain@run-"))
    kept = set(shown) - {run_key}
    assert kept == {"plain", "every", "allowing", "held", "ticking", "failing",
                    "file-exec"}, kept
    assert shown["held"]["paused"] is True and shown["allowing"]["concurrency"] == "allow"

    d_new: Daemon = daemon_factory(
        {"node_name": "new-host", "schedules_dir": str(sdir),
         "routes": [{**py, "user": "root"}, fail, sh("t", "true")]},
        url=db_url, extra_args=["-I", str(mods)]).start()
    new_socket = ctl_many(CTL, ["--socket", d_new.socket_path])

    def caught_up() -> bool:
        s, plain = new_socket([["show", "ticking"], ["history", "plain"]])
        return s["next_time"] > time.time() - 60 and s["owner"] is None and \
            any(r["key"] == run_key for r in plain)
    wait_until(caught_up, timeout=40, interval=0.5,
               what="ticking's backlog and plain's extra run, on the new daemon")
    after = snapshot(new_socket)
    assert d_new.stop() == 0, d_new.log()[-3000:]
    assert "Traceback" not in d_new.log(), d_new.log()[-3000:]

    # Every schedule kept with every field no run changes; the forced delete of the
    # file's entry still holds (the reload of the same file does not bring it back).
    assert set(after["show"]) == kept, set(after["show"]) ^ kept
    for key in sorted(kept):
        static = {f: shown[key][f] for f in (*STATIC, "concurrency", "creator")}
        assert projected(after["show"][key], static) == static, key
        now_runs = after["history"][key]
        assert now_runs[len(now_runs) - len(runs[key]):] == [
            {**n, **o} for n, o in zip(now_runs[len(now_runs) - len(runs[key]):], runs[key],
                                       strict=True)], key
    assert [r["outcome"] for r in after["history"]["plain"] if r["key"] == run_key] == \
        ["success"]
    rows = meta(db_url)
    assert rows is not None and rows.get("schema_version") == str(SCHEMA_VERSION), rows

    # A host of 0.2.0 keeps working on the database this release brought to schema 4
    # (rolling upgrades: expand-only, the tokens table is one 0.2.0 never reads), beside
    # a token root made: it starts, lists what it listed, and runs on.
    d_new.start()
    d_new.ctl("token", "add", "ci-read", "--role", "viewer")
    assert [t["name"] for t in d_new.ctl_json("token", "list")] == ["ci-read"]
    assert d_new.stop() == 0, d_new.log()[-3000:]
    engine = sa.create_engine(driver_url(db_url))
    try:
        assert sa.inspect(engine).has_table(f"{TABLE}_tokens")
    finally:
        engine.dispose()
    d_old.start()
    [listed, ticked] = old_socket([["list"], ["history", "ticking", "-n", HISTORY_ALL]])
    assert {s["key"] for s in listed if "@run-" not in s["key"]} == kept
    old_socket([["run", "ticking"]])
    wait_until(lambda: len(old_socket([["history", "ticking", "-n", HISTORY_ALL]])[0])
               > len(ticked), timeout=30, interval=0.3, what="0.2.0 runs on schema 4")
    assert d_old.stop() == 0, d_old.log()[-3000:]
    assert "Traceback" not in d_old.log(), d_old.log()[-3000:]
