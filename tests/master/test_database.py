"""master/database.py (MasterDatabase): the master's only door to the database, on a real
SQLite file.  What it reads for status (counts, running, unclaimed, hosts), its commands'
deadlines, the fork gate, and what it does when the database is unreachable (it says so
and retries) or refuses this version (fatal)."""

from __future__ import annotations

import dataclasses
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_harness import wait_until

import perfectschedd
from perfectschedd import __version__, config
from perfectschedd.config import Config
from perfectschedd.errors import DatabaseUnavailableError
from perfectschedd.master import database
from perfectschedd.master.database import PAGE_CACHE_KIB, MasterDatabase
from perfectschedd.master.snapshot import UNCLAIMED_AFTER
from perfectschedd.schedules.collection import ScheduleCollection

NODE = "dbtest-node"


def make_config(url: str, **changes: object) -> Config:
    cfg = config.load({"type": "rdb_compat", "url": url, "node_name": NODE,
                           "schedules_dir": None})
    return dataclasses.replace(cfg, **changes)  # type: ignore[arg-type]


@pytest.fixture
def started() -> Iterator[list[MasterDatabase]]:
    made: list[MasterDatabase] = []
    yield made
    for db in made:
        db.stop(timeout=2)


def start(made: list[MasterDatabase], cfg: Config, *, wait_open: bool = True
          ) -> MasterDatabase:
    db = MasterDatabase(cfg)
    made.append(db)
    db.start()
    if wait_open:
        assert db.first_open.wait(10)
    return db


def path_of(url: str) -> str:
    return url.removeprefix("sqlite:///")


def test_status_snapshot_reads_counts_running_unclaimed_and_hosts(
        sqlite_url: str, started: list[MasterDatabase]) -> None:
    now = time.time()
    with perfectschedd.open({"type": "rdb_compat", "url": sqlite_url}) as sc:
        sc.add("later", "t", "0 0 1 1 *", now=now)
        sc.add("paused", "t", "@daily", now=now)
        sc["paused"].pause()
        sc.add("busy", "t", "@once", at=int(now) - 5, now=now)
        busy = sc.poll(now=now)
        assert busy is not None and busy.key == "busy"
        # Due long ago and nobody takes it.
        sc.add("stuck", "nobody", "@once", at=int(now) - UNCLAIMED_AFTER - 100, now=now)
        # A 0.1.0 host: it holds a lease but never recorded itself.
        sc.store.record_host("gone-host", "0.2.0", 1, now - 30 * 86400, now - 8 * 86400)
    db = start(started, make_config(sqlite_url))
    snap = db.fresh_snapshot(5)
    assert snap.ok is True and snap.error is None and snap.unreachable_since is None
    assert snap.read_at is not None and abs(snap.read_at - time.time()) < 5
    assert snap.counts == {"schedules": 4, "paused": 1, "due": 1, "running": 1}
    assert [(r["key"], r["type"], r["attempt"]) for r in snap.running] == [("busy", "t", 1)]
    assert snap.running[0]["owner"] == busy_owner(sqlite_url)
    assert snap.running[0]["age"] >= 0
    assert snap.unclaimed == {"nobody": 1}
    names = {h["name"]: h for h in snap.hosts}
    # This host is recorded with its version; a host unseen for a week is forgotten.
    assert set(names) == {NODE}
    assert names[NODE]["version"] == __version__ and names[NODE]["pid"] == os.getpid()
    # The node holding the lease is at work but not in the hosts table.
    assert snap.unrecorded_nodes == [busy_owner(sqlite_url).rsplit(":", 1)[0]]
    assert db.health() == (True, None, None)


def busy_owner(url: str) -> str:
    with perfectschedd.open({"type": "rdb_compat", "url": url}) as sc:
        owner = sc["busy"].info().owner
    assert owner is not None
    return owner


def test_commands_run_off_the_callers_thread_and_return_their_result(
        sqlite_url: str, started: list[MasterDatabase]) -> None:
    db = start(started, make_config(sqlite_url))
    caller = threading.get_ident()
    seen: list[int] = []

    def add(sc: ScheduleCollection) -> str:
        seen.append(threading.get_ident())
        return sc.add("k", "t", "@daily").key

    assert db.call(add) == "k"
    assert seen and seen[0] != caller
    assert db.call(lambda sc: sc["k"].info().cron) == "@daily"
    # A refusal of the database layer reaches the caller as it is.
    with pytest.raises(perfectschedd.AlreadyExistsError):
        db.call(add)
    assert db.snapshot.ok is not False


