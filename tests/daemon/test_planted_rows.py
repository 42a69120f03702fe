"""A stored row is trusted no more than its writer (SPEC "Privilege model"; issue 38's
High): a row whose type names a schedules file's exec entry (exec:K) runs K's command
only if it is entry K's own row, whatever version wrote it.

Release 0.1.0 (tests/old_release.py) let any client store such rows: `add` with any
exec:K type, `apply` of any key with any file:NAME source.  Its own client plants them
here; this tree's daemon then starts on that database and must pause them with the
reason, name them in `status` and the log, never run them, and still run the entry.
A row a database peer writes while the daemon runs is refused by the worker itself.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import yaml
from daemon_harness import Daemon, lines, wait_until
from dbservers import driver_url
from old_release import OldRelease

# Daemon-level: the PostgreSQL and MariaDB runs are make check's (test-slow).
pytestmark = pytest.mark.slow_on_servers

TABLE = "perfectsched"
REASON = "refused by perfectschedd: "


def entries_file(sdir: Path, out: Path) -> None:
    """root.yml: rootjob and rootjob2, each appending its key and stdin (its data) to
    `out`: what ran, with which data, is the side effect the tests read."""
    command = f'printf "%s %s\\n" "$PERFECTSCHED_KEY" "$(cat)" >> {out}'
    (sdir / "root.yml").write_text(yaml.safe_dump([
        {"key": "rootjob", "cron": "@every 1s", "exec": command, "user": "root",
         "data": {"own": 1}},
        {"key": "rootjob2", "cron": "@every 1s", "exec": command, "user": "root",
         "data": {"own": 2}},
    ], sort_keys=False))


def old_request(old: OldRelease, config: str, command: str, args: dict[str, Any]) -> None:
    """A request as 0.1.0's socket would have served it for any member of the group: its
    own command code (control's dispatch) on its own library, on the database."""
    script = ("import json, sys\n"
              "from perfectschedd import commands, schedules\n"
              "with schedules.open(sys.argv[1]) as sc:\n"
              "    commands.execute(sc, sys.argv[2], json.loads(sys.argv[3]))\n")
    res = subprocess.run([*old.env_prefix(), "-c", script, config, command,
                          json.dumps(args)], capture_output=True, text=True, timeout=60,
                         cwd=str(old.path))
    assert res.returncode == 0, res.stdout + res.stderr


def plant(d: Daemon, key: str, due: int) -> None:
    """A row written as a database peer writes it, with the database's password: no
    daemon check on the way in."""
    engine = sa.create_engine(driver_url(d.config["url"]))
    try:
        with engine.begin() as conn:
            conn.execute(sa.text(
                f"INSERT INTO {TABLE} (\"key\", type, cron, delay, timezone, data, next_time, "
                "next_run_time, paused, fence, attempt, creator) VALUES (:key, "
                "'exec:rootjob', '* * * * *', 0, 'UTC', '{\"planted\":\"peer\"}', :due, "
                ":due, 0, 0, 0, 4242)"), {"key": key, "due": due})
    finally:
        engine.dispose()


def refused_rows(d: Daemon) -> dict[str, dict[str, Any]]:
    return {r["key"]: r for r in d.status().get("refused_rows") or []}


def test_rows_planted_under_0_1_0_never_run(db_url: str, old_release: OldRelease,
                                            daemon_factory: Any, tmp_path: Path) -> None:
    old = old_release
    out = tmp_path / "ran.txt"
    sdir = tmp_path / "schedules.d"
    sdir.mkdir()
    entries_file(sdir, out)
    d: Daemon = daemon_factory({"node_name": "new-host", "schedules_dir": str(sdir)},
                               url=db_url)
    conf = str(d.config_path)

    # -- 0.1.0's client plants them ------------------------------------------------------
    old.ctl("-c", conf, "init")
    now = int(time.time())
    # A member's own key with root's entry's type, due at once.
    old.ctl("-c", conf, "add", "alice-planted", "exec:rootjob", "* * * * *",
            '{"planted": "by alice under 0.1.0"}', "-s", str(now - 120))
    planted = {"cron": "* * * * *", "data": {"planted": "by alice under 0.1.0"}}
    old_request(old, conf, "apply", {"entries": [
        # The entry's own key, squatted from another file name.
        {"key": "rootjob2", "type": "exec:rootjob2", "source": "file:evil.yml", **planted},
        # The entry's own key and file: its fields are the file's again once applied.
        {"key": "rootjob", "type": "exec:rootjob", "source": "file:root.yml", **planted},
    ]})
    shown = {s["key"]: s for s in old.ctl_json("-c", conf, "list")}
    assert shown["alice-planted"]["type"] == "exec:rootjob"
    assert shown["rootjob2"]["source"] == "file:evil.yml"
    assert shown["rootjob"]["data"] == planted["data"]

    # -- this tree's daemon on that database ---------------------------------------------
    d.start()
    wait_until(lambda: sum(line.startswith("rootjob ") for line in lines(out)) >= 2,
               timeout=20, what="rootjob's own runs")
    ran = lines(out)
    assert not [line for line in ran if "planted" in line or
                not line.startswith("rootjob ")], ran
    assert all(json.loads(line.split(" ", 1)[1]) == {"own": 1} for line in ran), ran

    refused = wait_until(lambda: (r := refused_rows(d)) and {"alice-planted", "rootjob2"}
                         <= set(r) and r, timeout=20, what="status naming the rows")
    assert set(refused) == {"alice-planted", "rootjob2"}, refused
    assert refused["alice-planted"]["type"] == "exec:rootjob"
    for key in refused:
        row = d.ctl_json("show", key)
        assert row["paused"] is True and row["paused_reason"].startswith(REASON), row
        # Paused before it came due, or refused by the worker that claimed it.
        assert {r["outcome"] for r in d.ctl_json("history", key)} <= {"refused"}, key
    assert "not that entry's row" in refused["alice-planted"]["reason"]
    assert "file:evil.yml" in refused["rootjob2"]["reason"]
    text = d.ctl("status").stdout
    assert "refused schedule, paused, never runs: 'alice-planted'" in text, text
    log = d.log()
    for key, kind in (("alice-planted", "exec:rootjob"), ("rootjob2", "exec:rootjob2")):
        said = [line for line in log.splitlines()
                if f"schedule {key!r} refused and paused: type {kind}, creator unknown"
                in line]
        assert len(said) == 1 and " WARNING " in said[0], (key, log[-3000:])
        if key == "alice-planted":  # the schema upgrade pauses it before any worker runs
            assert "upgrade: schedule" in said[0], said
    # Nothing of them ran meanwhile either, and the entry's own row goes on.
    wait_until(lambda: sum(line.startswith("rootjob ") for line in lines(out)) > len(ran),
               timeout=10, what="rootjob running on")
    assert not [line for line in lines(out) if "planted" in line]
    assert "Traceback" not in log, log[-3000:]


def test_a_row_a_database_peer_plants_is_refused_by_the_worker(
        daemon_factory: Any, tmp_path: Path) -> None:
    out = tmp_path / "ran.txt"
    sdir = tmp_path / "schedules.d"
    sdir.mkdir()
    entries_file(sdir, out)
    d: Daemon = daemon_factory({"schedules_dir": str(sdir)}).start()
    wait_until(lambda: any(line.startswith("rootjob ") for line in lines(out)),
               timeout=15, what="rootjob's first run")

    now = int(time.time())
    plant(d, "mallory", now)
    runs = wait_until(lambda: d.ctl_json("history", "mallory"), timeout=15,
                      what="the worker's refusal in history")
    assert [r["outcome"] for r in runs] == ["refused"], runs
    assert "not that entry's row" in runs[0]["error"], runs
    row = d.ctl_json("show", "mallory")
    assert row["paused"] is True and row["paused_reason"].startswith(REASON), row
    d.wait_log("schedule 'mallory' refused and paused: type exec:rootjob, creator uid 4242")
    assert "mallory" in refused_rows(d)
    assert not [line for line in lines(out) if "mallory" in line or "planted" in line]
    # The entry's own extra runs (rootjob@run-...) still run its command.
    run_key = d.ctl_json("run", "rootjob")["run_key"]
    wait_until(lambda: any(line.startswith(f"{run_key} ") for line in lines(out)),
               timeout=15, what="rootjob's extra run")

    # One not due yet is refused by the next reload's convergence, before any claim.
    plant(d, "mallory-later", now + 3600)
    d.ctl("reload")
    d.wait_log("schedules files: schedule 'mallory-later' refused and paused")
    row = d.ctl_json("show", "mallory-later")
    assert row["paused"] is True and row["paused_reason"].startswith(REASON), row
    assert d.log().count("schedule 'mallory' refused") == 1  # reported once
    assert "Traceback" not in d.log(), d.log()[-3000:]
