"""perfectschedctl: -c direct mode, socket mode against a real daemon, output, exit codes.

Exit status (SPEC): 0 success, 1 a refused request with one line on stderr, 2 usage.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from daemon_harness import CTL, Daemon, foreign_ctl, wait_until

import perfectschedd
from perfectschedctl import cli

# The table's columns (SPEC `list`, then the state); --json adds the schedule policies,
# source and creator, and the state's parts (SPEC "Failures and notifications").
SPEC_KEYS = ["key", "type", "cron", "delay", "timezone", "next_time", "next_run_time", "data"]
TABLE_KEYS = [*SPEC_KEYS, "state", "source"]
ADD_KEYS = [*SPEC_KEYS, "misfire", "grace", "max_attempts", "retry_wait", "jitter", "timeout",
            "notify", "concurrency", "metrics", "source", "creator"]
LIST_KEYS = [*ADD_KEYS, "paused", "last_outcome", "attempt", "state"]
# 2030-01-01 00:00:00 UTC, a Tuesday
T2030 = 1893456000


Result = subprocess.CompletedProcess


def ctl_process(*args: str, env: dict[str, str] | None = None, user: list[str] | None = None,
                ) -> Result[str]:
    """perfectschedctl as its own process (optionally as another user)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("PERFECTSCHED_")}
    base.update(env or {})
    # Another user cannot reach this checkout or its venv (it may sit in a directory only
    # root can enter): they get a readable copy of the client.
    ctl = foreign_ctl() if user else CTL
    return subprocess.run([*(user or []), *ctl, *args], capture_output=True, text=True,
                          timeout=60, env=base, cwd="/")


Ctl = Callable[..., Result[str]]


def refused(res: subprocess.CompletedProcess[str], *texts: str) -> None:
    """Exit 1, nothing on stdout, one line on stderr containing every text."""
    assert res.returncode == 1, (res.returncode, res.stdout, res.stderr)
    assert res.stdout == ""
    lines = res.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("perfectschedctl: "), res.stderr
    for text in texts:
        assert text in lines[0], (text, lines[0])


# -- direct mode (-c) ---------------------------------------------------------------------

@pytest.fixture
def direct(tmp_path: Path, ctl: Ctl) -> Iterator[list[str]]:
    cfg = tmp_path / "perfectsched.yml"
    cfg.write_text(yaml.safe_dump({"type": "rdb_compat",
                                   "url": f"sqlite:///{tmp_path / 'sched.db'}"}))
    res = ctl("-c", str(cfg), "init")
    assert res.returncode == 0 and res.stdout == "created table perfectsched\n", res
    res = ctl("-c", str(cfg), "init")
    assert res.returncode == 0 and res.stdout == "table perfectsched exists\n", res
    yield ["-c", str(cfg)]


def test_direct_add_list_delete_and_output_format(direct: list[str], ctl: Ctl) -> None:
    res = ctl(*direct, "add", "k1", "backup", "0 3 * * *", '{"a": 1}', "-t", "Asia/Tokyo",
              "-s", str(T2030), "-d", "30")
    assert res.returncode == 0 and res.stdout.startswith("added k1: next run "), res
    assert ctl(*direct, "add", "k2", "t", "@hourly", "-s", str(T2030),
               "-a", str(T2030 + 5)).returncode == 0

    out = ctl(*direct, "list").stdout.splitlines()
    assert out[0].split() == TABLE_KEYS
    assert out[-1] == "2 entries."
    assert out[1].split()[:5] == ["k1", "backup", "0", "3", "*"]
    assert '{"a":1}' in out[1] and "Asia/Tokyo" in out[1]
    assert "2030-01-02 03:00:00 +0900" in out[1]

    rows = json.loads(ctl(*direct, "list", "--json").stdout)
    assert isinstance(rows, list) and [list(r) for r in rows] == [LIST_KEYS, LIST_KEYS]
    k1, k2 = rows
    # 03:00 in Tokyo on 2 Jan 2030 is 18:00 UTC on 1 Jan; run 30 s later.
    assert (k1["next_time"], k1["next_run_time"], k1["delay"]) == (T2030 + 18 * 3600,
                                                                   T2030 + 18 * 3600 + 30, 30)
    assert k1["data"] == {"a": 1} and k2["data"] == {}
    assert (k1["paused"], k1["last_outcome"], k1["attempt"], k1["state"]) == (
        False, None, 0, "ok")
    assert (k2["next_time"], k2["next_run_time"], k2["timezone"]) == (T2030, T2030 + 5, "UTC")
    # --json before the command works as well
    assert json.loads(ctl(*direct, "--json", "list", "--prefix", "k2").stdout) == [k2]

    assert ctl(*direct, "delete", "k1").stdout == "deleted k1\n"
    assert ctl(*direct, "list").stdout.splitlines()[-1] == "1 entries."
    assert ctl(*direct, "history", "k2", "--json").stdout.strip() == "[]"


