"""A noisy job costs the daemon bounded memory and log (issue 38, "Bounded noise"): 150 MB
of output on stdout or stderr, while the daemon's log is a pipe nobody reads (a stalled
journald or terminal), leave the worker's RSS within 64 MiB of what it was when the run
started; the log gets at most log_output_limit of it and one line saying what was cut;
history keeps the output's tail as ever.  Records a stalled log cannot take are dropped,
counted in /metrics and said once it drains."""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import YEARLY, Daemon, wait_until
from scrape import scrape, value

OUTPUT_BYTES = 150_000_000
LINE = 100  # bytes a line, its newline included
RSS_ROOM = 64 << 20
LOG_LIMIT = 65536  # log_output_limit's default
OUTPUT_LIMIT = 512


def rss(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of a process, in bytes: its resident memory now and at its peak."""
    fields = dict(line.split(":", 1) for line in
                  Path(f"/proc/{pid}/status").read_text().splitlines())
    return (int(fields["VmRSS"].split()[0]) << 10, int(fields["VmHWM"].split()[0]) << 10)


class StalledLog:
    """The daemon's `log:` as a FIFO whose reader reads nothing until drain(): once its
    pipe is full, every write of the daemon's log writers blocks."""

    def __init__(self, path: Path) -> None:
        os.mkfifo(path)
        self.path = path
        # Opened before the daemon: its open for writing would wait for a reader.
        self.fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        self.text = b""

    def drain(self, until: bytes, timeout: float = 30) -> str:
        """Read what the daemon wrote until `until` came; all of it so far."""
        def more() -> bool:
            while True:
                try:
                    chunk = os.read(self.fd, 1 << 20)
                except OSError as exc:
                    if exc.errno != errno.EAGAIN:
                        raise
                    break
                if not chunk:
                    break
                self.text += chunk
            return until in self.text
        wait_until(more, timeout, what=f"{until!r} in the log")
        return self.text.decode(errors="replace")

    def close(self) -> None:
        os.close(self.fd)


def history(d: Daemon) -> list[dict[str, Any]]:
    """The runs of `flood`; none while the daemon does not answer (0.2.0 under a stalled
    log did not: the RSS check in between must still be made)."""
    try:
        res = d.ctl("--json", "history", "flood", check=False, timeout=5)
    except subprocess.TimeoutExpired:
        return []
    return list(json.loads(res.stdout)) if res.returncode == 0 else []


def script(pid_file: Path, body: str) -> list[str]:
    # The job's parent is the worker that runs it (it is forked by the worker itself).
    # It waits for the test's go, so that the worker's RSS is read before the flood.
    return ["/bin/sh", "-c", f"echo $PPID > {pid_file}.tmp && mv {pid_file}.tmp {pid_file}; "
            f"while [ ! -e {pid_file}.go ]; do sleep 0.05; done; {body}", "sh"]


def start(daemon_factory: Any, tmp_path: Path, body: str, **config: Any
          ) -> tuple[Daemon, StalledLog, Path]:
    log = StalledLog(tmp_path / "log.fifo")
    pid_file = tmp_path / "worker.pid"
    d: Daemon = daemon_factory({
        "routes": [{"type": "noisy", "exec": script(pid_file, body), "user": "root"}],
        "workers": 1,
        "worker_timeout": 60,
        "poll_interval": 0.2, "log": str(log.path), **config}).start(timeout=90)
    d.ctl("add", "flood", "noisy", YEARLY, "--at", "0", "--max-attempts", "1")
    wait_until(pid_file.exists, 15, what="the job's start")
    return d, log, pid_file


@pytest.mark.parametrize("fd", [1, 2], ids=["stdout", "stderr"])
def test_150_mb_of_output_leave_the_worker_rss_and_the_log_bounded(
        daemon_factory: Any, tmp_path: Path, fd: int) -> None:
    d, log, pid_file = start(
        daemon_factory, tmp_path,
        f"yes {'x' * (LINE - 1)} | head -c {OUTPUT_BYTES} >&{fd}; echo done >&{fd}",
        output_limit=OUTPUT_LIMIT)
    worker = int(pid_file.read_text())
    assert worker in d.children()
    start_rss, _ = rss(worker)
    (pid_file.parent / f"{pid_file.name}.go").touch()

    peak = start_rss
    deadline = time.monotonic() + 120
    while not (runs := history(d)):
        peak = max(peak, rss(worker)[0])
        assert peak - start_rss <= RSS_ROOM, (start_rss, peak)
        assert time.monotonic() < deadline, "the noisy run did not end in 120 s"
        time.sleep(0.05)
    now, hwm = rss(worker)
    # The high-water mark covers the moments between samples too.
    assert max(peak, now, hwm) - start_rss <= RSS_ROOM, (start_rss, peak, now, hwm)

    (run,) = runs
    assert (run["outcome"], run["exit_code"]) == ("success", 0)
    total = OUTPUT_BYTES + len("done\n")
    mark, tail = run["output"].split("\n", 1)
    assert mark == f"[... {total - len(tail.encode())} bytes cut]"
    assert tail.endswith("x" * (LINE - 1) + "\ndone\n")
    assert len(run["output"].encode()) <= OUTPUT_LIMIT

    # The log: the first lines of the output up to the cap, then one line saying what was
    # not logged, and the run's end (and the daemon's own lines since it started).
    logged = log.drain(b"end key=flood")
    log.close()
    assert len(logged.encode()) <= 2 * LOG_LIMIT + 16384, len(logged.encode())
    assert "dropped" not in logged  # the cap kept the queue short: nothing was dropped
    output_lines = [line for line in logged.splitlines() if line.endswith(": " + "x" * (LINE - 1))]
    assert LOG_LIMIT // LINE - 1 <= len(output_lines) <= LOG_LIMIT // LINE
    cut = re.search(r"(WARNING|INFO) worker-0\[\d+\]: flood: (\d+) bytes \((\d+) lines\) "
                    rf"of output not logged \(log_output_limit {LOG_LIMIT}\)", logged)
    assert cut is not None, logged[-2000:]
    assert int(cut.group(2)) == total - len(output_lines) * LINE
    assert int(cut.group(3)) == total // LINE + 1 - len(output_lines)
    assert logged.index(cut.group(0)) < logged.index("end key=flood")
    assert not any(line.endswith(": done") for line in logged.splitlines())
    assert os.path.exists(f"/proc/{worker}")  # the same worker, alive


def test_records_a_stalled_log_cannot_take_are_dropped_counted_and_said(
        daemon_factory: Any, tmp_path: Path) -> None:
    """With the cap above the output (20,000 lines to log), a worker whose log is stalled
    queues QUEUE_MAX records and drops the rest: /metrics counts them (summed over the
    processes), and the worker says how many once its log drains."""
    lines = 30_000
    d, log, pid_file = start(daemon_factory, tmp_path,
                             f"yes {'y' * (LINE - 1)} | head -n {lines}",
                             log_output_limit=10 * lines * LINE)
    (pid_file.parent / f"{pid_file.name}.go").touch()
    wait_until(lambda: d.ctl_json("history", "flood"), 60, what="the run's end")

    def dropped() -> float:
        return value(scrape(d.metrics_port)[1], "perfectsched_log_records_dropped_total") \
            or 0.0
    count = wait_until(dropped, 20, what="the drops counted in /metrics")
    assert count >= lines - 10_000 - 1000, count
    logged = log.drain(b"record(s) dropped")

    def said() -> list[int]:
        return [int(n) for n in re.findall(
            r"worker-0\[\d+\]: log: (\d+) record\(s\) dropped", log.drain(b""))]
    # Said once the worker's queue drained: what it dropped, as /metrics counts it.
    wait_until(lambda: sum(said()) == dropped(), 20, what="the drops said in the log")
    assert sum(said()) >= count
    logged = log.drain(b"")
    kept = sum(1 for line in logged.splitlines() if line.endswith(": " + "y" * (LINE - 1)))
    assert kept + sum(said()) >= lines  # every line logged, or counted as dropped
    log.close()
