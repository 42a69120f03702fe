"""The database goes away (PostgreSQL stopped for 30 s) or gets slow; daemons ride it out."""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import pytest
from faultlib import (
    Cluster,
    LatencyProxy,
    add_catchup_schedules,
    analyse,
    expected_occurrences,
    metric,
    now_boot,
    wait_until,
    watchdog_gaps,
    workers,
)

pytestmark = pytest.mark.faults

WATCHDOG_USEC = 6_000_000
OUTAGE = 30.0


def _unreachable_lines(log: str) -> int:
    return len(re.findall(r"database unreachable", log))


def test_postgresql_stopped_30s(postgres_server: object, pg_url: str,
                                cluster_factory: Callable[..., Cluster]) -> None:
    c = cluster_factory(pg_url, 3, watchdog_usec=WATCHDOG_USEC)
    with c.open() as sc:
        sc.init()
        first = add_catchup_schedules(sc, 200, 180)
    n0, n1, n2 = c.nodes
    n0.start(timeout=60)
    n1.start(timeout=60)
    time.sleep(1.5)  # the catch-up is in full swing
    pids = {d.config["node_name"]: sorted(workers(d)) for d in (n0, n1)}

    t0 = now_boot()
    postgres_server.stop_server()  # type: ignore[attr-defined]
    try:
        # Both running daemons notice, say so in STATUS and in `status`, and keep running.
        for d in (n0, n1):
            d.wait_notify(lambda m: "STATUS=" in m and "database unreachable" in m,
                          timeout=10, what="STATUS with 'database unreachable'")
        st = n0.status()
        assert st["database_ok"] is False, st
        wait_until(lambda: metric(n0, "perfectsched_database_up") == 0, 10,
                   what="perfectsched_database_up 0")
        assert (metric(n0, "perfectsched_database_errors_total") or 0) > 0
        res = n0.ctl("list", check=False)
        assert res.returncode == 1 and len(res.stderr.strip().splitlines()) == 1, res
        # A daemon started while the database is down still comes up (and says so).
        n2.start(timeout=30)
        n2.wait_notify(lambda m: "database unreachable" in m, timeout=10,
                       what="STATUS of the node started during the outage")
        time.sleep(max(0.0, OUTAGE - (now_boot() - t0)))
        c.assert_all_alive()
        for d in (n0, n1):
            assert sorted(workers(d)) == pids[d.config["node_name"]], \
                "workers were replaced during the outage"
    finally:
        postgres_server.start_server()  # type: ignore[attr-defined]
    t1 = now_boot()
    c.fault(t0, t1, "PostgreSQL stopped")
    print(f"\noutage {t1 - t0:.1f}s")

    # Each node resumes by itself: STATUS clears, `status` and commands work again.
    for d in c.nodes:
        d.wait_notify(lambda m: "STATUS=" in m and "database unreachable" not in m,
                      timeout=40, what="STATUS without 'database unreachable'",
                      after=len(d.messages()) - 1)
        wait_until(lambda d=d: d.status()["database_ok"], 20, what="database_ok again")
        d.ctl("list")
        wait_until(lambda d=d: metric(d, "perfectsched_database_up") == 1, 10,
                   what="perfectsched_database_up 1")
    recovered = now_boot() - t1
    assert recovered < 15, f"nodes resumed only {recovered:.1f}s after the database"
    cutoff = int(time.time())
    c.wait_settled(cutoff, timeout=90)
    c.assert_all_alive()
    for d in c.nodes:
        d.wait_log("database reachable again")
        log = d.log()
        # Logged once per state change (per worker process), not once per poll.
        n_workers = len(set(re.findall(r"worker (\d+) spawned", log))) or 2
        assert _unreachable_lines(log) <= n_workers + 1, log[-3000:]
        assert "database reachable again" in log
        gap = watchdog_gaps(d)
        assert gap < WATCHDOG_USEC / 1e6, f"{d.config['node_name']}: watchdog gap {gap:.1f}s"
    rep = analyse(c.read_log(), expected_occurrences(first, cutoff), c.faults, keys=first)
    print(f"resumed after {recovered:.1f}s; {rep.summary()}")
    rep.assert_ok()
    c.assert_leases_expire()


STALL = 4.0


def test_slow_database(postgres_server: object, pg_url: str,
                       cluster_factory: Callable[..., Cluster]) -> None:
    """Every round trip to PostgreSQL takes 60+ ms, and once it hangs for a few seconds."""
    port = int(pg_url.rsplit(":", 1)[1].split("/")[0])
    proxy = LatencyProxy(("127.0.0.1", port), delay=0.03)
    try:
        c = cluster_factory(proxy.url(pg_url), 2, watchdog_usec=WATCHDOG_USEC)
        with c.open() as sc:
            sc.init()
            first = add_catchup_schedules(sc, 200, 120)
        c.start()
        pids = {d.config["node_name"]: sorted(workers(d)) for d in c.nodes}
        time.sleep(3)
        t0 = now_boot()
        proxy.flowing.clear()  # the server hangs: queries neither answer nor fail
        time.sleep(STALL)
        proxy.flowing.set()
        c.fault(t0, now_boot(), "database stalled")
        cutoff = int(time.time())
        c.wait_settled(cutoff, timeout=90)
        c.assert_all_alive()
        for d in c.nodes:
            assert sorted(workers(d)) == pids[d.config["node_name"]], \
                "a slow database got workers killed"
            gap = watchdog_gaps(d)
            assert gap < WATCHDOG_USEC / 1e6, f"{d.config['node_name']}: watchdog gap {gap:.1f}s"
        rep = analyse(c.read_log(), expected_occurrences(first, cutoff), c.faults, keys=first)
        print(f"\n{rep.summary()}")
        rep.assert_ok()
        c.assert_leases_expire()
    finally:
        proxy.close()