def test_direct_refusals_change_nothing(direct: list[str], ctl: Ctl) -> None:
    assert ctl(*direct, "add", "k", "t", "@daily", '{"x": 1}').returncode == 0
    before = ctl(*direct, "list", "--json").stdout
    refused(ctl(*direct, "add", "k", "t", "@hourly"), "'k' already exists")
    refused(ctl(*direct, "add", "n", "t", "61 * * * *"), "cron")
    refused(ctl(*direct, "add", "n", "t", "@daily", "{oops"), "DATA", "not valid JSON")
    refused(ctl(*direct, "add", "n", "t", "@daily", "[1, 2]"), "data", "JSON object")
    refused(ctl(*direct, "add", "n", "t", "@daily", "-t", "Nowhere/City"), "Nowhere/City")
    refused(ctl(*direct, "add", "", "t", "@daily"), "key")
    refused(ctl(*direct, "add", "x" * 1000, "t", "@daily"), "key", "longer than")
    refused(ctl(*direct, "delete", "absent"), "'absent' not found")
    refused(ctl(*direct, "show", "absent"), "not found")
    refused(ctl(*direct, "modify", "k"), "nothing to change")
    refused(ctl(*direct, "modify", "k", "--cron", "* * *"), "cron")
    refused(ctl(*direct, "modify", "k", "--data", "7"), "data")
    refused(ctl(*direct, "status"), "needs the daemon")
    refused(ctl(*direct, "reload"), "needs the daemon")
    assert ctl(*direct, "list", "--json").stdout == before


def test_pause_and_resume_of_one_key_print_one_line_as_of_several(
        direct: list[str], ctl: Ctl) -> None:
    """`pause KEY` says what it did in the line `pause A B` prints, not `show`'s block;
    --json still gives the schedule as `show --json` does."""
    for key in ("a", "b"):
        assert ctl(*direct, "add", key, "t", "@daily").returncode == 0
    assert ctl(*direct, "pause", "a").stdout == "paused 1 schedule(s): a\n"
    assert ctl(*direct, "pause", "a", "b").stdout == "paused 2 schedule(s): a b\n"
    assert ctl(*direct, "resume", "a").stdout == "resumed 1 schedule(s): a\n"
    res = ctl(*direct, "resume", "b", "--skip-missed")
    assert res.stdout == "resumed 1 schedule(s): b; 0 missed occurrence(s) skipped\n", res
    answer = json.loads(ctl(*direct, "pause", "a", "--json").stdout)
    shown = json.loads(ctl(*direct, "show", "a", "--json").stdout)
    assert answer["paused"] is True and answer == {k: shown[k] for k in answer}


