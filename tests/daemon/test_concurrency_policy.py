"""The concurrency policy (SPEC "Schedule policies", "Execution guarantees") and `run KEY`
behind a running occurrence, against real daemons on SQLite and PostgreSQL.

Several occurrences are due at once by a start in the past on a per-minute cron (misfire
all: they catch up oldest first), so nothing waits for the wall clock.  Each job appends
"start|end|stopped KEY SCHEDULED_TIME TIME" to one log (O_APPEND: lines never
interleave): the overlaps are read from the jobs' own stamps."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import YEARLY, Daemon, lines, sh, wait_until
from old_release import OldRelease

import perfectschedd

# Their PostgreSQL and MariaDB runs are make check's (conftest: slow_on_servers).
pytestmark = pytest.mark.slow_on_servers

POLL = 0.5
# The job: $1 is the key it runs under (KEY, or KEY@run-... for a row of its own).
JOB = """out={out}
stamp() {{ echo "$1 $2 $PERFECTSCHED_SCHEDULED_TIME $(date +%s.%N)" >> $out; }}
trap 'stamp stopped "$1"; exit 143' TERM
stamp start "$1"
sleep {seconds} &
wait $!
stamp end "$1"
"""


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgresql)])
def url(request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue("pg_url" if request.param == "postgresql"
                                       else "sqlite_url"))


def job_daemon(daemon_factory: Any, url: str, out: Path, seconds: float) -> Daemon:
    return daemon_factory({"workers": 2, "concurrency": 4, "poll_interval": POLL,
                           "alive_time": 6, "routes": [sh("t", JOB.format(
                               out=out, seconds=seconds))]}, url=url).start()


def stamps(out: Path) -> list[tuple[str, str, int, float]]:
    """(what, key, scheduled_time, at) of each line of the job log, in order."""
    return [(w, k, int(s), float(at)) for w, k, s, at in (ln.split() for ln in lines(out))]


def spans(out: Path) -> dict[str, tuple[float, float | None]]:
    """Each run's (start, end) by the key it ran under; end None while it runs."""
    found: dict[str, tuple[float, float | None]] = {}
    for what, key, _, at in stamps(out):
        found[key] = (at, None) if what == "start" else (found[key][0], at)
    return found


def overlapping(found: dict[str, tuple[float, float | None]]) -> list[tuple[str, str]]:
    """Pairs of runs whose spans overlap (an unfinished run counts as running now)."""
    now = time.time()
    items = sorted(found.items(), key=lambda kv: kv[1][0])
    return [(a, b) for i, (a, (_, end_a)) in enumerate(items) for b, (start_b, _) in
            items[i + 1:] if start_b < (end_a if end_a is not None else now)]


def history(d: Daemon, key: str) -> list[dict[str, Any]]:
    with perfectschedd.open(str(d.config_path)) as sc:
        return sc.store.history(key, 100)


def missed(n: int) -> tuple[list[int], str]:
    """The last `n` whole minutes up to now (the current one included) and a cron of
    those minutes only: `n` occurrences due at once from a --start at the first, and no
    other for the next hour."""
    while time.time() % 60 > 55:  # not at a minute's edge
        time.sleep(1)
    now = int(time.time()) // 60 * 60
    due = [now - 60 * i for i in range(n - 1, -1, -1)]
    return due, f"{','.join(str(t // 60 % 60) for t in due)} * * * *"


