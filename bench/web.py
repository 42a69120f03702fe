"""What the HTTP listener costs and how fast its pages are (docs/performance.md, "HTTP").

    .venv/bin/python bench/web.py                  # 100,000 schedules, SQLite
    .venv/bin/python bench/web.py --schedules 1000000 --url postgresql://...

Prints, for a real daemon (2 workers, a python route) on a database of N daily
schedules (none due during the run):
- PSS: the summed PSS of the daemon's processes, idle, with `http_listen: off` and with
  the listener on after it answered 200 API requests and console pages (what the
  listener adds);
- server time of a page of 100 schedules (GET /api/v1/schedules?limit=100&after=K at
  random keys K, and the console's /schedules?after=K), of GET /api/v1/status and of
  the console's overview: p50 and p99 over --requests requests, measured as the time
  from the request's last byte to the answer's first on a kept-alive loopback
  connection (the network is not in it).
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).parent))
from run import children, pct, pss_kib  # noqa: E402 - bench/run.py's helpers

from perfectschedd.store.sql import Store  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
APP = ("from perfectschedd import Application\n"
       "class Tick(Application):\n    def run(self):\n        pass\n")


def fill(url: str, n: int) -> list[str]:
    from perfectschedd.config import load
    from perfectschedd.schedules.collection import ScheduleCollection

    sc = ScheduleCollection(load({"type": "rdb_compat", "url": url}))
    keys = [f"bench/{i:08d}" for i in range(n)]
    now = time.time()
    for start in range(0, n, 5000):
        sc.add_many([{"key": k, "type": "tick", "cron": f"{i % 60} {i % 24} * * *",
                      "now": now, "creator": 0}
                     for i, k in enumerate(keys[start:start + 5000], start)])
    sc.close()
    return keys


def daemon(tmp: Path, url: str, listen: str) -> subprocess.Popen[bytes]:
    (tmp / "mods").mkdir(exist_ok=True)
    (tmp / "mods" / "benchjobs.py").write_text(APP)
    config = {"type": "rdb_compat", "url": url, "workers": 2, "poll_interval": 1.0,
              "control_socket": str(tmp / "ctl.sock"), "http_listen": listen,
              "routes": [{"type": "tick", "python": "benchjobs:Tick", "user": "root"}]}
    (tmp / "cfg.yml").write_text(yaml.safe_dump(config))
    proc = subprocess.Popen([sys.executable, "-m", "perfectschedd", "-c", str(tmp / "cfg.yml"),
                             "-I", str(tmp / "mods")], stdout=subprocess.DEVNULL,
                            stderr=(tmp / "log").open("ab"), start_new_session=True)
    deadline = time.monotonic() + 120
    while not (tmp / "ctl.sock").exists():
        if time.monotonic() > deadline or proc.poll() is not None:
            raise SystemExit(f"the daemon did not start: {(tmp / 'log').read_text()[-2000:]}")
        time.sleep(0.2)
    time.sleep(3)  # the workers and the first status reading
    return proc


def summed_pss(proc: subprocess.Popen[bytes]) -> float:
    pids = [proc.pid, *children(proc.pid)]
    return sum(pss_kib(p) for p in pids) / 1024


def timed(conn: http.client.HTTPConnection, path: str, headers: dict[str, str]) -> float:
    start = time.perf_counter()
    conn.request("GET", path, headers=headers)
    response = conn.getresponse()
    first = time.perf_counter()
    body = response.read()
    if response.status != 200:
        raise SystemExit(f"{path}: {response.status} {body[:300]!r}")
    return (first - start) * 1000


def session_cookie(port: int, token: str) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", "/login")
    r = conn.getresponse()
    page = r.read().decode()
    pre = r.headers["Set-Cookie"].split(";")[0]
    csrf = re.search(r'name="csrf" value="([^"]+)"', page).group(1)  # type: ignore[union-attr]
    conn.request("POST", "/login", body=urllib.parse.urlencode({"csrf": csrf, "token": token}),
                 headers={"Content-Type": "application/x-www-form-urlencoded", "Cookie": pre})
    r = conn.getresponse()
    r.read()
    return next(c.split(";")[0] for c in r.headers.get_all("Set-Cookie")
                if c.startswith("perfectsched_session="))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedules", type=int, default=100_000)
    parser.add_argument("--url", help="a database URL (default: a new SQLite file)")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--port", type=int, default=19939)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-web-") as tmp_name:
        tmp = Path(tmp_name)
        url = args.url or f"sqlite:///{tmp}/bench.db"
        t0 = time.monotonic()
        keys = fill(url, args.schedules)
        print(f"{args.schedules:,} schedules on {url.split(':')[0]} "
              f"({time.monotonic() - t0:.0f} s to add)")
        store = Store(url, "perfectsched", 300)
        _, token = store.add_token(f"bench{int(time.time())}", "admin", "root", None,
                                   time.time())
        store.close()

        off = daemon(tmp / "off", url, "off") if (tmp / "off").mkdir() is None else None
        assert off is not None
        time.sleep(5)
        pss_off = statistics.median(summed_pss(off) for _ in range(5))
        off.terminate()
        off.wait(60)

        (tmp / "on").mkdir()
        on = daemon(tmp / "on", url, f"127.0.0.1:{args.port}")
        try:
            auth = {"Authorization": f"Bearer {token}"}
            conn = http.client.HTTPConnection("127.0.0.1", args.port, timeout=60)
            cookie = {"Cookie": session_cookie(args.port, token)}
            results: dict[str, list[float]] = {}
            for name, path, headers in (
                    ("api page of 100", "/api/v1/schedules?limit=100&after={k}", auth),
                    ("api status", "/api/v1/status", auth),
                    ("console page of 100", "/schedules?limit=100&after={k}", cookie),
                    ("console overview", "/", cookie)):
                times = []
                for _ in range(args.requests):
                    k = urllib.parse.quote(random.choice(keys), safe="")
                    times.append(timed(conn, path.format(k=k), headers))
                results[name] = times
            time.sleep(2)
            pss_on = statistics.median(summed_pss(on) for _ in range(5))
        finally:
            on.terminate()
            on.wait(60)
        print(f"PSS, daemon idle: {pss_off:.1f} MiB with http_listen off, {pss_on:.1f} MiB "
              f"with the listener after {4 * args.requests} requests "
              f"(+{pss_on - pss_off:.1f} MiB)")
        for name, times in results.items():
            print(f"{name:22s} p50 {pct(times, 50):7.1f} ms   p99 {pct(times, 99):7.1f} ms")
        print(json.dumps({"schedules": args.schedules, "pss_off_mib": round(pss_off, 1),
                          "pss_on_mib": round(pss_on, 1),
                          **{k: {"p50_ms": round(pct(v, 50), 2), "p99_ms": round(pct(v, 99), 2)}
                             for k, v in results.items()}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
