"""leases.py: the lease pipeline with a real SQLite file and no worker process (and the
modules that work on it: admission, runs, ending, heartbeat, history_queue, stopping)."""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from perfectschedd import config
from perfectschedd.executors.application import Application
from perfectschedd.executors.base import StopReason
from perfectschedd.schedules.collection import ScheduleCollection
from perfectschedd.schedules.task import Task
from perfectschedd.worker import claims
from perfectschedd.worker.claims import close, drain_step, step
from perfectschedd.worker.heartbeat import renew
from perfectschedd.worker.history_queue import HISTORY_FLUSH
from perfectschedd.worker.leases import LeasePipeline
from perfectschedd.worker.runs import run_one
from perfectschedd.worker.stopping import give_back_queued, stop_runs

YEARLY = "0 0 1 1 *"


class Finishes(Application):
    def run(self) -> None:
        self.task.finish()


def pipeline(tmp_path: Path, on_recorded: Any = None, **extra: Any
             ) -> tuple[LeasePipeline, list[str]]:
    cfg = config.load({
        "type": "rdb_compat", "url": f"sqlite:///{tmp_path / 'db'}", "alive_time": 30,
        "kill_grace": 2, "routes": [
            {"type": "py", "python": f"{__name__}:Finishes"},
            {"type": "sh", "exec": ["/bin/sh", "-c", "exit 0"]},
            {"type": "fails", "exec": ["/bin/sh", "-c", "echo out; echo why >&2; exit 3"]}],
        **extra})
    with ScheduleCollection(cfg) as sc:
        sc.init()
    events: list[str] = []
    return LeasePipeline(cfg, report=events.append, on_recorded=on_recorded), events


def add(p: LeasePipeline, key: str, type_: str = "py") -> None:
    with ScheduleCollection(p.config) as sc:
        sc.add(key, type_, cron=YEARLY, next_run_time=int(time.time()) - 1)


def row(p: LeasePipeline, key: str) -> Any:
    assert p.sc is not None
    return p.sc.store.get(key)


def test_a_run_s_history_row_is_written_within_half_a_second_not_at_the_next_poll(
        tmp_path: Path) -> None:
    """With nothing due for long, the loop still wakes for the row a run left (history
    is written in batches, every HISTORY_FLUSH): status, list and notifications see it."""
    p, _ = pipeline(tmp_path, poll_interval=30)
    add(p, "a")
    submitted: list[Task] = []
    step(p, submitted.append)
    run_one(p, submitted[0])
    assert p.history.rows  # queued, not yet written
    # As if a batch had just been written: this row waits for the next one.  (On a loaded
    # machine half a second can pass before the step, which then writes it at once.)
    p.history.last_flush = time.monotonic()
    wait = step(p, submitted.append)
    if p.history.rows:
        assert wait <= HISTORY_FLUSH
        time.sleep(wait)
    step(p, submitted.append)
    assert [r["outcome"] for r in p.sc.store.history("a", 10)] == ["success"]  # type: ignore[union-attr]
    assert step(p, submitted.append) > HISTORY_FLUSH  # nothing left: the poll again
    close(p)


def test_claim_run_and_batched_finish(tmp_path: Path) -> None:
    p, _ = pipeline(tmp_path)
    for key in ("a", "b"):
        add(p, key)
    submitted: list[Task] = []
    step(p, submitted.append)
    assert sorted(t.key for t in submitted) == ["a", "b"]
    assert set(p.controls) == {"a", "b"}
    lease_end = math.ceil(submitted[0].claimed_at) + p.config.alive_time
    assert p.controls["a"].fence_at == lease_end - p.fence_lead  # self-fencing armed
    for task in submitted:
        run_one(p, task)
    assert p.running_count() == 0 and p.controls == {}
    assert row(p, "a").owner is not None  # the finish is queued, not yet written
    assert step(p, submitted.append) > 0
    assert row(p, "a").owner is None and row(p, "a").next_time > time.time()
    p.flush_history(force=True)
    assert [r["outcome"] for r in p.sc.store.history("a", 10)] == ["success"]  # type: ignore[union-attr]
    close(p)


