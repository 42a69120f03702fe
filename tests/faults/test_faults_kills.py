"""Kill -9 workers and whole daemons of a 3-node cluster while 500+ schedules fire."""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import pytest
from faultlib import (
    Cluster,
    add_catchup_schedules,
    analyse,
    expected_occurrences,
    now_boot,
    watchdog_gaps,
)

pytestmark = pytest.mark.faults

SCHEDULES = 500
BEHIND = 150  # each schedule starts with ~3 occurrences to catch up
CHAOS = 45.0  # seconds of kills
WATCHDOG_USEC = 6_000_000


def test_kill_workers_and_daemons(pg_url: str,
                                  cluster_factory: Callable[..., Cluster]) -> None:
    c = cluster_factory(pg_url, 3, watchdog_usec=WATCHDOG_USEC)
    with c.open() as sc:
        sc.init()
        first = add_catchup_schedules(sc, SCHEDULES, BEHIND)
    c.start()
    rng = random.Random(7)
    one_offs: set[tuple[str, int]] = set()
    end = time.monotonic() + CHAOS
    next_node_kill = time.monotonic() + 8
    victim = 0
    while time.monotonic() < end:
        time.sleep(rng.uniform(0.8, 1.6))
        c.kill_worker(rng)
        if time.monotonic() >= next_node_kill:
            victim = (victim + 1) % len(c.nodes)
            c.kill_node(victim)
            time.sleep(1.0)
            c.restart_node(victim)
            next_node_kill = time.monotonic() + 10
        # A one-off run through a random live node's control socket.
        node = rng.choice([d for d in c.nodes if d.alive()])
        res = node.ctl_json("run", f"s{rng.randrange(SCHEDULES):04d}")
        one_offs.add((res["run_key"], res["run_at"]))
    cutoff = int(time.time())
    t_settle = now_boot()
    c.wait_settled(cutoff, timeout=120)
    settle_s = now_boot() - t_settle
    c.assert_all_alive()
    for d in c.nodes:  # the master fed the watchdog through all the worker deaths
        gap = watchdog_gaps(d)
        assert gap < WATCHDOG_USEC / 1e6, f"{d.config['node_name']}: watchdog gap {gap:.1f}s"
    expected = expected_occurrences(first, cutoff) | one_offs
    rep = analyse(c.read_log(), expected, c.faults, keys=first)
    print(f"\nkills: {c.worker_kills} workers, {c.daemon_kills} daemons; settled "
          f"{settle_s:.1f}s after the chaos; {rep.summary()}")
    rep.assert_ok()
    assert len(rep.nodes) == 3, "every node ran tasks"
    # Leases of killed workers are expired (or taken over); none is held by a ghost.
    c.assert_leases_expire()
    # Graceful stop of the survivors: each exits 0 and gives its leases back.
    for d in c.nodes:
        assert d.stop() == 0, d.log()[-2000:]
    with c.open() as sc:
        now = int(time.time())
        held = [r.key for r in sc.list() if r.owner is not None and r.next_run_time > now]
        assert not held, f"leases still held after every daemon stopped: {held[:5]}"
