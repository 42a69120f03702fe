"""Fault-injection toolkit shared by tests/faults/ and bench/soak.py (no pytest here).

A *cluster* is several perfectschedd processes, each with its own config, control
socket and `node_name` (standing for separate hosts), on one database.  Every task runs
JOB_SCRIPT, an exec route that appends two lines to one execution log:

    S <key> <scheduled_time> <attempt> <node> <pid> <worker pid> <uptime>   run starts
    E <key> <scheduled_time> <attempt> <node> <pid> <worker pid> <uptime>   it ends (exit 0)

`uptime` is /proc/uptime (CLOCK_BOOTTIME, read by a shell builtin: no extra fork); the
fault injectors stamp their events with the same clock (`now_boot()`).  Small O_APPEND
writes are atomic, so concurrent jobs never interleave within a line.

An occurrence is (key, scheduled_time).  `analyse()` says which expected occurrences
have no E line (lost), which have several (duplicates), and whether each duplicate is
explained by a fault: one of its runs was in flight (started, result not yet recorded)
when a fault hit what ran it (that worker, that node, or - for database faults - any).
"""

from __future__ import annotations

import math
import os
import random
import signal
import socket
import sys
import threading
import time
import urllib.request
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TESTS_DIR = Path(__file__).resolve().parent.parent
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))

from daemon_harness import Daemon, pid_alive, wait_until  # noqa: E402

import perfectschedd  # noqa: E402
from perfectschedd.schedules import cron  # noqa: E402

JOB_TYPE = "job"
# Sleeps 0.1-0.9 s (by pid) so that kills find runs in flight.
JOB_SCRIPT = r"""#!/bin/sh
# PerfectSched fault-test job: log start and end of the run (see tests/faults/faultlib.py).
log() {
    read up _ < /proc/uptime
    echo "$1 $PERFECTSCHED_KEY $PERFECTSCHED_SCHEDULED_TIME $PERFECTSCHED_ATTEMPT" \
         "$FAULT_NODE $$ $PPID $up" >> "$FAULT_LOG"
}
log S
sleep "0.$(( $$ % 9 + 1 ))"
log E
"""

# A run's end line is written before the worker records the finish; a kill in between
# still makes that run "in flight".  The finish is written within this many seconds.
RECORD_SLACK = 3.0


def now_boot() -> float:
    return time.clock_gettime(time.CLOCK_BOOTTIME)


# -- the cluster ------------------------------------------------------------------------------

