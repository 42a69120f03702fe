"""The CLI parses as people type (issue #28): DATA before or after the options, as the
man page writes it; import-crontab says when a file looks like a system crontab."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from daemon_harness import Daemon

CTL = [sys.executable, "-m", "perfectschedctl"]


def test_data_after_options_parses(daemon_factory: Any) -> None:
    d: Daemon = daemon_factory().start()
    # perfectschedctl(1)'s own example: DATA after -t and -d.
    d.ctl("add", "backup", "backup", "0 2 * * *", "-t", "Asia/Tokyo", "-d", "30",
          '{"full": true}')
    shown = d.ctl_json("show", "backup")
    assert (shown["timezone"], shown["delay"], shown["data"]) == (
        "Asia/Tokyo", 30, {"full": True})
    # Options first, DATA between options, and a policy option after DATA.
    d.ctl("add", "-t", "Europe/Paris", "early", "t", "@daily", '{"n": 1}', "--jitter", "5")
    shown = d.ctl_json("show", "early")
    assert (shown["timezone"], shown["data"], shown["jitter"]) == (
        "Europe/Paris", {"n": 1}, 5)
    # Still one error for what is not there to take.
    res = d.ctl("add", "x", "t", "@daily", "{}", "extra", check=False)
    assert res.returncode == 2 and "unrecognized arguments: extra" in res.stderr
    assert d.stop() == 0


SYSTEM_CRONTAB = """SHELL=/bin/sh
PATH=/usr/local/sbin:/usr/local/bin:/sbin:/bin:/usr/sbin:/usr/bin
17 *\t* * *\troot\tcd / && run-parts --report /etc/cron.hourly
25 6\t* * *\troot\ttest -x /usr/sbin/anacron || run-parts --report /etc/cron.daily
"""


def import_crontab(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CTL, "import-crontab", *args], capture_output=True, text=True,
                          timeout=60)


def test_import_crontab_warns_of_a_user_column_without_system(tmp_path: Path) -> None:
    copy = tmp_path / "crontab.backup"  # /etc/crontab under another name
    copy.write_text(SYSTEM_CRONTAB)
    copy.chmod(0o644)
    res = import_crontab("--user", "root", str(copy))
    assert res.returncode == 0
    assert res.stderr.splitlines() == [
        "perfectschedctl: warning: crontab.backup:3: 'root' is a user of this host, not a "
        "command: this looks like a system crontab (a user column); give --system, or the "
        "user names stay part of the commands"]
    # With --system: the column is the user, and nothing to warn of.
    res = import_crontab("--system", str(copy))
    assert res.returncode == 0 and res.stderr == ""
    assert "user: root" in res.stdout
    # A user crontab whose commands start with a program: no warning.
    plain = tmp_path / "mine"
    plain.write_text("17 * * * * run-parts /etc/cron.hourly\n5 4 * * * echo root\n")
    plain.chmod(0o644)
    res = import_crontab("--user", "root", str(plain))
    assert res.returncode == 0 and res.stderr == ""
