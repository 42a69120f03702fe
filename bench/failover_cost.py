"""What synchronous replication costs: the burst on one PostgreSQL vs a Patroni cluster.

    .venv/bin/python bench/failover_cost.py                   # N=5000, median of 3, ~5 min
    .venv/bin/python bench/failover_cost.py -n 200 --repeat 1 # a smoke run, ~1 min
    .venv/bin/python bench/failover_cost.py --cluster-daemons 1,3 --json var/bench/fc.json

Needs PostgreSQL 15, patroni and etcd-server from Debian (`make test-deps`), like
tests/faults/test_faults_failover.py (run as root, Patroni and PostgreSQL run as user
postgres).  `--help` lists the knobs; --json keeps every single run.

One invocation starts both databases and keeps them up for the whole run:
- one PostgreSQL (tests/dbservers.py) with the cluster nodes' settings that change what
  a commit writes or waits for (fsync off, full_page_writes and wal_log_hints on,
  synchronous_commit on, shared_buffers 32MB);
- a Patroni cluster (tests/faults/patroni.py): etcd and three PostgreSQL 15 nodes on
  loopback ports, synchronous mode (a commit returns once the synchronous standby has
  flushed it), every node on this same machine.

Each repeat runs every setup once, in turn, starting one setup later than the repeat
before (so a noisy machine hurts all alike): one daemon on the single PostgreSQL, then
1, 2 and 3 daemons (2 workers each, otherwise the settings of bench/run.py:
poll_interval 1, concurrency 8) on the cluster's primary
through the libpq multi-host URL (`target_session_attrs=read-write`).  Every run gets a
fresh database, a CHECKPOINT, the daemons started and ready, then N one-off occurrences
of a trivial python job (bench/run.py's handler: one line appended to a file) registered
with `at` = T, a whole second a few seconds ahead.

Reported per setup, median of the repeats:
- fires/s = N / (last start - T), and lateness p99 (start - T);
- transactions per fire: the database's pg_stat_database.xact_commit delta / N, from
  just after registration to just after the daemons stopped (a backend's statistics are
  flushed when it exits), so it includes the daemons' idle polling for the few seconds
  before T and their shutdown;
- WAL bytes per fire: pg_wal_lsn_diff of pg_current_wal_lsn() over the same window, on
  the primary (the whole server: nothing else writes there during a run);
- net of idle polling: the same less idle transactions/s × the window (an estimate);
- idle transactions/s: xact_commit of the daemons, started and ready, over 4 s before
  the burst is registered (what the transactions per fire include for the seconds
  between registration and T, and a cost of every extra daemon).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for _dir in (ROOT, ROOT / "tests", ROOT / "tests" / "faults", ROOT / "bench"):
    sys.path.insert(0, str(_dir))

from dbservers import APP_USER, PostgresServer  # noqa: E402
from patroni import DATABASE, PatroniCluster  # noqa: E402
from run import PS, FireLog, burst_stats, log, median  # noqa: E402

# What differs between tests/dbservers.py's server and the Patroni nodes and changes the
# cost of a commit; later -c options win.
MATCH_CLUSTER = ["-c", "full_page_writes=on", "-c", "wal_log_hints=on",
                 "-c", "synchronous_commit=on", "-c", "shared_buffers=32MB",
                 "-c", "max_connections=300"]
SETTINGS = ("fsync", "full_page_writes", "wal_log_hints", "synchronous_commit",
            "synchronous_standby_names", "wal_level", "shared_buffers", "max_wal_size",
            "checkpoint_timeout")
YEARLY = "0 0 1 1 *"
IDLE_SECONDS = 4.0  # the daemons' idle transactions/s are measured over this, before N


class SinglePostgres(PostgresServer):
    def _server_argv(self) -> list[str]:
        return [*super()._server_argv(), *MATCH_CLUSTER]


@dataclass
class Target:
    """A database server the bench creates databases on and reads statistics from."""

    label: str
    psql: Callable[[str], str]
    url_for: Callable[[str], str]
    describe: Callable[[], str]

    def create(self, name: str) -> str:
        self.psql(f'CREATE DATABASE "{name}" OWNER {APP_USER}')
        return self.url_for(name)

    def drop(self, name: str) -> None:
        self.psql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def counters(self, name: str) -> tuple[int, int]:
        """(xact_commit of database `name`, WAL position in bytes)."""
        out = self.psql("SELECT xact_commit, pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')"
                        f"::bigint FROM pg_stat_database WHERE datname = '{name}'")
        xacts, wal = out.strip().split("|")
        return int(xacts), int(wal)

    def settings(self) -> dict[str, str]:
        names = ",".join(f"'{s}'" for s in SETTINGS)
        out = self.psql("SELECT name, current_setting(name) FROM pg_settings "
                        f"WHERE name IN ({names}) ORDER BY name")
        return dict(line.split("|", 1) for line in out.strip().splitlines())


def single_target(pg: PostgresServer) -> Target:
    return Target("one PostgreSQL", pg.psql, pg.url, lambda: f"port {pg.port}")


def cluster_target(pc: PatroniCluster) -> Target:
    def psql(sql: str) -> str:
        return pc.psql(pc.wait_leader(60), sql)

    def url_for(name: str) -> str:
        return pc.url().replace(f"/{DATABASE}?", f"/{name}?")

    def describe() -> str:
        leader, sync = pc.leader(), pc.sync_standby()
        return (f"primary {leader.name if leader else '?'}, synchronous standby "
                f"{sync.name if sync else 'NONE (asynchronous!)'}")

    return Target("Patroni, 3 nodes, synchronous", psql, url_for, describe)


class Overran(Exception):
    """Registration did not end before T: the run is void."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"registration took {seconds:.1f}s")
        self.seconds = seconds


