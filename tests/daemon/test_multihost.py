"""A PostgreSQL URL listing several hosts (libpq multi-host, target_session_attrs=
read-write; SPEC "Database failover"), in both of its forms, on whichever SQLAlchemy
and driver this installation has (SQLAlchemy 2 + psycopg 3; Debian 12's SQLAlchemy 1.4
+ psycopg2 in `make test-debian`).

Two servers stand for a primary and its replica: the daemon works on the one that takes
writes, skips one that refuses them, and leaves a server that turns read-only under it
for the other (as a demoted primary's connections must be left for the new primary)."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import Daemon, sh, wait_until
from dbservers import PostgresServer

import perfectschedd

pytestmark = pytest.mark.postgresql


@pytest.fixture
def two_servers() -> Iterator[tuple[PostgresServer, PostgresServer]]:
    with PostgresServer() as first, PostgresServer() as second:
        first.create_database("mh")
        second.create_database("mh")
        yield first, second


def _url(form: str, servers: tuple[PostgresServer, ...]) -> str:
    if form == "repeated":
        hosts = "&".join(f"host=127.0.0.1:{s.port}" for s in servers)
    else:
        hosts = (f"host={','.join('127.0.0.1' for _ in servers)}"
                 f"&port={','.join(str(s.port) for s in servers)}")
    return f"postgresql://sched:sched@/mh?{hosts}&target_session_attrs=read-write"


def _read_only(server: PostgresServer, on: bool) -> None:
    server.psql(f"ALTER SYSTEM SET default_transaction_read_only = {'on' if on else 'off'}")
    server.psql("SELECT pg_reload_conf()")


def _workers(d: Daemon) -> list[int]:
    return sorted(p for p in d.children()
                  if b"perfectschedd" in Path(f"/proc/{p}/cmdline").read_bytes())


def _metric(d: Daemon, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{d.metrics_port}/metrics",
                                timeout=10) as res:
        for line in res.read().decode().splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0] == name:
                return float(parts[1])
    return 0.0


def _store(server: PostgresServer) -> Any:
    return perfectschedd.open({"type": "rdb_compat", "url": server.url("mh")})


def _successes(server: PostgresServer, key: str) -> int:
    with _store(server) as sc:
        return sum(1 for h in sc.history(key, 100) if h["outcome"] == "success")


def _add_every_second(server: PostgresServer, prefix: str, n: int = 60) -> None:
    """`n` minutely schedules whose delays spread them over the minute: one falls due
    about every second (so claims, which write, keep coming)."""
    now = int(time.time())
    minute = now - now % 60
    with _store(server) as sc:
        sc.init()
        sc.add_many([{"key": f"{prefix}{i:02d}", "type": "t", "cron": "* * * * *",
                      "start": minute, "delay": i} for i in range(n)])


def _total_successes(server: PostgresServer, prefix: str, n: int = 60) -> int:
    return sum(_successes(server, f"{prefix}{i:02d}") for i in range(n))


# One form in make test; the other, as long again, in make check (test-slow).
@pytest.mark.parametrize("form", [pytest.param("repeated", marks=pytest.mark.slow), "comma"])
def test_daemon_on_a_multi_host_url_follows_the_primary(
        form: str, two_servers: tuple[PostgresServer, PostgresServer],
        daemon_factory: Callable[..., Daemon]) -> None:
    primary, replica = two_servers
    _add_every_second(primary, "p")
    with _store(replica) as sc:  # its table exists, as a replica's would
        sc.init()
    # Listed first, and refusing writes: libpq passes over it.
    _read_only(replica, True)
    d = daemon_factory({"alive_time": 30, "routes": [sh("t", "true")]},
                       url=_url(form, (replica, primary)))
    d.start(timeout=60)
    assert d.ctl_json("list") is not None
    wait_until(lambda: _total_successes(primary, "p") >= 3, 60,
               what="runs recorded on the primary")
    pids = _workers(d)

    # The primary turns read-only under the daemon (a demoted primary), the other server
    # takes writes: its connections are left for ones to the other server.
    _read_only(replica, False)
    _add_every_second(replica, "r")
    _read_only(primary, True)
    wait_until(lambda: _total_successes(replica, "r") >= 3, 60,
               what="runs recorded on the new primary")
    assert d.alive()
    assert _workers(d) == pids, "a worker was replaced"
    # Left, not reused: the read-only server's connections were abandoned.
    assert _metric(d, "perfectsched_database_connections_abandoned_total") >= 1
