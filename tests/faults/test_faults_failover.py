"""A PostgreSQL failover under load (SPEC "Database failover"): etcd and three
Patroni-managed PostgreSQL 15 nodes in synchronous mode, three daemons (two workers each)
on the libpq multi-host URL, hundreds of schedules with jobs of 0-3 s spread over each
minute.  Faults: a planned switchover, kill -9 of the primary's postmaster, and the
primary's whole process tree frozen for 45 s (alive_time 60).

Asserted from the database and the jobs' own log: every due occurrence ran to success,
none ran twice, no daemon exited, no worker was replaced, and work resumed within 10 s of
the new primary taking writes (printed per fault)."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from faultlib import Cluster, analyse, expected_occurrences, now_boot, workers
from patroni import Node, PatroniCluster, available

from perfectschedd.schedules import cron

pytestmark = [pytest.mark.faults, pytest.mark.postgresql]

N_SCHEDULES = 300
ALIVE_TIME = 60
FREEZE = 45.0
RESUME_WITHIN = 10.0

# faultlib's job (its log lines), running 0-3 s.
JOB = r"""#!/bin/sh
log() {
    read up _ < /proc/uptime
    echo "$1 $PERFECTSCHED_KEY $PERFECTSCHED_SCHEDULED_TIME $PERFECTSCHED_ATTEMPT" \
         "$FAULT_NODE $$ $PPID $up" >> "$FAULT_LOG"
}
log S
sleep "$(( $$ % 4 ))"
log E
"""


@pytest.fixture
def patroni_cluster() -> Iterator[PatroniCluster]:
    why = available()
    if why:
        pytest.fail(why)
    with PatroniCluster(3) as pc:
        yield pc


class WriteProbe:
    """Writes a row through the multi-host URL every 0.2 s, each on a new connection
    (each in a thread of its own: a write that reached a frozen server is left behind),
    and records when, and on which node's port, each write was acknowledged."""

    def __init__(self, pc: PatroniCluster) -> None:
        self.dsn = " ".join([
            f"host={','.join('127.0.0.1' for _ in pc.nodes)}",
            f"port={','.join(str(n.port) for n in pc.nodes)}",
            "dbname=perfectsched user=sched password=sched connect_timeout=2",
            "target_session_attrs=read-write"])
        self.acks: list[tuple[float, int]] = []  # (now_boot, server port)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self._write()  # the table, before the daemons start
        self.thread.start()

    def _write(self) -> None:
        try:
            import psycopg as driver
        except ImportError:  # SQLAlchemy 1.4's installations: psycopg2
            import psycopg2 as driver  # type: ignore[no-redef]
        try:
            conn = driver.connect(self.dsn, autocommit=True)
        except driver.Error:
            return
        try:
            with conn.cursor() as cur:
                cur.execute("CREATE TABLE IF NOT EXISTS probe (at double precision)")
                cur.execute("INSERT INTO probe VALUES (extract(epoch from now()))"
                            " RETURNING inet_server_port()")
                port = cur.fetchone()[0]
            self.acks.append((now_boot(), int(port)))
        except driver.Error:
            pass
        finally:
            conn.close()

    def _loop(self) -> None:
        while not self.stop.wait(0.2):
            t = threading.Thread(target=self._write, daemon=True)
            t.start()
            t.join(3)

    def first_ack(self, after: float, not_port: int | None = None) -> float | None:
        return next((t for t, port in self.acks if t >= after and port != not_port), None)


def _add_spread(c: Cluster, n: int) -> dict[str, int]:
    """`n` schedules `* * * * *`, their delays spread over the minute (0-59 s); the
    current minute's occurrence is the first.  Returns key -> first scheduled time."""
    now = int(time.time())
    minute = now - now % 60
    reqs = [{"key": f"f{i:04d}", "type": "job", "cron": "* * * * *", "start": minute,
             "delay": i % 60} for i in range(n)]
    with c.open() as sc:
        sc.init()
        for i in range(0, n, 200):
            sc.add_many(reqs[i:i + 200])
    first = cron.first_at_or_after("* * * * *", "UTC", minute)
    return {str(r["key"]): first for r in reqs}


def _resumed(c: Cluster, since: float) -> float | None:
    """When the first job started after `since` (now_boot)."""
    return min((r.at for r in c.read_log() if r.kind == "S" and r.at >= since), default=None)