def burst_once(target: Target, daemons: int, n: int, lead: float, tmp: Path,
               seq: int) -> dict[str, Any]:
    name = f"fcost_{seq}"
    url = target.create(name)
    try:
        target.psql("CHECKPOINT")  # no timed checkpoint (and its full-page images) mid-run
        nodes = [PS(url, tmp / f"{name}-d{i}", extra={"node_name": f"n{i}"})
                 for i in range(daemons)]
        load_before = os.getloadavg()[0]
        try:
            stats, xact0, wal0 = fire(target, name, nodes, n, lead)
            load_after = os.getloadavg()[0]
        finally:
            for ps in nodes:
                if ps.proc is not None and ps.proc.poll() is None:
                    ps.proc.terminate()  # all at once; stop() below waits for each
            for ps in nodes:
                ps.stop()
        wait_no_backends(target, name)  # an exiting backend flushes its statistics
        xact1, wal1 = target.counters(name)
        stats["window_s"] = time.monotonic() - stats.pop("counted_from")
    finally:
        target.drop(name)
    # What the daemons' idle polling adds to the count over the window, at the idle rate.
    stats["idle_share"] = stats["idle_xacts_per_s"] * stats["window_s"] / max(1, xact1 - xact0)
    stats["xacts_per_fire_net"] = (xact1 - xact0) * (1 - stats["idle_share"]) / n
    stats.update(xacts_per_fire=(xact1 - xact0) / n, wal_bytes_per_fire=(wal1 - wal0) / n,
                 load1=[load_before, load_after])
    return stats


def fire(target: Target, name: str, nodes: list[PS], n: int,
         lead: float) -> tuple[dict[str, Any], int, int]:
    """Start the daemons, register the burst, wait for it; (stats, xact_commit, WAL) as
    they were once the burst was registered."""
    for ps in nodes:  # one after the other: the first creates the schema
        ps.start()
    time.sleep(1)
    idle0, t0 = target.counters(name)[0], time.monotonic()
    time.sleep(IDLE_SECONDS)
    idle_rate = (target.counters(name)[0] - idle0) / (time.monotonic() - t0)
    due = float(math.ceil(time.time() + lead))
    reqs = [{"key": f"b{i}", "type": "bench", "cron": YEARLY, "at": int(due)}
            for i in range(n)]
    reg = nodes[0].add_many(reqs)
    time.sleep(0.3)  # the registering backend's exit (and statistics) first
    xact0, wal0 = target.counters(name)
    counted_from = time.monotonic()
    if time.time() > due - 0.2:
        raise Overran(reg)
    logs = [FireLog(ps.firedir) for ps in nodes]
    deadline = time.monotonic() + max(120.0, n / 50)
    while sum(fl.poll() for fl in logs) < n and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = burst_stats([f for fl in logs for f in fl.fires], n, due, reg)
    stats["complete"] = stats["fired"] == n
    stats["per_daemon"] = [len({f[0] for f in fl.fires}) for fl in logs]
    stats["idle_xacts_per_s"] = idle_rate
    stats["counted_from"] = counted_from
    return stats, xact0, wal0


