"""Claim throughput of the store: fires/s (claim + advance + commit, trivial task).

    .venv/bin/python bench/claim.py                       # SQLite + PostgreSQL, 1k and 1M,
                                                          # batches of 1 and 64
    .venv/bin/python bench/claim.py --sizes 1000 --backends sqlite --procs 1,2 --batch 1,64

For each backend and each number of stored schedules N: a fresh database is bulk-loaded
with N every-minute schedules, all due (a backlog far behind `now`), then P forked
processes - each with its own ScheduleCollection, as the daemon's workers - run the
worker's hot path for --seconds: `finish_and_poll(finished, batch)`: one transaction
writes the previous batch's finishes (fenced advance to the next cron time) and leases
the next batch.  A "fire" is one occurrence claimed and finished; the task itself does
nothing.  Batch 1 is one transaction per fire (what a worker does when occurrences
come one at a time); 64 is the most a worker claims at once in a burst.  PostgreSQL is
a throw-away server on loopback (tests/dbservers.py) unless --pg-url names one.  Each
setting is measured --repeat times, in turn across the sizes, and the median is printed
with the range; "vs 1,000" compares medians.

Targets (2-core box): >= 3,000 fires/s SQLite, >= 1,500/s PostgreSQL (several
processes), and 1M stored within 80% of 1k.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from perfectschedd.config import load  # noqa: E402
from perfectschedd.schedules.collection import ScheduleCollection  # noqa: E402
from perfectschedd.schedules.task import Task  # noqa: E402
from perfectschedd.store.schema import Row  # noqa: E402
from perfectschedd.store.sql import Store  # noqa: E402
from perfectschedd.worker.history_queue import HISTORY_FLUSH  # noqa: E402

T0 = 1_500_000_000 - 1_500_000_000 % 60  # minute-aligned
NOW = T0 + 10**8  # every schedule has a huge backlog: each claim finds due rows
LOAD_CHUNK = 20_000


def config(url: str) -> Any:
    return load({"type": "rdb_compat", "url": url, "alive_time": 600})


def bulk_load(url: str, n: int) -> float:
    """Store n schedules 'b<i>' firing every minute; returns rows/s."""
    store = Store(url)
    store.init()
    started = time.perf_counter()
    for lo in range(0, n, LOAD_CHUNK):
        store.insert_many([
            Row(key=f"b{i:08d}", type="bench", cron="* * * * *", delay=0, timezone="UTC",
                data="{}", next_time=T0, next_run_time=T0 + i % 60, paused=False, fence=0,
                attempt=0, owner=None, claimed_at=None)
            for i in range(lo, min(n, lo + LOAD_CHUNK))])
    rate = n / (time.perf_counter() - started)
    if store.dialect == "postgresql":
        with store.engine.connect() as conn:  # what autovacuum would do shortly after
            conn.execution_options(isolation_level="AUTOCOMMIT").exec_driver_sql(
                f"VACUUM ANALYZE {store.t.name}")
    store.close()
    return rate


def _history_row(task: Task, owner: str) -> dict[str, Any]:
    """A success's history row, as the worker builds it (LeasePipeline._record)."""
    now = time.time()
    return {"key": task.key, "type": task.type, "scheduled_time": task.scheduled_time,
            "attempt": task.attempt, "started_at": now, "finished_at": now,
            "outcome": "success", "worker": owner, "unit": None, "exit_code": None,
            "signal": None, "duration": 0.0, "output": None, "error": None}


def _worker(url: str, batch: int, seconds: float, barrier: Any, results: Any,
            history: bool = False) -> None:
    sc = ScheduleCollection(config(url))
    sc.earliest_due()  # connect before the start line
    barrier.wait()
    cpu0 = time.process_time()
    fires = lost = 0
    pending: list[Task] = []
    rows: list[dict[str, Any]] = []
    flushed = time.perf_counter()
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        gone, tasks = sc.finish_and_poll(pending, batch, now=NOW)
        fires += len(pending) - len(gone)
        lost += len(gone)
        for t in tasks:  # the trivial task: it just ends
            t._end()
            if history:
                rows.append(_history_row(t, sc.owner))
        pending = tasks
        if rows and time.perf_counter() - flushed >= HISTORY_FLUSH:
            sc.store.record_runs(rows)  # in batches, as the worker's flush_history
            rows, flushed = [], time.perf_counter()
    fires += len(pending) - len(sc.store.advance([t.next_advance() for t in pending]))
    if rows:
        sc.store.record_runs(rows)
    cpu = time.process_time() - cpu0
    sc.close()
    results.put((fires, lost, cpu))


