"""perfectschedctl import-legacy (issue #16): a table made with the Ruby gem's own DDL on
SQLite, MariaDB and PostgreSQL, with rows the gem would have read (data without a type,
data that is not JSON, an empty type, a leased row), copied into ours with their times."""

from __future__ import annotations

import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest
import sqlalchemy as sa
import yaml
from daemon_harness import Daemon

from perfectschedd.store.urls import engine_url

CTL = [sys.executable, "-m", "perfectschedctl"]

# The gem's rdb_compat DDL (lib/perfectsched/backend/rdb_compat.rb).  PostgreSQL reads
# neither backticks nor LONGBLOB: there the same table with its quotes and BYTEA (what
# Sequel makes of a blob column).
GEM_DDL = """CREATE TABLE IF NOT EXISTS `{table}` (
  id VARCHAR(255) NOT NULL,
  timeout INT NOT NULL,
  next_time INT NOT NULL,
  cron VARCHAR(128) NOT NULL,
  delay INT NOT NULL,
  data LONGBLOB NOT NULL,
  timezone VARCHAR(255) NULL,
  PRIMARY KEY (id)
)"""

HOUR = 3600


def gem_table(url: str, table: str, rows: list[dict[str, Any]]) -> None:
    engine = sa.create_engine(engine_url(url))
    ddl = GEM_DDL.format(table=table)
    if engine.dialect.name == "postgresql":
        ddl = ddl.replace("`", '"').replace("LONGBLOB", "BYTEA")
    with engine.begin() as conn:
        conn.exec_driver_sql(ddl)
        t = sa.table(table, *(sa.column(c) for c in (
            "id", "timeout", "next_time", "cron", "delay", "data", "timezone")))
        conn.execute(t.insert(), rows)
    engine.dispose()


def ctl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CTL, *args], capture_output=True, text=True, timeout=120)


def listed(conf: str) -> dict[str, dict[str, Any]]:
    res = ctl("-c", conf, "--json", "list")
    assert res.returncode == 0, res.stderr
    return {s["key"]: s for s in yaml.safe_load(res.stdout)}


