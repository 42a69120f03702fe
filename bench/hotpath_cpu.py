"""Client CPU of the worker's store operations, one process, one at a time: what each
costs the worker apart from the database's own work (the server's CPU is not counted).

    .venv-bench/bin/python bench/hotpath_cpu.py                       # PostgreSQL
    .venv-bench/bin/python bench/hotpath_cpu.py --compare /tmp/base   # and another tree

Operations: finish + claim at batch 64 (`ScheduleCollection.finish_and_poll`, 1,000
stored rows, as bench/claim.py), history rows written 4,480 at a time (a burst's flush)
and 64 at a time (`Store.record_runs`), the "next due" probe (`earliest_due`), and
heartbeats of 64 held leases.  Each tree's figures come from a process of its own (its
own package on sys.path); the trees take turns, --rounds times; each figure is the best of
5 repetitions in a round, and the median over rounds is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
REPS = 5


def _best(fn: Any, per: int) -> float:
    """Microseconds of process CPU per item: the best of REPS runs of fn()."""
    best = float("inf")
    for _ in range(REPS):
        c0 = time.process_time()
        fn()
        best = min(best, time.process_time() - c0)
    return 1e6 * best / per


def child(tree: str, url: str) -> dict[str, float]:
    """Measure in this process with `tree`'s package."""
    sys.path[:0] = [tree, str(Path(tree) / "bench"), str(Path(tree) / "tests")]
    import claim  # noqa: PLC0415 - the tree's own

    from perfectschedd.schedules.collection import ScheduleCollection  # noqa: PLC0415

    sc = ScheduleCollection(claim.config(url))
    sc.earliest_due()
    state: dict[str, Any] = {"pending": []}

    def turns(n: int = 60) -> None:
        for _ in range(n):
            _, tasks = sc.finish_and_poll(state["pending"], 64, now=claim.NOW)
            for t in tasks:
                t._end()
            state["pending"] = tasks

    turns(5)
    out = {"finish + claim, batch 64, us per fire": _best(turns, 60 * 64)}
    rows = [claim._history_row(t, sc.owner) for t in state["pending"]] * 70
    out["history, 4,480 a flush, us per row"] = _best(
        lambda: sc.store.record_runs(rows), len(rows))
    out["history, 64 a flush, us per row"] = _best(
        lambda: [sc.store.record_runs(rows[:64]) for _ in range(20)], 20 * 64)
    out["next-due probe, us per call"] = _best(
        lambda: [sc.earliest_due() for _ in range(200)], 200)
    held = [(t.key, t.fence) for t in state["pending"]]
    out["heartbeat, us per lease"] = _best(
        lambda: [sc.store.heartbeat(held, claim.NOW + 600) for _ in range(10)],
        10 * len(held))
    sc.close()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--compare", metavar="TREE", help="another checkout, measured in turn")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(*a.child)))
        return 0
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "bench"), str(ROOT)]
    import claim  # noqa: PLC0415
    from dbservers import PostgresServer  # noqa: PLC0415

    trees = [str(ROOT), *([str(Path(a.compare).resolve())] if a.compare else [])]
    got: dict[str, list[dict[str, float]]] = {t: [] for t in trees}
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    with PostgresServer() as pg:
        for r in range(a.rounds):
            for i, tree in enumerate(trees if r % 2 == 0 else trees[::-1]):
                name = f"hotpath_{r}_{i}"
                url = pg.create_database(name)
                claim.bulk_load(url, 1000)
                res = subprocess.run([sys.executable, __file__, "--child", tree, url],
                                     capture_output=True, text=True, env=env, check=False)
                pg.drop_database(name)
                if res.returncode:
                    sys.exit(res.stderr)
                got[tree].append(json.loads(res.stdout.strip().splitlines()[-1]))
    for tree in trees:
        print(f"{tree}  (median of {a.rounds})")
        for k in got[tree][0]:
            print(f"  {k:40s} {statistics.median(g[k] for g in got[tree]):8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