@pytest.mark.parametrize("policy", ["allow", "forbid"])
def test_allow_runs_occurrences_side_by_side_and_forbid_in_turn(
        daemon_factory: Any, url: str, tmp_path: Path, policy: str) -> None:
    """Two missed occurrences of one schedule: under allow both run at once, each on its
    own row (KEY@run-...) and recorded once; under forbid (the default) one after the
    other under the schedule's own key.  `run KEY` under allow starts at once beside."""
    out = tmp_path / "runs"
    d = job_daemon(daemon_factory, url, out, seconds=4)
    due, expr = missed(2)
    args = ["--concurrency", policy] if policy == "allow" else []
    d.ctl("add", "k", "t", expr, "-s", str(due[0]), *args)
    assert d.ctl_json("show", "k")["concurrency"] == policy
    assert [s["concurrency"] for s in d.ctl_json("list") if s["key"] == "k"] == [policy]
    wait_until(lambda: sum(w == "end" for w, *_ in stamps(out)) >= 2, timeout=40,
               what="both occurrences to end")
    ran = [(k, t) for w, k, t, _ in stamps(out) if w == "start"]
    assert sorted(t for _, t in ran[:2]) == due
    assert len({t for _, t in ran}) == len(ran)  # each occurrence ran once
    both = {k: v for k, v in spans(out).items() if k in {k for k, _ in ran[:2]}}
    if policy == "allow":
        assert all(k.startswith("k@run-") for k, _ in ran), ran
        assert overlapping(both), both
    else:
        assert [k for k, _ in ran] == ["k"] * len(ran)
        assert not overlapping(spans(out)), spans(out)

    def recorded() -> list[int]:
        return sorted(r["scheduled_time"] for r in history(d, "k")
                      if r["scheduled_time"] in due)
    wait_until(lambda: recorded() == due, timeout=15, what="each recorded once")
    assert {r["outcome"] for r in history(d, "k")} <= {"success"}
    if policy == "allow":
        # Its own row went with its end; the schedule itself stays.
        wait_until(lambda: d.ctl_json("show", "k")["extra_runs"] == [], what="rows gone")
        d.ctl("modify", "k", "--cron", YEARLY)
        d.ctl("run", "k")
        wait_until(lambda: any(w == "start" and k.startswith("k@run-") and k not in both
                               for w, k, *_ in stamps(out)), what="an extra run")
        reply = d.ctl("run", "k").stdout
        assert "queued a run of k now" in reply, reply
        wait_until(lambda: len(overlapping({k: v for k, v in spans(out).items()
                                            if k not in both})) >= 1,
                   what="two extra runs at once")
    assert d.stop() == 0
    assert "Traceback" not in d.log(), d.log()[-3000:]


def test_replace_stops_the_running_occurrence(daemon_factory: Any, url: str,
                                              tmp_path: Path) -> None:
    """Three missed occurrences under replace: each stops the one before (TERM; recorded
    `preempted`), the newest runs alone; `run KEY` then replaces it in turn."""
    out = tmp_path / "runs"
    d = job_daemon(daemon_factory, url, out, seconds=120)
    due, expr = missed(3)
    d.ctl("add", "k", "t", expr, "-s", str(due[0]), "--concurrency", "replace")

    def running() -> list[dict[str, Any]]:
        return [r for r in d.status()["running"] if r["key"].startswith("k@run-")]

    def preempted() -> list[int]:
        return sorted(r["scheduled_time"] for r in history(d, "k")
                      if r["outcome"] == "preempted")
    wait_until(lambda: preempted() == due[:2], timeout=30,
               what="the older two recorded preempted")
    wait_until(lambda: len(running()) == 1, what="one running")
    # Every job that started but the newest's was stopped by TERM; the newest runs on.
    started = {t for w, _, t, _ in stamps(out) if w == "start"}
    assert due[2] in started
    wait_until(lambda: {t for w, _, t, _ in stamps(out) if w == "stopped"}
               == started - {due[2]}, what="the stopped jobs' TERM")
    scheduled = {k: t for w, k, t, _ in stamps(out) if w == "start"}
    live = [scheduled[k] for k, (_, end) in spans(out).items() if end is None]
    assert live == [due[2]], spans(out)
    newest = running()[0]["key"]
    reply = d.ctl("run", "k").stdout
    assert "stopping its running occurrence" in reply, reply
    wait_until(lambda: any(w == "stopped" and k == newest for w, k, *_ in stamps(out)),
               what="the extra run to replace the occurrence")
    wait_until(lambda: len(running()) == 1 and running()[0]["key"] != newest,
               what="the extra run alone")
    wait_until(lambda: sum(r["outcome"] == "preempted" for r in history(d, "k")) == 3,
               what="the third preempted")
    # Each says it was replaced, not that its lease was lost and it may run elsewhere.
    # Read before the stop: the last run is stopped by it, and on a machine loaded enough
    # to hold its lease's renewal back 2.5 s (alive_time 6) it fences itself first
    # (preempted, "lease could not be renewed in time"), as it must; seen once in make test.
    replaced = "replaced by a newer occurrence (concurrency: replace)"
    errors = [r["error"] for r in history(d, "k") if r["outcome"] == "preempted"]
    assert len(errors) == 3 and all(e.startswith(f"stopped: {replaced}") for e in errors), errors
    assert d.stop() == 0
    assert "Traceback" not in d.log(), d.log()[-3000:]
    assert d.log().count(f": {replaced}; stopping its run") == 3
    assert "lease lost" not in d.log(), d.log()[-3000:]