def test_history_names_units_and_logs_prints_the_newest_run_s_output_or_journal(
        direct: list[str], ctl: Ctl, tmp_path: Path) -> None:
    """`history` has a unit column; `logs KEY` prints the newest run's stored output, or
    when it ran as a unit hands the unit to journalctl (here a stand-in that says how it
    was called: this host has no journal); `--attempt N` picks the newest run that was
    attempt N."""
    assert ctl(*direct, "add", "nightly", "backup", "@daily").returncode == 0
    refused(ctl(*direct, "logs", "nightly"), "nightly: no run in its history")
    refused(ctl(*direct, "logs", "nothing-here"), "not found")
    unit = "perfectsched-nightly-1893456000.service"
    run = {"key": "nightly", "type": "backup", "scheduled_time": T2030, "attempt": 1,
           "started_at": T2030 + 1.0, "finished_at": T2030 + 2.0, "worker": "h:1"}
    with perfectschedd.open(direct[1]) as sc:
        sc.store.record_runs([{**run, "outcome": "success", "unit": "perfectsched-old.service"},
                              {**run, "outcome": "failed", "attempt": 2,
                               "output": "partial\noutput\n", "exit_code": 1,
                               "error": "exit status 1: output"},
                              {**run, "outcome": "failed", "attempt": 3, "unit": unit}])
    table = ctl(*direct, "history", "nightly").stdout.splitlines()
    assert table[0].split()[-2:] == ["unit", "error"]
    assert f" {unit} " in table[1] and " perfectsched-old.service" in table[3]
    assert ".service" not in table[2] and table[2].endswith("exit status 1: output")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "journalctl"
    fake.write_text('#!/bin/sh\necho "journalctl $*"\n')
    fake.chmod(0o755)
    path = f"{bin_dir}:{os.environ['PATH']}"
    res = ctl_process(*direct, "logs", "nightly", env={"PATH": path})
    assert res.returncode == 0 and res.stdout == f"journalctl --no-pager --unit {unit}\n"
    res = ctl_process(*direct, "logs", "nightly", "-n", "5", env={"PATH": path})
    assert res.stdout == f"journalctl --no-pager --unit {unit} --lines 5\n", res
    res = ctl_process(*direct, "logs", "nightly", "--attempt", "2", env={"PATH": path})
    assert res.returncode == 0 and res.stdout == "partial\noutput\n", res
    res = ctl_process(*direct, "logs", "nightly", "--attempt", "2", "-n", "1")
    assert res.stdout == "output\n", res


def test_a_reader_that_goes_away_gets_no_traceback(direct: list[str], ctl: Ctl) -> None:
    """`perfectschedctl show KEY | head -1`: the rest of the output is not wanted.  Exit
    141 as a shell tool killed by SIGPIPE, nothing on stderr, nothing changed."""
    ctl(*direct, "add", "k", "t", "@daily", "-d", "60")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PERFECTSCHED_")}
    for args in (["show", "k"], ["list"], ["next", "k"], ["history", "k"],
                 ["--json", "list"], ["next", "--cron", "@hourly", "-n", "100"]):
        read_end, write_end = os.pipe()
        os.close(read_end)  # the reader is gone before the first byte
        try:
            res = subprocess.run([*CTL, *direct, *args], stdout=write_end,
                                 stderr=subprocess.PIPE, text=True, timeout=60, env=env)
        finally:
            os.close(write_end)
        assert (res.returncode, res.stderr) == (cli.EXIT_BROKEN_PIPE, ""), (args, res)
    assert [r["key"] for r in json.loads(ctl(*direct, "--json", "list").stdout)] == ["k"]


def test_bad_config_and_unreachable_database(tmp_path: Path, ctl: Ctl) -> None:
    refused(ctl("-c", str(tmp_path / "missing.yml"), "list"), "cannot read")
    bad = tmp_path / "bad.yml"
    bad.write_text("type: rdb_compat\nurl: sqlite:///x.db\nworkerz: 3\n")
    refused(ctl("-c", str(bad), "list"), "workerz")
    nodir = tmp_path / "nodir.yml"
    nodir.write_text(f"type: rdb_compat\nurl: sqlite:///{tmp_path}/no/such/dir/x.db\n")
    refused(ctl("-c", str(nodir), "list"), f"url: the SQLite database's directory "
            f"{tmp_path}/no/such/dir does not exist")
    # A relative path is read from the current directory: the message says which.
    relative = tmp_path / "relative.yml"
    relative.write_text("type: rdb_compat\nurl: sqlite:///no-such-dir/x.db\n")
    res = ctl_process("-c", str(relative), "list")  # run from /
    refused(res, "url: the SQLite database's directory /no-such-dir does not exist "
            "(sqlite:///no-such-dir/x.db is relative to the current directory, /)")


