"""What a job sees and who runs it (SPEC "Privilege model"; issue 38, issue 39 item 7),
against real root daemons: a job gets cron's environment of its user, never the
daemon's; a root daemon refuses exec and python routes (and schedules-file entries)
without `user:`; notifiers run as `notify_user`, never as root; a job knows its
schedule's key (PERFECTSCHED_SCHEDULE_KEY, Task.schedule_key)."""

from __future__ import annotations

import os
import pwd
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from daemon_harness import YEARLY, Daemon, lines, sh, shared_dir, wait_until
from notify_receivers import mails, sendmail_stand_in

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (a root daemon, "
                                "jobs as nobody)")

# The daemon's environment holds secrets; none may reach a job or a notifier.
SECRETS = {"PGPASSWORD": "secret", "PERFECTSCHED_TEST_SECRET": "x", "LANG": "C.UTF-8"}
# The shell's own initial environment, exactly as the daemon passed it (not the one `env`
# would print: the shell adds PWD).
DUMP = "tr '\\0' '\\n' < /proc/$$/environ"
RUN_VARS = {"PERFECTSCHED_KEY", "PERFECTSCHED_SCHEDULE_KEY", "PERFECTSCHED_TYPE",
            "PERFECTSCHED_SCHEDULED_TIME", "PERFECTSCHED_ATTEMPT", "PERFECTSCHED_RUN_ID"}
CRON_VARS = {"HOME", "LOGNAME", "USER", "SHELL", "PATH", "LANG"}
# systemd's default PATH of services (documented: perfectschedd(8), docs/security.md).
JOB_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def output_env(d: Daemon, key: str) -> dict[str, str]:
    runs = wait_until(lambda: [r for r in d.ctl_json("history", key)
                               if r["outcome"] == "success"], 20, what=f"a run of {key}")
    return dict(line.split("=", 1) for line in runs[0]["output"].splitlines())


def test_a_job_gets_cron_s_environment_never_the_daemon_s(daemon_factory: Any,
                                                          tmp_path: Path) -> None:
    files = tmp_path / "schedules.d"
    files.mkdir(mode=0o755)
    (files / "f.yml").write_text(yaml.safe_dump([{
        "key": "filed", "cron": YEARLY, "exec": ["/bin/sh", "-c", DUMP], "user": "nobody",
        "env": {"FROM_FILE": "yes", "PERFECTSCHED_KEY": "forged"}}]))
    d: Daemon = daemon_factory({
        "schedules_dir": str(files),
        "routes": [sh("as-root", DUMP, env={"EXTRA": "1"}),
                   sh("as-nobody", DUMP, user="nobody")]}, env=SECRETS).start()
    d.ctl("add", "r", "as-root", YEARLY, "-a", "0")
    d.ctl("add", "n", "as-nobody", YEARLY, "-a", "0")
    wait_until(lambda: "filed" in {s["key"] for s in d.ctl_json("list")}, 10,
               what="the file's entry stored")
    d.ctl("run", "filed")
    root, nobody, filed = output_env(d, "r"), output_env(d, "n"), output_env(d, "filed")
    assert set(root) == CRON_VARS | RUN_VARS | {"EXTRA"}
    assert set(nobody) == CRON_VARS | RUN_VARS
    assert set(filed) == CRON_VARS | RUN_VARS | {"FROM_FILE"}
    nb = pwd.getpwnam("nobody")
    assert {k: nobody[k] for k in CRON_VARS} == {
        "HOME": nb.pw_dir, "LOGNAME": "nobody", "USER": "nobody", "SHELL": nb.pw_shell,
        "PATH": JOB_PATH, "LANG": "C.UTF-8"}
    assert (root["HOME"], root["USER"], root["EXTRA"]) == ("/root", "root", "1")
    assert nobody["PERFECTSCHED_KEY"] == nobody["PERFECTSCHED_SCHEDULE_KEY"] == "n"
    # The run's own variables win over an entry's env: (RUN_ID marks the run's processes).
    assert filed["PERFECTSCHED_KEY"].startswith("filed@run-")
    assert (filed["PERFECTSCHED_SCHEDULE_KEY"], filed["FROM_FILE"]) == ("filed", "yes")
    assert filed["USER"] == "nobody"


def test_a_root_daemon_refuses_user_less_exec_and_python_routes(daemon_factory: Any,
                                                                tmp_path: Path) -> None:
    out = tmp_path / "ran"
    files = tmp_path / "schedules.d"
    files.mkdir(mode=0o755)
    (files / "f.yml").write_text(yaml.safe_dump([
        {"key": "nouser", "cron": YEARLY, "exec": f"echo nouser >> {out}"}]))
    routes = [{"type": "bare", "exec": ["/bin/sh", "-c", f"echo bare >> {out}"]},
              {"type": "py", "python": "json:JSONDecoder"},
              sh("meant", f"echo meant >> {out}", user="root")]
    d: Daemon = daemon_factory({"routes": routes, "schedules_dir": str(files)}).start()
    want = [f"{d.config_path}: routes[0].user: missing; an exec job without user: runs as "
            "the daemon's user, and this daemon runs as root: name the user (user: root only "
            "if meant)",
            f"{d.config_path}: routes[1].user: missing; a python handler runs inside the "
            "daemon, and this one runs as root: write user: root to run it as root"]
    entry = ("schedules file entry nouser: user: missing; an exec job without user: runs as "
             "the daemon's user, and this daemon runs as root: name the user (user: root "
             "only if meant)")
    assert d.status()["refused"] == [*want, entry]
    for line in want:
        d.wait_log(f"{line}; this route is refused, the other routes run")
    for key, kind in (("b", "bare"), ("p", "py"), ("m", "meant")):
        d.ctl("add", key, kind, YEARLY, "-a", "0")
    d.ctl("run", "nouser")
    wait_until(lambda: lines(out) == ["meant"], 15, what="the route with user: root")
    time.sleep(1.5)  # a poll or two: the refused routes run nothing
    assert lines(out) == ["meant"]
    assert {s["key"]: s["last_outcome"] for s in d.ctl_json("list")
            if "@run-" not in s["key"]} == {"b": None, "p": None, "m": "success",
                                            "nouser": None}
    # A reload says the same, and exits 1 (something was refused); the daemon runs on.
    d.config["routes"] = [routes[2], routes[1], routes[0]]
    d.write_config()
    res = d.ctl("reload", check=False)
    assert res.returncode == 1
    assert d.status()["refused"] == [want[1], want[0].replace("routes[0]", "routes[2]"),
                                     entry]
    assert d.alive