def test_patroni_failover_under_load(tmp_path: Path, patroni_cluster: PatroniCluster,
                                     cluster_factory: Callable[..., Cluster]) -> None:
    pc = patroni_cluster
    script = tmp_path / "job.sh"
    script.write_text(JOB)
    script.chmod(0o755)
    c = cluster_factory(pc.url(), 3, {
        "alive_time": ALIVE_TIME, "history_limit": 50, "worker_timeout": 20,
        "routes": [{"type": "job", "exec": ["/bin/sh", str(script)]}]})
    first = _add_spread(c, N_SCHEDULES)
    probe = WriteProbe(pc)
    c.start()
    pids = {d.config["node_name"]: sorted(workers(d)) for d in c.nodes}
    figures: dict[str, float] = {}
    try:
        time.sleep(10)  # under load

        def measure(what: str, t0: float, old: Node) -> None:
            new = pc.wait_leader(120, not_=old)
            took = probe.first_ack(t0, not_port=old.port)
            deadline = time.monotonic() + 60
            while took is None and time.monotonic() < deadline:
                time.sleep(0.2)
                took = probe.first_ack(t0, not_port=old.port)
            assert took is not None, f"{what}: the new primary {new.name} took no write"
            deadline = time.monotonic() + 60
            resumed = _resumed(c, took)
            while resumed is None and time.monotonic() < deadline:
                time.sleep(0.2)
                resumed = _resumed(c, took)
            assert resumed is not None, f"{what}: no job started after the failover"
            figures[what] = resumed - took
            print(f"\n{what}: {new.name} took writes {took - t0:.1f}s after the fault; "
                  f"work resumed {resumed - took:.1f}s later")
            pc.wait_replicas(180)  # the old primary is back, as a replica
            time.sleep(8)  # under load again

        old = pc.wait_leader(30)
        target = pc.sync_standby()
        assert target is not None
        t0 = now_boot()
        pc.switchover(old, target)
        c.fault(t0, now_boot() + 5, "switchover")
        measure("switchover", t0, old)

        old = pc.wait_leader(30)
        t0 = now_boot()
        pc.kill_postmaster(old)
        c.fault(t0, t0 + 10, "kill -9 of the primary's postmaster")
        measure("kill -9 postmaster", t0, old)

        old = pc.wait_leader(30)
        t0 = now_boot()
        pc.freeze(old)
        try:
            time.sleep(FREEZE)
            c.assert_all_alive()
        finally:
            pc.thaw(old)
        c.fault(t0, now_boot(), f"primary frozen for {FREEZE:g}s")
        measure(f"primary frozen {FREEZE:g}s", t0, old)

        cutoff = int(time.time())
        c.wait_settled(cutoff, timeout=240)
    finally:
        probe.stop.set()
    c.assert_all_alive()
    for d in c.nodes:
        assert sorted(workers(d)) == pids[d.config["node_name"]], \
            f"{d.config['node_name']}: a worker was replaced\n{d.log()[-3000:]}"

    expected = expected_occurrences(first, cutoff)
    rep = analyse(c.read_log(), expected, c.faults, keys=first)
    print(rep.summary())
    print("work resumed after the new primary took writes: "
          + ", ".join(f"{k} {v:.1f}s" for k, v in figures.items()))
    assert not rep.lost and not rep.duplicates and not rep.unexpected \
        and not rep.overlaps, "\n".join([rep.summary(), *rep.details])
    # The database's own record: one success per due occurrence, nothing else.  History
    # is written in batches after the finishes (up to HISTORY_FLUSH later).
    def recorded() -> Counter[tuple[str, int, str]]:
        found: Counter[tuple[str, int, str]] = Counter()
        with c.open() as sc:
            for key in first:
                for h in sc.history(key, 50):
                    found[(key, int(h["scheduled_time"]), str(h["outcome"]))] += 1
        return found

    outcomes = recorded()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not all(
            outcomes[(k, t, "success")] for k, t in expected):
        time.sleep(1)
        outcomes = recorded()
    assert all(outcomes[(k, t, "success")] == 1 for k, t in expected), \
        sorted((k, t) for k, t in expected if outcomes[(k, t, "success")] != 1)[:10]
    others = {o: n for o, n in outcomes.items() if o[2] != "success" and (o[0], o[1])
              in expected}
    assert not others, others
    slow = {k: v for k, v in figures.items() if v >= RESUME_WITHIN}
    assert not slow, f"work resumed later than {RESUME_WITHIN:g}s: {slow}"