@pytest.mark.parametrize("fraction", [0.0, 0.001, 0.5, 0.999])
def test_a_lease_is_never_shorter_than_alive_time(tmp_path: Path, fraction: float) -> None:
    """next_run_time holds whole seconds; rounded down, a claim at x.999 with alive_time 2
    held a 1-second lease, fenced 0.5 s after the claim: before its first heartbeat
    (every alive_time/3), so the run was stopped and its occurrence ran twice."""
    p, _ = pipeline(tmp_path, alive_time=2, kill_grace=1)
    with ScheduleCollection(p.config) as sc:
        for key in ("a", "b"):
            add(p, key)
        claimed_at = int(time.time()) + fraction
        lost, tasks = sc.finish_and_poll([], 1, now=claimed_at)
        assert len(tasks) == 1 and not lost
        assert sc.store.get(tasks[0].key).next_run_time >= claimed_at + 2
        sc.heartbeat_many(tasks, now=claimed_at + 0.6)
        assert sc.store.get(tasks[0].key).next_run_time >= claimed_at + 2.6
    submitted: list[Task] = []
    step(p, submitted.append)  # the pipeline's own claim, at the clock's fraction
    first_heartbeat = max(0.2, p.config.alive_time / 3)
    assert p.controls["b"].fence_at - submitted[0].claimed_at >= 0.75 * p.config.alive_time
    assert 0.75 * p.config.alive_time > first_heartbeat + 0.5
    close(p)