def test_notifiers_run_as_notify_user_with_cron_s_environment(daemon_factory: Any) -> None:
    shared = shared_dir()
    sendmail, mailbox = sendmail_stand_in(shared)
    told = shared / "told"
    d: Daemon = daemon_factory({
        "sendmail": str(sendmail),
        "notifiers": {
            "ops": {"mail": "ops@example.com"},
            # Whole or not at all: the test may look while the notifier still writes.
            "script": {"exec": ["/bin/sh", "-c",
                                f"{{ id -u; {DUMP}; }} > {told}.tmp && mv {told}.tmp {told}"]}},
        "routes": [sh("mailed", "exit 3", notify="ops"),
                   sh("scripted", "exit 2", notify="script")]}, env=SECRETS).start()
    d.ctl("add", "m", "mailed", YEARLY, "-a", "0", "--max-attempts", "1")
    d.ctl("add", "x", "scripted", YEARLY, "-a", "0", "--max-attempts", "1")
    wait_until(lambda: mails(mailbox), 15, what="a mail")
    assert mailbox.stat().st_uid == pwd.getpwnam("nobody").pw_uid
    wait_until(lambda: told.exists() and told.read_text(), 15, what="the exec notifier")
    uid, *env_lines = told.read_text().splitlines()
    env = dict(line.split("=", 1) for line in env_lines)
    assert uid == str(pwd.getpwnam("nobody").pw_uid)
    assert env["USER"] == "nobody" and env["PERFECTSCHED_KEY"] == "x"
    assert not {"PGPASSWORD", "PERFECTSCHED_TEST_SECRET"} & set(env)
    assert set(env) - CRON_VARS == {n for n in env if n.startswith("PERFECTSCHED_")}


def test_notify_user_root_is_refused(daemon_factory: Any) -> None:
    shared = shared_dir()
    told = shared / "told"
    d: Daemon = daemon_factory({
        "notify_user": "root",
        "notifiers": {"script": {"exec": ["/bin/sh", "-c", f"id -u > {told}"]}},
        "routes": [sh("scripted", "exit 2", notify="script")]}).start()
    line = (f"{d.config_path}: notify_user: root is root, which may start units: name an "
            "unprivileged user (default nobody); exec and mail notifiers are not sent")
    assert d.status()["refused"] == [line]
    d.ctl("add", "x", "scripted", YEARLY, "-a", "0", "--max-attempts", "1")
    d.wait_log("notification not sent (exec script): " + line)
    assert not told.exists()


APP = '''
from perfectschedd import Application


class Record(Application):
    def run(self):
        with open({out!r}, "a") as f:
            f.write(f"{{self.task.key}} {{self.task.schedule_key}}\\n")
        self.task.finish()
'''


def test_a_job_knows_its_schedule_s_key(daemon_factory: Any, tmp_path: Path) -> None:
    """Extra runs (`run KEY`) and an allow schedule's occurrences run under keys of their
    own (KEY@run-...); PERFECTSCHED_SCHEDULE_KEY and Task.schedule_key name KEY."""
    out, py_out = tmp_path / "exec", tmp_path / "python"
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "record_jobs.py").write_text(APP.format(out=str(py_out)))
    d: Daemon = daemon_factory({"routes": [
        sh("t", f'echo "$PERFECTSCHED_KEY $PERFECTSCHED_SCHEDULE_KEY" >> {out}'),
        {"type": "py", "python": "record_jobs:Record", "user": "root"}]},
        extra_args=["-I", str(mods)]).start()
    d.ctl("add", "once", "t", YEARLY)
    d.ctl("add", "p", "py", YEARLY)
    d.ctl("run", "once")
    d.ctl("run", "p")
    # Two past occurrences of an allow schedule: each on a row of its own.
    d.ctl("add", "many", "t", "* * * * *", "--concurrency", "allow",
          "-s", str(int(time.time()) - 120), "--misfire", "all")
    wait_until(lambda: len([x for x in lines(out) if x.startswith("many@")]) >= 2, 20,
               what="two occurrences of the allow schedule")
    wait_until(lambda: lines(py_out), 15, what="the python run")
    runs = [x.split() for x in lines(out)]
    assert [s for k, s in runs if k.startswith("once@run-")] == ["once"]
    assert {s for k, s in runs if k.startswith("many@run-")} == {"many"}
    ((key, schedule),) = [x.split() for x in lines(py_out)]
    assert key.startswith("p@run-") and schedule == "p"
