"""Schedule policies (SPEC "Schedule policies", issue #15) against a real daemon, on SQLite
and PostgreSQL: misfire, grace, max_attempts with back-off, jitter, timeout, @once.

Catch-ups are made with `--start` in the past on an hourly cron: the missed occurrences
are whole hours, and how late the newest one is (the time since the hour began) is known
to the second, so no test waits for the wall clock to reach a particular second."""

from __future__ import annotations

import calendar
import json
import math
import time
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import YEARLY, Daemon, lines, sh, wait_until
from scrape import scrape, value

# Their PostgreSQL and MariaDB runs are make check's (conftest: slow_on_servers).
pytestmark = pytest.mark.slow_on_servers

HOUR = 3600


def log_job(path: Path) -> dict[str, Any]:
    return sh("t", f'echo "$1 $PERFECTSCHED_SCHEDULED_TIME $(date +%s)" >> {path}')


def this_hour() -> int:
    """The start of the current hour, once it is at least 20 s old (a margin for the
    skip tolerance of 10 s and a slow claim)."""
    while time.time() % HOUR < 20:
        time.sleep(1)
    return int(time.time()) // HOUR * HOUR


def history(d: Daemon, key: str) -> list[dict[str, Any]]:
    return list(reversed(d.ctl_json("history", key, "-n", "100")))  # oldest first


@pytest.mark.parametrize("misfire", ["latest", "skip", "all"])
def test_misfire_after_ten_missed_hours(daemon_factory: Any, db_url: str, tmp_path: Path,
                                        misfire: str) -> None:
    out = tmp_path / "ran"
    d: Daemon = daemon_factory({"routes": [log_job(out)]}, url=db_url).start()
    hour = this_hour()
    started = time.time()
    d.ctl("add", "k", "t", "0 * * * *", "-s", str(hour - 9 * HOUR), "--misfire", misfire)
    missed = [hour - i * HOUR for i in range(9, -1, -1)]  # 10 occurrences, oldest first
    if misfire == "all":
        wait_until(lambda: len(lines(out)) == 10, 30, what="all ten to run")
        assert [int(line.split()[1]) for line in lines(out)] == missed
        wait_until(lambda: len(history(d, "k")) == 10, 10, what="the history")
        assert [r["outcome"] for r in history(d, "k")] == ["success"] * 10
        return
    want = 10 if misfire == "skip" else 9
    wait_until(lambda: sum(r["outcome"] == "skipped" for r in history(d, "k")) == want, 30,
               what=f"{want} skipped in history")
    if misfire == "latest":
        wait_until(lambda: lines(out), 30, what="the latest to run")
        wait_until(lambda: len(history(d, "k")) == 10, 10, what="the run in history")
        assert [int(line.split()[1]) for line in lines(out)] == [hour]
        runs = history(d, "k")
        assert [(r["outcome"], r["scheduled_time"]) for r in runs] == [
            *(("skipped", t) for t in missed[:9]), ("success", hour)]
    else:
        time.sleep(2)
        assert lines(out) == []
        assert [r["scheduled_time"] for r in history(d, "k")] == missed
    shown = d.ctl_json("show", "k")
    assert shown["next_time"] == hour + HOUR and shown["misfire"] == misfire
    assert time.time() - started < 20  # a catch-up is not a replay
    _, samples = scrape(d.metrics_port)
    assert value(samples, "perfectsched_occurrences_skipped_total", type="t") == want
    d.wait_log("missed occurrence(s)")
    assert d.log().count("missed occurrence(s)") == 1  # logged once, not per occurrence


def test_grace_skips_what_cannot_start_in_time(daemon_factory: Any, db_url: str,
                                               tmp_path: Path) -> None:
    out = tmp_path / "ran"
    d: Daemon = daemon_factory({"routes": [log_job(out)]}, url=db_url).start()
    hour = this_hour()
    late = int(time.time()) - hour  # how late this hour's occurrence is now (>= 20 s)
    # Could start within its grace: runs.  Could not: skipped, and the schedule moves on.
    d.ctl("add", "in-time", "t", "0 * * * *", "-s", str(hour), "--grace", str(late + 60))
    d.ctl("add", "too-late", "t", "0 * * * *", "-s", str(hour), "--grace", str(late - 10))
    wait_until(lambda: lines(out), 30, what="the one in time to run")
    wait_until(lambda: history(d, "too-late"), 30, what="the late one to be recorded")
    assert [line.split()[0] for line in lines(out)] == ["in-time"]
    assert [(r["outcome"], r["scheduled_time"]) for r in history(d, "too-late")] == [
        ("skipped", hour)]
    assert d.ctl_json("show", "too-late")["next_time"] == hour + HOUR
    assert d.ctl_json("show", "too-late")["grace"] == late - 10


