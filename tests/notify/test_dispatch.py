"""When a run is told (notify/dispatch.py), with a real SQLite history and a real exec
notifier: state changes by default, every failure on request, output on request, the
notifier's precedence, and a success after a success costing no query.  Under a flood:
root's lane, members in turn, a key's runs merged while it waits, bounds per member."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import shared_dir
from notify_receivers import wait_for

from perfectschedd import config
from perfectschedd.notify import dispatch
from perfectschedd.notify.dispatch import STATE_OUTCOMES, Dispatcher
from perfectschedd.schedules.collection import ScheduleCollection


def make(tmp_path: Path, **extra: Any) -> tuple[Dispatcher, ScheduleCollection, Path,
                                                 list[str]]:
    # Under root the notifiers run as notify_user (nobody): a directory it may write to.
    told = shared_dir() / "told"
    argv = ["/bin/sh", "-c", f'echo "$PERFECTSCHED_KEY $PERFECTSCHED_EVENT" >> {told}']
    raw = {"type": "rdb_compat", "url": f"sqlite:///{tmp_path / 'db.sqlite'}",
           "notifiers": {"log": {"exec": argv},
                         "every": {"exec": argv, "when": "every-failure"},
                         "out": {"exec": argv, "when": "output"}},
           "notify": "log", **extra}
    cfg = config.from_mapping(raw)
    sc = ScheduleCollection(cfg)
    sc.init()
    queries: list[str] = []

    def previous(key: str, before: float) -> str | None:
        queries.append(key)
        return sc.store.last_outcome(key, before, STATE_OUTCOMES)

    return Dispatcher(cfg, previous), sc, told, queries


def runs(key: str, outcomes: list[str], start: float = 1000.0, **extra: Any
         ) -> list[dict[str, Any]]:
    return [{"key": key, "type": "t", "scheduled_time": 0, "attempt": i + 1,
             "started_at": start + 10 * i, "finished_at": start + 10 * i + 1,
             "outcome": o, "worker": "w", "unit": None, **extra}
            for i, o in enumerate(outcomes)]


def record(d: Dispatcher, sc: ScheduleCollection, batch: list[dict[str, Any]]) -> None:
    sc.store.record_runs(batch)  # as the pipeline does: written, then told
    d.on_recorded(batch)


def told(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def settle(d: Dispatcher) -> None:
    assert d.drain(10) == 0


def idle(d: Dispatcher) -> None:
    with d.cond:
        assert d.cond.wait_for(lambda: all(lane.idle() for lane in d.lanes), 10)


@pytest.mark.parametrize(("notify", "want"), [
    (None, ["k failure", "k recovery"]),
    ("every", ["k failure"] * 5 + ["k recovery"]),
])
def test_five_failures_then_a_recovery(tmp_path: Path, notify: str | None,
                                       want: list[str]) -> None:
    d, sc, path, _ = make(tmp_path)
    extra = {"notify": notify} if notify else {}
    batch = runs("k", ["success", "failed", "timeout", "failed", "lost", "failed",
                       "success", "success"], **extra)
    for r in batch:  # one batch per run, as a slow schedule's runs come: each told
        record(d, sc, [r])  # before the next one (else they are coalesced: see below)
        idle(d)
    settle(d)
    assert told(path) == want


def test_the_history_says_what_came_before_this_worker(tmp_path: Path) -> None:
    d, sc, path, queries = make(tmp_path)
    sc.store.record_runs(runs("k", ["failed"], start=100.0))  # another worker's failure
    record(d, sc, runs("k", ["failed", "success"], start=200.0))
    settle(d)
    # The failure continues the one before it: only the recovery is told.
    assert told(path) == ["k recovery"]
    assert queries == ["k"]  # once for the key, then from memory


def test_a_success_after_a_success_costs_no_query_and_no_thread_work(tmp_path: Path) -> None:
    d, sc, path, queries = make(tmp_path)
    record(d, sc, runs("k", ["success"]))
    settle(d)
    queued_before = d.pending()
    started = time.perf_counter()
    for i in range(10_000):
        d.on_recorded([{"key": "k", "outcome": "success", "started_at": 2000.0 + i}])
    per_run = (time.perf_counter() - started) / 10_000
    assert d.pending() == queued_before == 0
    assert queries == ["k"] and told(path) == []
    assert per_run < 50e-6  # a dict look-up, not a query (SQLite takes ~100 us at least)


def test_precedence_schedule_then_entry_then_route_then_default(tmp_path: Path) -> None:
    d, _, _, _ = make(tmp_path, routes=[
        {"type": "r", "exec": ["/bin/true"], "notify": "every"},
        {"type": "quiet", "exec": ["/bin/true"], "notify": "none"}])
    d.entry_notify = {"file-k": d.config.notifier("out")}  # as FileSchedules.load sets
    assert d.resolve({"key": "x", "type": "t"}).name == "log"             # the default
    assert d.resolve({"key": "x", "type": "r"}).name == "every"           # the route's
    assert d.resolve({"key": "file-k", "type": "r"}).name == "out"        # the entry's
    assert d.resolve({"key": "file-k", "type": "r", "notify": "log"}).name == "log"
    assert d.resolve({"key": "x", "type": "quiet"}) is None               # none
    # A name this host does not know: logged once, the next level decides.
    assert d.resolve({"key": "x", "type": "r", "notify": "elsewhere"}).name == "every"


def test_output_mode_tells_runs_that_printed(tmp_path: Path) -> None:
    d, sc, path, queries = make(tmp_path, notify="out")
    record(d, sc, runs("a", ["success"], output="hello\n"))
    record(d, sc, runs("b", ["success"], output=""))
    record(d, sc, runs("c", ["failed"]))
    settle(d)
    assert told(path) == ["a output"]
    assert queries == []  # output mode needs no history


def test_a_notifier_that_keeps_failing_is_counted_and_retried(tmp_path: Path) -> None:
    d, sc, _, _ = make(tmp_path, notifiers={"bad": {"exec": ["/bin/false"]}}, notify="bad")
    d_runs = runs("k", ["failed"])
    tries: list[float] = []
    real = d._send

    def counting(n: Any, m: Any) -> None:
        tries.append(time.monotonic())
        real(n, m)

    d._send = counting
    record(d, sc, d_runs)
    wait_for(lambda: len(tries) == 3, 15, "three tries")
    assert tries[1] - tries[0] >= 0.9 and tries[2] - tries[1] >= 3.9
    settle(d)


def make_batched(tmp_path: Path) -> tuple[Dispatcher, ScheduleCollection, Path,
                                          list[int]]:
    """As make(), with the many-keys query the worker gives (one call per batch)."""
    d, sc, path, queries = make(tmp_path)
    calls: list[int] = []

    def previous_many(pairs: list[tuple[str, float]]) -> dict[str, str | None]:
        calls.append(len(pairs))
        return sc.store.last_outcomes(pairs, STATE_OUTCOMES)

    d.drain(1)  # make()'s dispatcher has no batch query: a new one
    return (Dispatcher(d.config, d.previous, previous_many=previous_many), sc, path,
            calls)


def test_a_first_success_after_a_failure_elsewhere_is_a_recovery(tmp_path: Path) -> None:
    """The run before this worker's first success of the key failed (another worker,
    an earlier occurrence given up): told as the recovery, from one batch query."""
    d, sc, path, calls = make_batched(tmp_path)
    sc.store.record_runs(runs("k", ["failed"], start=100.0) + runs("ok", ["success"],
                                                                   start=100.0))
    record(d, sc, runs("k", ["success"], start=200.0) + runs("ok", ["success"], start=200.0)
           + runs("new", ["success"], start=200.0))
    settle(d)
    assert told(path) == ["k recovery"]
    assert calls == [3]


def test_a_burst_of_new_keys_costs_a_query_per_batch_and_drops_nothing(
        tmp_path: Path) -> None:
    """5,000 first successes (a burst of new one-off schedules): none is told, the queue
    never fills (nothing dropped), and the history is asked once per 500 keys."""
    d, sc, path, calls = make_batched(tmp_path)
    burst = [r for i in range(5000) for r in runs(f"b{i}", ["success"], start=300.0)]
    for i in range(0, len(burst), 250):  # as the pipeline's history batches come
        record(d, sc, burst[i:i + 250])
    settle(d)
    assert told(path) == []
    assert sum(calls) == 5000 and len(calls) <= 5000 // 500 + len(burst) // 250
    assert d.pending() == d.unverified() == 0


def test_last_outcomes_agrees_with_last_outcome(tmp_path: Path) -> None:
    _, sc, _, _ = make(tmp_path)
    sc.store.record_runs(runs("a", ["failed", "success", "skipped"], start=100.0)
                         + runs("b", ["success", "timeout"], start=100.0))
    pairs = [("a", 115.0), ("a", 125.0), ("b", 500.0), ("b", 105.0), ("c", 500.0)]
    for key, before in pairs:
        assert sc.store.last_outcomes([(key, before)], STATE_OUTCOMES) == {
            key: sc.store.last_outcome(key, before, STATE_OUTCOMES)}, (key, before)
    assert sc.store.last_outcomes(pairs[1:3] + pairs[4:], STATE_OUTCOMES) == {
        "a": "success", "b": "timeout", "c": None}


def own_rows(base: str, outcomes: list[str], start: float) -> list[dict[str, Any]]:
    """Runs each on a row of its own, as an allow schedule's occurrences (KEY@run-...)."""
    return [r for i, o in enumerate(outcomes)
            for r in runs(f"{base}@run-{int(start) + i}-ab", [o], start=start + 10 * i)]


