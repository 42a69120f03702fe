"""Errors are reported where the command was given (issue #28): a reload that refuses
anything exits non-zero with the reasons, one line each, `status` shows them in
last_error until a reload takes everything, and `apply --dry-run` of a file the daemon
rejects fails for the same reason (one function checks both: files.check)."""

from __future__ import annotations

import configparser
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from daemon_harness import Daemon, lines, sh, wait_until

import perfectschedd

# Daemon-level: the PostgreSQL and MariaDB runs are make check's (test-slow).
pytestmark = pytest.mark.slow_on_servers

ROOT = Path(__file__).resolve().parent.parent.parent
NO_SENDMAIL = "/nonexistent/sendmail"
NO_USER = "no-such-user-28"


def write(path: Path, entries: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(entries, sort_keys=False))
    tmp.replace(path)


def applies(d: Daemon) -> int:
    return d.log().count("schedules files: applied")


def refusals(stderr: str, prefix: str) -> list[str]:
    """The lines of stderr, each without `prefix` (every line must have it)."""
    got = stderr.splitlines()
    assert all(line.startswith(prefix) for line in got), stderr
    return [line.removeprefix(prefix) for line in got]


def test_a_rejected_schedules_file_fails_reload_and_apply_dry_run_alike(
        daemon_factory: Any, tmp_path: Path) -> None:
    sdir = tmp_path / "schedules.d"
    out = tmp_path / "ran.txt"
    write(sdir / "good.yml", [{"key": "good", "cron": "@yearly", "type": "t"}])
    d: Daemon = daemon_factory({"schedules_dir": str(sdir), "sendmail": NO_SENDMAIL,
                                "routes": [sh("t", f"echo $1 >> {out}")]}).start()
    wait_until(lambda: applies(d) == 1, what="the first apply")
    assert d.status()["last_error"] is None

    # Two files the daemon rejects for what only its host can say (the user does not
    # exist here; nothing can send mail here), each a line of its own.
    write(sdir / "nouser.yml", [{"key": "dump", "cron": "@daily", "exec": "true",
                                 "user": NO_USER}])
    write(sdir / "mail.yml", [{"key": "mailer", "cron": "@daily", "type": "t",
                               "notify": {"mail": "root"}}])
    res = d.ctl("reload", check=False)
    assert res.returncode == 1, res.stdout + res.stderr
    assert res.stdout.startswith("reloaded with refusals: the rest of the new configuration")
    why_user = (f"{sdir / 'nouser.yml'}: entry 1 (dump): user: no such user {NO_USER!r} on "
                "this host")
    why_mail = (f"file:mail.yml: entry mailer: notify: mail needs sendmail, and "
                f"{NO_SENDMAIL} is not an executable program on this host (install a mail "
                "transfer agent, or set sendmail: in the configuration)")
    assert sorted(refusals(res.stderr, "perfectschedctl: refused: ")) == sorted(
        [why_user, why_mail])
    status = d.status()
    assert sorted(status["refused"]) == sorted([why_user, why_mail])
    assert why_user in status["last_error"] and why_mail in status["last_error"]
    human = d.ctl("status").stdout
    assert f"refused (the rest runs): {why_user}" in human
    # The rest runs: the good file's schedule is there and runs.
    assert {s["key"] for s in d.ctl_json("list")} == {"good"}
    d.ctl("run", "good")
    wait_until(lambda: [x.split("@")[0] for x in lines(out)] == ["good"],
               what="the good schedule's run")

    # apply --dry-run of the same files: the same reasons, nothing sent.
    for name, why in (("nouser.yml", why_user), ("mail.yml", why_mail)):
        res = d.ctl("apply", "--dry-run", str(sdir / name), check=False)
        assert res.returncode == 1 and res.stdout == ""
        assert refusals(res.stderr, "perfectschedctl: ") == [why]
    # Still refused after another reload (status says so until a reload takes it all).
    assert d.ctl("reload", check=False).returncode == 1
    assert d.status()["last_error"] is not None

    # Fixed: a clean reload exits 0 and clears last_error.
    (sdir / "nouser.yml").unlink()
    (sdir / "mail.yml").unlink()
    res = d.ctl("reload", check=False)
    assert res.returncode == 0 and res.stderr == "", res.stdout + res.stderr
    assert res.stdout.startswith("reloaded: the new configuration runs")
    status = d.status()
    assert status["last_error"] is None and status["refused"] == []
    assert d.stop() == 0


def test_an_entry_whose_key_is_another_s_fails_the_reload(daemon_factory: Any,
                                                          tmp_path: Path, db_url: str) -> None:
    """An entry refused by the convergence (its key was made with add) is a refusal too:
    the reload waits for the convergence of its files and says it."""
    sdir = tmp_path / "schedules.d"
    sdir.mkdir()
    d: Daemon = daemon_factory({"schedules_dir": str(sdir),
                                "routes": [sh("t", "true")]}, url=db_url).start()
    d.ctl("add", "taken", "t", "@daily")
    write(sdir / "jobs.yml", [{"key": "taken", "cron": "@hourly", "type": "t"},
                              {"key": "fine", "cron": "@hourly", "type": "t"}])
    res = d.ctl("reload", check=False)
    assert res.returncode == 1
    why = ("schedules file entry refused taken (the key belongs to api (made with add))")
    assert refusals(res.stderr, "perfectschedctl: refused: ") == [why]
    assert d.status()["last_error"] == why
    assert d.ctl_json("show", "fine")["source"] == "file:jobs.yml"  # the rest ran
    assert d.ctl_json("show", "taken")["cron"] == "@daily"
    write(sdir / "jobs.yml", [{"key": "fine", "cron": "@hourly", "type": "t"}])
    assert d.ctl("reload", check=False).returncode == 0
    assert d.status()["last_error"] is None
    assert d.stop() == 0


