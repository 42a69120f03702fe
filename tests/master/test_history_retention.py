"""history_keep_days (issue 38: the history of deleted schedules was never pruned): the
master's housekeeping thread removes runs older than the limit, of every key, deleted
or not, in bounded steps, and keeps each existing schedule's newest run (its state)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import pytest
from daemon_harness import wait_until

import perfectschedd
from perfectschedd import config
from perfectschedd.errors import ConfigError
from perfectschedd.master import database
from perfectschedd.master.database import MasterDatabase

DAY = 86400.0


def run(key: str, ended: float) -> dict[str, Any]:
    return {"key": key, "type": "t", "scheduled_time": int(ended), "attempt": 1,
            "started_at": ended - 1, "finished_at": ended, "outcome": "failed",
            "worker": "w", "unit": None}


@pytest.fixture
def master_db() -> Iterator[list[MasterDatabase]]:
    made: list[MasterDatabase] = []
    yield made
    for db in made:
        db.stop(timeout=2)


def test_old_runs_of_deleted_and_existing_keys_go_in_bounded_steps(
        sqlite_url: str, master_db: list[MasterDatabase],
        monkeypatch: pytest.MonkeyPatch) -> None:
    now = time.time()
    old, recent = now - 200 * DAY, now - 2 * DAY
    with perfectschedd.open({"type": "rdb_compat", "url": sqlite_url}) as sc:
        sc.add("alive", "t", "0 0 1 1 *", now=now)
        sc.add("quiet", "t", "0 0 1 1 *", now=now)  # its only runs are old
        sc.add("gone", "t", "0 0 1 1 *", now=now)
        sc.store.record_runs([run("gone", old + i) for i in range(7)]
                             + [run("alive", old + i) for i in range(3)]
                             + [run("quiet", old + i) for i in range(2)]
                             + [run("gone@run-5-ab", old + 9), run("alive", recent),
                                run("gone-lately", recent)])
        sc["gone"].delete()
        assert len(sc.history("gone", 100)) == 8  # deleting a schedule keeps its runs
    monkeypatch.setattr(database, "PRUNE_EVERY", 0.2)
    monkeypatch.setattr(database, "PRUNE_OLD_BATCH", 4)  # several steps, and passes
    monkeypatch.setattr(database, "PRUNE_OLD_STEPS", 2)
    cfg = dataclasses.replace(config.load({"type": "rdb_compat", "url": sqlite_url,
                                               "schedules_dir": None}),
                              history_keep_days=30.0)
    db = MasterDatabase(cfg)
    master_db.append(db)
    db.start()
    with perfectschedd.open({"type": "rdb_compat", "url": sqlite_url}) as sc:
        wait_until(lambda: not sc.history("gone", 100), 15,
                   what="the deleted schedule's old runs to go")
        assert [r["finished_at"] for r in sc.history("alive", 100)] == [recent]
        # The newest run of a schedule that exists stays, however old: list's state.
        assert [r["finished_at"] for r in sc.history("quiet", 100)] == [old + 1]
        assert len(sc.history("gone-lately", 100)) == 1  # within the 30 days
        assert sc["quiet"].exists()


def test_one_step_reads_at_most_its_limit(db_url: str) -> None:
    now = time.time()
    with perfectschedd.open({"type": "rdb_compat", "url": db_url}) as sc:
        sc.store.record_runs([run(f"gone-{i}", now - 100 * DAY + i) for i in range(10)]
                             + [run("new", now)])
        removed, after = sc.store.prune_old_history(now - 30 * DAY, 0, 4)
        assert removed == 4 and after > 0
        assert len(sc.store.history("gone-3", 10)) == 0
        assert len(sc.store.history("gone-4", 10)) == 1  # not read yet
        removed, after = sc.store.prune_old_history(now - 30 * DAY, after, 100)
        assert removed == 6
        # Only recent rows from there: nothing to do, the walk stays where it is.
        assert sc.store.prune_old_history(now - 30 * DAY, after, 100) == (0, after)
        assert [r["key"] for r in sc.store.history("new", 10)] == ["new"]


@pytest.mark.parametrize("bad", [-1, "90d", True])
def test_a_bad_value_is_refused_in_one_line(bad: Any) -> None:
    with pytest.raises(ConfigError, match="^history_keep_days: must be"):
        config.load({"type": "rdb_compat", "url": "sqlite:///x.db",
                         "history_keep_days": bad})


def test_zero_keeps_runs_of_any_age() -> None:
    cfg = config.load({"type": "rdb_compat", "url": "sqlite:///x.db",
                           "history_keep_days": 0})
    assert cfg.history_keep_days == 0
    assert config.load({"type": "rdb_compat", "url": "sqlite:///x.db"}
                           ).history_keep_days == 90
