"""A rolling upgrade from release 0.1.0 and from 0.2.0 (SPEC "Upgrades": hosts of a previous
release and of this one share a database with every guarantee intact), on PostgreSQL.

Two hosts (node_name n0 and n1) run the old release (tests/old_release.py); n1 is upgraded (stopped
with SIGTERM, this tree's daemon started in its place), then n0.  Work flows all along:
schedules `* * * * *` started two hours ago catch up minute after minute (misfire all,
oldest first), each run 0.1-0.3 s, so occurrences are in flight at every switch; more
are added through each host's socket in each phase.  At the end every occurrence from
each schedule's start up to where it reached ran exactly once, successfully; while they
ran, `status` listed the hosts of both releases with their versions.

Each run appends its start and end to one log, in the format of the fault suite
(tests/faults/faultlib.py), whose analysis is reused: S|E key scheduled_time attempt
label pid ppid uptime, `label` saying which host and version ran it.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from daemon_harness import Daemon, wait_until
from dbservers import driver_url
from old_release import OldRelease
from test_upgrade_db import ctl_many

import perfectschedd
from perfectschedd.schedules import cron

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "faults"))
from faultlib import analyse, expected_occurrences, parse_log  # noqa: E402

TABLE = "perfectsched"
JOB = "job"
# 0.1-0.3 s (by pid), logging its start and end (O_APPEND: lines never interleave).
JOB_SCRIPT = r"""#!/bin/sh
log() {
    read up _ < /proc/uptime
    echo "$1 $PERFECTSCHED_KEY $PERFECTSCHED_SCHEDULED_TIME $PERFECTSCHED_ATTEMPT" \
         "$UPGRADE_LABEL $$ $PPID $up" >> "$UPGRADE_LOG"
}
log S
sleep "0.$(( $$ % 3 + 1 ))"
log E
"""
BEHIND = 7200  # schedules start two hours ago: 120 missed minutes each


@pytest.mark.parametrize("release", ["old_release", "release_0_2_0"])
def test_rolling_upgrade_loses_and_repeats_nothing(
        pg_url: str, release: str, request: pytest.FixtureRequest, daemon_factory: Any,
        tmp_path: Path) -> None:
    old: OldRelease = request.getfixturevalue(release)
    log_path = tmp_path / "executions.log"
    log_path.touch()
    script = tmp_path / "job.sh"
    script.write_text(JOB_SCRIPT)
    script.chmod(0o755)

    def host(node: str, version: str) -> Daemon:
        """A daemon of `version` standing for host `node` (one config per host)."""
        cfg = {"node_name": node, "workers": 2, "concurrency": 4, "alive_time": 10,
               "poll_interval": 0.5, "shutdown_timeout": 10, "history_limit": 1000,
               # A job sees its route's env:, never the daemon's environment.
               "routes": [{"type": JOB, "exec": ["/bin/sh", str(script)], "user": "root",
                           "env": {"UPGRADE_LOG": str(log_path),
                                   "UPGRADE_LABEL": f"{node}@{version}"}}]}
        programs = {} if version == perfectschedd.__version__ else {
            "command": old.daemon_command, "ctl_command": old.ctl_command}
        assert version in (perfectschedd.__version__, old.version)
        return daemon_factory(cfg, url=pg_url, **programs)

    started: dict[str, int] = {}  # key -> its -s (start)
    via: dict[str, str] = {}      # key -> the host@version whose socket added it

    def add(d: Daemon, label: str, n: int) -> None:
        """`n` schedules through `d`'s socket, with `d`'s perfectschedctl (one process)."""
        now = int(time.time())
        keys = [f"k{len(started) + i:02d}-{label.replace('@', '-')}" for i in range(n)]
        many = ctl_many(d.ctl_command, ["--socket", d.socket_path],
                        home=None if label.endswith(new_label) else old.path)
        many([["add", key, JOB, "* * * * *", "-s", str(now - BEHIND)] for key in keys])
        for key in keys:
            started[key], via[key] = now - BEHIND, label

    def ended() -> Counter[str]:
        """Runs ended so far, by host@version."""
        return Counter(r.node for r in parse_log(log_path.read_text()) if r.kind == "E")

    def work(labels: list[str], since: Counter[str], n: int = 8) -> None:
        """Wait until each of `labels` ended `n` runs more than `since`: what the phase is
        for (each host of each version works), instead of a fixed time."""
        wait_until(lambda: all(ended()[lb] >= since[lb] + n for lb in labels), timeout=30,
                   interval=0.1, what=f"{n} runs more by each of {labels}")

    def all_ran() -> None:
        """Every schedule ran at least once (asserted below, from the database)."""
        wait_until(lambda: set(via) <= {r.key for r in parse_log(log_path.read_text())
                                        if r.kind == "E"}, timeout=30, interval=0.1,
                   what="a run of every schedule")

    def in_flight(d: Daemon) -> None:
        """Wait until `d` is running jobs: a switch now stops work in progress."""
        wait_until(lambda: d.status()["running"], timeout=20, interval=0.1,
                   what=f"jobs running on {d.config['node_name']}")

    def hosts_listed(d: Daemon, want: dict[str, str], timeout: float = 12) -> Any:
        """What `status` says of the hosts (name: version), once it says `want` or after
        `timeout`; checked at the end, with the rest (needs this release's hosts table)."""
        deadline = time.monotonic() + timeout
        while True:
            status = d.status()
            if "hosts" not in status:
                return "status lists no hosts"
            got = {h["name"]: h["version"] for h in status["hosts"]}
            if got == want or time.monotonic() > deadline:
                return got
            time.sleep(0.5)

    def hosts_table() -> Any:
        engine = sa.create_engine(driver_url(pg_url))
        try:
            with engine.connect() as conn:
                return dict(conn.execute(sa.text(f"SELECT name, version FROM {TABLE}_hosts"))
                            .all())
        except sa.exc.ProgrammingError as exc:  # no such table
            return str(exc).splitlines()[0]
        finally:
            engine.dispose()

    def upgrade(i: int) -> Daemon:
        in_flight(hosts[i])
        assert hosts[i].stop() == 0, hosts[i].log()[-3000:]
        logs.append(hosts[i].log())
        hosts[i] = host(f"n{i}", perfectschedd.__version__).start()
        return hosts[i]

    t0 = time.monotonic()
    n0 = host("n0", old.version)
    assert "created table" in old.ctl("-c", str(n0.config_path), "init").stdout
    logs: list[str] = []
    new = perfectschedd.__version__
    old_label, new_label = f"@{old.version}", f"@{new}"
    # -- phase A: two hosts of the old release --------------------------------------------------
    hosts = [n0.start(wait_ready=False), host("n1", old.version).start(wait_ready=False)]
    for d in hosts:  # both start at once
        d.wait_notify(lambda m: "READY=1" in m, timeout=30, what="READY=1")
    add(hosts[0], "n0" + old_label, 6)
    add(hosts[1], "n1" + old_label, 6)
    work(["n0" + old_label, "n1" + old_label], Counter())
    # -- phase B: n1 runs this release, n0 still the old one --------------------------------
    upgrade(1)
    # Schema 4's table in use beside the old host (which never reads it).
    hosts[1].ctl("token", "add", "ci-read", "--role", "viewer")
    add(hosts[1], "n1" + new_label, 3)
    add(hosts[0], "n0" + old_label, 3)
    since = ended()
    mixed = {"n0": old.version, "n1": new}
    seen = {"B": hosts_listed(hosts[1], mixed)}
    work(["n1" + new_label, "n0" + old_label], since)
    # -- phase C: both run this release -----------------------------------------------------
    upgrade(0)
    add(hosts[0], "n0" + new_label, 3)
    add(hosts[1], "n1" + new_label, 3)
    since = ended()
    seen.update({f"C n{i}": hosts_listed(d, {"n0": new, "n1": new})
                 for i, d in enumerate(hosts)})
    seen["C table"] = hosts_table()
    work(["n0" + new_label, "n1" + new_label], since)
    all_ran()
    in_flight(hosts[0])
    for d in hosts:
        assert d.stop() == 0, d.log()[-3000:]
        logs.append(d.log())
    elapsed = time.monotonic() - t0

    # -- what ran ---------------------------------------------------------------------------
    runs = parse_log(log_path.read_text())
    with perfectschedd.open({"type": "rdb_compat", "url": pg_url}) as sc:
        reached = {s.key: s.next_time for s in sc.list()}
        history = {k: sc.store.history(k, 1000) for k in started}
    assert set(reached) == set(started), set(reached) ^ set(started)
    first = {k: cron.first_at_or_after("* * * * *", "UTC", s) for k, s in started.items()}
    # Every occurrence before the one each schedule is at now...
    expected: set[tuple[str, int]] = set()
    for key, t in first.items():
        expected |= expected_occurrences({key: t}, reached[key] - 1)
    rep = analyse(runs, expected, [], keys=started)
    print(f"\n{rep.summary()} in {elapsed:.0f}s")
    rep.assert_ok()
    assert not rep.duplicates, rep.duplicates[:10]  # nothing failed: exactly once
    # ...and none after it (a run whose end was not recorded would run again).
    beyond = sorted((r.key, r.scheduled_time) for r in runs
                    if r.scheduled_time >= reached.get(r.key, 0))
    assert not beyond, f"ran, but not recorded as done: {beyond[:5]}"

    # Work went on in every phase, on every host and version, through each switch.
    by_label = {r.node for r in runs if r.kind == "E"}
    assert by_label >= {f"n{i}{v}" for i in (0, 1) for v in (old_label, new_label)}, by_label
    for key, label in via.items():
        assert reached[key] > first[key], f"{key} (added through {label}) never ran"
    # SIGTERM lets running jobs end: every run that started ended.
    ends = Counter((r.key, r.scheduled_time, r.node, r.pid) for r in runs if r.kind == "E")
    starts = Counter((r.key, r.scheduled_time, r.node, r.pid) for r in runs if r.kind == "S")
    assert starts == ends, f"runs that never ended: {sorted(starts - ends)[:5]}"

    # History agrees: one successful row per occurrence, nothing else.
    for key, rows in history.items():
        got = sorted((r["scheduled_time"], r["outcome"]) for r in rows)
        want = sorted((t, "success") for k, t in expected if k == key)
        assert got == want, (key, [g for g in got if g not in want][:5],
                             [w for w in want if w not in got][:5])

    for text in logs:
        assert "Traceback" not in text, text[-3000:]

    # Each host of this release recorded itself with its version, and status listed the
    # hosts of both releases (this release's hosts table; 0.1.0 hosts, which record
    # nothing, by their work).  A clean stop removes a host's row: seen while they ran.
    assert seen == {"B": mixed, "C n0": {"n0": new, "n1": new}, "C n1": {"n0": new, "n1": new},
                    "C table": {"n0": new, "n1": new}}, seen
