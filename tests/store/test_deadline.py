"""Client-side statement deadlines and "not the primary any more" errors, on a real
PostgreSQL (store/deadline.py): a frozen server's connection is cut at the deadline and
abandoned, a read-only server's connection is left for a new one."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from dbservers import PostgresServer
from sqlalchemy.exc import DBAPIError

from perfectschedd.store.deadline import CONNECT_TIMEOUT, statement_deadline
from perfectschedd.store.sql import Store

pytestmark = pytest.mark.postgresql


@pytest.fixture
def private_pg() -> Iterator[PostgresServer]:
    """A server of this test's own: it is frozen, which the shared one must never be."""
    with PostgresServer() as pg:
        yield pg


def _backend_pid(store: Store) -> int:
    with store.engine.connect() as conn:
        return int(conn.exec_driver_sql("SELECT pg_backend_pid()").scalar())


def test_deadline_is_well_inside_alive_time() -> None:
    assert statement_deadline(6) == 2.0
    assert statement_deadline(60) == 10.0
    assert statement_deadline(300) == 10.0
    assert statement_deadline(30) == 5.0


def test_frozen_server_statement_cut_at_its_deadline(private_pg: PostgresServer) -> None:
    store = Store(private_pg.create_database("frozen"), alive_time=12)
    try:
        store.init()
        assert store.deadline == 2.0
        old = _backend_pid(store)
        private_pg.pause_server()
        try:
            t0 = time.monotonic()
            with pytest.raises(DBAPIError) as err:
                store.earliest_due()
            waited = time.monotonic() - t0
        finally:
            private_pg.resume_server()
        # The deadline, then one try on a new connection (bounded by connect_timeout).
        assert store.deadline <= waited < store.deadline + CONNECT_TIMEOUT + 5, waited
        assert store.describe_error(err.value).startswith("hung: no answer within 2s"), \
            store.describe_error(err.value)
        # Thawed, it answers again, on a new connection: the cut one was never reused.
        assert store.earliest_due() is None
        assert _backend_pid(store) != old
        # The server sees the abandoned connection closed, and its backend ends.
        deadline = time.monotonic() + 20
        while str(old) in private_pg.psql("SELECT pid FROM pg_stat_activity").split():
            assert time.monotonic() < deadline, "the abandoned backend is still there"
            time.sleep(0.2)
    finally:
        store.close()


def test_read_only_connection_left_for_a_primary_one(pg_url: str) -> None:
    """A pooled connection that now reaches a read-only server (a demoted primary): the
    write is tried again on a new connection, and the read-only one is not reused."""
    store = Store(pg_url, alive_time=60)
    try:
        store.init()
        with store.engine.begin() as conn:  # the pool's one connection turns read-only
            ro = int(conn.exec_driver_sql("SELECT pg_backend_pid()").scalar())
            conn.exec_driver_sql("SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY")
        # 25006 on the read-only one, then a new connection.
        store.record_host("written", "0", 1, 0.0, time.time())
        assert "written" in {h["name"] for h in store.hosts()}
        assert _backend_pid(store) != ro
        assert store.describe_error(_read_only_error(pg_url)).startswith("read-only")
    finally:
        store.close()


@pytest.mark.parametrize("write", ["history", "claim"])
def test_hot_path_leaves_a_read_only_connection(pg_url: str, write: str) -> None:
    """The worker's hot path runs on the driver's cursor (history rows by COPY under
    psycopg 3, the claim and its finishes by plain statements): its errors must still be
    SQLAlchemy's, with the same handling, so a read-only connection is abandoned and the
    write done on a new one."""
    store = Store(pg_url, alive_time=60)
    try:
        store.init()
        with store.engine.begin() as conn:
            ro = int(conn.exec_driver_sql("SELECT pg_backend_pid()").scalar())
            conn.exec_driver_sql("SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY")
        if write == "history":
            store.record_runs([{
                "key": "ro", "type": "t", "scheduled_time": 60, "attempt": 1,
                "started_at": 61.5, "finished_at": 62.25, "outcome": "success",
                "worker": "h:1", "duration": 0.75}])
            assert [(r["key"], r["started_at"], r["duration"]) for r in
                    store.history("ro", 5)] == [("ro", 61.5, 0.75)]
        else:
            assert store.claim(time.time(), 60, "h:1", 64) == []
        assert _backend_pid(store) != ro
    finally:
        store.close()


def _read_only_error(url: str) -> DBAPIError:
    store = Store(url, alive_time=60)
    try:
        with store.engine.begin() as conn:
            conn.exec_driver_sql("SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY")
        with store.engine.connect() as conn:
            try:
                conn.exec_driver_sql("CREATE TABLE x (a int)")
            except DBAPIError as exc:
                assert exc.connection_invalidated
                return exc
    finally:
        store.close()
    raise AssertionError("a write on a read-only connection did not fail")
