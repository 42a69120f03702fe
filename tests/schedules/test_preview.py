"""`perfectschedctl next --cron EXPR` (schedules/preview.py) against croniter as the oracle.

The oracle lets croniter list the expression's wall-clock times from a few hours before
the start, and maps each to the instants it names in the zone by brute force over the
zone's offsets (a local time in a DST gap names none and is skipped; one in a repeated
hour names two, and runs twice: SPEC "Schedule semantics").  1,000 seeded random
expressions and zones, half of them started within two days of a DST change, go through
perfectschedctl's own main() (`--json next --cron`), which needs no daemon.
"""

from __future__ import annotations

import json
import random
from datetime import UTC, datetime, timedelta
from functools import cache
from zoneinfo import ZoneInfo

import pytest
from croniter import croniter

from perfectschedctl.cli import main
from perfectschedd.schedules import cron, preview
from perfectschedd.schedules.policy import jitter_offset
from perfectschedd.vocabulary.fields import PREVIEW_COUNT

ZONES = ("Europe/Berlin", "America/New_York", "Australia/Lord_Howe", "UTC",
         "Asia/Kolkata", "Pacific/Chatham", "America/Santiago", "Antarctica/Troll",
         "Europe/London", "America/St_Johns")
# Random cases: make test's run, and make check's (test-slow) with other seeds.
CASES = 300
CASES_SLOW = 2000
YEAR_START, YEAR_END = 2024, 2031


