"""Issue #27: a failed job is seen at once, and never stalls its schedule unnoticed.

Real daemons on a real database: the cron idiom `[ -x X ] && X` (exit 1 while X is
absent) imported with import-crontab runs every occurrence once and moves on; a retrying
schedule shows in `status`, `list` and /metrics within one poll interval; the config's
max_attempts is the default and a schedule's own value wins."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from daemon_harness import CTL, YEARLY, Daemon, sh, wait_until
from scrape import scrape, value

from perfectschedd.store.sql import Store

# Daemon-level: the PostgreSQL and MariaDB runs are make check's (test-slow).
pytestmark = pytest.mark.slow_on_servers


def ctl_c(config: Path, *args: str, stdin: str | None = None) -> str:
    res = subprocess.run([*CTL, "-c", str(config), *args], input=stdin, capture_output=True,
                         text=True, timeout=30)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout


def history(d: Daemon, key: str) -> list[dict[str, Any]]:
    return list(reversed(d.ctl_json("history", key, "--limit", "100")))


def listed(d: Daemon) -> dict[str, dict[str, Any]]:
    return {r["key"]: r for r in d.ctl_json("list")}


def test_imported_cron_idiom_runs_every_occurrence_once_and_moves_on(
        daemon_factory: Any, tmp_path: Path, db_url: str) -> None:
    absent = tmp_path / "opt-x"  # never created: `[ -x X ] && X` exits 1 every time
    crontab = f"* * * * * [ -x {absent} ] && {absent}\n"
    res = subprocess.run([*CTL, "import-crontab", "--user", "nobody", "-"], input=crontab,
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    (entry,) = yaml.safe_load(res.stdout)
    assert entry["max_attempts"] == 1
    key = entry["key"]
    sdir = tmp_path / "schedules.d"
    sdir.mkdir(mode=0o755)
    (sdir / "imported.yml").write_text(res.stdout)
    d = daemon_factory({"schedules_dir": str(sdir), "retry_wait": 300}, url=db_url)
    # The daemon was down for five minutes: the schedule's backlog is five missed
    # occurrences and the current one (apply, then the row's times moved back).
    ctl_c(d.config_path, "apply", str(sdir / "imported.yml"))
    minute = int(time.time()) // 60 * 60
    first = minute - 5 * 60
    store = Store(db_url)
    try:
        assert store.update(key, {"next_time": first, "next_run_time": first},
                            take_lease=False)
    finally:
        store.close()
    d.start()
    # Every occurrence runs once (attempt 1), fails, is recorded, and the next one runs:
    # with retries (retry_wait 300) the first would hold the others for minutes.
    runs = wait_until(lambda: len(h := history(d, key)) >= 6 and h, timeout=15,
                      what="six runs")
    # In time order: history is in the order rows were written, and each worker writes its
    # rows in batches (every 0.5 s), so two workers' rows may land out of run order.
    runs.sort(key=lambda r: r["scheduled_time"])
    assert [r["scheduled_time"] for r in runs[:6]] == list(range(first, minute + 1, 60))
    assert all(r["attempt"] == 1 and r["outcome"] == "failed" for r in runs)
    assert len({r["scheduled_time"] for r in runs}) == len(runs)  # no occurrence twice
    row = listed(d)[key]
    assert row["next_time"] > minute and row["max_attempts"] == 1
    # ... and none of it is invisible: failed in list and status, given up each time.
    assert (row["state"], row["last_outcome"], row["attempt"]) == ("failed", "failed", 0)
    out = d.ctl("list").stdout.splitlines()
    assert out[0].split()[-2:] == ["state", "source"] and out[1].split()[-2] == "failed"
    status = d.status()
    assert status["states"]["failed"] == 1
    assert [(f["key"], f["state"]) for f in status["failing"]] == [(key, "failed")]
    text = d.ctl("status").stdout
    assert f"{key}: failed at " in text and "1 failed" in text, text


def test_a_retrying_schedule_shows_within_one_poll_interval(
        daemon_factory: Any, tmp_path: Path, db_url: str) -> None:
    # A retry 6 s after each failed attempt: long enough for the reads below, on a loaded
    # machine, to see each attempt's state before the next attempt runs.
    d = daemon_factory({"routes": [sh("flaky", "exit 1")], "retry_wait": 6,
                        "retry_wait_max": 6}, url=db_url).start()
    _, samples = scrape(d.metrics_port)
    d.status()  # the figures are read (at start, and for status)
    _, samples = scrape(d.metrics_port)
    assert value(samples, "perfectsched_schedules", state="ok") == 0
    assert value(samples, "perfectsched_oldest_overdue_seconds") == 0
    d.ctl("add", "good", "other", YEARLY)  # never due during the test: ok
    # Every minute, from three minutes ago: its oldest occurrence is 2-3 periods late.
    d.ctl("add", "bad", "flaky", "* * * * *", "-s", str(int(time.time()) - 180))
    # The first status and list asked once the run has ended (the daemon logs its end
    # after writing the retry) name it: no wait for a periodic refresh.
    d.wait_log("end key=bad scheduled=", timeout=10)
    status = d.status()
    rows = listed(d)
    (f,) = status["failing"]
    assert (f["key"], f["state"], f["attempt"]) == ("bad", "retrying", 1)
    assert f["since"] == f["scheduled_time"]  # stalled since its occurrence was due
    assert "bad: retrying (attempt 1 failed)" in d.ctl("status").stdout
    assert rows["bad"]["state"] == "retrying 1" and rows["bad"]["attempt"] == 1
    assert rows["good"]["state"] == "ok" and rows["good"]["last_outcome"] is None
    # History is written in batches, every half second at most.
    wait_until(lambda: listed(d)["bad"]["last_outcome"] == "failed", timeout=1,
               what="the failed run in list --json")
    table = d.ctl("list").stdout
    assert "retrying 1" in table
    # /metrics, as the status read left it: one retrying, one ok, one long overdue.
    _, samples = scrape(d.metrics_port)
    assert value(samples, "perfectsched_schedules", state="retrying") == 1
    assert value(samples, "perfectsched_schedules", state="ok") == 1
    assert value(samples, "perfectsched_schedules", state="failed") == 0
    overdue = value(samples, "perfectsched_oldest_overdue_seconds")
    assert overdue is not None and 120 <= overdue < 200
    assert value(samples, "perfectsched_schedules_overdue_beyond_period") == 1
    # The retry (6 s later) fails too: attempt 2, still one retrying schedule.
    wait_until(lambda: listed(d)["bad"]["state"] == "retrying 2", timeout=20,
               what="the second attempt")
    d.status()
    _, samples = scrape(d.metrics_port)
    assert value(samples, "perfectsched_schedules", state="retrying") == 1
    assert value(samples, "perfectsched_oldest_overdue_seconds") >= overdue
    wait_until(lambda: [r["attempt"] for r in history(d, "bad")][:2] == [1, 2], timeout=1,
               what="both attempts in history")
    # Paused: not failing, not overdue.
    d.ctl("pause", "bad")
    status = d.status()
    assert status["failing"] == [] and status["states"]["paused"] == 1
    _, samples = scrape(d.metrics_port)
    assert value(samples, "perfectsched_schedules", state="paused") == 1
    assert value(samples, "perfectsched_oldest_overdue_seconds") == 0
    assert value(samples, "perfectsched_schedules_overdue_beyond_period") == 0


def test_config_max_attempts_is_the_default_and_a_schedule_s_own_wins(
        daemon_factory: Any, db_url: str) -> None:
    d = daemon_factory({"routes": [sh("flaky", "exit 1")], "retry_wait": 1,
                        "retry_wait_max": 1, "max_attempts": 2}, url=db_url).start()
    now = int(time.time())
    d.ctl("add", "dflt", "flaky", YEARLY, "--at", str(now))
    d.ctl("add", "own0", "flaky", YEARLY, "--at", str(now), "--max-attempts", "0")
    d.ctl("add", "own1", "flaky", YEARLY, "--at", str(now), "--max-attempts", "1")
    d.ctl("add", "own3", "flaky", YEARLY, "--at", str(now), "--max-attempts", "3")
    occurrence = listed(d)["own0"]["next_time"]  # next 1 January, run now (--at)
    wait_until(lambda: len(history(d, "own0")) >= 4, timeout=15, what="own0's 4th attempt")
    rows = listed(d)
    time.sleep(0.6)  # history is written in batches, every half second at most
    assert (rows["dflt"]["max_attempts"], rows["own0"]["max_attempts"]) == (None, 0)
    attempts = {k: [r["attempt"] for r in history(d, k)] for k in ("dflt", "own1", "own3")}
    assert attempts == {"dflt": [1, 2], "own1": [1], "own3": [1, 2, 3]}
    for key in ("dflt", "own1", "own3"):  # given up: the schedule moved on a year
        assert rows[key]["state"] == "failed"
        assert rows[key]["next_time"] > occurrence + 360 * 86400
    assert rows["own0"]["state"].startswith("retrying ")  # 0: its own "never give up"
    assert rows["own0"]["next_time"] == occurrence
    # Back to the config's default: the next failure (attempt >= 2) gives it up.
    d.ctl("modify", "own0", "--max-attempts", "default")
    assert d.ctl_json("show", "own0")["max_attempts"] is None


def test_bad_max_attempts_in_the_config_is_refused_naming_it(tmp_path: Path) -> None:
    for bad, why in (("-1", "must be at least 0"), ("many", "must be a number"),
                     ("1.5", "must be a whole number"), ("true", "must be a number")):
        config = tmp_path / "bad.yml"
        config.write_text(f"type: rdb_compat\nurl: sqlite:///{tmp_path}/x.db\n"
                          f"max_attempts: {bad}\n")
        res = subprocess.run([sys.executable, "-m", "perfectschedd", "-c", str(config)],
                             capture_output=True, text=True, timeout=30)
        assert res.returncode != 0
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and "max_attempts" in lines[0] and why in lines[0], lines
