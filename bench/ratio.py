"""Python-route burst against the store alone: what the daemon keeps of the store's speed.

    .venv-bench/bin/python bench/run.py --only ratio --backends sqlite,postgresql
    .venv-bench/bin/python bench/run.py --only ratio --ratio-compare /tmp/base-tree

For each backend, alternated --repeat times: the daemon's burst of --ratio-burst trivial
python jobs due at one instant (2 workers, bench/run.py's burst: fires/s = N / (last
start - T)), then bench/claim.py's measurement of the store alone with the same number
of processes (2), batch 64, 1,000 stored rows: each process claims, finishes and
commits, the task does nothing; measured twice, without and with a history row per fire
(claim.py --history, written in batches as a worker does: every run of the daemon gets
one).  The ratios are median burst / median store.
Also printed: CPU per fire (us) of the daemon's workers during the burst and of the
store-only processes, which a machine loaded by others changes far less than rates.

With --ratio-compare DIR, each round also runs the burst with the perfectschedd package
of another tree (DIR, e.g. `git worktree add /tmp/base BASE`): before and after in the
same run, alternated.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import claim

PROCS = 2
BATCH = 64
ROWS = 1000


def run(burst: Callable[[str | None], dict[str, Any]], env: Any, repeat: int, seconds: float,
        compare: str | None, log: Callable[[str], None]) -> dict[str, Any]:
    """burst(pythonpath) runs one daemon burst (pythonpath None: this tree) and returns
    bench/run.py's burst_stats."""
    url = env.fresh_url("claimstore")
    claim.bulk_load(url, ROWS)
    runs: list[dict[str, float]] = []
    try:
        for r in range(repeat):
            one: dict[str, float] = {}
            # The two trees take turns going first: a machine getting busier or quieter
            # during a round hits both alike.
            for tree in ([None, compare] if r % 2 == 0 else [compare, None]):
                if tree is None:
                    got = burst(None)
                    one["burst"] = got["fires_per_s"]
                    one["burst_cpu_us"] = got["worker_cpu_us_per_fire"]
                elif compare:
                    got = burst(str(Path(compare).resolve()))
                    one["burst_compare"] = got["fires_per_s"]
                    one["burst_compare_cpu_us"] = got["worker_cpu_us_per_fire"]
            one["store"], lost, one["store_cpu_us"] = claim.measure(url, PROCS, BATCH, seconds)
            one["store_history"], lost_h, one["store_history_cpu_us"] = claim.measure(
                url, PROCS, BATCH, seconds, history=True)
            if lost or lost_h:
                raise RuntimeError(f"store-only bench lost {lost + lost_h} leases")
            one["ratio"] = one["burst"] / one["store"]
            one["ratio_history"] = one["burst"] / one["store_history"]
            if compare:
                one["ratio_compare"] = one["burst_compare"] / one["store"]
            runs.append(one)
            log(f"  ratio run {r + 1}/{repeat}: " + ", ".join(
                f"{k} {v:,.2f}" if k.startswith("ratio") else f"{k} {v:,.0f}"
                for k, v in one.items()))
    finally:
        env.drop(url)
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    rng = {k: (min(r[k] for r in runs), max(r[k] for r in runs)) for k in runs[0]}
    line = (f"  {env.name} median: burst {med['burst']:,.0f} fires/s; store alone (2 procs, "
            f"batch 64, 1,000 rows) {med['store']:,.0f} fires/s, ratio "
            f"{med['burst'] / med['store']:.0%}; store alone with a history row per fire "
            f"{med['store_history']:,.0f} fires/s, ratio "
            f"{med['burst'] / med['store_history']:.0%}")
    if compare:
        line += (f"; {compare}: burst {med['burst_compare']:,.0f} fires/s, ratio "
                 f"{med['burst_compare'] / med['store']:.0%}")
    line += (f"\n  {env.name} CPU per fire (median): burst workers "
             f"{med['burst_cpu_us']:.0f} us, store alone {med['store_cpu_us']:.0f} us, with "
             f"history {med['store_history_cpu_us']:.0f} us")
    if compare:
        line += f", {compare} burst workers {med['burst_compare_cpu_us']:.0f} us"
    log(line)
    return {"median": med, "range": rng, "runs": runs,
            "ratio_of_medians": med["burst"] / med["store"],
            "ratio_history_of_medians": med["burst"] / med["store_history"]}
