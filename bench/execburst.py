"""Exec-route burst: PerfectSched's exec handler against a bare Python pool, same command.

N occurrences due at one instant T, routed to a tiny `bash -c` job that reads its stdin
(the data) and appends one line (its key and the time) to a file; then the same command
run N times by a ThreadPoolExecutor of 16 threads calling subprocess.run (what a script
without a scheduler would do).  Runs/s = N / (last line's time - start), for each.  The
ratio says what binding each job to its lease costs (a process group, a run id, three run
events to the master, a supervised pipe loop) next to spawning it bare.

The two sides run under the same conditions: the pool is a process of its own session,
as the daemon is, and each of its commands gets a session of its own, as each exec run
does (start_new_session).  With the kernel's autogroups (sched_autogroup_enabled, the
default of most distributions) each session is scheduled as one group: commands of
their own sessions take a larger share of a machine loaded by others than commands in
the pool's own session, which made the daemon look faster than the bare pool (ratios
above 1) whenever other work ran.  The two sides also take turns going first, so that
a load that rises or falls during a round weighs on both alike.

Besides runs/s it prints the CPU each side spent per run (user + system, the commands
included; for the daemon its master, its workers and, on PostgreSQL, the server's
processes), from the instant T to the last line.  On a machine shared with other work
the runs/s swing with the load, the CPU per run much less: its ratio (bare / daemon)
is what the runs/s ratio would be on a machine of our own, where both are CPU-bound.
It also prints the CPU per run without the commands (the daemon's processes alone, the
pool's process alone): the part each side's own code adds, which the commands' share,
swollen on a loaded machine, does not blur.

    .venv-bench/bin/python bench/run.py --only execburst --backends sqlite
    .venv-bench/bin/python bench/run.py --only execburst --exec-compare /tmp/base-tree

`--exec-compare TREE` runs, in each round, the daemon of TREE (another checkout, put
first on PYTHONPATH) too, against the same bare-pool run, the three taking turns going
first: before and after in one run.
"""

from __future__ import annotations

import json
import math
import os
import pwd
import resource
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

JOB = 'read -r line; echo "$1 $(date +%s.%N)" >> "$0"'
POOL = 16


def argv(log: Path) -> list[str]:
    return ["bash", "-c", JOB, str(log)]


def rate(log: Path, n: int, start: float, timeout: float) -> float:
    deadline = time.monotonic() + timeout
    lines: list[str] = []
    while time.monotonic() < deadline:
        try:
            lines = log.read_text().splitlines()
        except FileNotFoundError:
            lines = []
        if len(lines) >= n:
            break
        time.sleep(0.05)
    if len(lines) < n:
        return math.nan
    last = max(float(line.split()[1]) for line in lines)
    return n / (last - start)


CLK_TCK = os.sysconf("SC_CLK_TCK")


def _cpu(pids: list[int]) -> dict[int, tuple[float, float]]:
    """utime + stime of each process, with that of its children it reaped (the jobs),
    and without."""
    out = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[pid] = (sum(int(x) for x in fields[11:15]) / CLK_TCK,
                    sum(int(x) for x in fields[11:13]) / CLK_TCK)
    return out


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _pool(n: int, log: Path) -> dict[str, float]:
    """The bare pool itself (in a process of its own session): its start time and the
    CPU seconds it and its commands used."""
    cmd = argv(log)
    before = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    start = time.time()
    with ThreadPoolExecutor(POOL) as pool:
        list(pool.map(lambda i: subprocess.run([*cmd, f"b{i}"], input=b"{}\n", check=True,
                                               start_new_session=True), range(n)))
    after = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    used = [a.ru_utime + a.ru_stime - b.ru_utime - b.ru_stime
            for a, b in zip(after, before, strict=True)]
    return {"start": start, "cpu": sum(used), "own": used[0]}


def bare_pool(n: int, work: Path) -> tuple[float, float, float]:
    """Runs/s and CPU seconds per run of the bare pool: with its commands, and its own."""
    log = work / "bare.log"
    log.unlink(missing_ok=True)
    out = subprocess.run([sys.executable, __file__, "--pool", str(n), str(log)],
                         stdout=subprocess.PIPE, check=True, start_new_session=True)
    got = json.loads(out.stdout)
    return rate(log, n, got["start"], 60), got["cpu"] / n, got["own"] / n