def test_before_the_store_opens_commands_are_refused_not_queued(sqlite_url: str) -> None:
    db = MasterDatabase(make_config(sqlite_url))  # not started
    try:
        with pytest.raises(DatabaseUnavailableError, match="not open yet"):
            db.call(lambda sc: 1)
        ran: list[int] = []
        db.in_background("nothing", lambda sc: ran.append(1))
        time.sleep(0.1)
        assert ran == []
        with db.fork_gate() as clear:
            assert clear is True
    finally:
        db.stop(timeout=1)


def test_an_unreachable_database_is_reported_and_opened_once_it_answers(
        tmp_path: Path, started: list[MasterDatabase],
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "perfectschedd")
    where = tmp_path / "not-yet"
    db = start(started, make_config(f"sqlite:///{where}/perfectsched.db"))
    assert db.sc is None
    # (first_open is set just before the failure is published.)
    snap = wait_until(lambda: db.snapshot.ok is False and db.snapshot, 5, what="marked")
    assert snap.ok is False and snap.error and snap.unreachable_since is not None
    assert db.health()[0] is False
    with pytest.raises(DatabaseUnavailableError) as info:
        db.call(lambda sc: 1)
    assert str(info.value).startswith("database unreachable since ")
    assert "not open yet" in str(info.value)
    assert db.fatal is None  # waiting may fix it
    assert "database unreachable:" in caplog.text

    where.mkdir()
    wait_until(lambda: db.fresh_snapshot(1).ok is True, 10, what="the database opened")
    assert db.sc is not None
    assert db.call(lambda sc: sc.add("k", "t", "@daily").key) == "k"
    assert db.health() == (True, None, None)
    assert "database reachable again" in caplog.text or "database open" in caplog.text


def test_a_database_of_a_newer_schema_is_fatal(sqlite_url: str,
                                               started: list[MasterDatabase]) -> None:
    with perfectschedd.open({"type": "rdb_compat", "url": sqlite_url}) as sc:
        sc.add("k", "t", "@daily")
    with sqlite3.connect(path_of(sqlite_url)) as conn:
        conn.execute("UPDATE perfectsched_meta SET value = '99' "
                     "WHERE name IN ('schema_version', 'compatible_from')")
    db = start(started, make_config(sqlite_url))
    wait_until(lambda: db.fatal is not None, 5, what="the refusal")
    assert db.fatal is not None and "99" in db.fatal
    assert db.sc is None
    with pytest.raises(DatabaseUnavailableError):
        db.call(lambda sc: 1)


def test_a_command_that_hangs_answers_unreachable_and_the_fork_gate_stays_shut(
        sqlite_url: str, started: list[MasterDatabase],
        caplog: pytest.LogCaptureFixture) -> None:
    db = start(started, make_config(sqlite_url))
    assert db.call(lambda sc: sc.add("a", "t", "@daily").key) == "a"
    # Another process holds the write lock: writes wait (busy_timeout is long).
    locker = sqlite3.connect(path_of(sqlite_url), isolation_level=None)
    locker.execute("BEGIN EXCLUSIVE")
    try:
        began = time.monotonic()
        with pytest.raises(DatabaseUnavailableError, match=r"no answer within 0\.5s"):
            db.call(lambda sc: sc.add("b", "t", "@daily"), timeout=0.5)
        assert 0.5 <= time.monotonic() - began < 2.0
        assert db.snapshot.ok is False and db.snapshot.error == "no answer within 0.5s"
        assert "database unreachable: no answer within 0.5s" in caplog.text
        # Known to hang: the next command is refused at once.
        time.sleep(0.2)
        began = time.monotonic()
        with pytest.raises(DatabaseUnavailableError, match="a query has been waiting for"):
            db.call(lambda sc: sc.add("c", "t", "@daily"), timeout=0.5)
        assert time.monotonic() - began < 0.2
        # SQLite: no fork while the call is inside the library.
        with db.fork_gate() as clear:
            assert clear is False
    finally:
        locker.execute("ROLLBACK")
        locker.close()
    # The held call ends; the database answers again and a fork may go ahead.
    wait_until(lambda: db._stuck_for() == 0.0, 10, what="the held call to end")
    with db.fork_gate() as clear:
        assert clear is True
    assert db.call(lambda sc: sorted(i.key for i in sc.list())) == ["a", "b"]
    assert db.snapshot.ok is True
    assert db.health()[0] is True