def test_run_key_behind_a_running_occurrence_goes_next(daemon_factory: Any, url: str,
                                                       tmp_path: Path) -> None:
    """forbid: `run KEY` while an occurrence of KEY runs and another (missed) one is due
    too: the extra run starts next, within a poll interval (and a margin) of the running
    one's end, before the missed one; the log says so twice (queued, started), not once
    per second while it waits."""
    out = tmp_path / "runs"
    d = job_daemon(daemon_factory, url, out, seconds=4)
    due, expr = missed(2)
    d.ctl("add", "k", "t", expr, "-s", str(due[0]))
    wait_until(lambda: stamps(out), what="the first occurrence running")
    reply = d.ctl_json("run", "k")
    run_key = reply["run_key"]
    assert reply["after_running"] is True
    d.wait_log(f"key={run_key}: queued")
    entry = next(r for r in d.ctl_json("show", "k")["extra_runs"] if r["run_key"] == run_key)
    assert entry["queued"] != entry["running"], entry
    if not any(w == "end" for w, *_ in stamps(out)):  # the first had not ended at `show`
        assert entry["queued"], entry
    wait_until(lambda: sum(w == "end" for w, *_ in stamps(out)) >= 3, timeout=40,
               what="three runs")
    log = stamps(out)
    starts = [(k, t, at) for w, k, t, at in log if w == "start"]
    assert [k for k, *_ in starts][:3] == ["k", run_key, "k"], starts
    assert [t for _, t, _ in starts][::2][:2] == due
    first_end = next(at for w, k, t, at in log if w == "end" and t == due[0])
    assert 0 <= starts[1][2] - first_end <= POLL + 3.0, (first_end, starts[1])
    assert not overlapping(spans(out)), spans(out)
    about = wait_until(lambda: a if len(a := [ln for ln in d.log().splitlines()
                                               if run_key in ln and "end key=" not in ln]) >= 2
                       else None, what="the extra run's lines in the log")
    assert len(about) == 2, about
    assert "queued" in about[0] and "start key=" in about[1], about
    assert d.stop() == 0
    assert "Traceback" not in d.log(), d.log()[-3000:]


def test_a_queued_run_is_given_back_when_the_daemon_stops(daemon_factory: Any,
                                                         sqlite_url: str,
                                                         tmp_path: Path) -> None:
    """A run queued behind a running occurrence is held (no task thread): a stop gives
    it back untried, to run after a start, and nothing of it ran."""
    out = tmp_path / "runs"
    d = job_daemon(daemon_factory, sqlite_url, out, seconds=120)
    d.ctl("add", "k", "t", YEARLY, "--at", "0")
    wait_until(lambda: stamps(out), what="the occurrence running")
    run_key = d.ctl_json("run", "k")["run_key"]
    d.wait_log(f"key={run_key}: queued")
    with perfectschedd.open(str(d.config_path)) as sc:
        assert [r.key for r in sc.extra_runs("k") if r.owner is not None] == [run_key]
    # status lists it as queued, not as running (0.2.0's first cut listed it running)
    status = d.ctl_json("status")
    assert [r["key"] for r in status["running"]] == ["k"], status["running"]
    assert [r["key"] for r in status["queued"]] == [run_key], status["queued"]
    assert "queued behind a running occurrence of their schedule: 1" in d.ctl("status").stdout
    # ... and list says so too (it said running)
    states = {r["key"]: r["state"] for r in d.ctl_json("list")}
    assert states == {"k": "running", run_key: "queued"}, states
    assert [line.split()[-2] for line in d.ctl("list", "--prefix", run_key).stdout
            .splitlines()[1:-1]] == ["queued"]
    assert d.stop() == 0
    with perfectschedd.open(str(d.config_path)) as sc:
        rows = sc.extra_runs("k")
        assert [(r.key, r.owner, r.attempt) for r in rows] == [(run_key, None, 0)]
    assert not [k for w, k, *_ in stamps(out) if k == run_key]
    assert "Traceback" not in d.log(), d.log()[-3000:]


