"""The database's schema version (version.py; opening a database: upgrade.py), on
every backend: recorded on a new database, brought up from 0.1.0's (no version
record), refused in one line when newer than this version may use or not one of ours,
changing nothing then; several hosts updating at once; a daemon that cannot use its
database fails its start (no READY=1); each host records itself and status lists the
hosts.

Databases made by the real 0.1.0 are tests/daemon/test_upgrade_db.py's.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from daemon_harness import Daemon, wait_until

import perfectschedd
from perfectschedd.control import commands
from perfectschedd.errors import ConfigError, SchemaError
from perfectschedd.store import version
from perfectschedd.store.sql import Store

T0 = 1_700_002_800
CURRENT = str(version.SCHEMA_VERSION)
# A schema from a release after this one.
NEWER = version.SCHEMA_VERSION + 1


def meta(url: str) -> dict[str, str]:
    engine = sa.create_engine(Store(url).url)
    try:
        with engine.connect() as conn:
            return dict(conn.exec_driver_sql(
                "SELECT name, value FROM perfectsched_meta").all())
    finally:
        engine.dispose()


def snapshot(url: str) -> dict[str, Any]:
    """Every table, its columns and its rows: what "nothing changed" compares."""
    engine = sa.create_engine(Store(url).url)
    try:
        inspector = sa.inspect(engine)
        found: dict[str, Any] = {}
        with engine.connect() as conn:
            for name in sorted(inspector.get_table_names()):
                columns = sorted(c["name"] for c in inspector.get_columns(name))
                rows = sorted(map(tuple, conn.exec_driver_sql(
                    f"SELECT * FROM {engine.dialect.identifier_preparer.quote(name)}")
                    .all()), key=repr)
                found[name] = (columns, rows)
        return found
    finally:
        engine.dispose()


def make_v1(url: str) -> None:
    """A database as 0.1.0 left it: its two tables and no version record."""
    with perfectschedd.open({"type": "rdb_compat", "url": url}) as sc:
        sc.add("k", "t", cron="0 * * * *", start=T0, now=T0, data={"a": 1})
        engine = sc.store.engine
        with engine.begin() as conn:
            conn.exec_driver_sql("DROP TABLE perfectsched_meta")
            conn.exec_driver_sql("DROP TABLE perfectsched_hosts")
            conn.exec_driver_sql("DROP TABLE perfectsched_tokens")


def make_v3(url: str) -> None:
    """A database as 0.2.0 left it (schema 3): every table but the tokens table, a
    schedule, a run and a host row."""
    with perfectschedd.open({"type": "rdb_compat", "url": url}) as sc:
        sc.add("k", "t", cron="0 * * * *", start=T0, now=T0, data={"a": 1})
        sc.store.record_runs([{"key": "k", "type": "t", "scheduled_time": T0, "attempt": 1,
                               "started_at": T0 + 1.0, "finished_at": T0 + 2.0,
                               "outcome": "success", "worker": "old:1"}])
        sc.store.record_host("old", "0.2.0", 4242, T0, T0)
        with sc.store.engine.begin() as conn:
            conn.exec_driver_sql("DROP TABLE perfectsched_tokens")
            conn.exec_driver_sql("UPDATE perfectsched_meta SET value = '3' "
                                 "WHERE name = 'schema_version'")
            conn.exec_driver_sql("UPDATE perfectsched_meta SET value = '0.2.0' "
                                 "WHERE name = 'written_by'")
            conn.exec_driver_sql("UPDATE perfectsched_hosts SET schema_version = 3")


def make_newer(url: str, compatible_from: int | None) -> None:
    """A database a later release (0.9.0) updated: schema_version NEWER (and, if given,
    the oldest schema that may still use it)."""
    make_v1(url)
    Store(url).init()
    engine = sa.create_engine(Store(url).url)
    with engine.begin() as conn:
        conn.exec_driver_sql(f"UPDATE perfectsched_meta SET value = '{NEWER}' "
                             "WHERE name = 'schema_version'")
        conn.exec_driver_sql("UPDATE perfectsched_meta SET value = '0.9.0' "
                             "WHERE name = 'written_by'")
        if compatible_from is None:
            conn.exec_driver_sql("DELETE FROM perfectsched_meta WHERE name = 'compatible_from'")
        else:
            conn.exec_driver_sql(f"UPDATE perfectsched_meta SET value = '{compatible_from}' "
                                 "WHERE name = 'compatible_from'")
    engine.dispose()


def test_a_new_database_records_its_schema(db_url: str) -> None:
    store = Store(db_url)
    assert store.init() is True
    assert meta(db_url) == {"schema_version": str(version.SCHEMA_VERSION),
                            "compatible_from": str(version.COMPATIBLE_FROM),
                            "written_by": perfectschedd.__version__}
    assert store.init() is False  # idempotent
    assert meta(db_url)["schema_version"] == CURRENT


def test_a_0_1_0_database_is_brought_up_to_date_keeping_its_rows(db_url: str) -> None:
    make_v1(db_url)
    before = snapshot(db_url)
    assert "perfectsched_meta" not in before
    with perfectschedd.open({"type": "rdb_compat", "url": db_url}) as sc:
        info = sc["k"].info()
        assert (info.cron, info.next_time, info.data) == ("0 * * * *", T0, {"a": 1})
    after = snapshot(db_url)
    assert meta(db_url)["schema_version"] == CURRENT
    assert after["perfectsched"] == before["perfectsched"]
    assert after["perfectsched_history"] == before["perfectsched_history"]
    assert after["perfectsched_hosts"][1] == []
    assert "perfectsched_tokens" not in before and after["perfectsched_tokens"][1] == []


def test_a_0_2_0_database_gains_the_tokens_table_keeping_its_rows(db_url: str) -> None:
    """Schema 3 to 4 is expand-only: a new table (which 0.2.0 hosts never read), every
    other table as it was, and the record says 4, written by this release."""
    make_v3(db_url)
    before = snapshot(db_url)
    assert "perfectsched_tokens" not in before
    assert meta(db_url)["schema_version"] == "3"
    assert Store(db_url).init() is False
    after = snapshot(db_url)
    untouched = ("perfectsched", "perfectsched_history", "perfectsched_hosts")
    assert {n: after[n] for n in untouched} == {n: before[n] for n in untouched}
    assert set(after) == {*before, "perfectsched_tokens"}
    assert after["perfectsched_tokens"] == (
        sorted(("id", "name", "role", "hash", "created_at", "created_by", "expires_at",
                "revoked_at")), [])
    assert meta(db_url) == {"schema_version": "4", "compatible_from": "1",
                            "written_by": perfectschedd.__version__}
    assert version.RELEASES[4] == perfectschedd.__version__ == "0.3.0"
    store = Store(db_url)
    store.init()
    token_id, _ = store.add_token("after-upgrade", "viewer", "root", None, T0)
    assert [t.id for t in store.tokens()] == [token_id]


@pytest.mark.parametrize("compatible_from", [None, NEWER])
def test_a_newer_database_is_refused_naming_both_versions_and_left_alone(
        db_url: str, compatible_from: int | None) -> None:
    make_newer(db_url, compatible_from)
    before = snapshot(db_url)
    with pytest.raises(SchemaError) as caught:
        Store(db_url).init()
    message = str(caught.value)
    assert "\n" not in message
    assert f"schema {NEWER} (perfectsched 0.9.0)" in message
    assert f"perfectsched {perfectschedd.__version__}" in message and f"schema {CURRENT}" in message
    assert snapshot(db_url) == before


def test_a_newer_database_that_older_versions_may_use_is_used_as_it_is(db_url: str) -> None:
    """An expand-only later release (compatible_from 1) leaves room for this one: a host
    of it may restart during a rolling upgrade; the record is not lowered."""
    make_newer(db_url, 1)
    with perfectschedd.open({"type": "rdb_compat", "url": db_url}) as sc:
        assert sc["k"].exists()
    assert meta(db_url)["schema_version"] == str(NEWER)
    assert meta(db_url)["written_by"] == "0.9.0"


def test_a_table_not_made_by_perfectsched_is_refused_before_anything_is_created(
        db_url: str) -> None:
    engine = sa.create_engine(Store(db_url).url)
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE perfectsched (id INTEGER PRIMARY KEY, name "
                             "VARCHAR(20))")
    engine.dispose()
    before = snapshot(db_url)
    with pytest.raises(SchemaError, match="column key is missing"):
        Store(db_url).init()
    assert snapshot(db_url) == before
    assert issubclass(SchemaError, ConfigError)  # a configuration problem to every caller


def _init_in_a_process(url: str) -> str:
    try:
        Store(url).init()
        return "ok"
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        return f"{type(exc).__name__}: {exc}"


@pytest.mark.parametrize("start", ["new", "0.1.0"])
def test_hosts_starting_at_once_all_update_the_database(db_url: str, start: str) -> None:
    if start == "0.1.0":
        make_v1(db_url)
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(6) as pool:
        results = pool.map(_init_in_a_process, [db_url] * 6)
    assert results == ["ok"] * 6
    assert meta(db_url)["schema_version"] == CURRENT
    with perfectschedd.open({"type": "rdb_compat", "url": db_url}) as sc:
        assert sc["k"].exists() == (start == "0.1.0")


# -- the daemon ----------------------------------------------------------------------------

def _failed_start(d: Daemon) -> str:
    d.start(wait_ready=False)
    assert d.proc is not None
    code = d.proc.wait(30)
    assert code == 1, d.log()
    assert not any("READY=1" in m for m in d.messages()), d.messages()
    return d.log()


@pytest.mark.parametrize("compatible_from", [None, NEWER])
def test_a_daemon_on_a_newer_database_fails_its_start_in_one_line(
        db_url: str, daemon_factory: Any, compatible_from: int | None) -> None:
    make_newer(db_url, compatible_from)
    before = snapshot(db_url)
    log = _failed_start(daemon_factory(url=db_url))
    errors = [line for line in log.splitlines() if " ERROR " in line]
    assert errors and f"cannot start: the database has schema {NEWER} (perfectsched 0.9.0)" \
        in errors[-1], log
    assert "Traceback" not in log and "keep dying" not in log
    assert snapshot(db_url) == before


def test_a_daemon_on_a_refused_schema_fails_its_start(db_url: str,
                                                      daemon_factory: Any) -> None:
    engine = sa.create_engine(Store(db_url).url)
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE perfectsched (id INTEGER PRIMARY KEY)")
    engine.dispose()
    before = snapshot(db_url)
    log = _failed_start(daemon_factory(url=db_url))
    assert "cannot start: table perfectsched: column key is missing" in log, log
    assert "Traceback" not in log
    assert snapshot(db_url) == before


def test_a_daemon_whose_database_only_is_unreachable_starts(daemon_factory: Any,
                                                           tmp_path: Path) -> None:
    """Waiting fixes an unreachable server: the start goes on and status says so."""
    from daemon_harness import free_port

    d = daemon_factory(url=f"postgresql://nobody@127.0.0.1:{free_port()}/none").start()
    status = d.status()
    assert status["database_ok"] is False
    assert d.alive()


def test_status_lists_the_hosts_and_a_host_too_old_to_record_itself(
        db_url: str, daemon_factory: Any) -> None:
    a = daemon_factory({"node_name": "host-a"}, url=db_url).start()
    b = daemon_factory({"node_name": "host-b"}, url=db_url).start()
    # A 0.1.0 host records no row; it shows through the leases it holds.
    with perfectschedd.open({"type": "rdb_compat", "url": db_url}) as sc:
        sc.add("old-k", "nobody-routes-this", cron="* * * * *")
        sc.store.update("old-k", {"owner": "host-old:4242",
                                  "next_run_time": int(time.time()) + 600}, take_lease=False)

    def hosts() -> dict[str, dict[str, Any]]:
        return {h["name"]: h for h in a.status()["hosts"]}

    def three() -> dict[str, dict[str, Any]] | None:
        h = hosts()
        return h if {"host-a", "host-b", "host-old"} <= set(h) else None

    found = wait_until(three, timeout=30, what="three hosts")
    assert found["host-a"]["version"] == found["host-b"]["version"] == \
        perfectschedd.__version__
    assert found["host-b"]["live"] and found["host-b"]["schema_version"] == int(CURRENT)
    assert found["host-old"]["version"] == "0.1.0" and found["host-old"]["last_seen"] is None
    text = a.ctl("status").stdout
    assert "host-b" in text and "0.1.0 (or older)" in text
    # A clean stop takes the host off the list.
    assert b.stop() == 0
    wait_until(lambda: "host-b" not in hosts(), timeout=30, what="host-b gone")


def test_a_table_from_before_creators_gets_the_column_and_its_rows_read_as_unknown(
        db_url: str) -> None:
    """0.1.0 (and 0.2.0 before creators) wrote no creator: the column is added at start,
    expand-only (nullable), and those rows read as unknown."""
    config = {"type": "rdb_compat", "url": db_url}
    with perfectschedd.open(config) as sc:
        sc.add("old", "t", cron="@daily")
        with sc.store.engine.begin() as conn:
            conn.exec_driver_sql("ALTER TABLE perfectsched DROP COLUMN creator")
    with perfectschedd.open(config) as sc:
        assert sc["old"].info().creator is None
        sc.add("new", "t", cron="@daily")
        assert sc["new"].info().creator == os.geteuid()
        shown = commands.execute(sc, "show", {"key": "old"})
        assert (shown["creator"], shown["creator_name"]) == (None, None)
        assert [(s["key"], s["creator"]) for s in commands.execute(sc, "list")] == [
            ("new", os.geteuid()), ("old", None)]
    assert meta(db_url)["schema_version"] == CURRENT


RUN_COLUMNS = ("exit_code", "signal", "duration", "output", "error")


def test_a_history_table_from_before_schema_3_gets_the_run_columns(db_url: str) -> None:
    """0.1.0 and 0.2.0 made history without what each run did: init adds the columns
    (nullable: their hosts keep inserting the columns they name), older rows read them as
    NULL, and new rows fill them."""
    config = {"type": "rdb_compat", "url": db_url}
    run = {"key": "k", "type": "t", "scheduled_time": T0, "attempt": 1,
           "started_at": T0 + 1.0, "finished_at": T0 + 2.0, "outcome": "success",
           "worker": "old:1"}
    with perfectschedd.open(config) as sc:
        sc.add("k", "t", cron="@daily")
        with sc.store.engine.begin() as conn:
            for column in RUN_COLUMNS:
                conn.exec_driver_sql(f"ALTER TABLE perfectsched_history DROP COLUMN "
                                     f"{sc.store.engine.dialect.identifier_preparer.quote(column)}")
            # A host of 0.2.0 writes a run as it knows it.
            conn.execute(sc.store.h.insert().values(**run, unit=None))
            conn.exec_driver_sql("UPDATE perfectsched_meta SET value = '2' "
                                 "WHERE name = 'schema_version'")
    with perfectschedd.open(config) as sc:
        sc.store.record_runs([{**run, "attempt": 2, "outcome": "failed", "exit_code": 4,
                               "signal": None, "duration": 0.5, "output": "boom\n",
                               "error": "exit status 4: boom"}])
        newest, oldest = sc.history("k", 10)
    assert [oldest[c] for c in RUN_COLUMNS] == [None] * 5
    assert [newest[c] for c in RUN_COLUMNS] == [4, None, 0.5, "boom\n", "exit status 4: boom"]
    assert meta(db_url)["schema_version"] == CURRENT
