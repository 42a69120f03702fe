"""Files own their schedules (issue #28): a change of a schedules file's key through the
CLI is refused, naming the file; root's --force makes it and detaches the key (its new
source), so that no reload or apply brings the file's version back."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import test_dbus_service as dbus_harness
from daemon_harness import Daemon, foreign_ctl

needs_root = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                                reason="needs root and setpriv")
AS_NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
open_dir = dbus_harness.open_dir
DETACHED = "forced:file:backup.yml"


def managed(files: Path, key: str) -> str:
    return (f"perfectschedctl: {key} is managed by {files / 'backup.yml'}: edit it and "
            "reload (root may --force the change, which detaches it from the file)\n")


def entries(path: Path, *items: dict[str, object]) -> None:
    path.write_text(json.dumps(list(items)))  # JSON is YAML
    os.chmod(path, 0o644)


def reload_ok(d: Daemon) -> None:
    res = d.ctl("reload", check=False)
    assert res.returncode == 0 and res.stderr == "", res.stdout + res.stderr


@needs_root
def test_file_managed_keys_are_refused_then_forced_and_detached(open_dir: Path) -> None:
    files = open_dir / "schedules.d"
    files.mkdir()
    backup = files / "backup.yml"
    entries(backup, {"key": "nightly", "cron": "0 3 * * *", "type": "t"},
            {"key": "weekly", "cron": "@weekly", "type": "t"},
            {"key": "daily", "cron": "@daily", "type": "t"})
    d = Daemon(open_dir, {"control_group": "nogroup", "schedules_dir": str(files)})
    try:
        d.start()
        os.chmod(d.dir, 0o755)
        d.wait_log("schedules files: applied 3 entries")
        before = d.ctl_json("list")
        assert {s["source"] for s in before} == {"file:backup.yml"}

        # Refused, naming the file, for root without --force; nothing changes.
        for args in (["modify", "nightly", "--cron", "@hourly"], ["pause", "nightly"],
                     ["resume", "nightly"], ["delete", "nightly"]):
            res = d.ctl(*args, check=False)
            assert (res.returncode, res.stdout, res.stderr) == (
                1, "", managed(files, "nightly")), args
        # A member of the control group may not force.
        env = {k: v for k, v in os.environ.items() if not k.startswith("PERFECTSCHED_")}
        res = subprocess.run([*AS_NOBODY, *foreign_ctl(), "--socket", d.socket_path,
                              "modify", "nightly", "--cron", "@hourly", "--force"],
                             capture_output=True, text=True, timeout=60, env=env, cwd="/")
        assert res.returncode == 1 and res.stderr.startswith(
            "perfectschedctl: force: only root may force"), res.stderr
        assert d.ctl_json("list") == before

        # Root forces: done, and detached (the new source, shown by show and list).
        shown = d.ctl_json("modify", "nightly", "--cron", "@hourly", "--force")
        assert shown["cron"] == "@hourly" and shown["source"] == DETACHED
        assert d.ctl_json("pause", "weekly", "--force")["source"] == DETACHED
        d.ctl("delete", "daily", "--force")
        listed = {s["key"]: s for s in d.ctl_json("list")}
        assert set(listed) == {"nightly", "weekly"}
        assert listed["nightly"]["source"] == DETACHED and listed["weekly"]["paused"]
        table = d.ctl("list").stdout.splitlines()
        assert table[0].split()[-1] == "source"
        assert sum(DETACHED in line for line in table) == 2
        # A detached key is an ordinary schedule now: no --force needed.
        d.ctl("resume", "weekly")
        d.ctl("pause", "weekly")

        # Reloads do not bring the file's version back, and say so once, not as an error.
        for _ in range(3):
            reload_ok(d)
        d.wait_log("schedules files: applied", count=4)
        shown = d.ctl_json("show", "nightly")
        assert (shown["cron"], shown["source"]) == ("@hourly", DETACHED)
        assert d.ctl_json("show", "weekly")["paused"] is True
        assert "daily" not in {s["key"] for s in d.ctl_json("list")}
        log = d.log()
        assert log.count("schedules files: detached nightly") == 1
        assert "differs nightly" not in log and "refused nightly" not in log
        # Nor does an edit of the file, nor an apply of it.
        entries(backup, {"key": "nightly", "cron": "0 5 * * *", "type": "t"},
                {"key": "weekly", "cron": "@weekly", "type": "t"})
        reload_ok(d)
        d.wait_log("schedules files: applied", count=5)
        assert d.ctl_json("show", "nightly")["cron"] == "@hourly"
        res = d.ctl("apply", str(backup))
        assert res.stdout.splitlines() == [
            f"detached nightly (source {DETACHED}, changed with --force: the file's entry "
            "is not applied)",
            f"detached weekly (source {DETACHED}, changed with --force: the file's entry is "
            "not applied)"]
        assert d.ctl_json("show", "nightly")["cron"] == "@hourly"
        assert d.ctl_json("show", "weekly")["paused"] is True
        assert d.status()["last_error"] is None
    finally:
        d.kill()
