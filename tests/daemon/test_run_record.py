"""Every run is recorded with what happened (issue #27, SPEC "Failures and notifications"),
against a real daemon on SQLite, PostgreSQL and MariaDB: exit status or signal, duration,
the output's tail (at most output_limit bytes, marked when cut), the exception of a python
run, timeouts and runs lost with their worker, as `history`, `history --json` and
`logs KEY [--attempt N]` show them; bad `logs` arguments refused, changing nothing."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import YEARLY, Daemon, lines, sh, wait_until

# Daemon-level: the PostgreSQL and MariaDB runs are make check's (test-slow).
pytestmark = pytest.mark.slow_on_servers

OUTPUT_LIMIT = 256

JOBS = '''\
from perfectschedd import Application


class Broken(Application):
    def run(self):
        self.load(self.task.data["path"])

    def load(self, path):
        raise FileNotFoundError(f"no such report: {path}\\nsecond line")
'''


def history(d: Daemon, key: str) -> list[dict[str, Any]]:
    return list(d.ctl_json("history", key))


def runs_of(d: Daemon, key: str, count: int) -> list[dict[str, Any]]:
    """The newest runs of `key` once it has `count` of them (newest first)."""
    return list(wait_until(lambda: h if len(h := history(d, key)) >= count else None,
                           timeout=15, what=f"{count} run(s) of {key} in history"))


def start(daemon_factory: Any, db_url: str, tmp_path: Path, routes: list[dict[str, Any]]
          ) -> Daemon:
    mods = tmp_path / "mods"
    mods.mkdir(exist_ok=True)
    (mods / "recordjobs.py").write_text(JOBS)
    return daemon_factory({"routes": routes, "output_limit": OUTPUT_LIMIT, "workers": 1,
                           "poll_interval": 0.2}, url=db_url,
                          extra_args=["-I", str(mods)]).start()


def test_exec_runs_record_status_duration_output_and_timeout(
        daemon_factory: Any, db_url: str, tmp_path: Path) -> None:
    d = start(daemon_factory, db_url, tmp_path, [
        sh("ok", "echo all good; sleep 0.3"),
        # 2000 lines of output (8893 bytes), then its last words on stderr.
        sh("fails", "seq 1 2000; echo 'disk full' >&2; exit 3"),
        sh("slow", "echo started; exec sleep 30", timeout=1),
    ])
    for key in ("ok", "fails", "slow"):
        d.ctl("add", key, key, YEARLY, "--at", "0", "--max-attempts", "1")

    (ok,) = runs_of(d, "ok", 1)
    assert (ok["outcome"], ok["exit_code"], ok["signal"], ok["error"]) == (
        "success", 0, None, None)
    assert ok["output"] == "all good\n"
    assert 0.3 <= ok["duration"] < 5
    assert abs(ok["finished_at"] - ok["started_at"] - ok["duration"]) < 0.5

    (fails,) = runs_of(d, "fails", 1)
    assert (fails["outcome"], fails["exit_code"], fails["signal"]) == ("failed", 3, None)
    assert fails["error"] == "exit status 3: disk full"
    output = fails["output"]
    assert len(output.encode()) <= OUTPUT_LIMIT
    total = sum(len(f"{i}\n") for i in range(1, 2001)) + len("disk full\n")
    mark, tail = output.split("\n", 1)
    assert mark == f"[... {total - len(tail.encode())} bytes cut]"
    assert tail.endswith("1999\n2000\ndisk full\n")

    (slow,) = runs_of(d, "slow", 1)
    assert slow["outcome"] == "timeout" and slow["error"] == "timed out after 1 s: started"
    assert (slow["exit_code"], slow["signal"]) == (None, signal.SIGTERM)
    assert 1 <= slow["duration"] < 5 and slow["output"] == "started\n"

    # The table: exit status or signal, duration, the error.
    table = d.ctl("history", "fails").stdout.splitlines()
    assert table[0].split() == ["scheduled_time", "started_at", "outcome", "attempt", "exit",
                                "duration", "worker", "unit", "error"]
    assert " failed " in table[1] and " 3 " in table[1]
    assert table[1].endswith("exit status 3: disk full") and table[-1] == "1 runs."
    assert " SIGTERM " in d.ctl("history", "slow").stdout

    # logs prints the stored tail as it is, whatever the executor.
    assert d.ctl("logs", "fails").stdout == output
    assert d.ctl("logs", "fails", "-n", "2").stdout == "2000\ndisk full\n"
    assert d.ctl("logs", "ok", "--attempt", "1").stdout == "all good\n"
    assert d.stop() == 0


def test_python_exception_and_a_lost_run_are_recorded(
        daemon_factory: Any, db_url: str, tmp_path: Path) -> None:
    marker = tmp_path / "long-started"
    d = start(daemon_factory, db_url, tmp_path, [
        {"type": "py", "python": "recordjobs:Broken", "user": "root"},
        sh("long", f"echo $PERFECTSCHED_ATTEMPT >> {marker}; echo working; exec sleep 60"),
    ])
    d.ctl("add", "report", "py", YEARLY, '{"path": "/srv/r.csv"}', "--at", "0",
          "--max-attempts", "1")
    d.ctl("add", "long", "long", YEARLY, "--at", "0")

    (report,) = runs_of(d, "report", 1)
    assert report["outcome"] == "failed"
    assert report["error"] == "FileNotFoundError: no such report: /srv/r.csv"
    assert (report["exit_code"], report["signal"]) == (None, None)
    assert report["output"].startswith("[... ") or report["output"].startswith("Traceback")
    assert len(report["output"].encode()) <= OUTPUT_LIMIT
    assert report["output"].endswith("FileNotFoundError: no such report: /srv/r.csv\n"
                                      "second line\n")
    assert "in load" in report["output"]  # the traceback's last frames
    assert d.ctl("logs", "report").stdout == report["output"]

    # The worker running `long` dies: its run is recorded as lost, saying how.
    wait_until(lambda: lines(marker) == ["1"], timeout=10, what="the long job to start")
    (worker,) = d.children()
    os.kill(worker, signal.SIGKILL)
    wait_until(lambda: lines(marker) == ["1", "2"], timeout=15, what="the second attempt")
    lost = next(r for r in runs_of(d, "long", 1) if r["outcome"] == "lost")
    assert lost["attempt"] == 1 and lost["worker"].endswith(f":{worker}")
    assert lost["error"] == (f"worker {lost['worker']} died (killed by SIGKILL); its run "
                             "was stopped and the occurrence given back")
    assert lost["output"] is None and lost["exit_code"] is None
    logs = d.ctl("logs", "long", "--attempt", "1")
    assert logs.returncode == 0 and logs.stdout == ""
    when = time.strftime("%Y-%m-%d %H:%M:%S +0000", time.gmtime(lost["scheduled_time"]))
    assert f"long: attempt 1 of the occurrence of {when} (lost) has no output recorded" \
        in logs.stderr, logs.stderr
    assert d.stop() == 0


def test_bad_logs_arguments_are_refused_in_one_line_changing_nothing(
        daemon_factory: Any, tmp_path: Path) -> None:
    d = daemon_factory({"routes": [sh("t", "echo hi")]}).start()
    d.ctl("add", "k", "t", YEARLY, "--at", "0")
    runs_of(d, "k", 1)
    before = (d.ctl("--json", "list").stdout, d.ctl("--json", "history", "k").stdout)
    for args, status, says in (
            (["--attempt", "0"], 2, "must be 1 or more"),
            (["--attempt", "-1"], 2, "must be 1 or more"),
            (["--attempt", "two"], 2, "not a whole number: 'two'"),
            (["--attempt", "5"], 1, "k: no attempt 5 in its history"),
            (["-n", "-3"], 2, "must be 0 or more")):
        res = d.ctl("logs", "k", *args, check=False)
        assert res.returncode == status and res.stdout == "", (args, res)
        errors = [line for line in res.stderr.splitlines() if not line.startswith("usage:")]
        assert len(errors) == 1 and says in errors[0], (args, res.stderr)
    for key in ("nope", "-x"):
        res = d.ctl("logs", "--", key, check=False)
        assert res.returncode == 1 and res.stdout == "", res
        assert len(res.stderr.splitlines()) == 1 and key in res.stderr, res.stderr
    assert (d.ctl("--json", "list").stdout, d.ctl("--json", "history", "k").stdout) == before
    assert json.loads(before[1])[0]["output"] == "hi\n"
    assert d.stop() == 0
