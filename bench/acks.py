"""Acknowledged writes over the control socket: add and delete rates and latency.

    .venv/bin/python bench/acks.py                        # this tree, SQLite, 500 of each
    .venv/bin/python bench/acks.py --tree ../old --tree . # two builds in turn, same run

A real perfectschedd of each tree (python -m perfectschedd with PYTHONPATH=TREE) on a
fresh SQLite file (or --url, an empty database); one client sends `add` requests one
after another over the socket (each waits for its reply, as perfectschedctl does), then
`delete`s them.  Prints requests/s and latency p50/p99 per tree and round; --rounds
alternates the trees so that a noisy machine hurts both alike.  Since 0.2.0 every
acknowledged write on SQLite is synced before its reply (docs/ha.md): this measures what
that costs.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from daemon_harness import start_plain_daemon  # noqa: E402


def request(path: str, cmd: str, args: dict[str, object]) -> dict[str, object]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(path)
        s.sendall(json.dumps({"cmd": cmd, "args": args}).encode() + b"\n")
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                raise RuntimeError("the daemon closed the connection")
            buf += chunk
    answer = json.loads(buf)
    if not answer.get("ok"):
        raise RuntimeError(f"{cmd}: {answer}")
    return dict(answer)


def one_round(tree: Path, n: int, url: str | None) -> dict[str, tuple[float, float, float]]:
    with tempfile.TemporaryDirectory(prefix="perfectsched-acks-") as tmp:
        d = Path(tmp)
        proc, notify, sock, _ = start_plain_daemon(d, tree, url)
        try:
            found: dict[str, tuple[float, float, float]] = {}
            for cmd in ("add", "delete"):
                took = []
                start = time.perf_counter()
                for i in range(n):
                    args: dict[str, object] = {"key": f"k{i}"}
                    if cmd == "add":
                        args.update(type="t", cron="0 0 1 1 *")
                    t0 = time.perf_counter()
                    request(sock, cmd, args)
                    took.append(time.perf_counter() - t0)
                elapsed = time.perf_counter() - start
                took.sort()
                found[cmd] = (n / elapsed, statistics.median(took) * 1000,
                              took[int(len(took) * 0.99) - 1] * 1000)
            return found
        finally:
            proc.terminate()
            proc.wait(30)
            notify.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tree", action="append", default=[],
                   help="a checkout whose perfectschedd to run (default: this one)")
    p.add_argument("-n", type=int, default=500, help="requests of each kind per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--url", help="an empty database (default: a fresh SQLite file)")
    ns = p.parse_args()
    trees = [Path(t).resolve() for t in ns.tree] or [ROOT]
    print(f"{'tree':40} {'round':>5} {'cmd':>6} {'req/s':>8} {'p50 ms':>7} {'p99 ms':>7}")
    for r in range(ns.rounds):
        for tree in trees:
            for cmd, (rate, p50, p99) in one_round(tree, ns.n, ns.url).items():
                print(f"{str(tree)[-40:]:40} {r + 1:>5} {cmd:>6} {rate:8.0f} {p50:7.2f} "
                      f"{p99:7.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