@pytest.mark.parametrize("args", [
    [],
    ["frobnicate"],
    ["add", "k", "t"],
    ["add", "k", "t", "@daily", "-d", "soon"],
    ["add", "k", "t", "@daily", "-d", "-5"],
    ["add", "k", "t", "@daily", "-s", "yesterday"],
    ["history", "k", "-n", "0"],
    ["show"],
    ["--socket", "/x", "-c", "/y", "list"],
    ["list", "--bogus"],
])
def test_usage_errors_exit_2(args: list[str], ctl: Ctl) -> None:
    res = ctl("--socket", "/nonexistent/sock", *args) if "--socket" not in args else ctl(*args)
    assert res.returncode == 2, res
    assert res.stdout == "" and "usage:" in res.stderr


def test_help_and_version(ctl: Ctl) -> None:
    res = ctl("--help")
    assert res.returncode == 0
    for cmd in ("add", "list", "show", "delete", "modify", "pause", "resume", "run",
                "history", "status", "reload", "init"):
        assert cmd in res.stdout
    assert ctl("--version").stdout.startswith("perfectschedctl ")


# -- the daemon is not there -------------------------------------------------------------

def test_daemon_not_running_messages(tmp_path: Path, ctl: Ctl) -> None:
    path = tmp_path / "ctl.sock"
    refused(ctl("--socket", str(path), "list"), "perfectschedd is not running",
            f"no socket at {path}; another daemon's socket: --socket PATH or "
            "PERFECTSCHED_SOCKET")
    # the socket file of a crashed daemon: nothing listens
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.close()
    refused(ctl("--socket", str(path), "status"), "perfectschedd is not running",
            "nothing listens")
    # PERFECTSCHED_SOCKET is the default socket (here in a process of its own)
    refused(ctl_process("list", env={"PERFECTSCHED_SOCKET": str(tmp_path / "env.sock")}),
            f"no socket at {tmp_path / 'env.sock'}")
    refused(ctl("--socket", str(path), "init"), "give -c CONFIG")


# -- socket mode, a real daemon -----------------------------------------------------------