class Cluster:
    """`n` daemons on one database URL; node i is called n<i> (its `node_name`)."""

    def __init__(self, base: Path, url: str, n: int, overrides: dict[str, Any] | None = None,
                 *, watchdog_usec: int | None = None, prefix: str = "n") -> None:
        self.base = Path(base)
        self.url = url
        self.log_path = self.base / "executions.log"
        self.log_path.touch()
        script = self.base / "job.sh"
        script.write_text(JOB_SCRIPT)
        script.chmod(0o755)
        self.nodes: list[Daemon] = []
        for i in range(n):
            name = f"{prefix}{i}"
            cfg = {
                "node_name": name,
                "workers": 2,
                "concurrency": 8,
                "alive_time": 6,
                "poll_interval": 0.5,
                "worker_timeout": 10,
                "retry_wait": 1,
                "history_limit": 5,
                "routes": [{"type": JOB_TYPE, "exec": ["/bin/sh", str(script)]}],
                **(overrides or {}),
            }
            # A job sees its route's env:, never the daemon's environment.
            env = {"FAULT_LOG": str(self.log_path), "FAULT_NODE": name}
            cfg["routes"] = [{"user": "root", **r, "env": {**env, **r.get("env", {})}}
                             for r in cfg["routes"]]
            self.nodes.append(Daemon(self.base, cfg, url=url, name=name,
                                     watchdog_usec=watchdog_usec, env=env))
        self.faults: list[Fault] = []
        self.daemon_kills = 0
        self.worker_kills = 0

    def open(self) -> Any:
        """A ScheduleCollection on the cluster's database (direct, no daemon)."""
        return perfectschedd.open({"type": "rdb_compat", "url": self.url})

    def start(self) -> Cluster:
        for d in self.nodes:
            d.start(timeout=60)
        return self

    def close(self) -> None:
        for d in self.nodes:
            d.kill()

    def fault(self, start: float, end: float, what: str, node: str | None = None,
              worker: int | None = None) -> None:
        self.faults.append(Fault(start, end, what, node, worker))

    # -- fault injectors ----------------------------------------------------------------------

    def kill_worker(self, rng: random.Random, min_age: float = 0.0) -> int | None:
        """SIGKILL one worker process of a random running node; returns its pid."""
        nodes = [d for d in self.nodes if d.alive()]
        rng.shuffle(nodes)
        for d in nodes:
            kids = [p for p in workers(d) if _age(p) >= min_age]
            if kids:
                pid = rng.choice(kids)
                t = now_boot()
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
                node = d.config["node_name"]
                self.fault(t, t, f"kill -9 worker {pid} of {node}", node, pid)
                self.worker_kills += 1
                return pid
        return None

    def kill_node(self, i: int) -> None:
        """A host crash: SIGKILL the daemon and every process under it, jobs included."""
        d = self.nodes[i]
        # Before the master dies: jobs get re-parented.  (Daemon.descendants copes with
        # processes that exit while it looks.)
        doomed = [d.pid, *d.descendants()]
        t = now_boot()
        for pid in doomed:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        d.kill()
        node = self.nodes[i].config["node_name"]
        self.fault(t, t, f"kill -9 daemon {node}", node)
        self.daemon_kills += 1

    def restart_node(self, i: int) -> None:
        self.nodes[i].start(timeout=60)

    # -- checks -------------------------------------------------------------------------------

    def assert_all_alive(self) -> None:
        dead = [d.config["node_name"] for d in self.nodes if not d.alive()]
        assert not dead, f"daemon(s) exited: {dead}\n" + "\n".join(
            d.log()[-2000:] for d in self.nodes if not d.alive())

    def wait_settled(self, cutoff: int, timeout: float = 120.0) -> None:
        """Wait until every cron schedule has moved past `cutoff` and one-offs are gone."""
        with self.open() as sc:
            def settled() -> bool:
                try:
                    rows = sc.list()
                except Exception:  # noqa: BLE001 - the database may still be recovering
                    return False
                return all(r.next_time > cutoff for r in rows)
            wait_until(settled, timeout, interval=0.5,
                       what=f"every occurrence up to {cutoff} to finish")

    def leases_honest(self, now: int | None = None) -> list[str]:
        """Rows still held by a process that is gone and whose lease has not expired."""
        now = int(time.time()) if now is None else now
        live = {f"{d.config['node_name']}:{p}" for d in self.nodes if d.alive()
                for p in workers(d)}
        bad = []
        with self.open() as sc:
            for r in sc.list():
                if r.owner is not None and r.owner not in live and r.next_run_time > now + 1:
                    bad.append(f"{r.key} held by {r.owner} until {r.next_run_time}")
        return bad

    def assert_leases_expire(self) -> None:
        """Leases of dead processes are gone (taken over or expired) within alive_time."""
        alive_time = float(self.nodes[0].config["alive_time"])
        wait_until(lambda: not self.leases_honest(), alive_time + 3, interval=0.5,
                   what=f"leases of dead processes to expire: {self.leases_honest()[:3]}")

    def read_log(self) -> list[Run]:
        return parse_log(self.log_path.read_text())


def workers(d: Daemon) -> list[int]:
    """The worker processes of a daemon (not job processes re-parented to the master)."""
    out = []
    for pid in d.children():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"perfectschedd" in argv:
            out.append(pid)
    return out


def _age(pid: int) -> float:
    """Seconds since a process started."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return 0.0
    return now_boot() - start_ticks / os.sysconf("SC_CLK_TCK")


# -- a slow database -------------------------------------------------------------------------

class LatencyProxy:
    """A TCP proxy on 127.0.0.1 that delays every chunk by `delay` seconds each way, and
    can stall (hold all traffic) for a while: a slow or hung database server."""

    def __init__(self, target: tuple[str, int], delay: float) -> None:
        self.target = target
        self.delay = delay
        self.flowing = threading.Event()
        self.flowing.set()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self.closed = False
        self.socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, url: str) -> str:
        """`url` with host:port replaced by the proxy's."""
        host_port = f"{self.target[0]}:{self.target[1]}"
        assert host_port in url, url
        return url.replace(host_port, f"127.0.0.1:{self.port}")

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            self.socks += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                time.sleep(self.delay)
                self.flowing.wait()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.closed = True
        self.flowing.set()
        self.listener.close()
        for s in self.socks:
            s.close()


# -- schedules --------------------------------------------------------------------------------