def test_runs_on_rows_of_their_own_make_their_schedules_state(tmp_path: Path) -> None:
    """An allow schedule's occurrences (and extra runs) have keys of their own; the state
    is still the schedule's: failures after another worker's failure of the schedule are
    not told again, and the first success is its recovery."""
    d, sc, path, queries = make(tmp_path)
    sc.store.record_runs(own_rows("k", ["failed"], start=100.0))  # another worker's
    for r in own_rows("k", ["failed", "timeout", "success", "success"], start=200.0):
        record(d, sc, [r])
    settle(d)
    assert told(path) == ["k@run-202-ab recovery"]
    assert len(queries) == 1  # once for the schedule, then from memory


def test_a_first_success_of_a_row_of_its_own_after_a_failure_elsewhere(
        tmp_path: Path) -> None:
    """The batched check of first successes: the schedule's run before failed on another
    worker (on a row of its own too); a schedule differing in case only is not it (LIKE
    ignores case on SQLite)."""
    d, sc, path, _ = make_batched(tmp_path)
    sc.store.record_runs(own_rows("k", ["failed"], start=100.0)
                         + own_rows("j", ["failed"], start=100.0)
                         + own_rows("J", ["success"], start=150.0))
    record(d, sc, own_rows("k", ["success"], start=200.0) + own_rows("J", ["success"],
                                                                     start=200.0))
    settle(d)
    assert told(path) == ["k@run-200-ab recovery"]
    assert sc.store.last_outcome("j@run-300-ab", 300.0, STATE_OUTCOMES) == "failed"
    assert sc.store.last_outcome("J@run-300-ab", 300.0, STATE_OUTCOMES) == "success"