def test_every_command_through_the_socket(daemon_factory: Any, tmp_path: Path,
                                          ctl: Ctl) -> None:
    marker = tmp_path / "runs"
    d: Daemon = daemon_factory({
        "routes": [{"type": "quick", "exec": ["sh", "-c", f'echo "$0" >> {marker}'],
                    "user": "root"}],
    }).start()
    env = {"PERFECTSCHED_SOCKET": d.socket_path}

    def sctl(*args: str) -> subprocess.CompletedProcess[str]:
        return ctl(*args, env=env)  # socket from the environment

    res = sctl("add", "k1", "quick", "0 0 1 1 *", '{"n": 1}', "-s", str(T2030))
    assert res.returncode == 0 and res.stdout.startswith("added k1: next run 2030-01-01"), res
    added = json.loads(sctl("add", "k2", "other", "@daily", "--json").stdout)
    assert list(added) == ADD_KEYS and added["key"] == "k2"

    out = sctl("list").stdout.splitlines()
    assert out[0].split() == TABLE_KEYS and out[-1] == "2 entries."
    rows = json.loads(sctl("list", "--json").stdout)
    assert [r["key"] for r in rows] == ["k1", "k2"] and all(list(r) == LIST_KEYS for r in rows)

    shown = json.loads(sctl("show", "k1", "--json").stdout)
    assert shown["paused"] is False and shown["data"] == {"n": 1}
    assert shown["next_time"] == T2030
    text = sctl("show", "k1").stdout
    assert "paused" in text and "2030-01-01 00:00:00 +0000" in text

    modified = json.loads(sctl("modify", "k1", "--data", '{"n": 2}', "-d", "7", "--json").stdout)
    assert (modified["data"], modified["delay"], modified["next_run_time"]) == (
        {"n": 2}, 7, T2030 + 7)
    refused(sctl("modify", "k1", "--cron", "99 * * * *"), "cron")
    refused(sctl("modify", "k1"), "nothing to change")
    assert json.loads(sctl("show", "k1", "--json").stdout)["delay"] == 7

    assert json.loads(sctl("pause", "k1", "--json").stdout)["paused"] is True
    assert sctl("pause", "k1").stdout == "paused 1 schedule(s): k1\n"
    assert json.loads(sctl("resume", "k1", "--json").stdout)["paused"] is False

    # run: one occurrence now, the schedule itself does not move
    res = sctl("run", "k1")
    assert res.returncode == 0 and res.stdout.startswith("queued a run of k1 now"), res
    wait_until(lambda: marker.exists() and marker.read_text().strip(), 15, what="the run")
    assert marker.read_text().split()[0].startswith("k1@run-")
    after = json.loads(sctl("show", "k1", "--json").stdout)
    assert (after["next_time"], after["next_run_time"]) == (T2030, T2030 + 7)
    run_key = marker.read_text().split()[0]

    def runs() -> list[dict[str, Any]] | None:
        res = sctl("history", run_key, "--json")  # refused until the run is recorded
        return json.loads(res.stdout) if res.returncode == 0 else None

    history = wait_until(runs, 15, what="a history entry")
    assert history[0]["outcome"] == "success", history
    assert {"scheduled_time", "started_at", "finished_at", "outcome", "attempt",
            "worker"} <= set(history[0])
    assert history[0]["attempt"] == 1 and history[0]["finished_at"] >= history[0]["started_at"]
    hist_text = sctl("history", run_key).stdout.splitlines()
    assert hist_text[0].split()[:6] == ["scheduled_time", "started_at", "outcome", "attempt",
                                        "exit", "duration"]
    assert hist_text[-1] == "1 runs."

    status = json.loads(sctl("status", "--json").stdout)
    assert status["state"] == "running" and status["workers_alive"] == 2
    assert {"version", "host", "workers", "running", "due", "last_error"} <= set(status)
    assert status["schedules"] == 2
    text = sctl("status").stdout
    assert "workers: 2/2 alive" in text and "state: running" in text

    notified = len(d.messages())
    assert sctl("reload").stdout.startswith("reloaded: the new configuration runs")
    d.wait_notify(lambda m: "RELOADING=1" in m, after=notified, what="RELOADING=1")
    d.wait_notify(lambda m: "READY=1" in m and "RELOADING" not in m, after=notified + 1,
                  what="READY=1 after reload")

    assert sctl("delete", "k2").stdout == "deleted k2\n"
    refused(sctl("delete", "k2"), "'k2' not found")
    refused(sctl("add", "k1", "quick", "@daily"), "'k1' already exists")
    refused(sctl("show", "nope"), "not found")
    refused(sctl("history", "nope"), "not found")
    assert [r["key"] for r in json.loads(sctl("list", "--json").stdout)] == ["k1"]
    assert d.alive()


def test_status_shows_running_tasks_with_age(daemon_factory: Any) -> None:
    route = {"type": "slow", "exec": ["sh", "-c", "sleep 30"], "user": "root"}
    d: Daemon = daemon_factory({"routes": [route]}).start()
    d.ctl("add", "long", "slow", "* * * * *", "-a", str(int(time.time()) - 1))

    def running() -> list[dict[str, Any]]:
        return list(d.status()["running"])

    tasks = wait_until(running, 15, what="a running task")
    assert tasks[0]["key"] == "long" and tasks[0]["attempt"] == 1
    time.sleep(1.1)
    assert running()[0]["age"] >= 1.0
    assert "long" in d.ctl("status").stdout


# -- permissions: run the client as nobody ------------------------------------------------

@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory `nobody` can traverse (pytest's tmp_path is private to root)."""
    path = Path(tempfile.mkdtemp(prefix="psched-ctl-"))
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


needs_root = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                                reason="needs root and setpriv")