def add_catchup_schedules(sc: Any, n: int, behind: int, prefix: str = "s",
                          now: int | None = None) -> dict[str, int]:
    """`n` schedules `* * * * *` starting `behind` seconds ago: catch-up gives each about
    behind/60 occurrences at once, then one a minute.  Returns key -> first next_time."""
    now = int(time.time()) if now is None else now
    reqs = [{"key": f"{prefix}{i:04d}", "type": JOB_TYPE, "cron": "* * * * *",
             "start": now - behind} for i in range(n)]
    for i in range(0, n, 200):
        sc.add_many(reqs[i:i + 200])
    first = cron.first_at_or_after("* * * * *", "UTC", now - behind)
    return {str(r["key"]): first for r in reqs}


def expected_occurrences(first: dict[str, int], cutoff: int, cron_expr: str = "* * * * *",
                         tz: str = "UTC") -> set[tuple[str, int]]:
    out: set[tuple[str, int]] = set()
    for key, t in first.items():
        while t <= cutoff:
            out.add((key, t))
            t = cron.next_after(cron_expr, tz, t)
    return out


# -- the log and its analysis -----------------------------------------------------------------

@dataclass(frozen=True)
class Fault:
    start: float  # now_boot()
    end: float
    what: str
    node: str | None = None  # None: every node (a database fault)
    worker: int | None = None  # a worker's pid: only that worker's runs


@dataclass(frozen=True)
class Run:
    kind: str  # S or E
    key: str
    scheduled_time: int
    attempt: int
    node: str
    pid: int
    worker: int
    at: float


def parse_log(text: str) -> list[Run]:
    runs = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) != 8 or parts[0] not in ("S", "E"):
            continue  # a line cut by a host-crash kill mid-write
        try:
            runs.append(Run(parts[0], parts[1], int(parts[2]), int(parts[3]), parts[4],
                            int(parts[5]), int(parts[6]), float(parts[7])))
        except ValueError:
            continue
    return runs


@dataclass
class Report:
    expected: int = 0
    runs: int = 0  # successful runs (E lines) of expected occurrences
    started: int = 0  # S lines of expected occurrences
    lost: list[tuple[str, int]] = field(default_factory=list)
    duplicates: list[tuple[str, int]] = field(default_factory=list)
    unexplained: list[tuple[str, int]] = field(default_factory=list)
    unexpected: list[tuple[str, int]] = field(default_factory=list)
    nodes: Counter[str] = field(default_factory=Counter)
    faults: int = 0
    details: list[str] = field(default_factory=list)  # describe() of the first problems
    # Occurrences two of whose copies ran at the same time (by the jobs' own start and
    # end lines; a copy killed before its end line cannot be shown to overlap).
    overlaps: list[tuple[str, int]] = field(default_factory=list)

    def summary(self) -> str:
        return (f"occurrences={self.expected} runs={self.runs} starts={self.started} "
                f"faults={self.faults} overlapping={len(self.overlaps)} "
                f"duplicates={len(self.duplicates)} "
                f"(unexplained {len(self.unexplained)}) lost={len(self.lost)} "
                f"unexpected={len(self.unexpected)} per-node={dict(sorted(self.nodes.items()))}")

    def assert_ok(self) -> None:
        problems = []
        if self.overlaps:
            problems.append(f"{len(self.overlaps)} occurrences ran two copies at once, "
                            f"e.g. {sorted(self.overlaps)[:5]}")
        if self.lost:
            problems.append(f"{len(self.lost)} lost, e.g. {sorted(self.lost)[:5]}")
        if self.unexplained:
            problems.append(f"{len(self.unexplained)} duplicates not explained by a fault, "
                            f"e.g. {sorted(self.unexplained)[:5]}")
        if self.unexpected:
            problems.append(f"{len(self.unexpected)} runs of times that are no occurrence, "
                            f"e.g. {sorted(self.unexpected)[:5]}")
        assert not problems, "\n".join(["; ".join(problems), self.summary(), *self.details])