def test_background_calls_run_and_their_failures_are_logged(
        sqlite_url: str, started: list[MasterDatabase],
        caplog: pytest.LogCaptureFixture) -> None:
    db = start(started, make_config(sqlite_url))
    done = threading.Event()

    def work(sc: ScheduleCollection) -> None:
        sc.add("bg", "t", "@daily")
        done.set()

    db.in_background("adding", work)
    assert done.wait(5)
    assert db.call(lambda sc: sc["bg"].exists())
    db.in_background("adding again", work)
    wait_until(lambda: "adding again failed:" in caplog.text, 5, what="the failure logged")
    assert "already exists" in caplog.text


def test_stop_closes_the_store_and_removes_this_host(sqlite_url: str) -> None:
    db = MasterDatabase(make_config(sqlite_url))
    db.start()
    assert db.first_open.wait(10)
    wait_until(lambda: any(h["name"] == NODE for h in db.fresh_snapshot(1).hosts), 5,
               what="this host recorded")
    db.stop(timeout=2)
    assert db.sc is None
    with pytest.raises(DatabaseUnavailableError):
        db.call(lambda sc: 1)
    with perfectschedd.open({"type": "rdb_compat", "url": sqlite_url}) as sc:
        assert [h["name"] for h in sc.store.hosts()] == []


def test_schedule_states_are_read_unasked_at_most_their_share_and_always_when_asked(
        sqlite_url: str, started: list[MasterDatabase],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Which schedules are retrying or failed costs a history probe per schedule (0.7 s of
    CPU at a million rows): the periodic reads reuse the last reading until its share of
    the time allows another; a status request reads it afresh.  Counts stay fresh."""
    monkeypatch.setattr(database, "COUNTS_EVERY", 0.2)
    monkeypatch.setattr(database, "STATES_SHARE", 1e-9)  # unasked: not again in this test
    now = time.time()
    with perfectschedd.open({"type": "rdb_compat", "url": sqlite_url}) as sc:
        sc.add("fails", "t", "@once", at=int(now) - 5, now=now)
        db = start(started, make_config(sqlite_url))
        first = db.fresh_snapshot(5)
        assert first.states is not None and first.states["retrying"] == 0
        task = sc.poll()
        assert task is not None and task.key == "fails"
        task.retry(wait=3600)
        sc.add("another", "t", "0 0 1 1 *", now=now)
    # Periodic reads go on (counts see the new schedule); the states are the old reading.
    wait_until(lambda: (db.snapshot.counts or {}).get("schedules") == 2, timeout=10)
    assert db.snapshot.states is not None and db.snapshot.states["retrying"] == 0
    asked = db.fresh_snapshot(5)
    assert asked.states is not None and asked.states["retrying"] == 1
    assert [f["key"] for f in asked.failing] == ["fails"]


def test_the_masters_sqlite_connections_keep_a_small_page_cache(
        sqlite_url: str, started: list[MasterDatabase]) -> None:
    """The master scans whole tables for status; SQLite's default cache (2 MiB a
    connection) would keep what the scans read for good."""
    db = start(started, make_config(sqlite_url))
    db.fresh_snapshot(5)

    def cache_size(sc: ScheduleCollection) -> int:
        pooled = sc.store.engine.raw_connection()
        try:
            return int(pooled.driver_connection.execute("PRAGMA cache_size").fetchone()[0])
        finally:
            pooled.close()

    assert PAGE_CACHE_KIB < 2000
    assert db.call(cache_size) == -PAGE_CACHE_KIB


def test_a_worker_is_handed_the_masters_store_only_if_its_configuration_opens_it(
        sqlite_url: str, tmp_path: Path, started: list[MasterDatabase]) -> None:
    cfg = make_config(sqlite_url)
    db = MasterDatabase(cfg)
    started.append(db)
    assert db.store_for_worker(cfg) is None  # not open yet
    db.start()
    assert db.first_open.wait(10)
    store = db.store_for_worker(cfg)
    assert store is not None and store is db.store
    # Its connections from now on are a worker's: SQLite's default page cache.
    assert store.backend.page_cache_kib is None
    # Another database, table or statement deadline: the worker opens its own.
    other = f"sqlite:///{tmp_path / 'other.db'}"
    for changed in (make_config(other), dataclasses.replace(cfg, table="other"),
                    dataclasses.replace(cfg, alive_time=cfg.alive_time * 2)):
        assert db.store_for_worker(changed) is None
