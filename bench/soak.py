"""Soak test: the fault-injection checks of tests/faults/, for an hour (not run in CI).

    .venv/bin/python bench/soak.py                     # 60 minutes, 3 nodes, 500 schedules
    .venv/bin/python bench/soak.py --minutes 5 --nodes 2 --schedules 200

Starts a throw-away PostgreSQL (tests/dbservers.py), puts a TCP proxy in front of it (to
stall it), runs N daemons as separate "hosts" (own config, node_name, control socket)
and, while every schedule fires each minute plus one-off runs:

  - kills a random worker with SIGKILL every 1-3 s,
  - crashes a whole node (daemon, workers and jobs: SIGKILL) every ~45 s, restarts it,
  - stalls the database (no answer, no error) for 5 s every ~3 min,
  - stops PostgreSQL for 30 s every ~10 min.

At the end it waits until every occurrence up to the end of the faults has run, then
prints the figures: occurrences, runs, kills, duplicates (and how many no fault
explains), lost, and whether every daemon survived.  Exit status 1 if anything is lost,
a duplicate is unexplained, or a daemon exited by itself.
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "faults"))
sys.path.insert(0, str(HERE.parent / "tests"))

from dbservers import PostgresServer  # noqa: E402
from faultlib import (  # noqa: E402
    Cluster,
    LatencyProxy,
    add_catchup_schedules,
    analyse,
    describe,
    expected_occurrences,
    now_boot,
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=60.0)
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--schedules", type=int, default=500)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    ns = p.parse_args(argv)
    rng = random.Random(ns.seed)
    work = Path(tempfile.mkdtemp(prefix="perfectsched-soak-"))
    print(f"work directory {work}", flush=True)
    pg = PostgresServer()
    pg.start()
    proxy = LatencyProxy(("127.0.0.1", pg.port), delay=0.0)
    c = Cluster(work, proxy.url(pg.create_database("soak")), ns.nodes,
                watchdog_usec=10_000_000)
    t_start = time.monotonic()
    one_offs: set[tuple[str, int]] = set()
    stalls = outages = 0
    ok = False
    try:
        with c.open() as sc:
            sc.init()
            first = add_catchup_schedules(sc, ns.schedules, 180)
        c.start()
        end = t_start + ns.minutes * 60
        next_node = t_start + 45
        next_stall = t_start + 180
        next_outage = t_start + 600
        last_report = t_start
        while time.monotonic() < end:
            time.sleep(rng.uniform(1, 3))
            c.kill_worker(rng)
            now = time.monotonic()
            live = [d for d in c.nodes if d.alive()]
            if live and rng.random() < 0.3:
                try:
                    res = rng.choice(live).ctl_json("run", f"s{rng.randrange(ns.schedules):04d}")
                    one_offs.add((res["run_key"], res["run_at"]))
                except (AssertionError, ValueError):
                    pass  # refused while the database is down: nothing was added
            if now >= next_node:
                i = rng.randrange(len(c.nodes))
                c.kill_node(i)
                time.sleep(rng.uniform(0.5, 3))
                c.restart_node(i)
                next_node = now + rng.uniform(30, 60)
            if now >= next_stall:
                t0 = now_boot()
                proxy.flowing.clear()
                time.sleep(5)
                proxy.flowing.set()
                c.fault(t0, now_boot(), "database stalled")
                stalls += 1
                next_stall = now + rng.uniform(150, 210)
            if now >= next_outage:
                t0 = now_boot()
                pg.stop_server()
                time.sleep(30)
                pg.start_server()
                c.fault(t0, now_boot(), "PostgreSQL stopped")
                outages += 1
                next_outage = now + 600
            if now - last_report >= 60:
                last_report = now
                print(f"[{(now - t_start) / 60:5.1f} min] {c.worker_kills} worker kills, "
                      f"{c.daemon_kills} node crashes, {stalls} stalls, {outages} outages, "
                      f"{len(c.read_log())} log lines", flush=True)
        cutoff = int(time.time())
        dead = [d.config["node_name"] for d in c.nodes if not d.alive()]
        t_settle = time.monotonic()
        c.wait_settled(cutoff, timeout=300)
        settle = time.monotonic() - t_settle
        expected = expected_occurrences(first, cutoff) | one_offs
        rep = analyse(c.read_log(), expected, c.faults, keys=first)
        try:
            c.assert_leases_expire()
            stale: list[str] = []
        except AssertionError:
            stale = c.leases_honest()
        silent = sum(d.log().count("silent for") for d in c.nodes)
        late = sum(d.log().count("lease lost") for d in c.nodes)
        print(f"\nsoak of {(time.monotonic() - t_start) / 60:.1f} min, {ns.nodes} nodes, "
              f"{ns.schedules} schedules + {len(one_offs)} one-off runs")
        print(f"  occurrences expected : {rep.expected}")
        print(f"  successful runs      : {rep.runs}")
        print(f"  worker kills (-9)    : {c.worker_kills}")
        print(f"  node crashes (-9)    : {c.daemon_kills}")
        print(f"  database stalls      : {stalls} x 5 s")
        print(f"  PostgreSQL outages   : {outages} x 30 s")
        print(f"  duplicates           : {len(rep.duplicates)} "
              f"(not explained by a fault: {len(rep.unexplained)})")
        print(f"  lost                 : {len(rep.lost)}")
        print(f"  runs at no cron time : {len(rep.unexpected)}")
        print(f"  runs per node        : {dict(sorted(rep.nodes.items()))}")
        print(f"  daemons that exited  : {dead or 'none'}")
        print(f"  stale leases         : {len(stale)}")
        print(f"  silent workers killed: {silent} (by their master)")
        print(f"  'lease lost' warnings: {late} (a live worker's lease ran out)")
        print(f"  settled {settle:.1f} s after the last fault")
        runs = c.read_log()
        for occ in sorted(rep.unexplained)[:5] + sorted(rep.lost)[:5]:
            print(describe(runs, occ, c.faults))
        ok = not (rep.lost or rep.unexplained or rep.unexpected or dead or stale)
        print("OK" if ok else f"FAILED (logs kept in {work})")
        return 0 if ok else 1
    finally:
        c.close()
        proxy.close()
        pg.stop()
        if not ns.keep and ok:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