def test_max_attempts_backs_off_then_gives_up(daemon_factory: Any, db_url: str,
                                              tmp_path: Path) -> None:
    out = tmp_path / "ran"
    d: Daemon = daemon_factory({"poll_interval": 0.2, "routes": [
        sh("t", f'date +%s.%N >> {out}; exit 3')]}, url=db_url).start()
    d.ctl("add", "k", "t", YEARLY, "-a", "0", "--max-attempts", "3", "--retry-wait", "1")
    wait_until(lambda: len(history(d, "k")) == 3, 30, what="three attempts")
    time.sleep(3)  # a fourth would come 4 s after the third
    stamps = [float(x) for x in lines(out)]
    assert len(stamps) == 3
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    # 1 s, then doubled (retries run at whole seconds, and are claimed within a poll)
    assert 0.9 <= gaps[0] < 2.6 and 1.9 <= gaps[1] < 3.8 and gaps[1] > gaps[0], gaps
    assert [(r["outcome"], r["attempt"]) for r in history(d, "k")] == [
        ("failed", 1), ("failed", 2), ("failed", 3)]
    shown = d.ctl_json("show", "k")
    tried = time.gmtime(history(d, "k")[0]["scheduled_time"]).tm_year
    # moved on to its next occurrence, a year after the one given up
    assert shown["next_time"] == calendar.timegm((tried + 1, 1, 1, 0, 0, 0))
    assert shown["attempt"] == 0 and shown["owner"] is None
    d.wait_log("gave up the occurrence")
    _, samples = scrape(d.metrics_port)
    assert value(samples, "perfectsched_occurrences_given_up_total", type="t") == 1


def test_jitter_is_a_fixed_per_key_offset(daemon_factory: Any, db_url: str,
                                          tmp_path: Path) -> None:
    d: Daemon = daemon_factory({"routes": [sh("j", "true")]}, url=db_url).start()
    hour = this_hour()
    many = [{"key": f"j{i:04d}", "type": "unrouted", "cron": "0 * * * *",
             "start": hour + HOUR, "jitter": 30} for i in range(1000)]
    with socket_client(d) as call:
        assert call("add_many", {"schedules": many}) == {"added": 1000}
    rows = d.ctl_json("list", "--prefix", "j0")
    offsets = {r["key"]: r["next_run_time"] - r["next_time"] for r in rows}
    assert len(offsets) == 1000 and all(0 <= o < 30 for o in offsets.values())
    assert max(offsets.values()) - min(offsets.values()) >= 25  # spread over the window
    assert len(set(offsets.values())) >= 25
    # The same offsets after a restart, and on the next occurrence of a schedule that ran.
    d.stop()
    d.start()
    assert {r["key"]: r["next_run_time"] - r["next_time"]
            for r in d.ctl_json("list", "--prefix", "j0")} == offsets
    d.ctl("add", "ran", "j", "0 * * * *", "-s", str(hour), "--jitter", "600")
    first = d.ctl_json("show", "ran")
    offset = first["next_run_time"] - first["next_time"]
    if first["next_run_time"] <= time.time():  # due now: it runs, then moves an hour on
        wait_until(lambda: d.ctl_json("show", "ran")["next_time"] == hour + HOUR, 30,
                   what="the run and its advance")
    again = d.ctl_json("show", "ran")
    assert again["next_run_time"] - again["next_time"] == offset


def test_timeout_of_the_schedule_overrides_the_routes(daemon_factory: Any,
                                                       tmp_path: Path) -> None:
    d: Daemon = daemon_factory({"kill_grace": 0.5, "routes": [
        sh("t", "sleep 30", timeout=60)]}).start()
    started = time.monotonic()
    d.ctl("add", "k", "t", YEARLY, "-a", "0", "--timeout", "1", "--max-attempts", "1")
    wait_until(lambda: history(d, "k"), 20, what="the run to end")
    assert history(d, "k")[0]["outcome"] == "timeout"
    assert time.monotonic() - started < 10
    assert d.ctl_json("show", "k")["timeout"] == 1.0


def test_once_runs_once_then_is_gone(daemon_factory: Any, db_url: str, tmp_path: Path) -> None:
    out = tmp_path / "ran"
    d: Daemon = daemon_factory({"routes": [log_job(out)]}, url=db_url).start()
    added = d.ctl_json("add", "one", "t", "@once")
    assert added["cron"] == "@once" and added["next_time"] <= time.time() + 1
    wait_until(lambda: lines(out), 20, what="the one-shot to run")
    wait_until(lambda: d.ctl("show", "one", check=False).returncode == 1, 20,
               what="the one-shot to be removed")
    assert "not found" in d.ctl("show", "one", check=False).stderr
    wait_until(lambda: d.ctl("history", "one", check=False).returncode == 0, 10,
               what="its run in history")
    assert [r["outcome"] for r in d.ctl_json("history", "one")] == ["success"]
    time.sleep(1)
    assert len(lines(out)) == 1
    later = int(time.time()) + 3600
    assert d.ctl_json("add", "later", "t", "@once", "-a", str(later))["next_run_time"] == later