# -- fair under a flood (issue 38): lanes, turns, coalescing, bounds ---------------------

class HeldSender:
    """A sender that records each message and holds the sends of `held` creators until
    released (a slow receiver, with no clock to race)."""

    def __init__(self, held: set[Any]) -> None:
        self.held = held
        self.release = threading.Event()
        self.sent: list[tuple[Any, str, str, int]] = []  # (creator, key, event, coalesced)
        self.lock = threading.Lock()

    def __call__(self, notifier: Any, message: Any) -> None:
        run = message.run
        if run.get("creator") in self.held:
            self.release.wait(20)
        with self.lock:
            self.sent.append((run.get("creator"), run["key"], message.event,
                              message.document()["coalesced"]))

    def keys(self, creator: Any = None) -> list[str]:
        with self.lock:
            return [k for c, k, _, _ in self.sent if creator is None or c == creator]


def fair(tmp_path: Path, held: set[Any]) -> tuple[Dispatcher, ScheduleCollection,
                                                  HeldSender]:
    d, sc, _, _ = make(tmp_path)
    d.drain(1)
    sender = HeldSender(held)
    return Dispatcher(d.config, d.previous, send=sender), sc, sender


def failing(keys: list[str], creator: Any, start: float = 1000.0) -> list[dict[str, Any]]:
    return [r for k in keys for r in runs(k, ["failed"], start=start, creator=creator)]


