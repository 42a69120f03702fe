"""Catch-up of one schedule that missed 100,000 minutes (issue #15): the CPU time of the
claiming worker's decision (catchup.plan) under each policy, on the real store.  `all`
with a grace and `latest`/`skip` must not walk every missed occurrence.

    .venv-bench/bin/python bench/run.py --only catchup --backends sqlite
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

MISSED = 100_000


def run(url: str, tmp: Path, log: Any) -> dict[str, float]:
    import perfectschedd
    from perfectschedd.schedules import catchup

    out: dict[str, float] = {}
    with perfectschedd.open({"type": "rdb_compat", "url": url}) as sc:
        now = time.time()
        minute = math.floor(now / 60) * 60
        for name, options in [("latest", {"misfire": "latest"}), ("skip", {"misfire": "skip"}),
                              ("all, grace 60", {"grace": 60})]:
            key = f"catchup-{name.split(',')[0]}"
            sc.add(key, "t", "* * * * *", start=minute - MISSED * 60, **options)
            task = next(t for t in sc.poll_many(10, now) if t.key == key)
            t0 = time.process_time()
            plan = catchup.plan(task, now)
            took = time.process_time() - t0
            assert plan is not None
            out[name] = took
            log(f"  catch-up of {MISSED:,} missed minutes, {name}: {took * 1000:.0f} ms CPU "
                f"({len(plan.skipped):,} counted, runs {plan.run or plan.next_time})")
            task.give_back()
    return out