def measure(url: str, procs: int, batch: int, seconds: float,
            history: bool = False) -> tuple[float, int, float]:
    """Fires/s of `procs` processes claiming `batch` at a time for `seconds`, the leases
    lost, and the processes' CPU per fire (us); with `history`, each fire also gets its
    history row (written every HISTORY_FLUSH, as a worker does)."""
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(procs + 1)
    results = ctx.Queue()
    workers = [ctx.Process(target=_worker,
                           args=(url, batch, seconds, barrier, results, history))
               for _ in range(procs)]
    for w in workers:
        w.start()
    barrier.wait()
    started = time.perf_counter()
    got = [results.get(timeout=seconds + 120) for _ in workers]
    elapsed = time.perf_counter() - started
    for w in workers:
        w.join()
        if w.exitcode != 0:
            raise SystemExit(f"a bench worker failed (exit {w.exitcode})")
    fires = sum(f for f, _, _ in got)
    return (fires / elapsed, sum(lost for _, lost, _ in got),
            1e6 * sum(cpu for _, _, cpu in got) / max(fires, 1))


@contextmanager
def databases(backend: str, pg_url: str | None) -> Iterator[Any]:
    """Yields make(name) -> URL of a fresh empty database."""
    if backend == "sqlite":
        with tempfile.TemporaryDirectory(prefix="perfectsched-bench-") as d:
            yield lambda name: f"sqlite:///{d}/{name}.db"
        return
    if pg_url is not None:
        yield lambda name: pg_url
        return
    from dbservers import PostgresServer

    with PostgresServer() as pg:
        yield pg.create_database


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", default="sqlite,postgresql")
    ap.add_argument("--sizes", default="1000,1000000")
    ap.add_argument("--procs", default="", help="comma list (default: sqlite 2, postgresql 4)")
    ap.add_argument("--batch", default="1,64", help="comma list of claim batch sizes"
                    " (1: one transaction per fire; 64: a worker's batch in a burst)")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--repeat", type=int, default=3,
                    help="measurements per setting, taken in turn across the sizes; the"
                    " median is reported (single runs vary by 20 %% and more here)")
    ap.add_argument("--history", action="store_true",
                    help="each fire also writes its history row, in batches every "
                    "HISTORY_FLUSH (0.5 s), as the daemon's workers do")
    ap.add_argument("--pg-url", help="use this (empty) PostgreSQL database, do not start one"
                    " (one size only)")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    batches = [int(b) for b in args.batch.split(",")]
    if args.pg_url and len(sizes) > 1 and "postgresql" in args.backends:
        ap.error("--pg-url holds one table: give one size (--sizes N)")
    print(f"cores: {os.cpu_count()}, {args.seconds:g} s per measurement, median of "
          f"{args.repeat}" + (", a history row per fire" if args.history else ""))
    print(f"{'backend':<11} {'stored':>9} {'procs':>5} {'batch':>5} {'fires/s':>9} "
          f"{'vs ' + format(sizes[0], ','):>9}  {'range':>15}  load rows/s")
    for backend in args.backends.split(","):
        procs_list = ([int(p) for p in args.procs.split(",")] if args.procs
                      else [2 if backend == "sqlite" else 4])
        with databases(backend, args.pg_url) as make:
            loaded = {}
            for n in sizes:
                url = make(f"bench_{n}")
                loaded[n] = (url, bulk_load(url, n))
            # In turn, so that a slow spell of a shared machine hits every size alike.
            rates: dict[tuple[int, int, int], list[float]] = {}
            lost: dict[tuple[int, int, int], int] = {}
            for _ in range(args.repeat):
                for n in sizes:
                    for procs in procs_list:
                        for batch in batches:
                            rate, gone, _ = measure(loaded[n][0], procs, batch,
                                                    args.seconds, args.history)
                            rates.setdefault((n, procs, batch), []).append(rate)
                            lost[(n, procs, batch)] = lost.get((n, procs, batch), 0) + gone
            for n in sizes:
                for procs in procs_list:
                    for batch in batches:
                        got = rates[(n, procs, batch)]
                        rate = statistics.median(got)
                        ref = statistics.median(rates[(sizes[0], procs, batch)])
                        spread = f"{min(got):,.0f}-{max(got):,.0f}"
                        gone = lost[(n, procs, batch)]
                        warn = f"  ({gone} lost leases!)" if gone else ""
                        print(f"{backend:<11} {n:>9,} {procs:>5} {batch:>5} {rate:>9,.0f} "
                              f"{rate / ref:>9.0%}  {spread:>15}  {loaded[n][1]:,.0f}{warn}",
                              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