def test_heartbeat_stops_a_run_whose_lease_was_lost(tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """Stopped with why, as far as the database tells: its schedule deleted, or lost
    (modified, taken over)."""
    p, _ = pipeline(tmp_path)
    add(p, "gone")
    add(p, "changed")
    add(p, "kept")
    submitted: list[Task] = []
    step(p, submitted.append)
    for task in submitted:  # running, as far as the pipeline knows
        p.running[task.key] = task
    assert p.sc is not None
    p.sc["gone"].delete()
    p.sc["changed"].modify(delay=5)
    held = [(t.key, t.fence) for t in submitted]
    caplog.set_level(logging.WARNING, "perfectschedd.worker")
    renew(p, held, now=time.time() + 5)
    assert p.controls["gone"].reason is StopReason.DELETED
    assert p.controls["changed"].reason is StopReason.PREEMPTED
    assert sorted(caplog.messages) == [
        "key=changed: lease lost (deleted, modified or taken over); stopping its run",
        "key=gone: schedule deleted; stopping its run"]
    assert p.controls["kept"].reason is None
    assert p.controls["kept"].fence_at == pytest.approx(
        int(time.time() + 5) + 1 + p.config.alive_time - p.fence_lead, abs=1)
    assert row(p, "kept").next_run_time >= int(time.time()) + 5 + p.config.alive_time
    close(p)


def test_a_run_replaced_by_a_newer_occurrence_is_stopped_as_replaced(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """concurrency replace: the newer run of the schedule (here another worker's, as
    store.group_turn does it) deletes the running one's row; its heartbeat stops it as
    replaced, not as a lease lost that may run elsewhere; its history says so."""
    p, _ = pipeline(tmp_path)
    with ScheduleCollection(p.config) as sc:
        sc.add("r", "sh", cron=YEARLY, concurrency="replace")
        run_key = sc["r"].run_now()
    submitted: list[Task] = []
    step(p, submitted.append)
    [task] = submitted
    assert task.key == run_key and p.running == {run_key: task}  # its turn taken
    assert p.store.group_turn(f"r@run-{int(time.time())}-newer", "r", int(time.time()),
                              replace=True) == "start"
    caplog.set_level(logging.WARNING, "perfectschedd.worker")
    renew(p, [(task.key, task.fence)])
    assert p.controls[run_key].reason is StopReason.REPLACED
    assert caplog.messages == [f"key={run_key}: replaced by a newer occurrence "
                               "(concurrency: replace); stopping its run"]
    run_one(p, task)  # stopped before it started
    p.flush_history(force=True)
    [ran] = p.store.history(run_key, 10)
    assert (ran["outcome"], ran["error"]) == (
        "preempted", "not started: replaced by a newer occurrence (concurrency: replace)")
    close(p)


def test_an_end_whose_schedule_was_deleted_meanwhile_says_so(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """An extra run ended; its schedule is deleted before its end is written: the line
    says the schedule was deleted, not that the occurrence may run again elsewhere."""
    p, _ = pipeline(tmp_path)
    with ScheduleCollection(p.config) as sc:
        sc.add("d", "py", cron=YEARLY)  # not due: only its extra run runs
        run_key = sc["d"].run_now()
    submitted: list[Task] = []
    step(p, submitted.append)
    assert [t.key for t in submitted] == [run_key]
    run_one(p, submitted[0])  # its end is queued
    assert p.sc is not None
    p.sc["d"].delete()
    caplog.set_level(logging.WARNING, "perfectschedd.worker")
    step(p, submitted.append)
    assert caplog.messages == [f"key={run_key}: schedule deleted before its finish was "
                               "written; its result is discarded"]
    close(p)


def test_exec_runs_are_reported_before_and_after(tmp_path: Path) -> None:
    p, events = pipeline(tmp_path)
    add(p, "x", "sh")
    submitted: list[Task] = []
    step(p, submitted.append)
    run_one(p, submitted[0])
    kinds = [e.split()[0] for e in events]
    assert kinds == ["s", "g", "e"]
    run_ids = {e.split()[1] for e in events}
    assert len(run_ids) == 1 and run_ids.pop().startswith(f"{os.getpid()}.")
    close(p)


def test_shutdown_gives_back_what_did_not_run(tmp_path: Path) -> None:
    p, _ = pipeline(tmp_path)
    add(p, "q")
    submitted: list[Task] = []
    step(p, submitted.append)
    stop_runs(p, StopReason.SHUTDOWN)
    run_one(p, submitted[0])  # a queued task started after the stop: not run, given back
    r = row(p, "q")
    assert r.owner is None and r.attempt == 0 and r.next_run_time <= time.time()
    close(p)


def test_a_stale_heartbeat_never_stops_the_next_run_of_the_same_key(tmp_path: Path) -> None:
    """A heartbeat that read (key, old fence) before the finish was written and the key
    claimed again must not take the new run for a lost lease."""
    p, _ = pipeline(tmp_path)
    add(p, "k")
    first: list[Task] = []
    step(p, first.append)
    old = first[0]
    run_one(p, old)  # finished: queued
    step(p, lambda t: None)  # written
    assert p.sc is not None
    p.sc.store.update("k", {"next_run_time": int(time.time()) - 1}, take_lease=False)
    second: list[Task] = []
    step(p, second.append)
    new = second[0]
    p.running[new.key] = new
    assert new.fence > old.fence
    renew(p, [(old.key, old.fence)])
    assert p.controls["k"].reason is None
    renew(p, [(new.key, new.fence)])
    assert p.controls["k"].reason is None
    close(p)


def test_task_threads_taking_run_ids_at_once_get_distinct_ids(tmp_path: Path) -> None:
    """Seen in a burst: two task threads taking a run id together made a shared generator
    raise "already executing" (an internal error, the run retried 10 s later)."""
    p, _ = pipeline(tmp_path)
    ids: list[list[str]] = [[] for _ in range(8)]
    errors: list[BaseException] = []
    start = threading.Barrier(len(ids))

    def take(out: list[str]) -> None:
        start.wait()
        try:
            for _ in range(20_000):
                out.append(p.new_run_id())
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=take, args=(out,)) for out in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    every = [i for out in ids for i in out]
    assert len(every) == len(set(every)) == 8 * 20_000
    close(p)


def run_due(p: LeasePipeline) -> None:
    submitted: list[Task] = []
    step(p, submitted.append)
    for task in submitted:
        run_one(p, task)


def test_each_run_s_row_says_what_it_did_and_on_recorded_sees_it_once_written(
        tmp_path: Path) -> None:
    batches: list[list[dict[str, Any]]] = []

    def on_recorded(rows: list[dict[str, Any]]) -> None:
        # Called after the write: the rows are in the database already.
        assert p.sc is not None
        stored = {r["key"] for k in ("ok", "bad") for r in p.sc.store.history(k, 10)}
        assert {r["key"] for r in rows} <= stored
        batches.append(rows)

    p, _ = pipeline(tmp_path, on_recorded)
    add(p, "ok", "sh")
    add(p, "bad", "fails")
    run_due(p)
    assert batches == []  # nothing written yet: nothing seen
    p.flush_history(force=True)
    assert len(batches) == 1
    rows = {r["key"]: r for r in batches[0]}
    assert (rows["ok"]["outcome"], rows["ok"]["exit_code"], rows["ok"]["error"]) == (
        "success", 0, None)
    bad = rows["bad"]
    assert (bad["outcome"], bad["exit_code"], bad["signal"]) == ("failed", 3, None)
    assert bad["error"] == "exit status 3: why" and bad["output"] == "out\nwhy\n"
    assert 0 <= bad["duration"] < 5
    assert p.sc is not None
    (stored,) = p.sc.store.history("bad", 10)
    # Besides the columns, whose notification it is (not stored: the schedule's).
    assert bad.pop("creator") == os.geteuid()
    assert {k: stored[k] for k in bad} == bad
    p.flush_history(force=True)
    assert len(batches) == 1  # an empty flush hands nothing on
    close(p)


def test_on_recorded_sees_nothing_that_was_not_written_and_its_errors_never_stop_runs(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    calls: list[list[dict[str, Any]]] = []

    def on_recorded(rows: list[dict[str, Any]]) -> None:
        calls.append(rows)
        raise RuntimeError("observer broke")

    p, _ = pipeline(tmp_path, on_recorded)
    add(p, "a", "sh")
    run_due(p)
    assert p.sc is not None
    with p.sc.store.engine.begin() as conn:  # the write will fail: a real database error
        conn.exec_driver_sql("ALTER TABLE perfectsched_history RENAME TO away")
    p.flush_history(force=True)
    assert calls == [] and [r["key"] for r in p.history.rows] == ["a"]  # kept for the next one
    with p.sc.store.engine.begin() as conn:
        conn.exec_driver_sql("ALTER TABLE away RENAME TO perfectsched_history")
    p.flush_history(force=True)
    assert [[r["key"] for r in b] for b in calls] == [["a"]]
    assert [r["outcome"] for r in p.sc.store.history("a", 10)] == ["success"]
    add(p, "b", "sh")
    run_due(p)
    p.flush_history(force=True)
    assert [[r["key"] for r in b] for b in calls] == [["a"], ["b"]]
    # Logged once, then swallowed.
    assert [r.getMessage() for r in caplog.records if "on_recorded" in r.getMessage()] == [
        "on_recorded failed (logged once; the history is written)"]
    close(p)


def test_a_drain_gives_back_what_did_not_start_and_writes_what_ran(tmp_path: Path) -> None:
    """A reload's drain: claimed occurrences no thread started go back due now (untried,
    no history, attempt not counted); the running one's finish and history are written
    without any claim."""
    p, _ = pipeline(tmp_path)
    for key in ("a", "b", "c"):
        add(p, key)
    submitted: list[Task] = []
    step(p, submitted.append)
    started, *queued = sorted(submitted, key=lambda t: t.key)
    assert give_back_queued(p, queued) == 2
    assert set(p.running) == {"a"} and set(p.controls) == {"a"}
    for task in queued:
        r = row(p, task.key)
        assert r.owner is None and r.next_run_time <= time.time() and r.attempt == 0
    add(p, "d")  # due, but a draining worker claims nothing
    run_one(p, started)
    drain_step(p)
    assert row(p, "a").owner is None and row(p, "a").next_time > time.time()
    assert row(p, "d").owner is None
    p.flush_history(force=True)
    store = p.sc.store  # type: ignore[union-attr]
    assert [r["outcome"] for r in store.history("a", 10)] == ["success"]
    assert store.history("b", 10) == [] and store.history("c", 10) == []
    close(p)


def test_runs_ending_while_finishes_gather_do_not_wake_the_loop_until_threads_run_short(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While the loop lets finishes gather (FINISH_DEFER) and every thread still has a
    task queued, a run's end does not nudge the loop (it would only defer again); the run
    that leaves a thread without a queued task does, and so does any once a step no
    longer defers."""
    monkeypatch.setattr(claims, "FINISH_DEFER", 60.0)  # no slow machine ends it early
    p, _ = pipeline(tmp_path, concurrency=1)
    nudges: list[float] = []
    p.nudge = lambda: nudges.append(time.monotonic())
    for key in ("a", "b", "c"):
        add(p, key)
    submitted: list[Task] = []
    step(p, submitted.append)
    assert len(submitted) == 3  # one thread, two queued behind it
    run_one(p, submitted[0])
    assert len(nudges) == 1  # the loop was not deferring
    assert step(p, submitted.append) > 0  # a finish waits, each thread has a task queued
    assert p.deferred_until > time.monotonic()
    run_one(p, submitted[1])
    assert len(nudges) == 1  # "c" is still queued for the one thread: no wake-up
    run_one(p, submitted[2])
    assert len(nudges) == 2  # the thread has nothing queued: the loop must refill it
    step(p, submitted.append)  # writes the three finishes, defers nothing
    assert p.deferred_until == 0.0 and not p.finished
    close(p)


def test_with_history_limit_0_rows_are_told_and_dropped_never_kept(tmp_path: Path) -> None:
    """history_limit 0 keeps no history: each run's row still reaches on_recorded (its
    failure is notified), then goes; the queue does not grow with every run (it did: the
    rows were never written nor dropped) nor wake the loop every half second."""
    recorded: list[dict[str, Any]] = []
    p, _ = pipeline(tmp_path, on_recorded=recorded.extend, history_limit=0)
    submitted: list[Task] = []
    for i in range(3):
        add(p, f"f{i}", "fails")
    step(p, submitted.append)
    assert len(submitted) == 3
    for task in submitted:
        run_one(p, task)
    p.flush_history(force=True)
    assert p.history.rows == []
    assert p.history.wait() is None
    assert sorted((r["key"], r["outcome"]) for r in recorded) == [
        ("f0", "failed"), ("f1", "failed"), ("f2", "failed")]
    assert p.sc is not None and p.sc.store.history("f0", 10) == []
    close(p)
