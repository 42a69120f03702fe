"""files.check: the daemon's checks of schedules files, with a daemon's facts
(HostChecks), as the daemon runs them on reload and perfectschedctl apply runs them with
the facts the daemon's status gives (issue #28)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from perfectschedd.schedules import files

NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (chown)")


def write(path: Path, *entries: dict[str, object]) -> Path:
    path.write_text(json.dumps(list(entries)))  # JSON is YAML
    path.chmod(0o644)
    return path


def test_host_checks_come_from_a_daemon_s_status() -> None:
    status = {"daemon_uid": 5, "sendmail": "/usr/sbin/sendmail", "unit_grant": True}
    assert files.HostChecks.of_status(status, 7) == files.HostChecks(
        5, "/usr/sbin/sendmail", True, frozenset({7}))
    # A daemon older than 0.2.0 does not say: apply checks only what is stored.
    assert files.HostChecks.of_status({"version": "0.1.0"}, 7) is None


@needs_root
def test_the_daemon_s_user_decides_not_the_caller_s(tmp_path: Path) -> None:
    """Run by root (perfectschedctl apply as root) for a daemon that is not root: a job
    that runs as another user is refused as that daemon refuses it."""
    f = write(tmp_path / "jobs.yml", {"key": "dump", "cron": "@daily", "exec": "true",
                                      "user": "root"})
    as_root = files.check([f], files.HostChecks(0, "/bin/true"))
    assert as_root.problems() == [] and set(as_root.entries) == {"dump"}
    as_nobody = files.check([f], files.HostChecks(NOBODY, "/bin/true"))
    assert as_nobody.problems() == [
        f"{f}: entry 1 (dump): user: running as 'root' needs the daemon to run as root "
        "(this one does not)"]
    assert as_nobody.entries == {}


def test_the_privilege_rule_refuses_an_entry_alone(tmp_path: Path) -> None:
    f = write(tmp_path / "jobs.yml", {"key": "mine", "cron": "@daily", "exec": "true"},
              {"key": "plain", "cron": "@daily", "type": "t"})
    loaded = files.check([f], files.HostChecks(NOBODY, "/bin/true", grant=True,
                                               also_trusted=frozenset({os.geteuid()})))
    assert loaded.errors == [] and set(loaded.entries) == {"mine", "plain"}
    [why] = loaded.refused.values()
    assert why.startswith("schedules file entry mine: executor: an exec job runs as ")
    [route] = loaded.routes()
    assert route.pattern == "exec:mine" and route.refused == why


@needs_root
def test_an_appliers_own_file_is_trusted_for_its_apply_only(tmp_path: Path) -> None:
    f = write(tmp_path / "team.yml", {"key": "team", "cron": "@daily", "type": "t"})
    os.chown(f, NOBODY, NOBODY)
    daemon = files.HostChecks(0, "/bin/true")
    assert files.check([f], daemon).errors == [
        f"{f}: owned by uid 65534 (nobody), not root: rejected"]
    applier = files.HostChecks(0, "/bin/true", also_trusted=frozenset({NOBODY}))
    assert set(files.check([f], applier).entries) == {"team"}