def test_a_broken_config_fails_the_reload_and_the_old_one_keeps_running(
        daemon_factory: Any, tmp_path: Path) -> None:
    out = tmp_path / "ran.txt"
    d: Daemon = daemon_factory({"routes": [sh("t", f"echo $1 >> {out}")]}).start()
    d.ctl("add", "k", "t", "@yearly")
    good = d.config_path.read_text()
    d.write_config(raw=good + "workers: [oops\n")
    res = d.ctl("reload", check=False)
    assert res.returncode == 1 and res.stdout == ""
    [line] = res.stderr.splitlines()
    assert line.startswith("perfectschedctl: reload rejected, the running configuration "
                           "stays: "), line
    assert d.status()["last_error"].startswith("reload: ")
    assert d.alive() and d.status()["workers_alive"] == 2
    d.ctl("run", "k")  # the old configuration's route still runs
    wait_until(lambda: [x.split("@")[0] for x in lines(out)] == ["k"],
               what="a run under the old configuration")
    d.write_config(raw=good)
    assert d.ctl("reload", check=False).returncode == 0
    assert d.status()["last_error"] is None
    assert d.stop() == 0


def test_systemctl_reload_runs_perfectschedctl_reload() -> None:
    """`systemctl reload` fails when the daemon refused something: its ExecReload is the
    reload request (whose exit status systemd reports), not a bare signal."""
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.read(ROOT / "systemd" / "perfectschedd.service")
    assert unit["Service"]["ExecReload"].split() == ["/usr/bin/perfectschedctl", "reload"]


def test_a_reload_onto_a_database_this_version_refuses_keeps_the_running_one(
        daemon_factory: Any, tmp_path: Path) -> None:
    """A reload whose url names a database a later release made (schema 99, not usable
    by this version) is refused in one line; the daemon keeps running on its database
    (it used to take the new url and stop once the new store refused the schema)."""
    newer = tmp_path / "newer.db"
    with perfectschedd.open({"type": "rdb_compat", "url": f"sqlite:///{newer}"}) as sc:
        sc.add("elsewhere", "t", cron="@yearly")
        with sc.store.engine.begin() as conn:
            conn.exec_driver_sql("UPDATE perfectsched_meta SET value = '99' "
                                 "WHERE name = 'schema_version'")
            conn.exec_driver_sql("DELETE FROM perfectsched_meta WHERE name = 'compatible_from'")
    d: Daemon = daemon_factory({"routes": [sh("t", "true")]}).start()
    d.ctl("add", "here", "t", "@yearly")
    running_url = d.config["url"]
    d.write_config({**d.config, "url": f"sqlite:///{newer}"})
    res = d.ctl("reload", check=False)
    assert res.returncode == 1, res.stdout + res.stderr
    assert res.stderr.count("\n") == 1 and "url: " in res.stderr and "schema 99" in res.stderr, \
        res.stderr
    time.sleep(1)  # a store the daemon took would have stopped it by now
    assert d.alive()
    assert [s["key"] for s in d.ctl_json("list")] == ["here"]
    status = d.status()
    assert status["database_ok"] is True and "schema 99" in status["last_error"], status
    # The running configuration is whole: a reload back onto its own database is taken.
    d.write_config({**d.config, "url": running_url})
    assert d.ctl("reload", check=False).returncode == 0
    assert d.alive() and d.status()["last_error"] is None


def test_a_sqlite_directory_that_does_not_exist_yet(daemon_factory: Any,
                                                    tmp_path: Path) -> None:
    """Started on a SQLite file whose directory is missing (a disk not mounted yet): the
    master and the workers wait for it, saying why, and no worker crashes; once it exists
    the daemon runs.  A reload onto such a url is refused in one line."""
    later = tmp_path / "later"
    out = tmp_path / "out"
    d: Daemon = daemon_factory({"routes": [sh("t", f"echo ran >> {out}")]},
                               url=f"sqlite:///{later}/sched.db")
    d.start(wait_ready=False)
    missing = f"url: the SQLite database's directory {later} does not exist"
    d.wait_log(f"database unreachable: {missing}")
    workers = wait_until(lambda: (c := sorted(d.children())) and len(c) == 2 and c,
                         what="two workers")
    time.sleep(3)  # a worker that crashed on it would have been replaced by now
    assert sorted(d.children()) == workers and "crashed" not in d.log(), d.log()[-3000:]
    later.mkdir()
    wait_until(lambda: d.status().get("database_ok") is True, 30, what="the database open")
    d.ctl("add", "k", "t", "@yearly", "--at", "0")
    wait_until(lambda: lines(out) == ["ran"], 30, what="a run")
    assert sorted(d.children()) == workers, "no worker was replaced"
    # A reload onto a missing directory: refused, the daemon runs on its database.
    d.write_config({**d.config, "url": f"sqlite:///{tmp_path}/nowhere/sched.db"})
    res = d.ctl("reload", check=False)
    assert res.returncode == 1 and res.stderr.count("\n") == 1, res.stderr
    assert f"the SQLite database's directory {tmp_path}/nowhere does not exist" in res.stderr
    assert d.alive() and d.status()["database_ok"] is True
    assert [s["key"] for s in d.ctl_json("list")] == ["k"]
    assert d.stop() == 0
