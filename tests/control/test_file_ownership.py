"""Files own their schedules (issue #28): a change of a schedules file's key through the
CLI is refused, naming the file; root's --force makes it and detaches the key (its new
source), so that no reload or apply brings the file's version back."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import test_dbus_server
from daemon_harness import Daemon, foreign_ctl, sh, wait_until
from old_release import OldRelease

import perfectschedd

# Daemon-level: the PostgreSQL and MariaDB runs are make check's (test-slow).
pytestmark = pytest.mark.slow_on_servers

needs_root = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                                reason="needs root and setpriv")
AS_NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
open_dir = test_dbus_server.open_dir
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


def listed(d: Daemon) -> dict[str, dict[str, object]]:
    return {s["key"]: s for s in d.ctl_json("list")}


def markers(url: str) -> dict[str, str]:
    with perfectschedd.open({"type": "rdb_compat", "url": url}) as sc:
        return sc.deleted_markers()


NOT_ADDED = ("deleted nightly (deleted with --force: the file's entry is not added again "
             "until it changes)")


@needs_root
@pytest.mark.parametrize("backend", ["sqlite", "pg"])
def test_a_forced_delete_stays_deleted_until_its_entry_changes(
        daemon_factory: Any, request: pytest.FixtureRequest, backend: str) -> None:
    url = str(request.getfixturevalue(f"{backend}_url"))
    files = Path(str(request.getfixturevalue("tmp_path"))) / "schedules.d"
    files.mkdir()
    backup = files / "backup.yml"
    nightly = {"key": "nightly", "cron": "0 3 * * *", "type": "t"}
    weekly = {"key": "weekly", "cron": "@weekly", "type": "t"}
    entries(backup, nightly, weekly)
    config = {"schedules_dir": str(files), "node_name": "host-a"}
    d = daemon_factory(config, url=url).start()
    d.wait_log("schedules files: applied 2 entries")
    d.ctl("delete", "nightly", "--force")
    assert set(listed(d)) == {"weekly"} and len(markers(url)) == 1

    # Three reloads, a restart, an apply of the unchanged file: not added again.
    for _ in range(3):
        reload_ok(d)
    d.wait_log("schedules files: applied", count=4)
    assert d.log().count(f"schedules files: {NOT_ADDED}") == 1
    assert "differs nightly" not in d.log()
    assert d.stop() == 0
    d.start()
    d.wait_log("schedules files: applied", count=5)
    assert set(listed(d)) == {"weekly"}
    assert NOT_ADDED in d.ctl("apply", "--dry-run", str(backup)).stdout.splitlines()
    assert NOT_ADDED in d.ctl("apply", str(backup)).stdout.splitlines()
    assert set(listed(d)) == {"weekly"}
    # Another host with the same files on the same database: not added there either.
    b = daemon_factory(config | {"node_name": "host-b"}, url=url).start()
    b.wait_log("schedules files: applied 2 entries")
    assert NOT_ADDED in b.log()
    reload_ok(b)
    b.wait_log("schedules files: applied", count=2)
    assert set(listed(b)) == {"weekly"} and len(markers(url)) == 1
    assert d.status()["last_error"] is None and b.status()["last_error"] is None

    # The entry changes: added again, on the host that reloads, and the marker is gone.
    entries(backup, nightly | {"cron": "0 5 * * *"}, weekly)
    reload_ok(d)
    assert listed(d)["nightly"]["cron"] == "0 5 * * *"
    assert markers(url) == {}
    reload_ok(b)  # same files: nothing to write, nothing flaps
    assert listed(b)["nightly"]["cron"] == "0 5 * * *"

    # Deleted again, then out of the file and back as it was: added again.
    d.ctl("delete", "nightly", "--force")
    entries(backup, weekly)
    reload_ok(d)
    reload_ok(b)
    assert markers(url) == {}
    entries(backup, nightly | {"cron": "0 5 * * *"}, weekly)
    reload_ok(d)
    assert listed(d)["nightly"]["cron"] == "0 5 * * *"
    # Deleted again, then an apply --prune of the file without it: the marker is gone.
    d.ctl("delete", "nightly", "--force")
    assert len(markers(url)) == 1
    pruned = files.parent / "pruned" / "backup.yml"
    pruned.parent.mkdir()
    entries(pruned, weekly)
    d.ctl("apply", "--prune", "--dry-run", str(pruned))
    assert len(markers(url)) == 1
    d.ctl("apply", "--prune", str(pruned))
    assert markers(url) == {}
    entries(backup, nightly | {"cron": "0 6 * * *"}, weekly)
    reload_ok(d)
    # Deleted again, then made with add: its own key, and the marker is gone.
    d.ctl("delete", "nightly", "--force")
    d.ctl("add", "nightly", "t", "@hourly")
    assert markers(url) == {}
    assert listed(d)["nightly"]["source"] == "api"
    assert d.alive() and b.alive()


@needs_root
def test_a_forced_delete_is_refused_while_a_0_1_0_host_is_live(
        daemon_factory: Any, sqlite_url: str, tmp_path: Path,
        old_release: OldRelease) -> None:
    files = tmp_path / "schedules.d"
    files.mkdir()
    entries(files / "backup.yml", {"key": "nightly", "cron": "0 3 * * *", "type": "t"})
    d = daemon_factory({"schedules_dir": str(files), "node_name": "newhost"},
                       url=sqlite_url).start()
    d.wait_log("schedules files: applied 1 entries")
    # A 0.1.0 host reads no marker: it would add the entry back at its next start.  It is
    # known to be live while at work (it does not record itself): its job holds a lease.
    old: Daemon = daemon_factory({"node_name": "oldhost", "schedules_dir": "off",
                                  "routes": [sh("busy", "sleep 60")]}, url=sqlite_url,
                                 command=old_release.daemon_command,
                                 ctl_command=old_release.ctl_command).start()
    old.ctl("add", "busy", "busy", "@yearly", "-a", "0")
    wait_until(lambda: old.ctl_json("show", "busy")["owner"], 30, what="the old host to run")
    res = d.ctl("delete", "nightly", "--force", check=False)
    assert (res.returncode, res.stdout) == (1, "")
    assert res.stderr == (
        f"perfectschedctl: delete --force of a schedules file's schedule needs "
        f"PerfectSched {perfectschedd.__version__} or newer on every host; older hosts "
        "use this database: oldhost (0.1.0) (upgrade them first)\n")
    assert set(listed(d)) == {"busy", "nightly"} and markers(sqlite_url) == {}
    # A forced modify stays possible: a 0.1.0 host honours the detached source.
    assert d.ctl_json("modify", "nightly", "--cron", "@hourly", "--force")["source"] == \
        "forced:file:backup.yml"
    assert d.alive()
