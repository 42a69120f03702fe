"""perfectschedctl's start: process start to reply printed, against a running daemon.

    .venv/bin/python bench/client_start.py                          # this tree, 20 runs
    .venv/bin/python bench/client_start.py --tree ../old --tree .   # two builds in turn
    .venv/bin/python bench/client_start.py --python /usr/bin/python3  # Debian's python

One real perfectschedd of this tree on a fresh SQLite file holding --schedules
schedules.  Each run starts a client process the way the console script does (pip's and
Debian's /usr/bin/perfectschedctl: `from perfectschedctl.cli import main;
sys.exit(main())`) with PYTHONPATH=TREE, and times it from spawn to exit (its reply is
printed to a pipe): `list` over the socket, `--version` (no socket), and the bare
interpreter (`-c pass`) as the floor none of them can go under.  The modules' bytecode
is written, as pip and Debian install them (the first run of each command writes it and
is not counted).  Prints the median and p90 of --runs runs' wall time and their median
CPU time (user + system, which a busy machine disturbs less) per tree and round;
--rounds alternates the trees, so that a busy machine hurts each alike.  A venv with an
editable install (pip install -e) adds its path finder to every start, the tree's own
client included; Debian's python has none.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from daemon_harness import NotifyListener, start_plain_daemon  # noqa: E402

# What the console script runs (pip's wrapper minus its argv[0] rewrite).
SCRIPT = "import sys; from perfectschedctl.cli import main; sys.exit(main())"


def timed(argv: list[str], env: dict[str, str], cwd: str) -> tuple[float, float]:
    """(wall, CPU) seconds of one run: spawn to exit, and its user + system time (which
    other loads on the machine disturb less than the wall time)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    res = subprocess.run(argv, env=env, capture_output=True, cwd=cwd)
    took = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} -> {res.returncode}: {res.stderr.decode()}")
    return took, (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def start_daemon(d: Path, schedules: int) -> tuple[subprocess.Popen[bytes], NotifyListener,
                                                   str]:
    proc, notify, sock, env = start_plain_daemon(d, ROOT)
    for i in range(schedules):
        subprocess.run([sys.executable, "-m", "perfectschedctl", "--socket", sock, "add",
                        f"bench-{i}", "t", "0 0 1 1 *"], env=env, check=True,
                       stdout=subprocess.DEVNULL)
    return proc, notify, sock


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tree", action="append", default=[],
                   help="a checkout whose perfectschedctl to time (default: this one)")
    p.add_argument("--python", default=sys.executable,
                   help="the interpreter the clients run on (default: this one)")
    p.add_argument("--runs", type=int, default=20, help="runs of each command per round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--schedules", type=int, default=10, help="schedules `list` prints")
    ns = p.parse_args()
    trees = [Path(t).resolve() for t in ns.tree] or [ROOT]
    with tempfile.TemporaryDirectory(prefix="perfectsched-ctlstart-") as tmp:
        proc, notify, sock = start_daemon(Path(tmp), ns.schedules)
        try:
            # As installed (pip and Debian compile the modules): bytecode written by the
            # first, untimed run of each command and read by the others.
            base = {k: v for k, v in os.environ.items()
                    if not k.startswith("PERFECTSCHED_") and k != "PYTHONDONTWRITEBYTECODE"}
            commands = {"list": [ns.python, "-c", SCRIPT, "--socket", sock, "list"],
                        "--version": [ns.python, "-c", SCRIPT, "--version"],
                        "python -c pass": [ns.python, "-c", "pass"]}
            print(f"{'tree':36} {'round':>5} {'command':>15} {'median ms':>10} {'p90 ms':>8} "
                  f"{'CPU ms':>7}")
            for r in range(ns.rounds):
                for tree in trees:
                    env = {**base, "PYTHONPATH": str(tree)}
                    for name, argv in commands.items():
                        # cwd: not a checkout (`-c` puts it before PYTHONPATH).
                        runs = [timed(argv, env, tmp) for _ in range(ns.runs + 1)][1:]
                        wall = sorted(w for w, _ in runs)
                        cpu = statistics.median(c for _, c in runs)
                        print(f"{str(tree)[-36:]:36} {r + 1:>5} {name:>15} "
                              f"{statistics.median(wall) * 1000:10.1f} "
                              f"{wall[int(len(wall) * 0.9) - 1] * 1000:8.1f} "
                              f"{cpu * 1000:7.1f}", flush=True)
        finally:
            proc.terminate()
            proc.wait(30)
            notify.close()
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