def perfectsched(ps_class: Any, url: str, n: int, work: Path, lead: float,
                 server: int | None = None, pythonpath: str | None = None
                 ) -> tuple[float, float, float]:
    """Runs/s and CPU seconds per run of the daemon (and of `server`, the database
    server's postmaster, and its processes): with the commands, and without them (the
    daemon's own work); `pythonpath`: the perfectschedd package of another tree."""
    log = work / "ps.log"
    log.unlink(missing_ok=True)
    ps = ps_class(url, work / "ps", extra={"routes": [
        # user: a root daemon refuses a route without one (older trees take it too).
        {"type": "bench", "exec": argv(log),
         "user": pwd.getpwuid(os.geteuid()).pw_name}]}, pythonpath=pythonpath)
    try:
        ps.start()
        due = float(math.ceil(time.time() + lead))
        ps.add_many([{"key": f"e{i}", "type": "bench", "cron": "0 0 1 1 *", "at": int(due)}
                     for i in range(n)])
        if time.time() > due - 0.3:
            raise RuntimeError("registration overran T; raise the lead")

        def pids() -> list[int]:
            return ps.pids() + ([server, *_children(server)] if server else [])

        time.sleep(max(0.0, due - 0.2 - time.time()))
        before = _cpu(pids())
        runs = rate(log, n, due, max(120.0, n / 20))
        after = _cpu(pids())
        # A server process started during the burst counts whole; one that ended, not.
        cpu = sum(t[0] - before.get(pid, (0.0, 0.0))[0] for pid, t in after.items())
        own = sum(t[1] - before.get(pid, (0.0, 0.0))[1] for pid, t in after.items())
        return runs, cpu / n, own / n
    finally:
        ps.stop()


def run(ps_class: Any, env: Any, n: int, tmp: Path, repeat: int, log: Any,
        compare: str | None = None) -> dict[str, Any]:
    """`repeat` rounds of the daemon against the bare pool.  With `compare` (another
    checkout's tree), each round also runs the daemon of that tree, against the same
    pool run: before and after in one run, the three taking turns going first."""
    sides = ["this"] if compare is None else ["this", "other"]
    rounds: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
    server = getattr(getattr(env.pg, "proc", None), "pid", None)
    for r in range(repeat):
        order: list[str | None] = [None, *sides]  # None: the bare pool
        shift = r % len(order)
        order = order[shift:] + order[:shift]
        got: dict[str | None, tuple[float, float, float]] = {}
        for side in order:
            work = tmp / f"execburst-{env.name}-{env.counter}-{side or 'bare'}"
            work.mkdir(parents=True, exist_ok=True)
            if side is None:
                got[side] = bare_pool(n, work)
                continue
            url = env.fresh_url(f"execburst{n}")
            try:
                got[side] = perfectsched(ps_class, url, n, work, lead=3 + n / 5000,
                                         server=server,
                                         pythonpath=compare if side == "other" else None)
            finally:
                env.drop(url)
        bare, bare_cpu, bare_own = got[None]
        for side in sides:
            ps, ps_cpu, ps_own = got[side]
            rounds[side].append({
                "perfectsched": ps, "bare_pool": bare, "ratio": ps / bare,
                "perfectsched_cpu_ms": 1000 * ps_cpu, "bare_pool_cpu_ms": 1000 * bare_cpu,
                "cpu_ratio": bare_cpu / ps_cpu, "perfectsched_own_ms": 1000 * ps_own,
                "bare_pool_own_ms": 1000 * bare_own})
            name = "" if compare is None else f"{compare if side == 'other' else 'this tree'}: "
            log(f"  exec burst {n} run {r + 1}/{repeat}: {name}perfectsched {ps:,.0f} runs/s, "
                f"bare pool of {POOL} {bare:,.0f} runs/s, ratio {ps / bare:.2f}; CPU per run "
                f"{1000 * ps_cpu:.2f} / {1000 * bare_cpu:.2f} ms, ratio {bare_cpu / ps_cpu:.2f}, "
                f"without the commands {1000 * ps_own:.2f} / {1000 * bare_own:.2f} ms "
                f"(load {os.getloadavg()[0]:.1f})")
    out: dict[str, Any] = {}
    for side, runs in rounds.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        rng = {k: (min(r[k] for r in runs), max(r[k] for r in runs)) for k in runs[0]}
        name = "" if compare is None else f"{compare if side == 'other' else 'this tree'}: "
        log(f"  exec burst {n} median: {name}perfectsched {med['perfectsched']:,.0f} runs/s, "
            f"bare {med['bare_pool']:,.0f} runs/s, ratio {med['ratio']:.2f} "
            f"(range {rng['ratio'][0]:.2f}-{rng['ratio'][1]:.2f}); CPU per run "
            f"{med['perfectsched_cpu_ms']:.2f} / {med['bare_pool_cpu_ms']:.2f} ms, ratio "
            f"{med['cpu_ratio']:.2f} (range {rng['cpu_ratio'][0]:.2f}-{rng['cpu_ratio'][1]:.2f}), "
            f"without the commands {med['perfectsched_own_ms']:.2f} / "
            f"{med['bare_pool_own_ms']:.2f} ms")
        out[side] = {"median": med, "range": rng, "runs": runs}
    return out["this"] if compare is None else out


if __name__ == "__main__":  # the bare pool's own process (bare_pool)
    if sys.argv[1:2] != ["--pool"] or len(sys.argv) != 4:
        raise SystemExit("usage: execburst.py --pool N LOG (run by bare_pool)")
    print(json.dumps(_pool(int(sys.argv[2]), Path(sys.argv[3]))))
