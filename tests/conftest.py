"""Shared pytest fixtures.

Sections (each owned by one part of the suite; add yours below the last one):
  - database servers
"""

from __future__ import annotations

import itertools
import os
import pathlib
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from dbservers import DBServerError, MariaDBServer, PostgresServer  # noqa: E402

# --- database servers ---
#
# Fixtures:
#   postgres_server, mariadb_server   session-scoped tests/dbservers.py servers, started on
#                                     first use; FAIL (not skip) if the binaries are missing
#   db_url                            one fresh empty database per test, parametrized over
#                                     sqlite / postgresql / mysql (marks: postgresql, mysql)
#   sqlite_url, pg_url, mysql_url     one fresh empty database of that backend
# URLs carry no driver (postgresql://..., mysql://..., sqlite:///...); tests that connect
# themselves can use dbservers.driver_url(url).
# PERFECTSCHED_TEST_BACKENDS (default "sqlite,postgresql,mysql") lists the backends that
# may be used: db_url is only parametrized over those, and the server fixtures skip
# (with that reason) for excluded ones.

ALL_BACKENDS = ("sqlite", "postgresql", "mysql")
_BACKEND_ALIASES = {"postgres": "postgresql", "pg": "postgresql", "mariadb": "mysql"}


def _enabled_backends() -> tuple[str, ...]:
    # Popped: the daemon's exec handlers pass PERFECTSCHED_* on; keep tests' env clean.
    raw = os.environ.pop("PERFECTSCHED_TEST_BACKENDS", None) or ",".join(ALL_BACKENDS)
    names = [_BACKEND_ALIASES.get(n.strip(), n.strip()) for n in raw.split(",") if n.strip()]
    unknown = sorted(set(names) - set(ALL_BACKENDS))
    if unknown:
        raise pytest.UsageError(
            f"PERFECTSCHED_TEST_BACKENDS: unknown backend(s) {', '.join(unknown)};"
            f" known: {', '.join(ALL_BACKENDS)}"
        )
    return tuple(b for b in ALL_BACKENDS if b in names)


ENABLED_BACKENDS = _enabled_backends()

_DB_FIXTURE_MARKS = {
    "postgres_server": "postgresql",
    "pg_url": "postgresql",
    "mariadb_server": "mysql",
    "mysql_url": "mysql",
}


# What starts a whole daemon (or an old release's) in a test module: its tests are not
# `make test-quick`'s.
_DAEMON_NAMES = ("Daemon", "start_plain_daemon", "OldRelease")
_DAEMON_FIXTURES = {"daemon_factory", "old_release", "release_0_2_0"}
_HEAVY_FOLDERS = {"daemon", "faults", "system"}


def _is_heavy(item: pytest.Item) -> bool:
    """A test that starts a daemon or a database server, or waits on one."""
    module = getattr(item, "module", None)
    return (item.path.parent.name in _HEAVY_FOLDERS
            or any(hasattr(module, name) for name in _DAEMON_NAMES)
            or bool(_DAEMON_FIXTURES & set(getattr(item, "fixturenames", ())))
            or any(item.get_closest_marker(m) is not None
                   for m in ("postgresql", "mysql", "slow", "serial", "faults", "system")))


def pytest_itemcollected(item: pytest.Item) -> None:
    # Tests that use a server fixture directly get its marker, so that -m "not mysql"
    # deselects them too.  (Only one pytest_itemcollected may exist in this file.)
    for fixture, mark in _DB_FIXTURE_MARKS.items():
        if fixture in getattr(item, "fixturenames", ()):
            item.add_marker(mark)
    # make test-quick: the package's own tests, in one process each, no daemon, no server.
    if not _is_heavy(item):
        item.add_marker(pytest.mark.quick)
    # The longest tests run on SQLite in make test and on the servers in make check
    # (pyproject.toml: slow_on_servers), to keep make test within its 8 minutes.
    if item.get_closest_marker("slow_on_servers") is not None and (
            item.get_closest_marker("postgresql") or item.get_closest_marker("mysql")):
        item.add_marker(pytest.mark.slow)


_S = TypeVar("_S", PostgresServer, MariaDBServer)


def _server_fixture(cls: type[_S]) -> Iterator[_S]:
    if cls.kind not in ENABLED_BACKENDS:
        pytest.skip(f"{cls.kind} excluded by PERFECTSCHED_TEST_BACKENDS")
    server = cls()
    error = None
    try:
        server.start()
    except DBServerError as e:
        error = str(e)
    if error is not None:  # outside the except: no chained traceback, just the message
        pytest.fail(f"cannot start the {cls.kind} test server: {error}", pytrace=False)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """A throw-away PostgreSQL server for the whole session (see tests/dbservers.py)."""
    yield from _server_fixture(PostgresServer)


@pytest.fixture(scope="session")
def mariadb_server() -> Iterator[MariaDBServer]:
    """A throw-away MariaDB server for the whole session (see tests/dbservers.py)."""
    yield from _server_fixture(MariaDBServer)


