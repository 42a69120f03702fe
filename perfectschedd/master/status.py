"""The `status` answer, /healthz's verdict and the STATUS= line systemd shows: what the
master knows (its workers, their drains, what the configuration refused) with the
database's figures as the housekeeping thread last read them (snapshot.py).

Built from what the supervisor passes in; nothing here reads the database or waits.
"""

from __future__ import annotations

import os
import time
from typing import Any

from perfectschedd import __version__
from perfectschedd.config import Config
from perfectschedd.master.database import HOST_EVERY
from perfectschedd.master.snapshot import Snapshot
from perfectschedd.master.workertable import WorkerProc, WorkerTable

LAST_ERROR_MAX = 2000  # characters of status' last_error when it lists several problems

Health = tuple[bool | None, float | None, str | None]  # MasterDatabase.health()


def status_reply(config: Config, procs: list[WorkerProc], snap: Snapshot, health: Health,
                 *, state: str, started: float, last_error: str | None,
                 refused_routes: list[str], problems: list[str], unit_grant: bool,
                 reload_pending: bool) -> dict[str, Any]:
    """The answer to `status` (docs/protocol.md): `procs`, a copy of the worker table;
    `started`, the daemon's start (Unix time); `problems`, what the running configuration
    refused (HostConfig.problems)."""
    now = time.time()
    mono = time.monotonic()
    workers = [{"pid": p.pid, "index": p.index, "generation": p.generation,
                "age": round(mono - p.started, 1), "last_seen": round(mono - p.last_seen, 1),
                "running": p.running, "draining": p.draining_since is not None,
                # The name before 0.2.0 (a retiring worker was stopped, not drained).
                "retiring": p.draining_since is not None, "db_ok": p.db_ok,
                "in_db_call": p.in_db}
               for p in sorted(procs, key=lambda p: (p.generation, p.index))]
    ok, since, why = health
    reachable = ok is not False and all(p.db_ok for p in procs)
    database: dict[str, Any] = {"ok": reachable}
    if since is not None:
        database["unreachable_since"] = round(since, 3)
        database["error"] = why
    if snap.read_at is not None:
        database["figures_age"] = round(max(0.0, now - snap.read_at), 3)
    return {
        "version": __version__, "host": config.node, "pid": os.getpid(),
        "uptime": round(now - started, 1), "state": state,
        "workers_configured": config.workers,
        "workers_alive": sum(1 for p in procs if p.draining_since is None),
        "workers": workers, "running": list(snap.running), "queued": list(snap.queued),
        "next_due": list(snap.next_due),
        "draining": _draining(config, procs, [*snap.running, *snap.queued], now, mono),
        "reload_pending": reload_pending,
        "unclaimed": [{"type": t, "occurrences": n,
                       "routed_here": _routed_here(config, t)}
                      for t, n in snap.unclaimed.items()],
        "keys_to_rename": [{"key": k, "why": why} for k, why in snap.rename.items()],
        # Rows paused because they are not their file entry's own: they never run.
        "refused_rows": list(snap.refused_rows),
        "last_error": last_error or (f"database: {why}" if why else None) or (
            "; ".join(problems)[:LAST_ERROR_MAX] if problems else None),
        "refused_routes": list(refused_routes), "refused": problems,
        "unit_grant": unit_grant,
        # After the grant came on: the workers still stopping their runs as the
        # daemon's user (perfectsched-grant enable waits for none).
        "grant_stopping": _grant_stopping(config, procs, snap.running),
        # What `perfectschedctl apply` needs to check files as this daemon does
        # (files.HostChecks.of_status).
        "daemon_uid": os.geteuid(), "sendmail": config.sendmail,
        # ...and whether the files it is given are this daemon's own already.
        "schedules_dir": (os.path.abspath(config.schedules_dir)
                          if config.schedules_dir else None),
        "database_ok": reachable, "database": database,
        "hosts": _hosts(config, snap, now),
        # Schedules by state; those retrying or failed; overdue (docs/metrics.md).
        # pause --all in force (on every host): since, by, schedules held; else None.
        "paused_all": snap.paused_all,
        "states": dict(snap.states), "failing": list(snap.failing),
        "failing_total": snap.failing_total,
        "oldest_overdue": snap.oldest_overdue,
        "overdue_beyond_period": list(snap.beyond_period),
        "overdue_beyond_period_total": snap.beyond_period_total,
        **{k: snap.counts.get(k, 0) for k in ("schedules", "paused", "due")},
    }


def status_line(table: WorkerTable, db_ok: bool, snap: Snapshot) -> str:
    """What systemd shows as the daemon's STATUS= (systemctl status)."""
    counts = snap.counts
    line = (f"{len(table.active())} workers, {sum(p.running for p in table)} running, "
            f"{counts.get('due', 0)} due, {counts.get('schedules', 0)} schedules")
    draining = len(table.draining())
    if draining:
        line += f"; {draining} worker(s) draining"
    if not db_ok:
        line += "; database unreachable"
    if snap.paused_all is not None:
        line += "; everything paused"  # pause --all, on every host
    return line


def healthy(state: str, procs: list[WorkerProc], health: Health, worker_timeout: float
            ) -> bool:
    """/healthz: running, a worker alive, and the database reachable from the master and
    from every worker (as each last saw it): a daemon that cannot write cannot run jobs."""
    now = time.monotonic()
    return state in ("running", "reloading") and any(
        now - p.last_seen < worker_timeout for p in procs) \
        and health[0] is not False and all(p.db_ok for p in procs)


def _draining(config: Config, procs: list[WorkerProc], running: list[dict[str, Any]],
              now: float, mono: float) -> list[dict[str, Any]]:
    """The draining workers, since when (Unix time), and the keys of the jobs each
    still runs: the rows whose lease it holds (owner NODE:PID, as the database said
    at `figures_age`), whatever the executor."""
    node = config.node
    return [{"pid": p.pid, "index": p.index, "generation": p.generation,
             "since": round(now - (mono - p.draining_since), 3), "running": p.running,
             "keys": [r["key"] for r in running if r.get("owner") == f"{node}:{p.pid}"]}
            for p in sorted(procs, key=lambda p: (p.generation, p.index))
            if p.draining_since is not None]


def _grant_stopping(config: Config, procs: list[WorkerProc], running: list[dict[str, Any]]
                    ) -> list[dict[str, Any]]:
    node = config.node
    return [{"pid": p.pid, "index": p.index,
             "keys": [r["key"] for r in running if r.get("owner") == f"{node}:{p.pid}"]}
            for p in procs if p.grant_pending]


def _routed_here(config: Config, task_type: str) -> bool:
    route = next((r for r in config.routes if r.matches(task_type)), None)
    return route is not None and route.refused is None


def _hosts(config: Config, snap: Snapshot, now: float) -> list[dict[str, Any]]:
    """The hosts on this database: those that record themselves (0.2.0 on), and nodes
    seen at work that do not (an older release)."""
    live_after = now - max(config.alive_time, 3 * HOST_EVERY)
    hosts = [{"name": h["name"], "version": h["version"],
              "schema_version": h["schema_version"], "pid": h["pid"],
              "started_at": round(h["started_at"], 3),
              "last_seen": round(h["last_seen"], 3),
              "live": h["last_seen"] >= live_after}
             for h in snap.hosts]
    hosts += [{"name": n, "version": "0.1.0", "schema_version": 1, "pid": None,
               "started_at": None, "last_seen": None, "live": True}
              for n in snap.unrecorded_nodes]
    return sorted(hosts, key=lambda h: h["name"])