@pytest.mark.slow_on_servers
def test_import_legacy_keeps_times_types_and_data(tmp_path: Path, db_url: str) -> None:
    now = int(time.time())
    hour = now // HOUR * HOUR + HOUR  # the next round hour: an occurrence of @hourly
    tokyo_3am = (now // 86400 + 1) * 86400 + 18 * HOUR  # 03:00 in Tokyo (UTC+9)
    gem_table(db_url, "rb_sched", [
        {"id": "backup.nightly", "timeout": tokyo_3am, "next_time": tokyo_3am,
         "cron": "0 3 * * *", "delay": 0, "timezone": "Asia/Tokyo",
         "data": b'{"type":"backup","dir":"/srv"}'},
        {"id": "mail.hourly", "timeout": hour + 30, "next_time": hour, "cron": "@hourly",
         "delay": 30, "timezone": None, "data": b'{"to":"ops"}'},
        {"id": "broken.data", "timeout": hour, "next_time": hour, "cron": "0 * * * *",
         "delay": 0, "timezone": None, "data": b"not json{"},
        {"id": "nodot", "timeout": hour, "next_time": hour, "cron": "0 * * * *",
         "delay": 0, "timezone": "UTC", "data": b'{"type":""}'},
        {"id": "leased.job", "timeout": now + 300, "next_time": hour - HOUR,
         "cron": "0 * * * *", "delay": 0, "timezone": None, "data": b"{}"},
    ])
    conf = tmp_path / "perfectsched.yml"
    conf.write_text(yaml.safe_dump({"type": "rdb_compat", "url": db_url}))
    assert ctl("-c", str(conf), "init").returncode == 0

    dry = ctl("-c", str(conf), "import-legacy", db_url, "--table", "rb_sched", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.splitlines()[-1] == "5 schedule(s) would import from table rb_sched"
    # Times as `list` prints them, in the schedule's zone (not Unix seconds).
    tokyo = datetime.fromtimestamp(tokyo_3am, ZoneInfo("Asia/Tokyo"))
    assert tokyo.strftime("%H:%M") == "03:00"
    utc = datetime.fromtimestamp(hour + 30, UTC)
    assert sorted(ln for ln in dry.stdout.splitlines() if ln.startswith("would "))[:2] == [
        "would import backup.nightly (type backup, cron 0 3 * * *, next run "
        f"{tokyo.strftime('%Y-%m-%d %H:%M:%S')} +0900)",
        "would import broken.data (type broken, cron 0 * * * *, next run "
        f"{datetime.fromtimestamp(hour, UTC).strftime('%Y-%m-%d %H:%M:%S')} +0000)"]
    assert f"(type mail, cron @hourly, next run {utc.strftime('%Y-%m-%d %H:%M:%S')} +0000)" \
        in dry.stdout
    assert listed(str(conf)) == {}

    res = ctl("-c", str(conf), "import-legacy", db_url, "--table", "rb_sched")
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[-1] == "5 schedule(s) imported from table rb_sched"
    assert res.stderr.strip() == ("perfectschedctl: warning: broken.data: data not JSON; "
                                  "imported as {} (as the Ruby gem read it)")
    got = listed(str(conf))
    assert {k: (s["type"], s["data"], s["timezone"]) for k, s in got.items()} == {
        "backup.nightly": ("backup", {"dir": "/srv"}, "Asia/Tokyo"),
        "mail.hourly": ("mail", {"to": "ops"}, "UTC"),
        "broken.data": ("broken", {}, "UTC"),
        "nodot": ("nodot", {}, "UTC"),
        "leased.job": ("leased", {}, "UTC"),
    }
    assert (got["backup.nightly"]["next_time"], got["backup.nightly"]["next_run_time"]) == \
        (tokyo_3am, tokyo_3am)
    assert (got["mail.hourly"]["next_time"], got["mail.hourly"]["next_run_time"],
            got["mail.hourly"]["delay"]) == (hour, hour + 30, 30)
    # A row the gem had leased: its next run is the lease's end, as the gem would run it.
    assert (got["leased.job"]["next_time"], got["leased.job"]["next_run_time"]) == \
        (hour - HOUR, now + 300)
    assert all(s["source"] == "api" for s in got.values())

    # Again: every key exists, each is named, nothing is written.
    again = ctl("-c", str(conf), "import-legacy", db_url, "--table", "rb_sched")
    assert again.returncode == 1
    assert sorted(again.stderr.splitlines()) == sorted(
        f"perfectschedctl: exists {k} (nothing imported)" for k in got)
    assert listed(str(conf)) == got


@pytest.mark.slow_on_servers
def test_import_legacy_refuses_bad_rows_and_tables(tmp_path: Path, db_url: str) -> None:
    now = int(time.time())
    gem_table(db_url, "rb_bad", [
        {"id": "fine", "timeout": now, "next_time": now, "cron": "@daily", "delay": 0,
         "timezone": None, "data": b"{}"},
        {"id": "-dash", "timeout": now, "next_time": now, "cron": "@daily", "delay": 0,
         "timezone": None, "data": b"{}"},
        {"id": "badcron", "timeout": now, "next_time": now, "cron": "61 * * * *",
         "delay": 0, "timezone": None, "data": b"{}"},
    ])
    conf = tmp_path / "perfectsched.yml"
    conf.write_text(yaml.safe_dump({"type": "rdb_compat", "url": db_url}))
    assert ctl("-c", str(conf), "init").returncode == 0
    res = ctl("-c", str(conf), "import-legacy", db_url, "--table", "rb_bad")
    assert res.returncode == 1 and res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("perfectschedctl: cannot import '-dash': key: must not start")
    assert lines[1].startswith("perfectschedctl: cannot import 'badcron': cron: ")
    assert listed(str(conf)) == {}
    for table, message in (("no_such_table", "table no_such_table not found"),
                           ("perfectsched", "table perfectsched: not a PerfectSched table "
                                            "(no column id, timeout)"),
                           ("x; DROP", "--table: must be an SQL identifier")):
        res = ctl("-c", str(conf), "import-legacy", db_url, "--table", table)
        assert res.returncode == 1
        assert res.stderr.startswith(f"perfectschedctl: {message}"), res.stderr
        assert len(res.stderr.strip().splitlines()) == 1
    # A SQLite file that does not exist is not created (empty) to be read.
    missing = tmp_path / "gone" / "legacy.db"
    res = ctl("-c", str(conf), "import-legacy", f"sqlite:///{missing}")
    assert (res.returncode, res.stderr) == (
        1, f"perfectschedctl: {missing}: no such SQLite database file\n"), res.stderr
    res = ctl("-c", str(conf), "import-legacy", f"sqlite:///{tmp_path}/legacy.db")
    assert res.returncode == 1 and "no such SQLite database file" in res.stderr
    assert not missing.parent.exists() and not (tmp_path / "legacy.db").exists()


def test_import_legacy_says_a_database_error_in_one_line(tmp_path: Path,
                                                         sqlite_url: str) -> None:
    """A legacy database that cannot be reached or read: one line naming it (without its
    password) and the driver's reason, not the driver's exception; nothing imported."""
    conf = tmp_path / "perfectsched.yml"
    conf.write_text(yaml.safe_dump({"type": "rdb_compat", "url": sqlite_url}))
    assert ctl("-c", str(conf), "init").returncode == 0
    res = ctl("-c", str(conf), "import-legacy", "mysql://u:secret@127.0.0.1:1/x", "--dry-run")
    assert (res.returncode, res.stdout) == (1, ""), res
    assert res.stderr == (
        "perfectschedctl: legacy database mysql://u:***@127.0.0.1:1/x unreachable: Can't "
        "connect to MySQL server on '127.0.0.1' ([Errno 111] Connection refused)\n"), res
    garbage = tmp_path / "not-a-database.db"
    garbage.write_bytes(b"this is not SQLite\n" * 100)
    res = ctl("-c", str(conf), "import-legacy", f"sqlite:///{garbage}")
    assert (res.returncode, res.stdout) == (1, ""), res
    assert res.stderr == (f"perfectschedctl: legacy database sqlite:///{garbage}: "
                          "file is not a database\n"), res
    assert listed(str(conf)) == {}


@pytest.mark.parametrize("backend", ["sqlite"])
def test_import_legacy_through_the_daemon(daemon_factory: Any, tmp_path: Path,
                                          backend: str) -> None:
    legacy = f"sqlite:///{tmp_path / 'gem.db'}"
    now = int(time.time())
    gem_table(legacy, "perfectsched", [
        {"id": "report.weekly", "timeout": now + 60, "next_time": now + 60,
         "cron": "* * * * *", "delay": 0, "timezone": None,
         "data": b'{"type":"report","who":"ops"}'}])
    d: Daemon = daemon_factory().start()
    res = d.ctl("import-legacy", legacy)
    assert res.stdout.splitlines()[0].startswith("imported report.weekly (type report")
    shown = d.ctl_json("show", "report.weekly")
    assert (shown["type"], shown["data"], shown["next_run_time"]) == (
        "report", {"who": "ops"}, now + 60)
    assert d.stop() == 0
