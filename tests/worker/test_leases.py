"""leases.py: the lease pipeline with a real SQLite file and no worker process."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from perfectschedd import config as config_mod
from perfectschedd.executors.application import Application
from perfectschedd.executors.base import StopReason
from perfectschedd.schedules.collection import ScheduleCollection, Task
from perfectschedd.worker.leases import LeasePipeline

YEARLY = "0 0 1 1 *"


class Finishes(Application):
    def run(self) -> None:
        self.task.finish()


def pipeline(tmp_path: Path, **extra: Any) -> tuple[LeasePipeline, list[str]]:
    cfg = config_mod.load({
        "type": "rdb_compat", "url": f"sqlite:///{tmp_path / 'db'}", "alive_time": 30,
        "kill_grace": 2, "routes": [
            {"type": "py", "python": f"{__name__}:Finishes"},
            {"type": "sh", "exec": ["/bin/sh", "-c", "exit 0"]}], **extra})
    with ScheduleCollection(cfg) as sc:
        sc.init()
    events: list[str] = []
    return LeasePipeline(cfg, report=events.append), events


def add(p: LeasePipeline, key: str, type_: str = "py") -> None:
    with ScheduleCollection(p.config) as sc:
        sc.add(key, type_, cron=YEARLY, next_run_time=int(time.time()) - 1)


def row(p: LeasePipeline, key: str) -> Any:
    assert p.sc is not None
    return p.sc.store.get(key)


def test_claim_run_and_batched_finish(tmp_path: Path) -> None:
    p, _ = pipeline(tmp_path)
    for key in ("a", "b"):
        add(p, key)
    submitted: list[Task] = []
    p.step(submitted.append)
    assert sorted(t.key for t in submitted) == ["a", "b"]
    assert set(p.controls) == {"a", "b"}
    lease_end = int(submitted[0].claimed_at) + p.config.alive_time
    assert p.controls["a"].fence_at == lease_end - p.fence_lead  # self-fencing armed
    for task in submitted:
        p.run_one(task)
    assert p.running_count() == 0 and p.controls == {}
    assert row(p, "a").owner is not None  # the finish is queued, not yet written
    assert p.step(submitted.append) > 0
    assert row(p, "a").owner is None and row(p, "a").next_time > time.time()
    p.flush_history(force=True)
    assert [r["outcome"] for r in p.sc.store.history("a", 10)] == ["success"]  # type: ignore[union-attr]
    p.close()


def test_heartbeat_stops_a_run_whose_lease_was_lost(tmp_path: Path) -> None:
    p, _ = pipeline(tmp_path)
    add(p, "gone")
    add(p, "kept")
    submitted: list[Task] = []
    p.step(submitted.append)
    for task in submitted:  # running, as far as the pipeline knows
        p.running[task.key] = task
    assert p.sc is not None
    p.sc["gone"].delete()
    held = [(t.key, t.fence) for t in submitted]
    p.renew(held, now=time.time() + 5)
    assert p.controls["gone"].reason is StopReason.PREEMPTED
    assert p.controls["kept"].reason is None
    assert p.controls["kept"].fence_at == pytest.approx(
        int(time.time() + 5) + 1 + p.config.alive_time - p.fence_lead, abs=1)
    assert row(p, "kept").next_run_time >= int(time.time()) + 5 + p.config.alive_time
    p.close()


def test_exec_runs_are_reported_before_and_after(tmp_path: Path) -> None:
    p, events = pipeline(tmp_path)
    add(p, "x", "sh")
    submitted: list[Task] = []
    p.step(submitted.append)
    p.run_one(submitted[0])
    kinds = [e.split()[0] for e in events]
    assert kinds == ["s", "g", "e"]
    run_ids = {e.split()[1] for e in events}
    assert len(run_ids) == 1 and run_ids.pop().startswith(f"{os.getpid()}.")
    p.close()


def test_shutdown_gives_back_what_did_not_run(tmp_path: Path) -> None:
    p, _ = pipeline(tmp_path)
    add(p, "q")
    submitted: list[Task] = []
    p.step(submitted.append)
    p.stop_runs(StopReason.SHUTDOWN)
    p.run_one(submitted[0])  # a queued task started after the stop: not run, given back
    r = row(p, "q")
    assert r.owner is None and r.attempt == 0 and r.next_run_time <= time.time()
    p.close()


def test_a_stale_heartbeat_never_stops_the_next_run_of_the_same_key(tmp_path: Path) -> None:
    """A heartbeat that read (key, old fence) before the finish was written and the key
    claimed again must not take the new run for a lost lease."""
    p, _ = pipeline(tmp_path)
    add(p, "k")
    first: list[Task] = []
    p.step(first.append)
    old = first[0]
    p.run_one(old)  # finished: queued
    p.step(lambda t: None)  # written
    assert p.sc is not None
    p.sc.store.update("k", {"next_run_time": int(time.time()) - 1}, take_lease=False)
    second: list[Task] = []
    p.step(second.append)
    new = second[0]
    p.running[new.key] = new
    assert new.fence > old.fence
    p.renew([(old.key, old.fence)])
    assert p.controls["k"].reason is None
    p.renew([(new.key, new.fence)])
    assert p.controls["k"].reason is None
    p.close()


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
    p.close()
