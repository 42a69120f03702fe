"""The SQLite hot path (claim, finish, earliest due on the sqlite3 connection): what
SQLAlchemy used to guarantee for it must still hold - one transaction, errors as
SQLAlchemy's exceptions, a busy database waited for, connections handed back clean."""

from __future__ import annotations

import sqlite3
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.exc import IntegrityError, OperationalError

import perfectschedd
from perfectschedd import ScheduleCollection
from perfectschedd.store.backends.sqlite import SQLiteBackend
from perfectschedd.store.schema import Advance, Claimed

T0 = 1_700_002_800
ALIVE = 300


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "s.db"


@pytest.fixture
def sc(db: Path) -> Iterator[ScheduleCollection]:
    with perfectschedd.open({"type": "rdb_compat", "url": f"sqlite:///{db}",
                             "alive_time": ALIVE}) as c:
        c.init()
        yield c


def row(db: Path, key: str) -> tuple[int, int, str | None]:
    with sqlite3.connect(db) as con:
        got = con.execute("SELECT next_run_time, fence, owner FROM perfectsched WHERE key = ?",
                          (key,)).fetchone()
    con.close()
    return got


def test_the_hot_path_is_what_sqlite_stores_use(sc: ScheduleCollection) -> None:
    assert isinstance(sc.store.backend, SQLiteBackend)
    # Its rows become Claimed(*row): the claim returns Claimed's fields, in their order.
    returned = sc.store.backend.sql.returned.split(", ")
    assert [c.strip('"') for c in returned] == list(Claimed._fields)


def test_finish_and_claim_is_one_transaction(sc: ScheduleCollection, db: Path) -> None:
    """A claim that fails after the finishes were written undoes them too."""
    for k in ("a", "b"):
        sc.add(k, "t", cron="0 * * * *", next_time=T0, now=T0)
    (held,) = sc.store.claim(T0, ALIVE, "w1", 1)
    before = row(db, held.key)
    with sqlite3.connect(db) as con:  # a real constraint failure inside the claim
        con.execute("CREATE TRIGGER boom BEFORE UPDATE OF owner ON perfectsched"
                    " WHEN NEW.owner = 'boom' BEGIN SELECT RAISE(ABORT, 'no boom'); END")
    con.close()
    advance = Advance(held.key, held.fence, T0 + 3600, T0 + 3600)
    with pytest.raises(IntegrityError, match="no boom"):
        sc.store.finish_and_claim([advance], T0, ALIVE, "boom", 5)
    assert row(db, held.key) == before  # the finish was rolled back with the claim
    # The pooled connection came back out of its transaction: others can write at once.
    with sqlite3.connect(db, timeout=0) as con:
        con.execute("BEGIN IMMEDIATE")
        con.execute("ROLLBACK")
    con.close()
    lost, claimed = sc.store.finish_and_claim([advance], T0, ALIVE, "w1", 5)
    assert lost == set() and [c.key for c in claimed] == ["a" if held.key == "b" else "b"]
    assert row(db, held.key) == (T0 + 3600, held.fence + 1, None)


def test_a_stale_fence_writes_nothing_and_is_reported(sc: ScheduleCollection, db: Path
                                                      ) -> None:
    sc.add("k", "t", cron="0 * * * *", next_time=T0 + 3600, now=T0)
    once = sc["k"].run_now(now=T0)  # a one-off row: finishing it deletes it
    sc.add("k2", "t", cron="0 * * * *", next_time=T0, now=T0)
    claimed = {c.key: c for c in sc.store.claim(T0, ALIVE, "w1", 5)}
    assert set(claimed) == {once, "k2"}
    stale = [Advance("k2", claimed["k2"].fence - 1, T0 + 3600, T0 + 3600),
             Advance(once, claimed[once].fence + 7, None, None),
             Advance("gone", 1, T0, T0)]
    before = row(db, "k2"), row(db, once)
    assert sc.store.advance(stale) == {"k2", once, "gone"}
    assert (row(db, "k2"), row(db, once)) == before
    assert sc.store.advance([Advance(once, claimed[once].fence, None, None)]) == set()
    assert row(db, once) is None


def test_a_foreign_writer_is_waited_for_not_reported(sc: ScheduleCollection, db: Path
                                                     ) -> None:
    """A writer outside our lock (the sqlite3 shell) holds SQLite's write lock: the claim
    waits in SQLite's busy handler, then succeeds."""
    sc.add("k", "t", cron="0 * * * *", next_time=T0, now=T0)
    locked, release = threading.Event(), threading.Event()

    def foreign_writer() -> None:
        con = sqlite3.connect(db, isolation_level=None)
        con.execute("BEGIN IMMEDIATE")
        locked.set()
        release.wait(10)
        con.execute("COMMIT")
        con.close()

    thread = threading.Thread(target=foreign_writer)
    thread.start()
    assert locked.wait(10)
    threading.Timer(0.5, release.set).start()
    started = time.monotonic()
    (claimed,) = sc.store.claim(T0, ALIVE, "w1", 5)
    waited = time.monotonic() - started
    thread.join()
    assert claimed.key == "k" and waited >= 0.4


def test_driver_errors_are_sqlalchemy_errors(sc: ScheduleCollection, db: Path) -> None:
    sc.store.close()
    with sqlite3.connect(db) as con:
        con.execute("DROP TABLE perfectsched")
    con.close()
    with pytest.raises(OperationalError, match="no such table"):
        sc.store.earliest_due()
    with pytest.raises(OperationalError, match="no such table"):
        sc.store.claim(T0, ALIVE, "w1", 5)
    sc.init()  # the store is still usable: the table comes back, claims work again
    sc.add("k", "t", cron="0 * * * *", next_time=T0, now=T0)
    assert sc.store.earliest_due() == T0
    assert [c.key for c in sc.store.claim(T0, ALIVE, "w1", 5)] == ["k"]


def test_a_custom_table_name_is_quoted(tmp_path: Path) -> None:
    with perfectschedd.open({"type": "rdb_compat", "url": f"sqlite:///{tmp_path}/t.db",
                             "table": "order"}) as c:  # an SQL keyword
        c.init()
        c.add("k", "t", cron="0 * * * *", next_time=T0, now=T0)
        assert c.store.earliest_due() == T0
        (task,) = c.poll_many(5, now=T0)
        task.finish()
        assert c.store.earliest_due() == T0 + 3600


def test_a_stores_page_cache_is_what_it_asked_for(db: Path) -> None:
    """page_cache_kib sets every pooled connection's cache (the master's small one); a
    Store that does not ask keeps SQLite's default."""
    from perfectschedd.store.sql import Store

    def cache_sizes(store: Store) -> set[int]:
        # Two connections at once: both come from the pool's connect hook.
        a, b = store.engine.raw_connection(), store.engine.raw_connection()
        try:
            return {int(c.driver_connection.execute("PRAGMA cache_size").fetchone()[0])
                    for c in (a, b)}
        finally:
            a.close()
            b.close()

    small = Store(f"sqlite:///{db}", page_cache_kib=256)
    default = Store(f"sqlite:///{db}")
    try:
        assert cache_sizes(small) == {-256}
        with sqlite3.connect(db) as con:
            sqlite_default = con.execute("PRAGMA cache_size").fetchone()[0]
        con.close()
        assert cache_sizes(default) == {sqlite_default} != {-256}
    finally:
        small.close()
        default.close()
