"""A reload applies the whole new configuration, and a wrong one changes nothing (issue
39, items 1 and 2): the control socket's commands follow the reloaded file at once (the
default zone of `add`, the notifiers `--notify` names, the schedules_dir refusals name,
the zone of a schedules file's entry that names none), as after a restart; a
schedules_dir that does not exist is refused in one line, at a reload and at a start,
and deletes nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from daemon_harness import YEARLY, Daemon, sh, wait_until


def write(path: Path, entries: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(entries, sort_keys=False))
    tmp.replace(path)


def keys(d: Daemon) -> dict[str, dict[str, Any]]:
    return {s["key"]: s for s in d.ctl_json("list")}


def test_the_socket_s_commands_follow_a_reload(daemon_factory: Any, tmp_path: Path) -> None:
    sdir = tmp_path / "schedules.d"
    write(sdir / "jobs.yml", [{"key": "f1", "cron": "0 9 * * *", "type": "t"}])
    d: Daemon = daemon_factory({"schedules_dir": str(sdir),
                                "routes": [sh("t", "true")]}).start()
    wait_until(lambda: "f1" in keys(d), what="the file's schedule")
    res = d.ctl("add", "n0", "t", YEARLY, "--notify", "hook", check=False)
    assert res.returncode == 1 and "no notifier named 'hook'" in res.stderr, res.stderr

    # The files move to another directory; the zone and a notifier are new.
    moved = tmp_path / "moved.d"
    sdir.rename(moved)
    d.write_config({**d.config, "schedules_dir": str(moved), "timezone": "Asia/Tokyo",
                    "notifiers": {"hook": {"webhook": "http://127.0.0.1:9/"}}})
    res = d.ctl("reload", check=False)
    assert res.returncode == 0, res.stdout + res.stderr

    d.ctl("add", "n1", "t", YEARLY, "--notify", "hook")
    assert d.ctl_json("show", "n1")["notify"] == "hook"
    d.ctl("add", "tz1", "t", "0 9 * * *")
    assert d.ctl_json("show", "tz1")["timezone"] == "Asia/Tokyo"
    # A file's entry without a zone takes the configuration's, as it would at a start.
    assert d.ctl_json("show", "f1")["timezone"] == "Asia/Tokyo"
    # A refusal names the file where it is now.
    res = d.ctl("delete", "f1", check=False)
    assert res.returncode == 1 and f"f1 is managed by {moved}/jobs.yml" in res.stderr, \
        res.stderr
    assert d.stop() == 0


def test_a_schedules_dir_that_does_not_exist_is_refused_and_deletes_nothing(
        daemon_factory: Any, tmp_path: Path) -> None:
    sdir = tmp_path / "schedules.d"
    write(sdir / "jobs.yml", [{"key": "f1", "cron": "@hourly", "type": "t"},
                              {"key": "f2", "cron": "@daily", "type": "t"}])
    d: Daemon = daemon_factory({"schedules_dir": str(sdir),
                                "routes": [sh("t", "true")]}).start()
    wait_until(lambda: set(keys(d)) == {"f1", "f2"}, what="the files' schedules")
    before = keys(d)
    good = dict(d.config)
    d.write_config({**good, "schedules_dir": "/nonexistent/dir"})
    res = d.ctl("reload", check=False)
    assert res.returncode == 1 and res.stdout == "", res.stdout + res.stderr
    [line] = res.stderr.splitlines()
    assert line.endswith("schedules_dir: /nonexistent/dir does not exist (create it, or set "
                         "schedules_dir: off for no schedules files)"), line
    assert "schedules files: removed" not in d.log()
    assert keys(d) == before
    assert "/nonexistent/dir" in d.status()["last_error"]
    # The running configuration stays whole: its directory is still the one read.
    res = d.ctl("delete", "f1", check=False)
    assert f"managed by {sdir}/jobs.yml" in res.stderr, res.stderr
    d.write_config(good)
    assert d.ctl("reload", check=False).returncode == 0
    assert keys(d) == before and d.status()["last_error"] is None
    # An existing directory emptied is an edit: its schedules go.
    (sdir / "jobs.yml").unlink()
    assert d.ctl("reload", check=False).returncode == 0
    assert keys(d) == {}
    assert d.stop() == 0


def test_a_schedules_dir_that_does_not_exist_stops_a_start(daemon_factory: Any,
                                                           tmp_path: Path) -> None:
    d: Daemon = daemon_factory({"schedules_dir": str(tmp_path / "typo.d")})
    d.start(wait_ready=False)
    assert d.proc is not None and d.proc.wait(30) == 1
    assert f"schedules_dir: {tmp_path}/typo.d does not exist" in d.log(), d.log()


def test_the_shipped_schedules_dir_is_installed() -> None:
    """The shipped configuration names its schedules_dir, which the package installs (a
    named directory must exist, or the daemon does not start)."""
    root = Path(__file__).resolve().parent.parent.parent
    shipped = yaml.safe_load((root / "etc" / "perfectsched.yml").read_text())
    installed = (root / "packaging" / "debian" / "perfectsched.install").read_text().split("\n")
    assert any("/" + line.split()[-1].strip("/") == shipped["schedules_dir"]
               for line in installed if line.strip()), installed
