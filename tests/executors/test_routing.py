"""Hosts that route different types (SPEC "Execution guarantees"): a worker claims only
the types it routes, so a host without a route never delays the work; an occurrence that
nobody routes waits unchanged and shows in status and /metrics.  Two real daemons on one
database (SQLite file and PostgreSQL)."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import YEARLY, Daemon, lines, sh, wait_until

import perfectschedd

# Daemon-level: the PostgreSQL and MariaDB runs are make check's (test-slow).
pytestmark = pytest.mark.slow_on_servers


def runs(path: Path) -> list[tuple[str, str, float]]:
    """(key, host, start time) of each run a job logged."""
    return [(k, h, float(t)) for k, h, t in (line.split() for line in lines(path))]


def test_hosts_with_different_routes_never_delay_each_other(daemon_factory: Any,
                                                            db_url: str,
                                                            tmp_path: Path) -> None:
    out = tmp_path / "runs"
    job = 'echo "$1 {host} $(date +%s.%N)" >> ' + str(out)
    common = {"retry_wait": 60, "poll_interval": 0.5}
    a = daemon_factory({**common, "node_name": "host-a",
                        "routes": [sh("only-a", job.format(host="a"))]}, url=db_url).start()
    b = daemon_factory({**common, "node_name": "host-b",
                        "routes": [sh("/^only-b$/", job.format(host="b"))]},
                       url=db_url).start()
    with perfectschedd.open(str(a.config_path)) as sc:
        sc.init()
        stale = int(time.time()) - 120
        sc.add("nobody", "unrouted", cron=YEARLY, next_run_time=stale)
        due = int(time.time()) + 2
        for i in range(10):
            sc.add(f"a{i}", "only-a", cron=YEARLY, next_run_time=due)
            sc.add(f"b{i}", "only-b", cron=YEARLY, next_run_time=due)
    wait_until(lambda: len(lines(out)) == 20, timeout=30, what="20 runs")
    done = runs(out)
    # Each on its own host, on time (retry_wait is 60 s: one push-back would show).
    assert {(k[0], h) for k, h, _ in done} == {("a", "a"), ("b", "b")}
    assert max(t for _, _, t in done) - due < 10, done
    with perfectschedd.open(str(a.config_path)) as sc:
        for i in range(10):
            assert [r["attempt"] for r in sc.store.history(f"b{i}", 10)] in ([], [1])
            assert all(r["outcome"] == "success" for r in sc.store.history(f"a{i}", 10))
        left = sc.store.get("nobody")
    # Nobody routes "unrouted": it waits as it was, never tried.
    assert left is not None and left.attempt == 0 and left.owner is None
    assert left.next_run_time == stale
    assert "no route" not in a.log() + b.log()
    st = a.status()
    assert {"type": "unrouted", "occurrences": 1, "routed_here": False} in st["unclaimed"]
    assert "type 'unrouted'; no route on this host" in a.ctl("status").stdout
    body = urllib.request.urlopen(f"http://127.0.0.1:{a.metrics_port}/metrics",
                                  timeout=5).read().decode()
    assert 'perfectsched_occurrences_unclaimed{type="unrouted"} 1.0' in body
    # A reload that adds the route picks the waiting occurrence up.
    b.config["routes"].append(sh("unrouted", job.format(host="b")))
    b.write_config()
    b.ctl("reload")
    wait_until(lambda: any(k == "nobody" for k, _, _ in runs(out)), timeout=30,
               what="the newly routed occurrence")
    for d in (a, b):
        assert d.stop() == 0


def test_a_worker_without_routes_claims_nothing(daemon_factory: Any,
                                                tmp_path: Path) -> None:
    d: Daemon = daemon_factory({"routes": []}).start()
    d.ctl("add", "k", "t", YEARLY, "--at", "0")
    time.sleep(2)
    st = d.status()
    assert st["running"] == []
    shown = d.ctl_json("show", "k")
    assert shown["attempt"] == 0 and shown["owner"] is None and shown["next_run_time"] == 0
    assert d.stop() == 0
