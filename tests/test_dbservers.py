"""The database fixtures give real, working, isolated databases (tests/dbservers.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import sqlalchemy as sa
from dbservers import DBServerError, MariaDBServer, PostgresServer, driver_url

HERE = os.path.dirname(os.path.abspath(__file__))

EXPECTED_DIALECT = {"sqlite": "sqlite", "postgresql": "postgresql", "mysql": "mysql"}


def _engine(url: str) -> sa.engine.Engine:
    return sa.create_engine(driver_url(url), poolclass=sa.pool.NullPool)


def _table_names(engine: sa.engine.Engine) -> list[str]:
    return sorted(sa.inspect(engine).get_table_names())


def _jobs_table(md: sa.MetaData) -> sa.Table:
    return sa.Table(
        "jobs",
        md,
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("key", sa.String(100), nullable=False, unique=True),
        sa.Column("data", sa.Text),
    )


def test_db_url_round_trip(db_url: str) -> None:
    scheme = db_url.split(":", 1)[0]
    assert scheme in EXPECTED_DIALECT
    if scheme != "sqlite":
        assert db_url.startswith(f"{scheme}://sched:sched@127.0.0.1:")
    engine = _engine(db_url)
    try:
        assert engine.dialect.name == EXPECTED_DIALECT[scheme]
        assert _table_names(engine) == [], "a fresh database must be empty"
        md = sa.MetaData()
        jobs = _jobs_table(md)
        md.create_all(engine)  # as the unprivileged app user
        with engine.begin() as conn:
            conn.execute(
                jobs.insert(),
                [{"key": "a", "data": '{"x": 1}'}, {"key": "ü-€-日本", "data": "ünïcødé"}],
            )
        with engine.connect() as conn:
            rows = conn.execute(sa.select(jobs.c.key, jobs.c.data).order_by(jobs.c.id)).all()
        assert [tuple(r) for r in rows] == [("a", '{"x": 1}'), ("ü-€-日本", "ünïcødé")]
        # a unique violation is reported as IntegrityError by every backend
        with pytest.raises(sa.exc.IntegrityError), engine.begin() as conn:
            conn.execute(jobs.insert(), {"key": "a"})
    finally:
        engine.dispose()


@pytest.mark.parametrize("run", [1, 2])
def test_databases_are_isolated_between_tests(db_url: str, run: int) -> None:
    # Both runs create the same table: the second would find the first's if shared.
    engine = _engine(db_url)
    try:
        assert _table_names(engine) == []
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE isolation_probe (run INTEGER)"))
            conn.execute(sa.text("INSERT INTO isolation_probe VALUES (:r)"), {"r": run})
        assert _table_names(engine) == ["isolation_probe"]
    finally:
        engine.dispose()


def test_two_databases_on_one_server_are_separate(postgres_server: PostgresServer) -> None:
    urls = [postgres_server.create_database(f"sep_{i}") for i in (1, 2)]
    try:
        e1, e2 = (_engine(u) for u in urls)
        with e1.begin() as conn:
            conn.execute(sa.text("CREATE TABLE only_in_one (x INTEGER)"))
        assert _table_names(e1) == ["only_in_one"]
        assert _table_names(e2) == []
        e1.dispose()
        e2.dispose()
    finally:
        for i in (1, 2):
            postgres_server.drop_database(f"sep_{i}")


def test_drop_database_cuts_open_connections(mariadb_server: MariaDBServer) -> None:
    url = mariadb_server.create_database("drop_me")
    engine = sa.create_engine(driver_url(url))
    conn = engine.connect()
    tx = conn.begin()
    conn.execute(sa.text("CREATE TABLE t (x INTEGER)"))
    conn.execute(sa.text("INSERT INTO t VALUES (1)"))  # holds a metadata lock
    t0 = time.monotonic()
    mariadb_server.drop_database("drop_me")
    assert time.monotonic() - t0 < 10
    with pytest.raises(sa.exc.DBAPIError):
        tx.commit()
    conn.invalidate()
    engine.dispose()


def _count(url: str) -> int:
    engine = _engine(url)
    try:
        with engine.connect() as conn:
            return int(conn.execute(sa.text("SELECT COUNT(*) FROM kept")).scalar_one())
    finally:
        engine.dispose()


@pytest.mark.parametrize("mode", ["fast", "immediate"])
@pytest.mark.parametrize(
    "server_fixture",
    [
        pytest.param("postgres_server", marks=pytest.mark.postgresql),
        pytest.param("mariadb_server", marks=pytest.mark.mysql),
    ],
)
def test_stop_and_start_server_keeps_data(
    request: pytest.FixtureRequest, server_fixture: str, mode: str
) -> None:
    server: PostgresServer | MariaDBServer = request.getfixturevalue(server_fixture)
    name = f"keep_{mode}"
    url = server.create_database(name)
    try:
        engine = _engine(url)
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE kept (x INTEGER)"))
            conn.execute(sa.text("INSERT INTO kept VALUES (1), (2), (3)"))
        engine.dispose()
        port = server.port

        server.stop_server(mode=mode)
        assert not server.running
        with pytest.raises(sa.exc.OperationalError):
            _count(url)

        server.start_server()
        assert server.running and server.port == port
        assert _count(url) == 3
    finally:
        if not server.running:
            server.start_server()
        server.drop_database(name)


def test_pause_and_resume_server(pg_url: str, postgres_server: PostgresServer) -> None:
    url = pg_url + "?connect_timeout=2"
    engine = _engine(url)
    conn = engine.connect()
    result: list[int] = []

    def query() -> None:
        result.append(conn.execute(sa.text("SELECT 42")).scalar_one())

    postgres_server.pause_server()
    try:
        # an open connection hangs ...
        worker = threading.Thread(target=query, daemon=True)
        worker.start()
        worker.join(1.0)
        assert worker.is_alive() and result == []
        # ... and a new one is not refused but times out
        t0 = time.monotonic()
        with pytest.raises(sa.exc.OperationalError):
            _engine(url).connect()
        assert time.monotonic() - t0 >= 1.5
    finally:
        postgres_server.resume_server()
    worker.join(10)
    assert result == [42]
    conn.close()
    with engine.connect() as c:
        assert c.execute(sa.text("SELECT 1")).scalar_one() == 1
    engine.dispose()


def test_missing_binaries_give_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PERFECTSCHED_PG_BINDIR", "/nonexistent/bin")
    with pytest.raises(DBServerError, match="install-test-deps"):
        PostgresServer().start()


@pytest.mark.postgresql
def test_cli_prints_url_and_cleans_up_on_sigterm() -> None:
    proc = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "dbservers.py"), "postgresql", "--db", "bench"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        assert url.startswith("postgresql://sched:sched@127.0.0.1:") and url.endswith("/bench")
        engine = _engine(url)
        with engine.connect() as conn:
            assert conn.execute(sa.text("SELECT current_user")).scalar_one() == "sched"
        engine.dispose()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        data_dir = err.split("data in ", 1)[1].split(";", 1)[0]
        assert not os.path.exists(data_dir)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
