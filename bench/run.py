"""PerfectSched vs APScheduler 3.11 (SQLAlchemyJobStore), same machine, same run.

    make bench                                   # SQLite file + PostgreSQL, ~25 min
    .venv-bench/bin/python bench/run.py --help   # sizes, backends, repeats, --million

Workloads (each on a fresh database, for each backend, PerfectSched then APScheduler):

burst   N cron occurrences all due at the same instant T (N = 2,000 and 20,000):
        fires/s = N / (last start - T); lateness = start - T, p50/p99/max.
steady  500 schedules firing every minute, schedule i at second (i*60)//500, for
        --steady-seconds: lateness p50/p99 and occurrences missed (not started by the
        end of the window + 10 s).
scale   N stored daily cron schedules (100k; 1M with --million), none due during the
        test: registration rate, start-to-ready (process spawn -> ready), idle CPU over
        --idle-seconds (as % of one core), RSS/PSS.

PerfectSched runs as the real daemon (`python -m perfectschedd`, 2 workers, a python
route to a tiny Application).  APScheduler runs in its own process
(bench/peer_apscheduler.py): BackgroundScheduler + SQLAlchemyJobStore + thread pool.
Both jobs do the same thing: take time.time() and append one line to a file.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from daemon_harness import RUNNER, NotifyListener, free_port  # noqa: E402
from dbservers import PostgresServer  # noqa: E402

import perfectschedd  # noqa: E402

PEER = ROOT / "bench" / "peer_apscheduler.py"
CLK_TCK = os.sysconf("SC_CLK_TCK")
PEER_OPTS: list[str] = []  # --executor, --sqlite-pragmas for every peer process

APP_MODULE = '''\
"""Bench handler: record (key, due time, start time), finish the task."""
import os
import time

from perfectschedd import Application

_FD = os.open(os.path.join({firedir!r}, f"ps-{{os.getpid()}}.log"),
              os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)


class Fire(Application):
    def run(self) -> None:
        started = time.time()
        task = self.task
        due = task.scheduled_time + getattr(task, "delay", 0)
        os.write(_FD, f"{{task.key}} {{due}} {{started:.6f}}\\n".encode())
        task.finish()
'''


def log(msg: str) -> None:
    print(f"[{datetime.now().strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -- statistics ----------------------------------------------------------------------------

def pct(values: list[float], p: float) -> float:
    """Nearest-rank percentile."""
    if not values:
        return math.nan
    s = sorted(values)
    return s[max(0, math.ceil(p / 100 * len(s)) - 1)]


def median(values: list[float]) -> float:
    vals = [v for v in values if not math.isnan(v)]
    return statistics.median(vals) if vals else math.nan


# -- /proc ---------------------------------------------------------------------------------

def children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def cpu_seconds(pid: int) -> float:
    """utime + stime of the process (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def status_kib(pid: int, name: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(name + ":"):
                return int(line.split()[1])
    return 0


def pss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def idle_cpu(pids: list[int], seconds: float) -> float:
    """CPU used by `pids` over `seconds` of wall time, as % of one core."""
    before = sum(cpu_seconds(p) for p in pids)
    t0 = time.monotonic()
    time.sleep(seconds)
    used = sum(cpu_seconds(p) for p in pids) - before
    return 100.0 * used / (time.monotonic() - t0)


def memory(pids: list[int]) -> dict[str, Any]:
    rss = [status_kib(p, "VmRSS") for p in pids]
    return {"rss_kib": rss, "rss_sum_mib": sum(rss) / 1024, "rss_max_mib": max(rss) / 1024,
            "pss_sum_mib": sum(pss_kib(p) for p in pids) / 1024}


# -- fire logs -----------------------------------------------------------------------------

class FireLog:
    """Reads the lines both systems' jobs append: `KEY [DUE] START`."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory
        self.offsets: dict[Path, int] = {}
        self.partial: dict[Path, bytes] = {}
        self.fires: list[tuple[str, float | None, float]] = []

    def poll(self) -> int:
        for path in sorted(self.dir.glob("*.log")):
            with path.open("rb") as f:
                f.seek(self.offsets.get(path, 0))
                data = f.read()
            if not data:
                continue
            self.offsets[path] = self.offsets.get(path, 0) + len(data)
            data = self.partial.pop(path, b"") + data
            lines = data.split(b"\n")
            if lines[-1]:
                self.partial[path] = lines[-1]
            for line in lines[:-1]:
                parts = line.decode().split()
                due = float(parts[1]) if len(parts) == 3 else None
                self.fires.append((parts[0], due, float(parts[-1])))
        return len(self.fires)

    def wait_count(self, n: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self.poll() < n:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True


# -- the two systems ------------------------------------------------------------------------

@dataclass
class Env:
    """One backend: where databases come from."""

    name: str
    work: Path
    pg: PostgresServer | None = None
    counter: int = 0

    def fresh_url(self, label: str) -> str:
        self.counter += 1
        name = f"{label}_{self.counter}"
        if self.pg is not None:
            return self.pg.create_database(name)
        d = self.work / "sqlite"
        d.mkdir(parents=True, exist_ok=True)
        return f"sqlite:///{d / (name + '.db')}"

    def drop(self, url: str) -> None:
        if self.pg is not None:
            self.pg.drop_database(url.rsplit("/", 1)[1])
        else:
            path = Path(url[len("sqlite:///"):])
            for suffix in ("", "-wal", "-shm", "-writer.lock"):
                Path(str(path) + suffix).unlink(missing_ok=True)


def takes_route_user(pythonpath: str | None) -> bool:
    """Whether the perfectschedd of `pythonpath` (this tree's when None) is 0.3.0 or
    later: the release whose root daemon needs `user:` on a python route."""
    if pythonpath is None:
        return True
    text = (Path(pythonpath) / "perfectschedd" / "__init__.py").read_text()
    found = re.search(r'__version__ = "(\d+)\.(\d+)', text)
    return found is None or (int(found[1]), int(found[2])) >= (0, 3)


@dataclass
class PS:
    """PerfectSched: the real daemon in a subprocess, schedules added with add_many."""

    url: str
    dir: Path
    workers: int = 2
    extra: dict[str, Any] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    notify: NotifyListener | None = None
    profiled: bool = False
    pythonpath: str | None = None  # the perfectschedd package of another tree
    firedir: Path = field(init=False)

    def __post_init__(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.firedir = self.dir / "fires"
        self.firedir.mkdir(exist_ok=True)
        (self.dir / "benchapp.py").write_text(APP_MODULE.format(firedir=str(self.firedir)))
        self.config: dict[str, Any] = {
            "type": "rdb_compat", "url": self.url,
            "control_socket": str(self.dir / "ctl.sock"),
            "metrics_listen": f"127.0.0.1:{free_port()}",
            "workers": self.workers, "poll_interval": 1,
            # user: a root daemon refuses a route without one (a tree before 0.3.0 takes
            # no user: on a python route, and needs none).
            "routes": [{"type": "bench", "python": "benchapp:Fire",
                        **({"user": RUNNER} if takes_route_user(self.pythonpath) else {})}],
            **self.extra,
        }
        (self.dir / "perfectsched.yml").write_text(yaml.safe_dump(self.config))

    def add_many(self, requests: list[dict[str, Any]], chunk: int = 10_000) -> float:
        t0 = time.perf_counter()
        with perfectschedd.open(self.config) as sc:
            for i in range(0, len(requests), chunk):
                sc.add_many(requests[i:i + chunk])
        return time.perf_counter() - t0

    def start(self, profile: list[str] | None = None) -> float:
        """Spawn the daemon; returns seconds from spawn to READY=1."""
        path = self.dir / "notify.sock"
        path.unlink(missing_ok=True)
        self.notify = NotifyListener(path)
        env = {k: v for k, v in os.environ.items() if not k.startswith("PERFECTSCHED_")}
        env["NOTIFY_SOCKET"] = str(path)
        if self.pythonpath:
            env["PYTHONPATH"] = self.pythonpath
        argv = [sys.executable, "-m", "perfectschedd", "-c", str(self.dir / "perfectsched.yml"),
                "-I", str(self.dir)]
        self.profiled = bool(profile)
        t0 = time.monotonic()
        self.proc = subprocess.Popen([*(profile or []), *argv], stdin=subprocess.DEVNULL,
                                     stdout=(self.dir / "daemon.log").open("ab"),
                                     stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True, cwd=str(self.dir))
        deadline = t0 + 600
        while time.monotonic() < deadline:
            for stamp, msg in self.notify.timed():
                if "READY=1" in msg:
                    return stamp - t0
            if self.proc.poll() is not None:
                raise RuntimeError(f"perfectschedd exited: {self.log_tail()}")
            time.sleep(0.005)
        raise RuntimeError("perfectschedd: no READY=1 within 600 s")

    def pids(self) -> list[int]:
        """The master and its workers (under py-spy, the master is py-spy's child)."""
        assert self.proc is not None
        master = self.proc.pid
        if self.profiled:
            master = children(master)[0]
        return [master, *children(master)]

    def log_tail(self) -> str:
        try:
            return (self.dir / "daemon.log").read_text(errors="replace")[-3000:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        if self.notify is not None:
            self.notify.close()
        self.proc = None


@dataclass
class APS:
    """APScheduler in bench/peer_apscheduler.py."""

    url: str
    dir: Path
    proc: subprocess.Popen[str] | None = None
    firedir: Path = field(init=False)

    def __post_init__(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.firedir = self.dir / "fires"
        self.firedir.mkdir(exist_ok=True)

    def spawn(self, mode: str, *args: str) -> float:
        env = dict(os.environ, BENCH_FIRE_LOG=str(self.firedir / "aps.log"))
        t0 = time.time()
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER), mode, "--url", self.url, *PEER_OPTS, *args],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=(self.dir / "peer.log").open("a"), text=True, env=env,
            start_new_session=True)
        return t0

    def expect(self, event: str, timeout: float = 3600) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            msg = json.loads(line)
            if msg["event"] == event:
                return dict(msg)
        self.proc.wait(5)
        tail = (self.dir / "peer.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"peer_apscheduler exited before {event!r}: {tail}")

    def stop(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.proc is None:
            return out
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                out = self.expect("stopped")
            except (RuntimeError, json.JSONDecodeError):
                pass
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.proc = None
        return out


# -- workloads ------------------------------------------------------------------------------

def burst_stats(fires: list[tuple[str, float | None, float]], n: int, due: float,
                reg_seconds: float) -> dict[str, Any]:
    first: dict[str, float] = {}
    for key, _, started in fires:
        if key not in first or started < first[key]:
            first[key] = started
    late = [s - due for s in first.values()]
    span = max(first.values()) - due if first else math.nan
    return {"n": n, "fired": len(first), "duplicates": len(fires) - len(first),
            "fires_per_s": len(first) / span if span > 0 else math.nan,
            "late_p50_ms": 1000 * pct(late, 50), "late_p99_ms": 1000 * pct(late, 99),
            "late_max_ms": 1000 * max(late) if late else math.nan,
            "register_s": reg_seconds}


def burst_ps(env: Env, n: int, tmp: Path, lead: float,
             profile: list[str] | None = None, pythonpath: str | None = None
             ) -> dict[str, Any]:
    url = env.fresh_url(f"psburst{n}")
    ps = PS(url, tmp / f"ps-burst-{n}-{env.name}-{env.counter}", pythonpath=pythonpath)
    try:
        ps.start(profile)
        due = float(math.ceil(time.time() + lead))
        reqs = [{"key": f"b{i}", "type": "bench", "cron": "0 0 1 1 *", "at": int(due)}
                for i in range(n)]
        reg = ps.add_many(reqs)
        if time.time() > due - 0.3:
            return {"overran": True, "register_s": reg}
        fl = FireLog(ps.firedir)
        workers = ps.pids()[1:]
        cpu0 = sum(cpu_seconds(p) for p in workers)
        ok = fl.wait_count(n, timeout=max(120.0, n / 50))
        cpu = sum(cpu_seconds(p) for p in workers) - cpu0
        stats = burst_stats(fl.fires, n, due, reg)
        stats["complete"] = ok
        # CPU of the workers per fire: what a loaded machine changes least.
        stats["worker_cpu_us_per_fire"] = 1e6 * cpu / n
        return stats
    finally:
        ps.stop()
        env.drop(url)


def burst_aps(env: Env, n: int, tmp: Path, lead: float) -> dict[str, Any]:
    url = env.fresh_url(f"apsburst{n}")
    aps = APS(url, tmp / f"aps-burst-{n}-{env.name}-{env.counter}")
    try:
        due = float(math.ceil(time.time() + lead))
        aps.spawn("burst", "--n", str(n), "--due", str(due), "--prefix", "b")
        reg = aps.expect("registered")
        if reg["end"] > due - 0.3:
            return {"overran": True, "register_s": reg["seconds"]}
        fl = FireLog(aps.firedir)
        ok = fl.wait_count(n, timeout=max(300.0, n / 20))
        stats = burst_stats(fl.fires, n, due, reg["seconds"])
        stats["complete"] = ok
        return stats
    finally:
        aps.stop()
        env.drop(url)


def run_burst(system: str, fn: Callable[[float], dict[str, Any]], n: int,
              lead: float) -> dict[str, Any]:
    """Run one burst; if registration did not end before T, try again with more lead."""
    for _ in range(4):
        r = fn(lead)
        if not r.get("overran"):
            return r
        lead = max(lead * 2, r["register_s"] * 1.5 + 2)
        log(f"  {system} burst {n}: registration overran T; retrying with lead {lead:.0f}s")
    raise RuntimeError(f"{system} burst {n}: registration never finished before T")


def steady_expected(n: int, t0: int, window: int) -> dict[tuple[str, int], None]:
    exp: dict[tuple[str, int], None] = {}
    for i in range(n):
        off = (i * 60) // n
        d = t0 + ((off - t0) % 60)
        while d < t0 + window:
            exp[(f"s{i}", d)] = None
            d += 60
    return exp


def steady_stats(fires: list[tuple[str, float | None, float]], n: int, t0: int, window: int,
                 cutoff: float) -> dict[str, Any]:
    exp = steady_expected(n, t0, window)
    got: dict[tuple[str, int], float] = {}
    for key, due, started in fires:
        if due is None:  # APScheduler: the occurrence is the last second `off` <= start
            off = (int(key[1:]) * 60) // n
            d = int(math.floor((started - off) / 60) * 60 + off)
        else:
            d = int(due)
        k = (key, d)
        if k in exp and started <= cutoff and (k not in got or started < got[k]):
            got[k] = started
    late = [got[k] - k[1] for k in got]
    return {"schedules": n, "expected": len(exp), "fired": len(got),
            "missed": len(exp) - len(got), "late_p50_ms": 1000 * pct(late, 50),
            "late_p99_ms": 1000 * pct(late, 99),
            "late_max_ms": 1000 * max(late) if late else math.nan}


def steady_requests(n: int, t0: int) -> list[dict[str, Any]]:
    reqs = []
    for i in range(n):
        off = (i * 60) // n
        first = t0 + ((off - t0) % 60)
        reqs.append({"key": f"s{i}", "type": "bench", "cron": "* * * * *", "delay": off,
                     "start": first - off, "at": first})
    return reqs


def steady_ps(env: Env, n: int, window: int, tmp: Path, pythonpath: str | None = None
              ) -> dict[str, Any]:
    url = env.fresh_url("pssteady")
    ps = PS(url, tmp / f"ps-steady-{env.name}-{env.counter}", pythonpath=pythonpath)
    try:
        ps.start()
        t0 = int(time.time()) + 5
        ps.add_many(steady_requests(n, t0))
        time.sleep(max(0.0, t0 + window + 10 - time.time()))
        fl = FireLog(ps.firedir)
        fl.poll()
        return steady_stats(fl.fires, n, t0, window, t0 + window + 10)
    finally:
        ps.stop()
        env.drop(url)


def steady_aps(env: Env, n: int, window: int, tmp: Path) -> dict[str, Any]:
    url = env.fresh_url("apssteady")
    aps = APS(url, tmp / f"aps-steady-{env.name}-{env.counter}")
    try:
        t0 = int(time.time()) + 8
        aps.spawn("steady", "--n", str(n), "--due", str(t0), "--prefix", "s")
        reg = aps.expect("registered")
        if reg["end"] > t0:
            log("  apscheduler steady: registration ended after the window began")
        time.sleep(max(0.0, t0 + window + 10 - time.time()))
        fl = FireLog(aps.firedir)
        fl.poll()
        stats = steady_stats(fl.fires, n, t0, window, t0 + window + 10)
        stats["aps_missed_events"] = aps.stop().get("missed")
        return stats
    finally:
        aps.stop()
        env.drop(url)


def daily_hours() -> list[int]:
    now = datetime.now(UTC).hour
    return [h for h in range(24) if (h - now) % 24 > 2]


def scale_requests(n: int) -> Iterator[dict[str, Any]]:
    hours = daily_hours()
    for i in range(n):
        yield {"key": f"j{i}", "type": "bench",
               "cron": f"{i % 60} {hours[(i // 60) % len(hours)]} * * *"}


def scale_ps(env: Env, n: int, idle: float, tmp: Path) -> dict[str, Any]:
    url = env.fresh_url(f"psscale{n}")
    ps = PS(url, tmp / f"ps-scale-{n}-{env.name}-{env.counter}")
    try:
        reg = ps.add_many(list(scale_requests(n)))
        log(f"  perfectsched: {n} registered in {reg:.1f}s")
        ready = ps.start()
        time.sleep(5)
        pids = ps.pids()
        cpu = idle_cpu(pids, idle)
        mem = memory(pids)
        return {"n": n, "register_s": reg, "adds_per_s": n / reg, "ready_s": ready,
                "idle_cpu_pct": cpu, "processes": len(pids), **mem}
    finally:
        ps.stop()
        env.drop(url)


def scale_aps(env: Env, n: int, idle: float, tmp: Path,
              add_limit: int) -> dict[str, Any]:
    url = env.fresh_url(f"apsscale{n}")
    aps = APS(url, tmp / f"aps-scale-{n}-{env.name}-{env.counter}")
    try:
        aps.spawn("register", "--n", str(n), "--prefix", "j", "--add-limit", str(add_limit))
        added = aps.expect("added")
        aps.expect("registered")
        aps.proc.wait(600) if aps.proc else None
        log(f"  apscheduler: {added['n']} add_job calls in {added['seconds']:.1f}s"
            + (f", {n - added['n']} bulk-loaded" if added["n"] < n else ""))
        t0 = aps.spawn("serve")
        ready = aps.expect("ready")["ready_time"] - t0
        time.sleep(5)
        assert aps.proc is not None
        pids = [aps.proc.pid]
        cpu = idle_cpu(pids, idle)
        mem = memory(pids)
        return {"n": n, "register_s": added["seconds"], "adds_per_s": added["n"] /
                added["seconds"], "add_job_calls": added["n"], "ready_s": ready,
                "idle_cpu_pct": cpu, "processes": 1, **mem}
    finally:
        aps.stop()
        env.drop(url)


# -- report ---------------------------------------------------------------------------------

def fmt(v: Any, digits: int = 0) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "—"
    if isinstance(v, float):
        return f"{v:,.{digits}f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def ratio(ps: Any, aps: Any, higher_better: bool) -> str:
    try:
        if ps is None or aps is None or math.isnan(ps) or math.isnan(aps):
            return "—"
        r = ps / aps if higher_better else aps / ps
    except ZeroDivisionError:
        return "—"
    return f"{r:,.1f}×" if r >= 1 else f"{r:.2f}× (worse)"


def table(results: dict[str, Any]) -> str:
    lines = ["| backend | workload | metric | PerfectSched | APScheduler | advantage |",
             "|---|---|---|---:|---:|---:|"]
    metrics = {
        "burst": [("fires/s", "fires_per_s", True, 0), ("lateness p50 ms", "late_p50_ms",
                                                          False, 0),
                  ("lateness p99 ms", "late_p99_ms", False, 0),
                  ("lateness max ms", "late_max_ms", False, 0)],
        "steady": [("lateness p50 ms", "late_p50_ms", False, 1),
                   ("lateness p99 ms", "late_p99_ms", False, 1),
                   ("missed (of expected)", "missed", False, 0)],
        "scale": [("adds/s", "adds_per_s", True, 0), ("start-to-ready s", "ready_s", False, 2),
                  ("idle CPU % of a core", "idle_cpu_pct", False, 2),
                  ("RSS MiB, largest process", "rss_max_mib", False, 1),
                  ("RSS MiB, sum of processes", "rss_sum_mib", False, 1),
                  ("PSS MiB, sum of processes", "pss_sum_mib", False, 1)],
    }
    for backend, rows in results.items():
        for wl, pair in rows.items():
            kind = wl.split()[0]
            for label, k, hb, dg in metrics[kind]:
                p, a = pair["perfectsched"].get(k), pair["apscheduler"].get(k)
                if k == "missed":
                    cell_p = f"{p} of {pair['perfectsched'].get('expected')}"
                    cell_a = f"{a} of {pair['apscheduler'].get('expected')}"
                    r = "—" if p == a else ("fewer" if p < a else "more (worse)")
                else:
                    cell_p, cell_a, r = fmt(p, dg), fmt(a, dg), ratio(p, a, hb)
                lines.append(f"| {backend} | {wl} | {label} | {cell_p} | {cell_a} | {r} |")
    return "\n".join(lines)


def machine() -> str:
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = status_total_mem()
    import apscheduler
    import sqlalchemy
    return (f"{os.cpu_count()} CPU ({cpu}), {mem} GiB RAM, Linux {os.uname().release}, "
            f"Python {sys.version.split()[0]}, SQLAlchemy {sqlalchemy.__version__}, "
            f"APScheduler {apscheduler.__version__}")


def status_total_mem() -> int:
    with open("/proc/meminfo") as f:
        return round(int(f.readline().split()[1]) / 1024 / 1024)


# -- main -----------------------------------------------------------------------------------

@contextmanager
def backends(names: list[str], tmp: Path) -> Iterator[list[Env]]:
    envs: list[Env] = []
    pg: PostgresServer | None = None
    try:
        for name in names:
            if name == "sqlite":
                envs.append(Env("sqlite", tmp))
            elif name == "postgresql":
                pg = PostgresServer()
                pg.start()
                log(f"postgresql server on port {pg.port}")
                envs.append(Env("postgresql", tmp, pg))
            else:
                raise SystemExit(f"unknown backend {name!r}")
        yield envs
    finally:
        if pg is not None:
            pg.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default="sqlite,postgresql")
    p.add_argument("--only", default="burst,steady,scale,execburst,ratio",
                   help="workloads to run (burst, steady, scale, execburst, catchup, "
                        "ratio)")
    p.add_argument("--bursts", default="2000,20000")
    p.add_argument("--repeat", type=int, default=3, help="runs of each small burst (median)")
    p.add_argument("--repeat-large", type=int, default=1,
                   help="runs of bursts of 10,000 or more (median)")
    p.add_argument("--steady-schedules", type=int, default=500)
    p.add_argument("--steady-seconds", type=int, default=120)
    p.add_argument("--steady-compare", metavar="TREE",
                   help="steady: also run PerfectSched with the perfectschedd of TREE, "
                        "alternated with this one --repeat times (APScheduler once)")
    p.add_argument("--scale", default="100000")
    p.add_argument("--exec-burst", type=int, default=2000,
                   help="execburst: occurrences of the exec job due at once")
    p.add_argument("--exec-compare", metavar="TREE",
                   help="execburst: also run the daemon of TREE (another checkout), the "
                        "bare pool and both daemons taking turns: before and after in one run")
    p.add_argument("--ratio-burst", type=int, default=20_000,
                   help="ratio: the python burst measured against the store alone")
    p.add_argument("--ratio-seconds", type=float, default=3.0,
                   help="ratio: seconds of each store-only measurement")
    p.add_argument("--ratio-compare", metavar="TREE",
                   help="ratio: also run the burst with the perfectschedd of TREE (another "
                        "checkout), alternated: before and after in one run")
    p.add_argument("--million", action="store_true", help="add the 1,000,000-schedule row")
    p.add_argument("--idle-seconds", type=float, default=30.0)
    p.add_argument("--aps-executor", default="thread:10", help="thread:N or process:N")
    p.add_argument("--aps-sqlite-pragmas", choices=["same", "default"], default="same",
                   help="same: APScheduler's SQLite also gets WAL + synchronous=NORMAL, as "
                        "PerfectSched uses; default: APScheduler as shipped (fsync per commit)")
    p.add_argument("--aps-add-limit", type=int, default=25_000,
                   help="scale: APScheduler add_job calls; rows beyond are bulk-loaded")
    p.add_argument("--quick", action="store_true", help="small sizes, for trying the bench")
    p.add_argument("--out", default=str(ROOT / "var" / "bench"))
    a = p.parse_args(argv)
    if a.quick:
        a.bursts, a.repeat, a.steady_schedules, a.steady_seconds = "200,2000", 1, 100, 60
        a.scale, a.idle_seconds = "10000", 10.0
    PEER_OPTS[:] = ["--executor", a.aps_executor, "--sqlite-pragmas", a.aps_sqlite_pragmas]
    only = set(a.only.split(","))
    bursts = [int(x) for x in a.bursts.split(",") if x]
    scales = [int(x) for x in a.scale.split(",") if x] + ([1_000_000] if a.million else [])
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    raw: dict[str, Any] = {"machine": machine(), "args": vars(a), "runs": []}
    started = time.time()
    rates: dict[tuple[str, str], float] = {}
    log(f"machine: {raw['machine']}")
    tmp = Path(tempfile.mkdtemp(prefix="perfectsched-bench-"))
    try:
        with backends(a.backends.split(","), tmp) as envs:
            for env in envs:
                res: dict[str, Any] = {}
                results[env.name] = res
                if "burst" in only:
                    for n in bursts:
                        reps = a.repeat if n < 10_000 else a.repeat_large
                        runs: dict[str, list[dict[str, Any]]] = {"perfectsched": [],
                                                                 "apscheduler": []}
                        for r in range(reps):
                            log(f"{env.name}: burst {n} run {r + 1}/{reps}: perfectsched")
                            runs["perfectsched"].append(run_burst(
                                "perfectsched", lambda lead, n=n, e=env: burst_ps(e, n, tmp, lead),
                                n, lead_for(rates, env.name, "perfectsched", n)))
                            log(f"  {_brief(runs['perfectsched'][-1])}")
                            _note_rate(rates, env.name, "perfectsched", runs["perfectsched"][-1])
                            log(f"{env.name}: burst {n} run {r + 1}/{reps}: apscheduler")
                            runs["apscheduler"].append(run_burst(
                                "apscheduler",
                                lambda lead, n=n, e=env: burst_aps(e, n, tmp, lead),
                                n, lead_for(rates, env.name, "apscheduler", n)))
                            log(f"  {_brief(runs['apscheduler'][-1])}")
                            _note_rate(rates, env.name, "apscheduler", runs["apscheduler"][-1])
                        raw["runs"].append({"backend": env.name, "workload": f"burst {n}",
                                            **runs})
                        res[f"burst {n:,}"] = {s: _median_dict(v) for s, v in runs.items()}
                if "steady" in only:
                    n, w = a.steady_schedules, a.steady_seconds
                    label = f"steady {n}/min, {w}s"
                    if a.steady_compare:
                        pairs: dict[str, list[dict[str, Any]]] = {"this": [], "other": []}
                        for r in range(a.repeat):
                            for which, pp in (("this", None), ("other", a.steady_compare)):
                                log(f"{env.name}: {label} run {r + 1}/{a.repeat}: {which}")
                                pairs[which].append(steady_ps(env, n, w, tmp, pythonpath=pp))
                                log(f"  {pairs[which][-1]}")
                        raw["runs"].append({"backend": env.name,
                                            "workload": f"{label} vs {a.steady_compare}",
                                            **pairs})
                        for which, v in pairs.items():
                            log(f"  {which}: median {_median_dict(v)}")
                    log(f"{env.name}: {label}: perfectsched")
                    ps = steady_ps(env, n, w, tmp)
                    log(f"  {ps}")
                    log(f"{env.name}: {label}: apscheduler")
                    ap = steady_aps(env, n, w, tmp)
                    log(f"  {ap}")
                    res[label] = {"perfectsched": ps, "apscheduler": ap}
                    raw["runs"].append({"backend": env.name, "workload": label,
                                        "perfectsched": [ps], "apscheduler": [ap]})
                if "execburst" in only:
                    import execburst

                    log(f"{env.name}: exec burst {a.exec_burst}")
                    ex = execburst.run(PS, env, a.exec_burst, tmp, a.repeat, log,
                                       a.exec_compare)
                    raw["runs"].append({"backend": env.name,
                                        "workload": f"exec burst {a.exec_burst}", **ex})
                if "ratio" in only:
                    import ratio

                    n = a.ratio_burst
                    log(f"{env.name}: python burst {n} vs the store alone")

                    def one_burst(pythonpath: str | None, n: int = n, e: Env = env
                                  ) -> dict[str, Any]:
                        r = run_burst("perfectsched", lambda lead: burst_ps(
                            e, n, tmp, lead, pythonpath=pythonpath), n,
                            lead_for(rates, e.name, "perfectsched", n))
                        log(f"  {'' if pythonpath is None else pythonpath + ': '}{_brief(r)}")
                        _note_rate(rates, e.name, "perfectsched", r)
                        return r

                    rt = ratio.run(one_burst, env, a.repeat, a.ratio_seconds, a.ratio_compare,
                                   log)
                    raw["runs"].append({"backend": env.name, "workload": f"ratio {n}", **rt})
                if "catchup" in only:
                    import catchup

                    log(f"{env.name}: catch-up")
                    cu = catchup.run(env.fresh_url("catchup"), tmp, log)
                    raw["runs"].append({"backend": env.name, "workload": "catch-up", **cu})
                if "scale" in only:
                    for n in scales:
                        label = f"scale {n:,}"
                        log(f"{env.name}: {label}: perfectsched")
                        ps = scale_ps(env, n, a.idle_seconds, tmp)
                        log(f"  {ps}")
                        log(f"{env.name}: {label}: apscheduler")
                        ap = scale_aps(env, n, a.idle_seconds, tmp, a.aps_add_limit)
                        log(f"  {ap}")
                        res[label] = {"perfectsched": ps, "apscheduler": ap}
                        raw["runs"].append({"backend": env.name, "workload": label,
                                            "perfectsched": [ps], "apscheduler": [ap]})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    raw["results"] = results
    raw["wall_seconds"] = time.time() - started
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    text = table(results)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"results-{stamp}.json").write_text(json.dumps(raw, indent=1, default=str))
    (out_dir / f"results-{stamp}.md").write_text(
        f"Machine: {raw['machine']}\n\n{text}\n")
    print(textwrap.dedent(f"""
        Machine: {raw['machine']}
        Wall time: {raw['wall_seconds'] / 60:.1f} min; raw data in {out_dir}/results-{stamp}.json
        """))
    print(text)
    return 0


def lead_for(rates: dict[tuple[str, str], float], backend: str, system: str, n: int) -> float:
    """Seconds between now and T: process start + registration of n jobs, with margin."""
    rate = rates.get((backend, system), 10_000.0 if system == "perfectsched" else 300.0)
    return 3 + 1.3 * n / rate


def _note_rate(rates: dict[tuple[str, str], float], backend: str, system: str,
               r: dict[str, Any]) -> None:
    if r.get("register_s", 0) > 0.05:
        rates[(backend, system)] = r["n"] / r["register_s"]


def _brief(r: dict[str, Any]) -> str:
    return (f"fired {r['fired']}/{r['n']} at {r['fires_per_s']:,.0f}/s, lateness p50 "
            f"{r['late_p50_ms']:.0f} ms p99 {r['late_p99_ms']:.0f} ms max "
            f"{r['late_max_ms']:.0f} ms (registration {r['register_s']:.1f}s)")


def _median_dict(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in runs[0].items():
        vals = [r.get(k) for r in runs]
        if all(isinstance(x, int | float) and not isinstance(x, bool) for x in vals):
            out[k] = median([float(x) for x in vals if x is not None])
        else:
            out[k] = v
    out["runs"] = len(runs)
    return out


if __name__ == "__main__":
    sys.exit(main())