def test_a_queued_run_goes_to_the_new_workers_at_a_reload(daemon_factory: Any, url: str,
                                                          tmp_path: Path) -> None:
    """A reload drains: the running occurrence goes on in an old worker, the run queued
    behind it is given back to the new ones, and still starts next, once it has ended."""
    out = tmp_path / "runs"
    d = job_daemon(daemon_factory, url, out, seconds=6)
    d.ctl("add", "k", "t", YEARLY, "--at", "0")
    wait_until(lambda: stamps(out), what="the occurrence running")
    run_key = d.ctl_json("run", "k")["run_key"]
    d.wait_log(f"key={run_key}: queued")
    d.ctl("reload")
    wait_until(lambda: sum(w == "end" for w, *_ in stamps(out)) == 2, timeout=40,
               what="both runs")
    log = stamps(out)
    assert [(w, k) for w, k, *_ in log] == [("start", "k"), ("end", "k"),
                                            ("start", run_key), ("end", run_key)], log
    assert log[2][3] - log[1][3] <= POLL + 3.0, log
    wait_until(lambda: [r["outcome"] for r in history(d, "k")] == ["success", "success"],
               what="both recorded once")
    assert d.stop() == 0
    assert "Traceback" not in d.log(), d.log()[-3000:]


def test_concurrency_allow_is_refused_while_a_0_1_0_host_works(
        daemon_factory: Any, sqlite_url: str, old_release: OldRelease,
        tmp_path: Path) -> None:
    """A 0.1.0 host sharing the database would run the rows of allow and replace in turn
    (or never stop one): add, modify and apply refuse them in one line naming it, and
    nothing stored changes; forbid is still fine."""
    old = old_release
    d_old: Daemon = daemon_factory(
        {"node_name": "old-host", "routes": [sh("slow", "sleep 60")]}, url=sqlite_url,
        command=old.daemon_command, ctl_command=old.ctl_command)
    old.ctl("-c", str(d_old.config_path), "init")
    d_old.start()
    d = daemon_factory({"routes": [sh("t", "true")]}, url=sqlite_url).start()
    d.ctl("add", "busy", "slow", YEARLY, "--at", "0")
    wait_until(lambda: any(r["key"] == "busy" and r["owner"].startswith("old-host:")
                           for r in d.status()["running"]), what="0.1.0 at work")
    d.ctl("add", "k", "t", "@hourly")

    def listed() -> list[dict[str, Any]]:  # busy's lease moves: 0.1.0 renews it
        return [s for s in d.ctl_json("list") if s["key"] != "busy"]
    before = listed()
    entries = tmp_path / "entries.yml"
    entries.write_text("- {key: f, type: t, cron: '@daily', concurrency: replace}\n")
    for args, feature in ((["add", "n", "t", "@hourly", "--concurrency", "allow"],
                           "--concurrency allow"),
                          (["modify", "k", "--concurrency", "replace"],
                           "--concurrency replace"),
                          (["apply", str(entries)], "f: concurrency: replace")):
        res = d.ctl(*args, check=False)
        assert res.returncode == 1, res
        message = res.stderr.strip()
        assert len(message.splitlines()) == 1, message
        assert feature in message and "old-host (0.1.0)" in message, message
    # A bad value is refused for what it is, first.
    res = d.ctl("modify", "k", "--concurrency", "sometimes", check=False)
    assert res.returncode == 1 and "concurrency:" in res.stderr and "old-host" not in res.stderr
    assert listed() == before
    d.ctl("modify", "k", "--concurrency", "forbid")
    assert d.ctl_json("show", "k")["concurrency"] == "forbid"
    assert d.stop() == 0
    assert "Traceback" not in d.log(), d.log()[-3000:]
    assert d_old.stop() == 0