_db_counter = itertools.count(1)


def _fresh_database(
    request: pytest.FixtureRequest, server: PostgresServer | MariaDBServer
) -> Iterator[str]:
    if not server.running:
        # A fault test stopped it and did not restart it: bring it back.
        server.start_server()
    slug = re.sub(r"[^a-z0-9_]+", "_", request.node.name.lower()).strip("_")[:40]
    name = f"t{next(_db_counter)}_{slug}"
    url = server.create_database(name)
    yield url
    if not server.running:
        server.start_server()
    server.drop_database(name)


@pytest.fixture
def sqlite_url(tmp_path: pathlib.Path) -> str:
    """sqlite:///<tmp_path>/perfectsched.db (the file does not exist yet)."""
    return f"sqlite:///{tmp_path / 'perfectsched.db'}"


@pytest.fixture
def pg_url(request: pytest.FixtureRequest, postgres_server: PostgresServer) -> Iterator[str]:
    """postgresql://sched:sched@127.0.0.1:PORT/NAME of a fresh database owned by sched."""
    yield from _fresh_database(request, postgres_server)


@pytest.fixture
def mysql_url(request: pytest.FixtureRequest, mariadb_server: MariaDBServer) -> Iterator[str]:
    """mysql://sched:sched@127.0.0.1:PORT/NAME of a fresh database granted to sched."""
    yield from _fresh_database(request, mariadb_server)


@pytest.fixture(
    params=[
        pytest.param(b, id=b, marks=[] if b == "sqlite" else [getattr(pytest.mark, b)])
        for b in ENABLED_BACKENDS
    ]
)
def db_url(request: pytest.FixtureRequest) -> str:
    """A fresh empty database, once per enabled backend (PERFECTSCHED_TEST_BACKENDS)."""
    backend: str = request.param
    if backend == "sqlite":
        return str(request.getfixturevalue("sqlite_url"))
    if backend == "postgresql":
        return str(request.getfixturevalue("pg_url"))
    return str(request.getfixturevalue("mysql_url"))


# --- running daemons ---
#
# daemon_factory(overrides=None, *, url=None, watchdog_usec=None, extra_args=None, env=None)
#   -> tests/daemon_harness.Daemon (not started: call .start(), which waits for READY=1).
# Every daemon made is killed with its whole process tree at teardown.

from daemon_harness import Daemon  # noqa: E402


@pytest.fixture
def daemon_factory(tmp_path: pathlib.Path) -> Iterator[object]:
    made: list[Daemon] = []

    def make(overrides: dict[str, object] | None = None, **kwargs: object) -> Daemon:
        d = Daemon(tmp_path, overrides, name=f"d{len(made)}", **kwargs)  # type: ignore[arg-type]
        made.append(d)
        return d

    yield make
    for d in made:
        d.kill()


# --- past releases ---
#
# old_release   session-scoped tests/old_release.OldRelease: release 0.1.0 taken from git
#               history (commit 0ffb1ea), run with this interpreter; FAILS (not skips) when
#               the checkout does not hold that commit.  Its daemon runs in the harness:
#               daemon_factory(cfg, command=old.daemon_command, ctl_command=old.ctl_command).
# release_0_2_0 the same for release 0.2.0 (commit ea31003).

from old_release import OldRelease, OldReleaseUnavailable, materialise  # noqa: E402


def _release(tmp_path_factory: pytest.TempPathFactory, version: str) -> OldRelease:
    error = None
    try:
        return materialise(tmp_path_factory.mktemp(f"release-{version}"), version)
    except OldReleaseUnavailable as exc:
        error = str(exc)
    pytest.fail(f"cannot run release {version}: {error}", pytrace=False)


@pytest.fixture(scope="session")
def old_release(tmp_path_factory: pytest.TempPathFactory) -> OldRelease:
    return _release(tmp_path_factory, "0.1.0")


@pytest.fixture(scope="session")
def release_0_2_0(tmp_path_factory: pytest.TempPathFactory) -> OldRelease:
    return _release(tmp_path_factory, "0.2.0")


# perfectschedctl in this process: its main(), exit status and output (tests of its
# output over the socket and over --url).
CtlResult = subprocess.CompletedProcess


@pytest.fixture
def ctl(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
        ) -> Callable[..., CtlResult[str]]:
    """perfectschedctl's main() in this process (fast), with its exit code and output;
    no PERFECTSCHED_* variable of the test run's own environment."""
    from perfectschedctl import cli

    for name in list(os.environ):
        if name.startswith("PERFECTSCHED_"):
            monkeypatch.delenv(name)

    def run(*args: str, env: dict[str, str] | None = None) -> CtlResult[str]:
        capsys.readouterr()
        with monkeypatch.context() as m:
            for k, v in (env or {}).items():
                m.setenv(k, v)
            try:
                code = cli.main(list(args))
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else 1
        out, err = capsys.readouterr()
        return CtlResult(list(args), code, out, err)
    return run
