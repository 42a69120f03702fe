"""Series of one schedule on /metrics (docs/metrics.md "Series of one schedule"): for the
schedules that ask (policy `metrics`, a file entry's, a route's default), right after a
failure and a recovery, bounded by schedule_metrics_max with files' and root's first.
(The shipped alert on them: etc/prometheus/perfectsched.rules.test.yml.)"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import yaml
from daemon_harness import YEARLY, Daemon, sh, wait_until
from scrape import Samples, scrape, value

SERIES = "perfectsched_schedule_"


def fresh(d: Daemon) -> Samples:
    """A scrape of a reading of the database begun after this call (status asks for one
    and waits half a second for it; unasked, every 15 s)."""
    asked = time.time()
    d.ctl("status")

    def read() -> Samples | None:
        samples = scrape(d.metrics_port)[1]
        at = value(samples, "perfectsched_schedule_counts_timestamp_seconds")
        return samples if at is not None and at >= asked else None
    return wait_until(read, timeout=30, interval=0.2, what="a reading after the change")


def keys_shown(samples: Samples) -> set[str]:
    return {dict(labels)["key"] for (name, labels), _ in samples.items()
            if name == f"{SERIES}state"}


def state_of(samples: Samples, key: str) -> str:
    found = [dict(labels)["state"] for (name, labels), v in samples.items()
             if name == f"{SERIES}state" and dict(labels)["key"] == key and v == 1]
    assert len(found) == 1, (key, found)
    return found[0]


def test_series_follow_a_failure_and_a_recovery(daemon_factory: Any, tmp_path: Path) -> None:
    flag = tmp_path / "succeed"
    d: Daemon = daemon_factory({"routes": [
        sh("flaky", f"test -e {flag}"),
        sh("chatty", "true", metrics=True),  # the route's default: its schedules' series
    ]}).start()
    d.ctl("add", "job", "flaky", "@hourly", "--metrics", "true", "--max-attempts", "1")
    d.ctl("add", "quiet", "flaky", "@hourly")  # asks for none
    d.ctl("add", "c1", "chatty", "@daily")
    d.ctl("add", "c2", "chatty", "@daily", "--metrics", "no")  # refuses its route's
    assert d.ctl_json("show", "job")["metrics"] is True
    assert d.ctl_json("show", "c2")["metrics"] is False

    samples = fresh(d)
    assert keys_shown(samples) == {"job", "c1"}
    assert state_of(samples, "job") == "ok"
    assert value(samples, f"{SERIES}last_success_timestamp_seconds", key="job") is None
    due = d.ctl_json("show", "job")["next_run_time"]
    assert value(samples, f"{SERIES}next_run_timestamp_seconds", key="job") == due
    assert value(samples, f"{SERIES}period_seconds", key="job", type="flaky") == 3600
    assert value(samples, f"{SERIES}series_omitted") == 0

    failed_at = time.time()
    d.ctl("run", "job")
    wait_until(lambda: [r["outcome"] for r in d.ctl_json("history", "job")] == ["failed"],
               what="the failed run recorded")
    samples = fresh(d)
    failure = value(samples, f"{SERIES}last_failure_timestamp_seconds", key="job")
    assert failure is not None and failed_at - 1 <= failure <= time.time()
    assert value(samples, f"{SERIES}last_success_timestamp_seconds", key="job") is None
    assert state_of(samples, "job") == "failed"

    flag.touch()
    d.ctl("run", "job")
    wait_until(lambda: [r["outcome"] for r in d.ctl_json("history", "job")][0] == "success",
               what="the successful run recorded")
    samples = fresh(d)
    success = value(samples, f"{SERIES}last_success_timestamp_seconds", key="job")
    assert success is not None and success > failure
    assert value(samples, f"{SERIES}last_failure_timestamp_seconds", key="job") == failure
    assert state_of(samples, "job") == "ok"

    d.ctl("pause", "job")
    samples = fresh(d)
    assert state_of(samples, "job") == "paused"
    assert value(samples, f"{SERIES}next_run_timestamp_seconds", key="job") is None
    # It asks no more: its series go at the next reading.
    d.ctl("modify", "job", "--metrics", "default")
    assert keys_shown(fresh(d)) == {"c1"}
    assert d.stop() == 0


def test_series_are_bounded_with_files_and_root_first(daemon_factory: Any,
                                                        tmp_path: Path) -> None:
    sdir = tmp_path / "schedules.d"
    sdir.mkdir()
    (sdir / "jobs.yml").write_text(yaml.safe_dump([
        {"key": "zz-file", "type": "t", "cron": "@daily", "metrics": True}]))
    d: Daemon = daemon_factory({"schedules_dir": str(sdir), "schedule_metrics_max": 3,
                                "routes": [sh("t", "true")]}).start()
    for i in range(5):
        d.ctl("add", f"k{i}", "t", YEARLY, "--metrics", "true")
    samples = fresh(d)
    # The file's entry sorts last by key and is shown all the same.
    assert keys_shown(samples) == {"zz-file", "k0", "k1"}
    assert value(samples, f"{SERIES}series_omitted") == 3
    text = scrape(d.metrics_port)[0]
    assert text.count(f"{SERIES}state{{") == 3

    # Bad input: one line, nothing stored changes, the daemon goes on.
    res = d.ctl("modify", "k0", "--metrics", "maybe", check=False)
    assert res.returncode != 0 and res.stderr.count("\n") == 1, res.stderr
    assert "metrics: must be true or false, got 'maybe'" in res.stderr, res.stderr
    assert d.ctl_json("show", "k0")["metrics"] is True
    assert d.stop() == 0


def test_a_bad_metrics_setting_in_the_config_is_refused(daemon_factory: Any) -> None:
    for bad, said in (({"schedule_metrics_max": 10_001}, "schedule_metrics_max: at most"),
                      ({"routes": [sh("t", "true", metrics="yes")]},
                       "routes[0].metrics: must be true or false")):
        d: Daemon = daemon_factory(bad)
        res = subprocess.run([*d.ctl_command, "-c", str(d.config_path), "list"],
                             capture_output=True, text=True, timeout=30)
        assert res.returncode != 0 and said in res.stderr, res.stderr
