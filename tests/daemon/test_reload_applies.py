"""A reload applies the whole new configuration, and a wrong one changes nothing (issue
39, items 1 and 2): the control socket's commands follow the reloaded file at once (the
default zone of `add`, the notifiers `--notify` names, the schedules_dir refusals name,
the zone of a schedules file's entry that names none), as after a restart; a
schedules_dir that does not exist is refused in one line, at a reload and at a start,
and deletes nothing."""

from __future__ import annotations

import subprocess
import sys
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
