"""The file system of a SQLite database fills up (a 16 MB tmpfs), then gets space again."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from faultlib import (
    Cluster,
    add_catchup_schedules,
    analyse,
    expected_occurrences,
    now_boot,
    wait_until,
    workers,
)

pytestmark = pytest.mark.faults

FULL_FOR = 10.0


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 16 MB tmpfs (CI runs as root: a failure to mount is an error, not a skip)."""
    mnt = tmp_path / "smallfs"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m,mode=0755", "tmpfs",
                          str(mnt)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.fail(f"cannot mount a tmpfs for the disk-full test (needs root): "
                    f"{res.stderr.strip()}", pytrace=False)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _fill(path: Path) -> int:
    """Write zeros until ENOSPC; returns the bytes written."""
    written = 0
    chunk = b"\0" * 65536
    with open(path, "wb", buffering=0) as f:
        while True:
            try:
                n = f.write(chunk)
            except OSError:
                n = 0
            if not n:
                # the last partial block, byte by byte is too slow: try a small one
                try:
                    written += f.write(b"\0" * 512) or 0
                except OSError:
                    return written
                continue
            written += n


def test_sqlite_disk_full(small_fs: Path, cluster_factory: Callable[..., Cluster]) -> None:
    url = f"sqlite:///{small_fs / 'sched.db'}"
    c = cluster_factory(url, 1, {"workers": 2})
    with c.open() as sc:
        sc.init()
        first = add_catchup_schedules(sc, 150, 120)
    (node,) = c.start().nodes
    time.sleep(1.0)
    pids = sorted(workers(node))
    t0 = now_boot()
    filler = small_fs / "filler"
    written = _fill(filler)
    try:
        node.wait_notify(lambda m: "STATUS=" in m and "database unreachable" in m,
                         timeout=20, what="STATUS reporting the database")
        assert node.status()["database_ok"] is False
        time.sleep(max(0.0, FULL_FOR - (now_boot() - t0)))
        c.assert_all_alive()
        assert sorted(workers(node)) == pids, "workers were replaced while the disk was full"
        node.wait_log("full")  # the log names the cause
    finally:
        os.unlink(filler)
    t1 = now_boot()
    c.fault(t0, t1, f"disk full ({written} bytes of filler)")
    node.wait_notify(lambda m: "STATUS=" in m and "database unreachable" not in m,
                     timeout=30, what="STATUS without the database error",
                     after=len(node.messages()) - 1)
    wait_until(lambda: node.status()["database_ok"], 20, what="database_ok again")
    recovered = now_boot() - t1
    assert recovered < 10, f"resumed only {recovered:.1f}s after space came back"
    cutoff = int(time.time())
    c.wait_settled(cutoff, timeout=60)
    c.assert_all_alive()
    rep = analyse(c.read_log(), expected_occurrences(first, cutoff), c.faults, keys=first)
    print(f"\nfull for {t1 - t0:.1f}s, resumed after {recovered:.1f}s; {rep.summary()}")
    rep.assert_ok()
    c.assert_leases_expire()
    assert node.stop() == 0
