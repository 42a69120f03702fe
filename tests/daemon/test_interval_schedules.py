"""CRON `@every DURATION` on a real daemon (SPEC "Schedule policies"): a fixed rate from the
schedule's start, caught up after downtime by its misfire policy; `next KEY` (delay and
jitter applied); and the refusal of `@every` while a 0.1.0 host, which cannot read it,
uses the database (SPEC "Upgrades")."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from daemon_harness import YEARLY, Daemon, lines, sh, wait_until
from old_release import OldRelease

from perfectschedd.schedules.policy import jitter_offset

EVERY = 5
POLICIES = ("all", "latest", "skip")


def history(d: Daemon, key: str) -> list[dict[str, Any]]:
    return list(reversed(d.ctl_json("history", key, "-n", "200")))  # oldest first


@pytest.mark.slow
def test_every_5s_runs_on_its_grid_and_catches_up_after_a_30s_stop(
        daemon_factory: Any, sqlite_url: str, tmp_path: Path) -> None:
    out = tmp_path / "ran"
    # Each run logs its key, PERFECTSCHED_SCHEDULED_TIME and when it started.
    d: Daemon = daemon_factory({"poll_interval": 0.5, "routes": [
        sh("t", f'echo "$1 $PERFECTSCHED_SCHEDULED_TIME $(date +%s.%N)" >> {out}')]},
        url=sqlite_url).start()
    start = int(time.time()) + 2
    for policy in POLICIES:
        d.ctl("add", policy, "t", "@every 5s", "-s", str(start), "--misfire", policy)

    def runs() -> dict[str, list[tuple[int, float]]]:
        got: dict[str, list[tuple[int, float]]] = {p: [] for p in POLICIES}
        for line in lines(out):
            key, scheduled, began = line.split()
            got[key].append((int(scheduled), float(began)))
        return got

    # Four runs each (the rate is proved by their times; a minute would only add more).
    wait_until(lambda: all(len(r) >= 4 for r in runs().values()), 60, what="4 runs each")
    d.stop()
    stopped = time.time()
    before = runs()
    for policy, done in before.items():
        scheduled = [s for s, _ in done]
        assert scheduled == [start + EVERY * i for i in range(len(done))], (policy, done)
        assert all(began >= s for s, began in done), (policy, done)  # never early
    time.sleep(30)
    restart = time.time()
    d.start()
    # After the stop: every grid point runs or is recorded skipped, each exactly once.
    horizon = restart + 3 * EVERY

    def settled() -> bool:
        return all(any(r["scheduled_time"] >= horizon for r in history(d, p))
                   for p in POLICIES)

    wait_until(settled, 60, what="runs after the restart")
    recorded_of = {p: [r for r in history(d, p) if r["scheduled_time"] < horizon]
                   for p in POLICIES}
    after = {p: [(s, b) for s, b in done if s < horizon] for p, done in runs().items()}
    for policy, recorded in recorded_of.items():
        times = [r["scheduled_time"] for r in recorded]
        assert times == [start + EVERY * i for i in range(len(times))], (policy, recorded)
        ran = [r["scheduled_time"] for r in recorded if r["outcome"] == "success"]
        skipped = [r["scheduled_time"] for r in recorded if r["outcome"] == "skipped"]
        assert ran == [s for s, _ in after[policy]]  # as PERFECTSCHED_SCHEDULED_TIME said
        ran_before = [s for s, _ in before[policy]]
        caught_up = [(s, b) for s, b in after[policy] if b >= restart and s < restart]
        if policy == "all":
            assert skipped == []
            # every interval missed while stopped runs once, oldest first
            assert [s for s, _ in caught_up] == [t for t in times
                                                  if t < restart and t not in ran_before]
            assert len(caught_up) >= 5
            assert [b for _, b in caught_up] == sorted(b for _, b in caught_up)
        else:
            # The occurrences missed by more than one interval are recorded skipped;
            # latest runs the newest one, skip runs it only within its grace.
            assert len(skipped) >= 4, recorded
            assert all(ran_before[-1] < t < restart for t in skipped), recorded
            assert [t for t in times if t < restart - EVERY] == \
                ran_before + [t for t in skipped if t < restart - EVERY]
            assert len(caught_up) <= 1
        assert d.ctl_json("show", policy)["next_time"] % EVERY == start % EVERY
    assert stopped + 25 < restart


def test_next_key_applies_delay_and_jitter(daemon_factory: Any, sqlite_url: str,
                                           tmp_path: Path) -> None:
    d: Daemon = daemon_factory({"routes": [sh("t", "true")]}, url=sqlite_url).start()
    start = int(time.time()) + 86400  # not due during the test
    d.ctl("add", "hourly", "t", "@every 1h", "-s", str(start), "-d", "30", "--jitter", "600")
    offset = jitter_offset("hourly", 600)
    shown = d.ctl_json("next", "hourly", "-n", "3")
    assert [t["scheduled_time"] for t in shown["times"]] == [start, start + 3600,
                                                              start + 7200]
    assert [t["run_time"] for t in shown["times"]] == [start + 30 + offset,
                                                        start + 3630 + offset,
                                                        start + 7230 + offset]
    assert shown["delay"] == 30 and shown["jitter"] == 600
    # People's form: the run time with its offset, Unix seconds, the nominal time.
    text = d.ctl("next", "hourly", "-n", "2").stdout.splitlines()
    assert len(text) == 2 and str(start + 30 + offset) in text[0]
    assert "nominal" in text[0] and "+00:00" in text[0]
    # -c (no daemon): the same times, read from the database.
    direct = d.ctl_command + ["-c", str(d.config_path), "--json", "next", "hourly", "-n", "3"]
    res = subprocess.run(direct, capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["times"] == shown["times"]
    # A cron schedule across a DST change: the gap and the repeat are marked.
    d.ctl("add", "berlin", "t", "30 2 * * *", "-t", "Europe/Berlin",
          "-s", "1806019200")  # 2027-03-26 00:00 UTC
    marked = d.ctl("next", "berlin", "-n", "3").stdout
    assert "skipped 2027-03-28T02:30:00" in marked and "DST gap" in marked
    bad = d.ctl("next", "nope", check=False)
    assert bad.returncode == 1 and bad.stderr.count("\n") == 1 and "nope" in bad.stderr
    assert d.alive()


@pytest.mark.slow
def test_every_is_refused_while_a_0_1_0_host_is_live(
        daemon_factory: Any, sqlite_url: str, tmp_path: Path,
        old_release: OldRelease) -> None:
    # A 0.1.0 daemon at work on the database (its job holds a lease).
    old: Daemon = daemon_factory({"node_name": "oldhost", "routes": [sh("t", "sleep 60")]},
                                 url=sqlite_url, command=old_release.daemon_command,
                                 ctl_command=old_release.ctl_command).start()
    old.ctl("add", "busy", "t", YEARLY, "-a", "0")
    wait_until(lambda: old.ctl_json("show", "busy")["owner"], 30, what="the old host to run")
    # The new host's own schedules files: the @every entry waits, the others apply.
    own = tmp_path / "own"
    own.mkdir()
    (own / "own.yml").write_text(yaml.safe_dump([
        {"key": "f-every", "type": "t", "cron": "@every 5m"},
        {"key": "f-plain", "type": "t", "cron": "0 * * * *"}]))
    new: Daemon = daemon_factory({"node_name": "newhost", "routes": [sh("t", "true")],
                                  "schedules_dir": str(own)}, url=sqlite_url).start()
    wait_until(lambda: "refused f-every" in new.log(), 30, what="the @every entry refused")
    assert "oldhost (0.1.0)" in new.log()
    assert [s["key"] for s in new.ctl_json("list")] == ["busy", "f-plain"]
    new.ctl("add", "plain", "t", "0 * * * *")
    def stored() -> list[tuple[str, str, int]]:
        return [(s["key"], s["cron"], s["next_time"]) for s in new.ctl_json("list")]

    before = stored()
    for args in (("add", "k", "t", "@every 5m"),
                 ("modify", "plain", "--cron", "@every 5m")):
        res = new.ctl(*args, check=False)
        assert res.returncode == 1, res
        assert res.stderr.count("\n") == 1
        assert "@every" in res.stderr and "oldhost (0.1.0)" in res.stderr, res.stderr
    schedfile = tmp_path / "every.yml"
    schedfile.write_text(yaml.safe_dump([{"key": "f", "type": "t", "cron": "@every 5m"}]))
    for dry_run in ((), ("--dry-run",)):
        res = new.ctl("apply", *dry_run, str(schedfile), check=False)
        assert res.returncode == 1 and "oldhost (0.1.0)" in res.stderr, res.stderr
        assert res.stderr.count("\n") == 1
    assert stored() == before  # nothing changed
    assert new.alive() and old.alive()
    # Once the old host is gone (stopped, its lease released), @every is taken.
    old.stop()
    wait_until(lambda: new.ctl("add", "k", "t", "@every 5m", check=False).returncode == 0,
               60, interval=2, what="@every to be taken once the old host is gone")
    new.send_signal(signal.SIGHUP)  # its files apply whole now
    wait_until(lambda: "f-every" in [s["key"] for s in new.ctl_json("list")], 30,
               what="the @every entry once the old host is gone")


def test_bad_every_is_refused_in_one_line(daemon_factory: Any, sqlite_url: str) -> None:
    d: Daemon = daemon_factory({"routes": [sh("t", "true")]}, url=sqlite_url).start()
    for cron in ("@every 0s", "@every 5", "@every 1h 30m", "@every 36501d", "@every"):
        res = d.ctl("add", "k", "t", cron, check=False)
        assert res.returncode == 1 and res.stderr.count("\n") == 1, (cron, res)
        assert res.stderr.startswith("perfectschedctl: cron: ") and "@every" in res.stderr
    assert d.ctl_json("list") == [] and d.alive()