def run_next(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


@cache
def transitions(tz: str) -> list[int]:
    """The instants at which the zone's UTC offset changes, 2024-2030 (to the hour)."""
    zone = ZoneInfo(tz)
    found: list[int] = []
    t = int(datetime(YEAR_START, 1, 1, tzinfo=UTC).timestamp())
    end = int(datetime(YEAR_END, 1, 1, tzinfo=UTC).timestamp())
    offset = datetime.fromtimestamp(t, zone).utcoffset()
    while t < end:
        t += 3600
        now = datetime.fromtimestamp(t, zone).utcoffset()
        if now != offset:
            found.append(t)
            offset = now
    return found


def instants(wall: datetime, zone: ZoneInfo) -> list[int]:
    """Every instant whose local time in `zone` is `wall` (brute force over the offsets
    the zone uses within a day of it)."""
    naive_utc = int(wall.replace(tzinfo=UTC).timestamp())
    offsets = {datetime.fromtimestamp(naive_utc + h * 1800, zone).utcoffset()
               for h in range(-52, 53)}
    out = []
    for off in offsets:
        assert off is not None
        ts = naive_utc - int(off.total_seconds())
        if datetime.fromtimestamp(ts, zone).replace(tzinfo=None) == wall:
            out.append(ts)
    return sorted(out)


def oracle(expr: str, tz: str, start: int, n: int) -> list[dict[str, object]]:
    """The first n fire times at or after `start`: (time, repeated, the gap times
    skipped just before it)."""
    zone = ZoneInfo(tz)
    wall = datetime.fromtimestamp(start - 1, UTC).astimezone(zone).replace(tzinfo=None)
    it = croniter(cron.normalize(expr), wall - timedelta(hours=4))
    events: list[tuple[int, int | None]] = []
    gaps: list[datetime] = []
    last_wall: datetime | None = None
    while True:
        w = it.get_next(datetime)
        if last_wall is not None and w > last_wall + timedelta(hours=4):
            break
        found = instants(w, zone)
        if not found and w > wall:
            gaps.append(w)
        events += [(ts, i + 1 if len(found) == 2 else None) for i, ts in enumerate(found)]
        if last_wall is None and sum(ts >= start for ts, _ in events) >= n:
            last_wall = w
    fires = sorted(e for e in events if e[0] >= start)[:n]
    out: list[dict[str, object]] = []
    previous = wall
    for ts, rep in fires:
        here = datetime.fromtimestamp(ts, UTC).astimezone(zone).replace(tzinfo=None)
        out.append({"scheduled_time": ts, "repeated": rep,
                    "skipped_before": [g.isoformat() for g in gaps if previous < g < here]})
        previous = max(previous, here)
    return out


def _item(rng: random.Random, low: int, high: int, hot: tuple[int, ...]) -> str:
    r = rng.random()
    if r < 0.3:
        return "*" if rng.random() < 0.5 else f"*/{rng.choice((2, 3, 5, 10, 15, 20, 30))}"
    if r < 0.5:
        a = rng.randint(low, high)
        return f"{a}-{rng.randint(a, high)}" + (f"/{rng.randint(1, 4)}"
                                                if rng.random() < 0.3 else "")
    return str(rng.choice(hot) if rng.random() < 0.6 else rng.randint(low, high))


def random_expression(rng: random.Random) -> str:
    """Mostly times that DST changes touch (hours 0-3, half hours), sometimes days."""
    if rng.random() < 0.03:
        return f"@every {rng.choice(('90s', '5m', '1h30m', '2h', '1d'))}"
    minute = ",".join(_item(rng, 0, 59, (0, 15, 30, 45)) for _ in range(rng.choice((1, 1, 2))))
    hour = ",".join(_item(rng, 0, 23, (0, 1, 2, 3)) for _ in range(rng.choice((1, 1, 2))))
    dom, month, dow = "*", "*", "*"
    r = rng.random()
    if r < 0.15:
        dom = rng.choice(("L", "1", "1-15", "*/2", "28"))
    elif r < 0.3:
        dow = rng.choice(("0", "7", "1-5", "SAT,SUN", "5L", "L0", "0#1", "FRI#2", "mon-fri"))
    elif r < 0.36:
        month = rng.choice(("3,4,10,11", "MAR-APR", "9-11", "*/3"))
    return " ".join((minute, hour, dom, month, dow))


@pytest.mark.parametrize(("seed", "cases"), [
    (28, CASES), pytest.param(29, CASES_SLOW, marks=pytest.mark.slow)])
def test_next_matches_the_croniter_oracle_across_dst(
        capsys: pytest.CaptureFixture[str], seed: int, cases: int) -> None:
    rng = random.Random(seed)
    checked = gaps_seen = repeats_seen = 0
    while checked < cases:
        expr, tz = random_expression(rng), rng.choice(ZONES)
        if rng.random() < 0.5 and transitions(tz):
            start = rng.choice(transitions(tz)) + rng.randint(-2 * 86400, 2 * 86400)
        else:
            start = rng.randint(int(datetime(YEAR_START, 1, 1, tzinfo=UTC).timestamp()),
                                int(datetime(YEAR_END - 1, 1, 1, tzinfo=UTC).timestamp()))
        n = rng.randint(1, 12)
        code, out, err = run_next(capsys, "--json", "next", "--cron", expr, "-t", tz,
                                  "-s", str(start), "-n", str(n))
        assert code == 0, (expr, tz, start, err)
        got = json.loads(out)
        assert got["cron"] == expr and got["timezone"] == tz
        if cron.period(expr) is not None:
            step = cron.period(expr)
            assert [t["scheduled_time"] for t in got["times"]] == \
                [start + i * step for i in range(n)]
            assert all(t["repeated"] is None and not t["skipped_before"]
                       for t in got["times"])
        else:
            want = oracle(expr, tz, start, n)
            assert [{k: t[k] for k in ("scheduled_time", "repeated", "skipped_before")}
                    for t in got["times"]] == want, (expr, tz, start, n)
        for t in got["times"]:
            # The local time shown with its offset names the same instant.
            assert datetime.fromisoformat(t["scheduled_local"]).timestamp() == \
                t["scheduled_time"]
            assert t["run_time"] == t["scheduled_time"]  # --cron: no delay, no jitter
            gaps_seen += len(t["skipped_before"])
            repeats_seen += t["repeated"] is not None
        checked += 1
    # The DST cases were really there.
    assert gaps_seen > 5 and repeats_seen > 5, (gaps_seen, repeats_seen)


def test_people_see_offsets_gaps_and_repeats(capsys: pytest.CaptureFixture[str]) -> None:
    # New York, 1 Nov 2026: 01:00-01:59 happens twice (EDT, then EST).
    code, out, _ = run_next(capsys, "next", "--cron", "30 1 * * *", "-t", "America/New_York",
                            "-s", "1793491200", "-n", "3")  # 2026-10-31T22:00 UTC
    assert code == 0
    assert out.splitlines() == [
        "2026-11-01T01:30:00-04:00  1793511000  (repeated local time, first of two)",
        "2026-11-01T01:30:00-05:00  1793514600  (repeated local time, second of two)",
        "2026-11-02T01:30:00-05:00  1793601000"]
    # Lord Howe, 5 Oct 2025: clocks go from 02:00 to 02:30 (a half-hour shift).
    code, out, _ = run_next(capsys, "next", "--cron", "15 2 * * *", "-t",
                            "Australia/Lord_Howe", "-s", "1759500000", "-n", "2")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("2025-10-04T02:15:00+10:30")
    assert lines[1] == ("skipped 2025-10-05T02:15:00: no such local time in "
                        "Australia/Lord_Howe (DST gap)")
    assert lines[2].startswith("2025-10-06T02:15:00+11:00")


@pytest.mark.parametrize("args, message", [
    (("--cron", "61 * * * *"), "perfectschedctl: cron: minute '61' is out of range 0-59\n"),
    (("--cron", "0 0 * * *", "-t", "Mars/Olympus"),
     "perfectschedctl: timezone: unknown time zone 'Mars/Olympus'\n"),
    (("--cron", "@every 0s"), "perfectschedctl: cron: @every: duration '0s' is shorter "
                              "than 1s\n"),
    (("--cron", "0 0 15W * *"), None),
    (("k", "--cron", "* * * * *"), "perfectschedctl: next: give a KEY or --cron EXPR (one "
                                   "of them)\n"),
    ((), "perfectschedctl: next: give a KEY or --cron EXPR (one of them)\n"),
])
def test_bad_next_is_one_line_and_exit_1(capsys: pytest.CaptureFixture[str],
                                         args: tuple[str, ...], message: str | None) -> None:
    code, out, err = run_next(capsys, "next", *args)
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and err.startswith("perfectschedctl: ")
    if message is not None:
        assert err == message


@pytest.mark.parametrize("count", ["0", "1001", "x"])
def test_count_is_bounded(capsys: pytest.CaptureFixture[str], count: str) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["next", "--cron", "* * * * *", "-n", count])
    assert exited.value.code == 2
    assert "1 to 1000" in capsys.readouterr().err or count == "x"


