"""`pause --all` (SPEC perfectschedctl: a cluster-wide pause stored in the database), with
real daemons on one PostgreSQL database: it holds across a restart, on a second host and
on a host of release 0.1.0 (each row's own `paused` column, which every release obeys);
`resume --all` runs what was missed (each schedule's misfire policy: `all` here, every
occurrence) except schedules paused on their own; `resume --skip-missed` runs nothing
missed, and the next occurrence on time.

Schedules are `* * * * *` started ten minutes ago while everything is paused: ten missed
occurrences each, which any host would run at once if the pause did not hold.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import CTL, Daemon, lines, sh, wait_until
from old_release import OldRelease

from perfectschedd.vocabulary.fields import PAUSED_ALL_REASON

JOB = "job"
BEHIND = 600
# Long enough for every host to poll many times (poll_interval 0.5): were anything
# claimable, it would have run.
WATCH = 4.0


def config(node: str, log: Path) -> dict[str, Any]:
    script = f'echo "$PERFECTSCHED_KEY $PERFECTSCHED_SCHEDULED_TIME $(date +%s)" >> {log}'
    return {"node_name": node, "workers": 2, "poll_interval": 0.5, "alive_time": 10,
            "routes": [sh(JOB, script)]}


def direct(d: Daemon, *args: str) -> str:
    """This release's perfectschedctl on the database of `d`'s config (-c), not a daemon."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PERFECTSCHED_")}
    res = subprocess.run([*CTL, "-c", str(d.config_path), *args], capture_output=True,
                         text=True, timeout=60, env=env)
    assert res.returncode == 0, f"{args} -> {res.returncode}: {res.stdout}{res.stderr}"
    return res.stdout


def runs(log: Path) -> list[tuple[str, int, int]]:
    """(key, scheduled_time, start) of every run so far."""
    return [(k, int(t), int(s)) for k, t, s in (line.split() for line in lines(log))]


def times(log: Path, key: str) -> list[int]:
    return sorted(t for k, t, _ in runs(log) if k == key)