def test_roots_failure_is_told_while_a_members_flood_waits(tmp_path: Path) -> None:
    """A member's 300 failing schedules, its receiver stuck: root's one failure is told
    at once, from a lane of its own; the member's are all told once it answers."""
    d, sc, sender = fair(tmp_path, held={1000})
    record(d, sc, failing([f"m{i}" for i in range(300)], creator=1000))
    wait_for(lambda: d.pending() == 299, 5, "the member's first send to hang")
    record(d, sc, failing(["root-job"], creator=0, start=2000.0))
    wait_for(lambda: sender.keys(0), 5, "root's notification")
    assert sender.keys() == ["root-job"]  # the member's are still held
    sender.release.set()
    settle(d)
    assert sorted(sender.keys(1000)) == sorted(f"m{i}" for i in range(300))


def test_members_take_turns_and_a_key_waits_once(tmp_path: Path) -> None:
    """Two members' backlogs are told in turn, one run each; the runs of a key that
    keep coming while it waits are merged into one notification of its latest state."""
    d, sc, sender = fair(tmp_path, held={7})
    record(d, sc, failing(["hold"], creator=7))
    wait_for(lambda: d.pending() == 0, 5, "the first send to hang")
    record(d, sc, failing([f"a{i}" for i in range(5)], creator=1001)
           + failing([f"b{i}" for i in range(5)], creator=1002))
    # a0 fails again twice, then succeeds: still one pending run, the success.
    for n, outcome in enumerate(["failed", "timeout", "success"]):
        record(d, sc, runs("a0", [outcome], start=1100.0 + 10 * n, creator=1001))
    assert d.pending() == 10
    sender.release.set()
    settle(d)
    # In turn: a0's turn came first and told nothing (its failures were merged into
    # its latest run, a success, and it was never told failing: nothing to recover).
    assert sender.keys()[1:] == ["b0", "a1", "b1", "a2", "b2", "a3", "b3", "a4", "b4"]


def test_a_coalesced_failure_says_how_many_runs_it_stands_for(tmp_path: Path) -> None:
    d, sc, sender = fair(tmp_path, held={7})
    record(d, sc, failing(["hold"], creator=7))
    wait_for(lambda: d.pending() == 0, 5, "the first send to hang")
    for n in range(4):
        record(d, sc, runs("k", ["failed"], start=1100.0 + 10 * n, creator=1001))
    sender.release.set()
    settle(d)
    with sender.lock:
        assert [s for s in sender.sent if s[1] == "k"] == [(1001, "k", "failure", 3)]


def test_one_members_backlog_is_bounded_and_drops_only_its_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dispatch, "PENDING_PER_CREATOR", 20)
    d, sc, sender = fair(tmp_path, held={1000})
    record(d, sc, failing(["first"], creator=1000))
    wait_for(lambda: d.pending() == 0, 5, "the first send to hang")
    record(d, sc, failing([f"m{i}" for i in range(50)], creator=1000)
           + failing(["other"], creator=1001))
    assert d.pending() == 21  # 20 of the member's, and the other member's one
    sender.release.set()
    idle(d)
    assert len(sender.keys(1000)) == 21 and sender.keys(1001) == ["other"]
    # A dropped failure is not forgotten: the key's next failure is told, although
    # the history says the run before it failed too.
    record(d, sc, runs("m40", ["failed"], start=5000.0, creator=1000))
    settle(d)
    assert sender.keys(1000)[-1] == "m40"


def test_idle_lanes_sleep(tmp_path: Path) -> None:
    """Both lanes' threads wait on one condition: with nothing to tell, neither may wake
    the other (once they did, for ever: two threads spinning in every daemon with a
    notifier).  This process's CPU time over a second of rest is the test."""
    d, sc, path, _ = make(tmp_path)
    record(d, sc, runs("k", ["failed"]))
    wait_for(lambda: told(path) == ["k failure"], what="the failure told")
    idle(d)
    assert all(lane.thread is not None and lane.thread.is_alive() for lane in d.lanes)
    before = time.process_time()
    time.sleep(1.0)
    assert time.process_time() - before < 0.2  # spinning, it was the whole second
    settle(d)