def test_default_is_five_from_now(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_next(capsys, "--json", "next", "--cron", "@hourly")
    times = [t["scheduled_time"] for t in json.loads(out)["times"]]
    assert code == 0 and len(times) == PREVIEW_COUNT == 5
    assert all(b - a == 3600 for a, b in zip(times, times[1:], strict=False))


def test_a_schedule_shows_delay_jitter_and_the_stored_first_run() -> None:
    info = {"key": "k", "cron": "@every 10m", "timezone": "Asia/Tokyo", "delay": 5,
            "jitter": 60, "next_time": 1_000_000_000, "next_run_time": 1_000_000_200,
            "owner": None}
    offset = jitter_offset("k", 60)
    fires = preview.of_schedule(info, 3)
    assert [f.scheduled_time for f in fires] == [1_000_000_000, 1_000_000_600,
                                                 1_000_001_200]
    # The first as stored (--at, a retry's wait), the others as the worker will set them.
    assert [f.run_time for f in fires] == [1_000_000_200, 1_000_000_605 + offset,
                                           1_000_001_205 + offset]
    assert fires[0].as_dict("Asia/Tokyo")["run_local"].endswith("+09:00")
    # While its occurrence runs, the next ones follow it.
    running = preview.of_schedule({**info, "owner": "h:1"}, 2)
    assert [f.scheduled_time for f in running] == [1_000_000_600, 1_000_001_200]