def missed_minutes(start: int, until: float) -> list[int]:
    first = -(-start // 60) * 60
    return list(range(first, int(until) + 1, 60))


def paused_everything(d: Daemon) -> int:
    """Hold everything through `d` and add, while it holds: `k` (ten missed minutes) and
    `own`, then paused on its own (it stays paused after resume --all).  Returns their
    start."""
    out = d.ctl("pause", "--all").stdout
    assert out.startswith("paused everything"), out
    start = int(time.time()) - BEHIND
    for key in ("k", "own"):
        d.ctl("add", key, JOB, "* * * * *", "-s", str(start))
    shown = d.ctl_json("show", "k")
    assert (shown["paused"], shown["paused_reason"]) == (True, PAUSED_ALL_REASON)
    d.ctl("pause", "own")
    return start


def wait_status_paused(d: Daemon, held: bool) -> dict[str, Any]:
    def seen() -> Any:
        status = d.status()
        return status if (status.get("paused_all") is not None) == held else None
    status = wait_until(seen, 30, 0.2, what=f"status of {d.config['node_name']}: paused "
                        f"everything {held}")
    return dict(status)


def check_caught_up(log: Path, start: int, paused_at: float) -> None:
    """resume --all: every minute `k` missed ran, once; `own` ran nothing."""
    want = missed_minutes(start, paused_at)
    wait_until(lambda: set(want) <= set(times(log, "k")), 60, 0.2,
               what=f"the {len(want)} missed runs of k")
    got = times(log, "k")
    assert len(got) == len(set(got)), got  # none twice
    assert times(log, "own") == []


def check_skipped(d: Daemon, log: Path, start: int, resumed: tuple[float, float]) -> None:
    """resume --skip-missed, run between the two times of `resumed`: nothing missed ran;
    each was recorded as skipped; the next occurrence ran on time."""
    resumed_at, resumed_by = resumed
    next_minute = -(-int(resumed_at) // 60) * 60
    wait_until(lambda: times(log, "k"), 80, 0.2, what="the next run of k")
    [(key, scheduled, started)] = [r for r in runs(log) if r[0] == "k"][:1]
    # The minute after the command was typed, or the next one if the resume itself
    # ran past that minute.
    assert scheduled == next_minute or (scheduled == next_minute + 60
                                        and resumed_by >= next_minute), (scheduled, resumed)
    assert started - scheduled <= 15, (scheduled, started)  # on time, not a catch-up
    assert all(t >= resumed_at - 1 for t in times(log, "k")), times(log, "k")
    history = json.loads(direct(d, "--json", "history", "k", "-n", "100"))
    skipped = sorted(h["scheduled_time"] for h in history if h["outcome"] == "skipped")
    assert skipped == missed_minutes(start, scheduled - 1)
    assert times(log, "own") == []


@pytest.mark.slow
@pytest.mark.parametrize("resume", ["catch-up", "skip-missed"])
def test_pause_all_holds_across_a_restart_and_on_a_second_host(
        resume: str, pg_url: str, daemon_factory: Any, tmp_path: Path) -> None:
    log = tmp_path / "runs.log"
    n0 = daemon_factory(config("n0", log), url=pg_url).start()
    n1 = daemon_factory(config("n1", log), url=pg_url).start()
    start = paused_everything(n0)
    paused_at = time.time()
    status = wait_status_paused(n1, True)  # the other host says so too
    assert status["paused_all"]["schedules"] == 1 and status["paused_all"]["by"]
    assert "everything paused (pause --all) since" in n1.ctl("status").stdout
    time.sleep(WATCH)
    assert runs(log) == []
    # a restart of a host: the pause is in the database, not in the daemon
    assert n0.stop() == 0
    n0.start()
    assert wait_status_paused(n0, True)["paused_all"]["schedules"] == 1
    n0.wait_notify(lambda m: m.startswith("STATUS=") and "; everything paused" in m,
                   timeout=30, what="STATUS saying everything is paused")
    time.sleep(WATCH)
    assert runs(log) == []
    if resume == "catch-up":
        assert "resumed everything: 1 schedule(s)" in n1.ctl("resume", "--all").stdout
        check_caught_up(log, start, paused_at)
    else:
        resumed_at = time.time()
        out = n1.ctl("resume", "--all", "--skip-missed").stdout
        assert "missed occurrence(s) skipped" in out, out
        check_skipped(n0, log, start, (resumed_at, time.time()))
    assert wait_status_paused(n0, False)["paused_all"] is None
    assert n1.ctl_json("show", "own")["paused"] is True
    assert n0.alive() and n1.alive()


@pytest.mark.slow
@pytest.mark.parametrize("resume", ["catch-up", "skip-missed"])
def test_pause_all_holds_on_a_0_1_0_host(resume: str, pg_url: str, old_release: OldRelease,
                                          daemon_factory: Any, tmp_path: Path) -> None:
    """A 0.1.0 host obeys the pause (rows paused, as it reads them), and after the resume
    runs what the resume says: here it is the only host left."""
    old, log = old_release, tmp_path / "runs.log"
    n0 = daemon_factory(config("n0", log), url=pg_url, command=old.daemon_command,
                        ctl_command=old.ctl_command)
    assert "created table" in old.ctl("-c", str(n0.config_path), "init").stdout
    n0.start()
    n1 = daemon_factory(config("n1", log), url=pg_url).start()
    start = paused_everything(n1)
    paused_at = time.time()
    assert n1.stop() == 0  # only the 0.1.0 host is left to run anything
    time.sleep(WATCH)
    assert runs(log) == []
    assert n0.ctl_json("show", "k")["paused"] is True  # as 0.1.0 shows it
    # resumed in the database directly (this release's perfectschedctl -c): the 0.1.0
    # host alone runs what follows
    if resume == "catch-up":
        assert "resumed everything" in direct(n1, "resume", "--all")
        check_caught_up(log, start, paused_at)
    else:
        resumed_at = time.time()
        direct(n1, "resume", "--all", "--skip-missed")
        check_skipped(n1, log, start, (resumed_at, time.time()))
    assert n0.ctl_json("show", "own")["paused"] is True
    assert n0.alive()