def analyse(runs: Sequence[Run], expected: Iterable[tuple[str, int]],
            faults: Sequence[Fault], keys: Iterable[str] | None = None
            ) -> Report:
    """Compare the execution log with the expected occurrences.

    Occurrences of `keys` after the expected ones (the next minute already running) are
    neither lost nor unexpected; a scheduled time that no cron time explains is.
    """
    exp = set(expected)
    rep = Report(expected=len(exp), faults=len(faults))
    known_keys = set(keys) if keys is not None else {k for k, _ in exp}
    ends: dict[tuple[str, int], list[Run]] = defaultdict(list)
    starts: dict[tuple[str, int], list[Run]] = defaultdict(list)
    for r in runs:
        (ends if r.kind == "E" else starts)[(r.key, r.scheduled_time)].append(r)
    latest: dict[str, int] = {}
    for k, t in exp:
        latest[k] = max(t, latest.get(k, t))
    for occ in ends:
        key, t = occ
        if occ not in exp and (key not in known_keys or t <= latest.get(key, -1)):
            rep.unexpected.append(occ)
    for occ in exp:
        es = ends.get(occ, [])
        rep.started += len(starts.get(occ, []))
        rep.runs += len(es)
        for e in es:
            rep.nodes[e.node] += 1
        if not es:
            rep.lost.append(occ)
        elif len(es) > 1:
            rep.duplicates.append(occ)
            if not _explained(starts.get(occ, []), es, faults):
                rep.unexplained.append(occ)
    rep.overlaps = overlapping(runs)
    rep.details = [describe(runs, occ, faults)
                   for occ in sorted(rep.overlaps)[:3] + sorted(rep.unexplained)[:3]
                   + sorted(rep.lost)[:3]]
    return rep


def overlapping(runs: Sequence[Run]) -> list[tuple[str, int]]:
    """Occurrences with two copies whose [start, end] (the job's own lines, one pid each)
    intersect."""
    spans: dict[tuple[str, int], dict[tuple[str, int], list[float]]] = defaultdict(dict)
    for r in runs:
        span = spans[(r.key, r.scheduled_time)].setdefault((r.node, r.pid), [math.nan] * 2)
        span[0 if r.kind == "S" else 1] = r.at
    out = []
    for occ, copies in spans.items():
        done = sorted((s, e) for s, e in copies.values()
                      if not (math.isnan(s) or math.isnan(e)))
        latest_end = -math.inf
        for start, end in done:
            if start < latest_end:
                out.append(occ)
                break
            latest_end = max(latest_end, end)
    return out


def _explained(starts: list[Run], ends: list[Run], faults: Sequence[Fault]) -> bool:
    """Some run of the occurrence was in flight (started, result not yet recorded) when a
    fault hit the worker, the node or the database it depended on, so its result could be
    lost and the occurrence rerun."""
    end_of = {(e.node, e.pid): e.at for e in ends}
    for s in starts:
        stop = end_of.get((s.node, s.pid), float("inf")) + RECORD_SLACK
        for f in faults:
            if f.node is not None and f.node != s.node:
                continue
            if f.worker is not None and f.worker != s.worker:
                continue
            if s.at <= f.end + 0.5 and stop >= f.start:
                return True
    return False


def describe(runs: Sequence[Run], occ: tuple[str, int], faults: Sequence[Fault]) -> str:
    """The log lines of one occurrence and the faults near them (for failure reports)."""
    mine = [r for r in runs if (r.key, r.scheduled_time) == occ]
    lines = [f"{occ[0]} @ {occ[1]}:"]
    lines += [f"  {r.kind} attempt={r.attempt} node={r.node} pid={r.pid} worker={r.worker} "
              f"at={r.at:.2f}" for r in mine]
    if mine:
        lo, hi = min(r.at for r in mine) - 10, max(r.at for r in mine) + 10
        lines += [f"  fault {f.what} {f.start:.2f}-{f.end:.2f}" for f in faults
                  if f.end >= lo and f.start <= hi]
    return "\n".join(lines)


def metric(daemon: Daemon, name: str) -> float | None:
    """One unlabelled sample of the daemon's /metrics (None: not exported)."""
    url = f"http://127.0.0.1:{daemon.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == name:
            return float(parts[1])
    return None


def watchdog_gaps(daemon: Daemon) -> float:
    """Longest pause between WATCHDOG=1 messages of the daemon's current run."""
    assert daemon.notify is not None
    times = [t for t, m in daemon.notify.timed() if "WATCHDOG=1" in m]
    times.append(time.monotonic())
    return max((b - a for a, b in zip(times, times[1:], strict=False)), default=0.0)


__all__ = ["Cluster", "Daemon", "Fault", "LatencyProxy", "Report", "Run",
           "add_catchup_schedules", "analyse", "describe", "expected_occurrences",
           "metric", "now_boot",
           "parse_log", "pid_alive", "wait_until", "watchdog_gaps", "workers"]