@needs_root
def test_callers_not_allowed_are_refused(open_dir: Path) -> None:
    # Members of group nogroup may control the daemon; user `daemon` (uid 1) is not one.
    d = Daemon(open_dir, {"control_group": "nogroup"})
    try:
        d.start()
        os.chmod(d.dir, 0o755)
        st = os.stat(d.socket_path)
        assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == 65534
        as_nobody = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
        as_daemon = ["setpriv", "--reuid=daemon", "--regid=daemon", "--clear-groups"]
        as_daemon_in_group = ["setpriv", "--reuid=daemon", "--regid=daemon",
                              "--groups=nogroup"]
        sock = ["--socket", d.socket_path]

        # the group may (primary or supplementary group)
        res = ctl_process(*sock, "add", "by-nobody", "t", "@daily", user=as_nobody)
        assert res.returncode == 0, res
        res = ctl_process(*sock, "list", user=as_daemon_in_group)
        assert res.stdout.endswith("1 entries.\n"), res

        # others: the socket's mode stops them, and the message says so
        refused(ctl_process(*sock, "delete", "by-nobody", user=as_daemon), "permission denied",
                d.socket_path)

        # past the file mode, the daemon's own check (SO_PEERCRED) refuses them
        os.chmod(d.socket_path, 0o666)
        refused(ctl_process(*sock, "delete", "by-nobody", user=as_daemon), "permission denied",
                "daemon may not control perfectschedd")
        assert [r["key"] for r in d.ctl_json("list")] == ["by-nobody"]
        d.wait_log("refused daemon")  # logged before the reply, written by a thread
        assert d.alive()
    finally:
        d.kill()


def test_perfectschedctl_module_entry_point() -> None:
    res = subprocess.run([sys.executable, "-m", "perfectschedctl", "--version"],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 0 and "perfectschedctl" in res.stdout


# -- bash completion matches the parser ---------------------------------------------------

COMPLETION = Path(__file__).resolve().parents[2] / "etc" / "bash-completion" / "perfectschedctl"
BASH_COMPLETION = Path("/usr/share/bash-completion/bash_completion")


def _complete(*words: str) -> set[str]:
    script = f"""
source {BASH_COMPLETION}
source {COMPLETION}
COMP_WORDS=({" ".join(repr(w) for w in words)})
COMP_CWORD=$((${{#COMP_WORDS[@]}}-1)); COMP_LINE="${{COMP_WORDS[*]}}"; COMP_POINT=${{#COMP_LINE}}
_perfectschedctl
printf '%s\\n' "${{COMPREPLY[@]}}"
"""
    res = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    return {w for w in res.stdout.split() if w}


def _options(parser: Any) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings}


@pytest.mark.skipif(not BASH_COMPLETION.exists(), reason="bash-completion is not installed")
def test_bash_completion_matches_the_parser() -> None:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    commands: dict[str, Any] = sub.choices  # type: ignore[attr-defined]
    assert _complete("perfectschedctl", "") == set(commands)
    assert _complete("perfectschedctl", "-") == _options(parser)
    for name, sp in commands.items():
        args = {"add": ["k", "t", "c"]}.get(name, [])
        assert _complete("perfectschedctl", name, *args, "-") == _options(sp), name


def test_status_says_how_a_given_up_occurrence_ended() -> None:
    from perfectschedctl import output

    def line(outcome: str | None) -> str:
        return output._failing_lines({"failing": [
            {"key": "k", "state": "failed", "last_outcome": outcome, "since": T2030}]})[1]
    given_up = "at 2030-01-01 00:00:00 +0000; given up, the schedule moved on"
    assert line("failed") == f"  k: failed {given_up}"  # not "failed (failed)"
    assert line(None) == f"  k: failed {given_up}"
    assert line("timeout") == f"  k: failed (timeout) {given_up}"


def test_show_prints_lists_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    from perfectschedctl import output

    output.print_result("show", {"key": "k", "extra_runs": [
        {"run_key": "k@run-1-ab", "queued": True}]}, as_json=False)
    assert capsys.readouterr().out.splitlines()[1] == \
        'extra_runs  [{"queued":true,"run_key":"k@run-1-ab"}]'
