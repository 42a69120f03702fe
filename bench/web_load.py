"""Do 100 API clients polling status and lists slow the scheduler?  (docs/performance.md,
"HTTP"; the target: neither the burst's fires/s nor the steady lateness p99 moves by
more than 10 %.)

    .venv/bin/python bench/web_load.py [--clients 100] [--burst 2000] [--steady-seconds 60]

Same run, same machine: bench/run.py's burst (N occurrences due at one instant) and
steady (500 schedules firing every minute) workloads on a SQLite file, each once without
clients and once with --clients threads that each poll GET /api/v1/status and GET
/api/v1/schedules?limit=100 in turn on a kept-alive connection, each every --interval
seconds (a dashboard's refresh; 0: as fast as answered).
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from run import (  # noqa: E402 - bench/run.py's workloads
    PS,
    Env,
    FireLog,
    burst_stats,
    steady_requests,
    steady_stats,
)

from perfectschedd.store.sql import Store  # noqa: E402


@contextmanager
def pollers(ps: PS, clients: int, interval: float) -> Iterator[list[int]]:
    """`clients` threads polling ps's API every `interval` seconds (0: as fast as it
    answers) until the block ends; yields the counts."""
    counts = [0] * clients
    if clients == 0:
        yield counts
        return
    store = Store(ps.url, "perfectsched", 300)
    _, token = store.add_token(f"poll{time.monotonic_ns()}", "viewer", "root", None,
                               time.time())
    store.close()
    port = int(ps.config["metrics_listen"].rsplit(":", 1)[1])
    stop = threading.Event()

    def poll(i: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        paths = ("/api/v1/status", "/api/v1/schedules?limit=100")
        next_at = time.monotonic() + interval * i / clients  # spread over the interval
        while not stop.wait(max(0.0, next_at - time.monotonic())):
            conn.request("GET", paths[counts[i] % 2],
                         headers={"Authorization": f"Bearer {token}"})
            response = conn.getresponse()
            response.read()
            counts[i] += 1
            next_at += interval

    threads = [threading.Thread(target=poll, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    try:
        yield counts
    finally:
        stop.set()
        for t in threads:
            t.join(30)


def burst(env: Env, n: int, clients: int, interval: float, tmp: Path) -> dict[str, Any]:
    url = env.fresh_url(f"burst{clients}")
    ps = PS(url, tmp / f"burst-{clients}")
    try:
        ps.start()
        with pollers(ps, clients, interval) as counts:
            time.sleep(2 if clients else 0)  # the clients at full speed first
            due = float(math.ceil(time.time() + 8))
            reg = ps.add_many([{"key": f"b{i}", "type": "bench", "cron": "0 0 1 1 *",
                                "at": int(due)} for i in range(n)])
            fl = FireLog(ps.firedir)
            fl.wait_count(n, timeout=max(120.0, n / 50))
            stats = burst_stats(fl.fires, n, due, reg)
            stats["api_requests"] = sum(counts)
        return stats
    finally:
        ps.stop()
        env.drop(url)


def steady(env: Env, n: int, window: int, clients: int, interval: float, tmp: Path
           ) -> dict[str, Any]:
    url = env.fresh_url(f"steady{clients}")
    ps = PS(url, tmp / f"steady-{clients}")
    try:
        ps.start()
        with pollers(ps, clients, interval) as counts:
            t0 = int(time.time()) + 5
            ps.add_many(steady_requests(n, t0))
            time.sleep(max(0.0, t0 + window + 10 - time.time()))
            fl = FireLog(ps.firedir)
            fl.poll()
            stats = steady_stats(fl.fires, n, t0, window, t0 + window + 10)
            stats["api_requests"] = sum(counts)
        return stats
    finally:
        ps.stop()
        env.drop(url)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=100)
    p.add_argument("--interval", type=float, default=1.0,
                   help="seconds between one client's requests (0: as fast as answered)")
    p.add_argument("--burst", type=int, default=2000)
    p.add_argument("--steady-schedules", type=int, default=500)
    p.add_argument("--steady-seconds", type=int, default=60)
    args = p.parse_args()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-webload-") as tmp_name:
        tmp = Path(tmp_name)
        env = Env("sqlite", tmp)
        for clients in (0, args.clients):
            results[f"burst {clients}"] = b = burst(env, args.burst, clients, args.interval,
                                                    tmp)
            print(f"burst {args.burst}, {clients:3d} API clients: "
                  f"{b['fires_per_s']:8.0f} fires/s, "
                  f"lateness p99 {b['late_p99_ms']:.0f} ms, "
                  f"{b['api_requests']} API answers", flush=True)
        for clients in (0, args.clients):
            results[f"steady {clients}"] = s = steady(env, args.steady_schedules,
                                                      args.steady_seconds, clients,
                                                      args.interval, tmp)
            print(f"steady {args.steady_schedules}/min, {clients:3d} API clients: "
                  f"lateness p50 {s['late_p50_ms']:.0f} ms, p99 {s['late_p99_ms']:.0f} ms, "
                  f"missed {s.get('missed')}, {s['api_requests']} API answers", flush=True)
    print(json.dumps(results, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