@pytest.mark.parametrize(("args", "field"), [
    (["--misfire", "sometimes"], "misfire"),
    (["--grace", "-1"], "grace"),
    (["--grace", "soon"], "grace"),
    (["--max-attempts", "1.5"], "max_attempts"),
    (["--max-attempts", "-2"], "max_attempts"),
    (["--retry-wait", "nan"], "retry_wait"),
    (["--jitter", "1e9"], "jitter"),
    (["--timeout", "0"], "timeout"),
    (["--concurrency", "parallel"], "concurrency"),
    (["--concurrency", "ALLOW"], "concurrency"),
])
def test_bad_policy_values_are_refused_by_name(daemon_factory: Any, args: list[str],
                                               field: str) -> None:
    d: Daemon = daemon_factory().start()
    d.ctl("add", "keep", "t", YEARLY)
    before = d.ctl_json("list")
    for command in (["add", "k", "t", YEARLY], ["modify", "keep"]):
        res = d.ctl(*command, *args, check=False)
        assert res.returncode == 1, res
        message = res.stderr.strip()
        assert len(message.splitlines()) == 1 and f"{field}:" in message, message
    assert d.ctl_json("list") == before


def test_a_start_far_back_asks_for_a_misfire_policy(daemon_factory: Any) -> None:
    """`-s 0` of an hourly schedule would run some 500,000 missed occurrences one after
    the other: refused in one line until --misfire says what is meant; a start a few
    occurrences back is taken as before."""
    d: Daemon = daemon_factory().start()
    d.ctl("add", "keep", "t", YEARLY)
    before = d.ctl_json("list")
    for command in (["add", "k", "t", "@hourly", "-s", "0"],
                    ["add", "k", "t", "* * * * *", "-s", str(int(time.time()) - 2 * 86400)]):
        res = d.ctl(*command, check=False)
        message = res.stderr.strip()
        assert res.returncode == 1 and len(message.splitlines()) == 1, res
        assert "start: more than 1,000 occurrences since" in message, message
        assert "--misfire all to mean it" in message, message
    assert d.ctl_json("list") == before
    # Said: taken.
    d.ctl("add", "latest", "t", "@hourly", "-s", "0", "--misfire", "latest")
    d.ctl("add", "all", "t", "@hourly", "-s", "0", "--misfire", "all")
    d.ctl("add", "recent", "t", "@hourly", "-s", str(int(time.time()) - 10 * HOUR))
    assert {s["key"] for s in d.ctl_json("list")} == {"keep", "latest", "all", "recent"}
    assert d.stop() == 0


def test_policies_through_modify_show_and_the_library(daemon_factory: Any,
                                                       tmp_path: Path) -> None:
    import perfectschedd

    d: Daemon = daemon_factory().start()
    d.ctl("add", "k", "t", "@hourly", "--misfire", "latest", "--jitter", "60")
    shown = d.ctl_json("show", "k")
    assert (shown["misfire"], shown["jitter"], shown["grace"], shown["max_attempts"]) == (
        "latest", 60, None, None)  # max_attempts None: the config's (0 by default)
    d.ctl("modify", "k", "--grace", "30", "--misfire", "all")
    shown = d.ctl_json("show", "k")
    assert (shown["misfire"], shown["grace"], shown["jitter"]) == ("all", 30, 60)
    with perfectschedd.open(d.config) as sc:
        sc.add("lib", "t", "@daily", max_attempts=2, retry_wait=5, timeout=2.5)
        info = sc["lib"].info()
        assert (info.max_attempts, info.retry_wait, info.timeout) == (2, 5, 2.5)
        sc["lib"].modify(max_attempts=None)
        assert sc["lib"].info().max_attempts is None  # the config's again


class socket_client:  # noqa: N801 - used as a context manager, like open()
    def __init__(self, d: Daemon) -> None:
        self.d = d

    def __enter__(self) -> Any:
        import socket

        from perfectschedd.control import protocol

        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(self.d.socket_path)
        reader = self.sock.makefile("rb")

        def call(cmd: str, args: dict[str, Any]) -> Any:
            self.sock.sendall(protocol.request(cmd, args))
            answer = json.loads(reader.readline())
            assert answer["ok"], answer
            return answer["result"]
        return call

    def __exit__(self, *exc: object) -> None:
        self.sock.close()


def test_catch_up_of_100000_missed_minutes_is_quick(tmp_path: Path) -> None:
    """`latest` over 100,000 missed minutes: a few croniter steps, not 100,000."""
    import perfectschedd
    from perfectschedd.schedules import catchup

    with perfectschedd.open({"type": "rdb_compat",
                             "url": f"sqlite:///{tmp_path / 'db'}"}) as sc:
        now = time.time()
        minute = math.floor(now / 60) * 60
        sc.add("k", "t", "* * * * *", start=minute - 100_000 * 60, misfire="latest")
        task = sc.poll(now)
        assert task is not None and task.scheduled_time == minute - 100_000 * 60
        t0 = time.process_time()
        plan = catchup.plan(task, now)
        took = time.process_time() - t0
        assert plan is not None and plan.run == minute
        assert len(plan.skipped) == catchup.COUNT_CAP and plan.skipped[0] == minute - 60
        print(f"catch-up plan of 100,000 missed minutes: {took * 1000:.0f} ms of CPU")
