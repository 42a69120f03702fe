"""The peer: APScheduler 3.11 (BackgroundScheduler + SQLAlchemyJobStore), driven like
PerfectSched by bench/run.py.

Run in the bench venv (APScheduler is not a dependency of the project):

    .venv-bench/bin/python bench/peer_apscheduler.py MODE --url URL [options]

MODE
  burst     register --n cron jobs whose next run is --due (Unix seconds), then run
            until SIGTERM; each run appends "KEY START_TIME" to --fire-log
  steady    register --n jobs firing every minute at second (i*60)//n, first at or
            after --due; run until SIGTERM
  register  add --n daily cron jobs to the store (scheduler started paused), then exit
  serve     start on the existing store and idle until SIGTERM (start-to-ready, idle
            CPU, RSS are measured from outside)

Progress goes to stdout as one JSON object per line: {"event": "...", ...}.
The job is a module-level function, the same trivial work as PerfectSched's handler:
take the time, append one line to a file.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import signal
import sys
import threading
import time
from datetime import UTC, datetime
from typing import Any

_T_EXEC = time.time()  # process start (import of this module), for start-to-ready

from apscheduler.executors.pool import ProcessPoolExecutor, ThreadPoolExecutor  # noqa: E402
from apscheduler.jobstores.sqlalchemy import SQLAlchemyJobStore  # noqa: E402
from apscheduler.schedulers.background import BackgroundScheduler  # noqa: E402
from apscheduler.triggers.cron import CronTrigger  # noqa: E402

_FIRE_FD: int | None = None
_FIRE_LOCK = threading.Lock()


def fire(key: str) -> None:
    """The job: record (key, start time) and return."""
    global _FIRE_FD
    started = time.time()
    if _FIRE_FD is None:
        with _FIRE_LOCK:
            if _FIRE_FD is None:
                _FIRE_FD = os.open(os.environ["BENCH_FIRE_LOG"],
                                   os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.write(_FIRE_FD, f"{key} {started:.6f}\n".encode())


def emit(event: str, **fields: Any) -> None:
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


def sa_url(url: str) -> str:
    """Same database as PerfectSched; APScheduler takes a SQLAlchemy URL as is."""
    if url.startswith("postgresql://"):
        return "postgresql+psycopg://" + url[len("postgresql://"):]
    return url


def make_store(url: str, sqlite_pragmas: str) -> SQLAlchemyJobStore:
    """The job store; on SQLite optionally with PerfectSched's own settings.

    PerfectSched opens SQLite with journal_mode=WAL and synchronous=NORMAL (no fsync per
    commit).  APScheduler's default is the rollback journal with an fsync per commit, so
    on a disk with slow fsync it measures the disk, not the scheduler; `same` gives it
    the same settings (the fair comparison), `default` leaves APScheduler as shipped.
    """
    if not url.startswith("sqlite") or sqlite_pragmas == "default":
        return SQLAlchemyJobStore(url=sa_url(url))
    import sqlalchemy as sa
    from sqlalchemy import event

    engine = sa.create_engine(url)

    @event.listens_for(engine, "connect")
    def _pragmas(dbapi_conn: Any, _record: Any) -> None:
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute("PRAGMA busy_timeout=60000")
        cur.close()

    return SQLAlchemyJobStore(engine=engine)


def make_scheduler(url: str, executor: str, sqlite_pragmas: str = "same"
                   ) -> BackgroundScheduler:
    kind, _, size = executor.partition(":")
    workers = int(size or 10)
    pool = (ProcessPoolExecutor(workers) if kind == "process" else ThreadPoolExecutor(workers))
    return BackgroundScheduler(
        jobstores={"default": make_store(url, sqlite_pragmas)},
        executors={"default": pool},
        # Run every occurrence however late (the default grace of 1 s would drop late runs
        # silently and flatter the lateness figures); no coalescing, like PerfectSched.
        job_defaults={"misfire_grace_time": None, "coalesce": False, "max_instances": 1},
        timezone=UTC,
    )


def wait_for_term() -> None:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    while not stop.wait(0.5):
        pass


def dt(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, UTC)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["burst", "steady", "register", "serve"])
    p.add_argument("--url", required=True)
    p.add_argument("--n", type=int, default=0)
    p.add_argument("--due", type=float, default=0.0)
    p.add_argument("--executor", default="thread:10", help="thread:N or process:N")
    p.add_argument("--add-limit", type=int, default=0,
                   help="register: use add_job for this many jobs, bulk-load the rest "
                        "straight into the job table (0 = add_job for all)")
    p.add_argument("--prefix", default="j")
    p.add_argument("--sqlite-pragmas", choices=["same", "default"], default="same",
                   help="same: WAL + synchronous=NORMAL like PerfectSched; default: as shipped")
    a = p.parse_args(argv)

    import peer_apscheduler  # noqa: PLC0415 - the job must be importable by reference
    job = peer_apscheduler.fire

    sched = make_scheduler(a.url, a.executor, a.sqlite_pragmas)
    missed = 0

    def on_missed(_event: Any) -> None:
        nonlocal missed
        missed += 1

    from apscheduler.events import EVENT_JOB_MISSED

    sched.add_listener(on_missed, EVENT_JOB_MISSED)

    if a.mode == "serve":
        sched.start()
        emit("ready", exec_time=_T_EXEC, ready_time=time.time(),
             jobs=None)
        wait_for_term()
        sched.shutdown(wait=False)
        return 0

    sched.start(paused=True)
    t0 = time.time()
    if a.mode == "burst":
        trig = CronTrigger.from_crontab("0 0 1 1 *", timezone=UTC)
        for i in range(a.n):
            sched.add_job(job, trig, args=[f"{a.prefix}{i}"], id=f"{a.prefix}{i}",
                          next_run_time=dt(a.due), replace_existing=False)
    elif a.mode == "steady":
        for i in range(a.n):
            offset = (i * 60) // a.n
            first = a.due + ((offset - a.due) % 60)  # first time at second `offset` >= due
            sched.add_job(job, CronTrigger(second=offset, timezone=UTC),
                          args=[f"{a.prefix}{i}"], id=f"{a.prefix}{i}",
                          next_run_time=dt(first), replace_existing=False)
    elif a.mode == "register":
        hour_now = datetime.now(UTC).hour
        hours = [h for h in range(24) if (h - hour_now) % 24 > 2]
        n_add = a.n if a.add_limit <= 0 else min(a.n, a.add_limit)
        for i in range(n_add):
            m, h = daily(i, hours)
            sched.add_job(job, CronTrigger(minute=m, hour=h, timezone=UTC),
                          args=[f"{a.prefix}{i}"], id=f"{a.prefix}{i}")
        t_add = time.time() - t0
        emit("added", n=n_add, seconds=t_add)
        if n_add < a.n:
            bulk_load(sched, job, a.prefix, n_add, a.n, hours)
    t_reg = time.time() - t0
    emit("registered", n=a.n, seconds=t_reg, end=time.time())
    if a.mode == "register":
        sched.shutdown(wait=False)
        return 0
    sched.resume()
    emit("running")
    wait_for_term()
    sched.shutdown(wait=False)
    emit("stopped", missed=missed)
    return 0


def daily(i: int, hours: list[int]) -> tuple[int, int]:
    """The same spread of daily times as run.py gives PerfectSched (never the next 2 h)."""
    return i % 60, hours[(i // 60) % len(hours)]


def bulk_load(sched: BackgroundScheduler, job: Any, prefix: str, start: int, n: int,
              hours: list[int]) -> None:
    """Rows add_job would have written (same pickled job state), inserted in batches.

    Only used beyond --add-limit, to build a 1M-job store in minutes rather than the
    ~20 min that 1M add_job calls take; the time is not reported as registration speed.
    """
    store = sched._lookup_jobstore("default")  # noqa: SLF001
    template = sched.add_job(job, CronTrigger(minute=0, hour=hours[0], timezone=UTC),
                             args=["template"], id=f"{prefix}-template")
    state = template.__getstate__()
    sched.remove_job(f"{prefix}-template")
    table = store.jobs_t
    batch: list[dict[str, Any]] = []
    now = datetime.now(UTC)
    for i in range(start, n):
        m, h = daily(i, hours)
        trig = CronTrigger(minute=m, hour=h, timezone=UTC)
        nxt = trig.get_next_fire_time(None, now)
        assert nxt is not None
        st = dict(state, id=f"{prefix}{i}", args=(f"{prefix}{i}",), trigger=trig,
                  next_run_time=nxt)
        batch.append({"id": st["id"], "next_run_time": nxt.timestamp(),
                      "job_state": pickle.dumps(st, store.pickle_protocol)})
        if len(batch) >= 10_000:
            with store.engine.begin() as conn:
                conn.execute(table.insert(), batch)
            batch = []
    if batch:
        with store.engine.begin() as conn:
            conn.execute(table.insert(), batch)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    sys.exit(main())