def wait_no_backends(target: Target, name: str, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    sql = f"SELECT count(*) FROM pg_stat_activity WHERE datname = '{name}'"
    while int(target.psql(sql).strip()) > 0:
        if time.monotonic() > end:
            log(f"  {name}: backends still connected after {timeout:.0f}s")
            return
        time.sleep(0.1)


def burst(target: Target, daemons: int, n: int, tmp: Path, seq: int,
          lead: float) -> dict[str, Any]:
    for attempt in range(4):
        try:
            return burst_once(target, daemons, n, lead, tmp, seq * 10 + attempt)
        except Overran as exc:
            lead = max(lead * 2, exc.seconds * 1.5 + 2)
            log(f"  {exc}, past T: again with {lead:.0f}s of lead")
    raise RuntimeError("registration never ended before T")


def machine() -> str:
    import sqlalchemy

    cpu = next((line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "?")
    mem = round(int(Path("/proc/meminfo").read_text().split()[1]) / 1024 / 1024)
    return (f"{os.cpu_count()} CPU ({cpu}), {mem} GiB RAM, Linux {os.uname().release}, "
            f"Python {sys.version.split()[0]}, SQLAlchemy {sqlalchemy.__version__}")


def fmt(v: float, digits: int = 0) -> str:
    return "—" if math.isnan(v) else f"{v:,.{digits}f}"


def table(rows: list[tuple[str, int, dict[str, Any]]]) -> str:
    base = next((r["fires_per_s"] for t, _, r in rows if t == "one PostgreSQL"), math.nan)
    out = ["| database | daemons × workers | fires/s | vs one PostgreSQL | lateness p99 ms "
           "| transactions / fire | net of idle polling | WAL bytes / fire "
           "| idle transactions/s | runs |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for label, daemons, r in rows:
        rel = r["fires_per_s"] / base if base == base and base else math.nan
        out.append(f"| {label} | {daemons} × 2 | {fmt(r['fires_per_s'])} | "
                   f"{fmt(100 * rel)} % | {fmt(r['late_p99_ms'])} | "
                   f"{fmt(r['xacts_per_fire'], 3)} | {fmt(r['xacts_per_fire_net'], 3)} | "
                   f"{fmt(r['wal_bytes_per_fire'])} | "
                   f"{fmt(r['idle_xacts_per_s'], 1)} | "
                   f"{r['runs']}{'' if r['all_complete'] else ' (incomplete!)'} |")
    return "\n".join(out)


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("fires_per_s", "late_p50_ms", "late_p99_ms", "xacts_per_fire", "xacts_per_fire_net",
            "wal_bytes_per_fire", "register_s", "idle_xacts_per_s")
    out: dict[str, Any] = {k: median([float(r[k]) for r in runs]) for k in keys}
    out["runs"] = len(runs)
    out["all_complete"] = all(r["complete"] and r["duplicates"] == 0 for r in runs)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-n", type=int, default=5000, help="occurrences due at once (5000)")
    p.add_argument("--repeat", type=int, default=3, help="runs of each setup (median; 3)")
    p.add_argument("--single-daemons", default="1",
                   help="daemon counts on the single PostgreSQL (1)")
    p.add_argument("--cluster-daemons", default="1,2,3",
                   help="daemon counts on the cluster's primary (1,2,3)")
    p.add_argument("--json", help="also write every run to this file")
    a = p.parse_args(argv)
    setups = ([("single", int(d)) for d in a.single_daemons.split(",") if d]
              + [("cluster", int(d)) for d in a.cluster_daemons.split(",") if d])
    started = datetime.now(UTC)
    log(f"machine: {machine()}; load average {os.getloadavg()}")
    tmp = Path(tempfile.mkdtemp(prefix="perfectsched-fcost-"))
    pg = SinglePostgres()
    pc = PatroniCluster(3)
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {s: [] for s in setups}
    try:
        pg.start()
        log(f"single PostgreSQL on port {pg.port}; starting the Patroni cluster")
        pc.start()
        targets = {"single": single_target(pg), "cluster": cluster_target(pc)}
        settings = {t.label: t.settings() for t in targets.values()}
        for label, values in settings.items():
            log(f"{label}: {values}")
        seq = 0
        for rep in range(a.repeat):
            # Each repeat starts one setup later: none always runs first, or after another.
            turn = rep % len(setups)
            for kind, daemons in setups[turn:] + setups[:turn]:
                target = targets[kind]
                seq += 1
                log(f"run {rep + 1}/{a.repeat}: {target.label} ({target.describe()}), "
                    f"{daemons} daemon(s), N={a.n}")
                r = burst(target, daemons, a.n, tmp, seq, lead=3 + a.n / 2000)
                runs[(kind, daemons)].append(r)
                log(f"  fired {r['fired']}/{r['n']} (per daemon {r['per_daemon']}, "
                    f"duplicates {r['duplicates']}) at {r['fires_per_s']:,.0f}/s, p99 "
                    f"{r['late_p99_ms']:.0f} ms; {r['xacts_per_fire']:.2f} xacts and "
                    f"{r['wal_bytes_per_fire']:,.0f} WAL bytes per fire (idle "
                    f"{r['idle_xacts_per_s']:.1f} xacts/s, ~{100 * r['idle_share']:.0f} % of the "
                    f"count over {r['window_s']:.1f}s); registration "
                    f"{r['register_s']:.2f}s; load {r['load1'][0]:.2f} -> {r['load1'][1]:.2f}")
    finally:
        pc.stop()
        pg.stop()
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    rows = [(targets[k].label, d, summarize(v)) for (k, d), v in runs.items()]
    loads = [x for v in runs.values() for r in v for x in r["load1"]]
    print(f"\nMachine: {machine()}")
    print(f"Run: {started:%Y-%m-%d %H:%M}–{datetime.now(UTC):%H:%M} UTC, N = {a.n}, "
          f"median of {a.repeat}; load average (1 min) during the runs "
          f"{min(loads):.2f}–{max(loads):.2f}")
    for label, values in settings.items():
        print(f"{label}: " + ", ".join(f"{k}={v}" for k, v in values.items()))
    print()
    print(table(rows))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(
            {"machine": machine(), "args": vars(a), "settings": settings,
             "runs": [{"setup": k, "daemons": d, "runs": v} for (k, d), v in runs.items()]},
            indent=1, default=str))
    return 0 if all(r["all_complete"] for _, _, r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
