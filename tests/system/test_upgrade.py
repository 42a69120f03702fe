"""System test: upgrading the Debian package from the released 0.1.0, as an unattended
upgrade does it, keeps everything (SPEC.md, "Upgrades").

In a namespace of its own (test_system.py's), 0.1.0 is installed with apt, its
configuration edited, schedules added and run; then the .deb of `make deb` is
installed over it with unattended-upgrades' dpkg options, stdin on /dev/null and no
terminal.  The checks: nothing asked, the edited configuration byte for byte, the
daemon restarted on the new code, every schedule and field, every history row, the
every-minute schedule running again, release notes shipped, no traceback.

The 0.1.0 package is built from its commit by `make deb-0.1.0` (never a stored
binary); PERFECTSCHED_OLD_DEB names it.  Like the other system tests, this FAILS when
it cannot run.

Run:  make test-system    or, with both .debs built:
      env PATH=/usr/sbin:/usr/bin:/sbin:/bin \\
          PERFECTSCHED_OLD_DEB=dist/old/perfectsched_0.1.0_all.deb python3 -m pytest -v \\
          -p no:cacheprovider --noconftest -m system tests/system/test_upgrade.py
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import test_system as base
from test_system import CONF, REPO, TOKEN, UNIT, Namespace, ensure_active, wait_for

# test_system.py's module-scoped fixtures: a namespace of this module's own.
deb_file, ns = base.deb_file, base.ns
INNER_SHARE, SYS_PATH = base.INNER_SHARE, base.SYS_PATH

pytestmark = pytest.mark.system

OLD_VERSION = "0.1.0"
OLD_DEB_DEFAULT = REPO / "dist" / "old" / f"perfectsched_{OLD_VERSION}_all.deb"
ROUTE_TYPE = "upgrade-tick"
# In the service's StateDirectory: the only place the hardened unit may write.
TICKS = "/var/lib/perfectsched/upgrade-ticks.log"
SCHEDULES_FILE = "/etc/perfectsched/schedules.d/upgrade.yml"
KEYS = {name: f"upgrade-{name}-{TOKEN}" for name in ("every", "paused", "zoned", "file")}
# Issue 38's High: under 0.1.0 a client stores a row of its own key with the type of a
# root-owned file entry (exec:ROOTJOB); it must never run that entry's command after the
# upgrade.  The entry writes each run's key and time where the test reads them.
ROOTJOB, PLANTED = f"upgrade-rootjob-{TOKEN}", f"upgrade-planted-{TOKEN}"
ROOTJOB_RAN = "/var/lib/perfectsched/upgrade-rootjob.log"
# What a run (or a run in flight at a snapshot) changes in `show --json`.
RUN_FIELDS = {"next_time", "next_run_time", "owner", "claimed_at", "attempt"}
# unattended-upgrades' dpkg options: keep an edited conffile, never ask.
UNATTENDED = ["-o", "Dpkg::Options::=--force-confdef", "-o", "Dpkg::Options::=--force-confold"]


def deb_version(deb: Path) -> str:
    return subprocess.run(["dpkg-deb", "-f", str(deb), "Version"], capture_output=True,
                          text=True, check=True, env=dict(os.environ, PATH=SYS_PATH)
                          ).stdout.strip()


@pytest.fixture(scope="module")
def old_deb_file() -> Path:
    base._require_host()
    path = os.environ.get("PERFECTSCHED_OLD_DEB")
    deb = Path(path) if path else OLD_DEB_DEFAULT
    if not path and not deb.is_file():
        r = subprocess.run(["make", "-C", str(REPO), f"deb-{OLD_VERSION}"], text=True,
                           capture_output=True, timeout=1800,
                           env=dict(os.environ, PATH=SYS_PATH))
        assert r.returncode == 0, (f"make deb-{OLD_VERSION} failed:\n{r.stdout[-3000:]}\n"
                                   f"{r.stderr[-3000:]}")
    assert deb.is_file(), (f"{deb} does not exist: the upgrade test needs the {OLD_VERSION} "
                           f"package (make deb-{OLD_VERSION}; PERFECTSCHED_OLD_DEB)")
    assert deb_version(deb) == OLD_VERSION, f"{deb} is not version {OLD_VERSION}"
    return deb


def apt_install(ns: Namespace, deb: Path) -> str:
    """apt-get install of a .deb copied into the share; its output."""
    (ns.share / deb.name).write_bytes(deb.read_bytes())
    argv = ["apt-get", "install", "-y", "-q", f"{INNER_SHARE}/{deb.name}"]
    r = ns.run(*argv, check=False, timeout=900)
    if r.returncode != 0:  # stale or missing package lists: refresh them (inside only)
        ns.run("apt-get", "update", "-q", timeout=600)
        r = ns.run(*argv, timeout=900)
    return r.stdout + r.stderr


def sha256(ns: Namespace, path: str) -> str:
    return ns.out("sha256sum", path).split()[0]


def dpkg_status(ns: Namespace) -> dict[str, str]:
    out = ns.out("dpkg", "-s", "perfectsched")
    return dict(line.split(": ", 1) for line in out.splitlines()
                if ": " in line and not line.startswith(" "))


def main_pid(ns: Namespace) -> int:
    return int(ns.show("MainPID")["MainPID"])


def ctl_json(ns: Namespace, *args: str) -> Any:
    return json.loads(ns.ctl("--json", *args).stdout)


def history(ns: Namespace, key: str) -> list[dict[str, Any]]:
    return ctl_json(ns, "history", key, "-n", "1000")


def ticks(ns: Namespace) -> list[str]:
    return ns.run("cat", TICKS, check=False).stdout.splitlines()


def snapshot(ns: Namespace) -> dict[str, Any]:
    """Every schedule (list and show) and history row, taken while no run holds a
    lease (a run in flight shows its lease times)."""
    def take():
        shows = {k: ctl_json(ns, "show", k) for k in KEYS.values()}
        if any(s["owner"] for s in shows.values()):
            return None
        return {"list": {s["key"]: s for s in ctl_json(ns, "list")}, "show": shows,
                "history": {k: history(ns, k) for k in KEYS.values()}, "ticks": ticks(ns)}

    return wait_for(take, 20, "a moment with no run in flight", lambda: ns.journal(20))


def edit_config(text: str, port: int) -> str:
    """The administrator's edits of the packaged perfectsched.yml: a comment, harmless
    values changed, an exec route; every other line as shipped."""
    route = ["/bin/sh", "-c",
             f'echo "tick $1 $PERFECTSCHED_SCHEDULED_TIME $PERFECTSCHED_ATTEMPT" >> {TICKS}',
             "upgrade-tick"]
    lines = [f"# Edited by the administrator before the upgrade ({TOKEN}).\n"]
    seen = set()
    for line in text.splitlines(keepends=True):
        key = line.split(":", 1)[0]
        if key == "metrics_listen":
            # the namespace shares the host's network: the packaged port may be taken
            line = f"metrics_listen: 127.0.0.1:{port}\n"
        elif key == "poll_interval":
            line = "poll_interval: 0.5\n"
        lines.append(line)
        if key == "routes":
            lines.append(f"  - type: {ROUTE_TYPE}  # the administrator's route\n"
                         f"    exec: {json.dumps(route)}\n    timeout: 30\n")
        seen.add(key)
    assert {"metrics_listen", "poll_interval", "routes"} <= seen, (
        f"the packaged {CONF} lacks a key edit_config() changes:\n{text}")
    return "".join(lines)


# --------------------------------------------------------------------------------------
# 0.1.0 installed, configured and at work; then the unattended upgrade
# --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def before(old_deb_file: Path, ns: Namespace) -> dict[str, Any]:
    out = apt_install(ns, old_deb_file)
    assert dpkg_status(ns)["Version"] == OLD_VERSION, out[-2000:]
    edited = edit_config(ns.out("cat", CONF) + "\n", base._free_port())
    ns.write(CONF, edited, mode="0644")
    # A schedules file is the administrator's too (not a conffile: dpkg never owns it).
    ns.write(SCHEDULES_FILE, json.dumps([{
        "key": KEYS["file"], "cron": "45 4 * * 1", "timezone": "Europe/Berlin",
        "exec": "echo file-entry", "misfire": "skip", "max_attempts": 2}, {
        "key": ROOTJOB, "cron": "0 0 1 1 *",
        "exec": f'echo "$PERFECTSCHED_KEY $(date +%s)" >> {ROOTJOB_RAN}'}], indent=2) + "\n")
    ns.run("systemctl", "restart", UNIT, timeout=150)
    st = ensure_active(ns)
    base.journal_showing(ns, f"perfectschedd {re.escape(OLD_VERSION)} starting", pid=st["MainPID"])

    # A past --start: the occurrences since then run at once, oldest first.
    ns.ctl("add", KEYS["every"], ROUTE_TYPE, "* * * * *", json.dumps({"token": TOKEN}),
           "--start", str(int(time.time()) - 150))
    ns.ctl("add", KEYS["paused"], ROUTE_TYPE, "@hourly", '{"paused": true}')
    ns.ctl("pause", KEYS["paused"])
    ns.ctl("add", KEYS["zoned"], ROUTE_TYPE, "30 3 * * *",
           json.dumps({"nested": {"list": [1, 2.5, "drei"], "none": None}}),
           "-t", "Asia/Tokyo", "-d", "45", "--misfire", "latest", "--grace", "600",
           "--max-attempts", "3", "--retry-wait", "7", "--jitter", "20", "--timeout", "99")
    # The planted row (0.1.0 accepted any exec: type): it runs the entry's command there.
    ns.ctl("add", PLANTED, f"exec:{ROOTJOB}", "* * * * *", '{"planted": "under 0.1.0"}',
           "--start", str(int(time.time()) - 60))
    wait_for(lambda: len(history(ns, KEYS["every"])) >= 2, 30,
             "the every-minute schedule's catch-up runs", lambda: ns.journal(30))
    wait_for(lambda: history(ns, PLANTED), 30, "the planted row's run under 0.1.0",
             lambda: ns.journal(30))
    snap = snapshot(ns)
    assert set(KEYS.values()) <= set(snap["list"]), snap["list"]
    assert snap["show"][KEYS["paused"]]["paused"] is True, snap["show"]
    assert snap["show"][KEYS["file"]]["source"] != "api", snap["show"]
    runs = snap["history"][KEYS["every"]]
    assert all(r["outcome"] == "success" for r in runs), runs
    # the runs went through the administrator's route: one line each in the file
    assert {f"tick {KEYS['every']} {r['scheduled_time']} 1" for r in runs} <= set(
        snap["ticks"]), (runs, snap["ticks"])
    assert any(line.startswith(f"{PLANTED} ") for line in ns.run(
        "cat", ROOTJOB_RAN, check=False).stdout.splitlines()), "0.1.0 ran no planted row"
    return {"conf_sha256": sha256(ns, CONF), "file_sha256": sha256(ns, SCHEDULES_FILE),
            "main_pid": main_pid(ns), "workers": ns.children(main_pid(ns)), **snap}


@pytest.fixture(scope="module")
def upgraded(ns: Namespace, before: dict[str, Any], deb_file: Path) -> dict[str, Any]:
    new_version = deb_version(deb_file)
    newer = subprocess.run(["dpkg", "--compare-versions", new_version, "gt", OLD_VERSION],
                           env=dict(os.environ, PATH=SYS_PATH))
    assert newer.returncode == 0, f"{deb_file} ({new_version}) is not newer than {OLD_VERSION}"
    (ns.share / deb_file.name).write_bytes(deb_file.read_bytes())
    # As unattended-upgrades runs it: no terminal (setsid), stdin /dev/null, noninteractive
    # debconf, its dpkg options.  Anything that asks fails or hangs here.
    cmd = shlex.join(["apt-get", "install", "-y", "-q", *UNATTENDED,
                      f"{INNER_SHARE}/{deb_file.name}"])
    t0, started = time.monotonic(), time.time()
    r = ns.run("setsid", "-w", "sh", "-c", f"exec {cmd} </dev/null",
               check=False, timeout=600)
    took = time.monotonic() - t0
    output = r.stdout + r.stderr
    print(f"upgrade {OLD_VERSION} -> {new_version}: apt-get took {took:.1f}s\n"
          + "\n".join(x for x in output.splitlines() if "Reading database" not in x))
    assert r.returncode == 0, f"unattended upgrade failed (exit {r.returncode}):\n{output}"
    return {"version": new_version, "output": output, "seconds": took, "started": started}


# --------------------------------------------------------------------------------------
# the checks
# --------------------------------------------------------------------------------------

def test_up01_upgrade_asks_nothing_and_installs_the_new_version(
        ns: Namespace, upgraded: dict[str, Any]) -> None:
    out = upgraded["output"]
    # A question would have read /dev/null and failed the run (the fixture asserts it
    # succeeded); dpkg's conffile question shows in the output even when answered.
    assert "(Y/I/N/O/D/Z)" not in out, out
    # 0.3.0 changed the shipped configuration's comments (the password out of url:, issue
    # 38): dpkg says it keeps the administrator's edited one, as unattended-upgrades'
    # options tell it to, and asks nothing.  Any other conffile notice is a failure.
    notices = re.findall(r"Configuration file '([^']*)'\n((?: ==> .*\n)+)", out)
    assert [path for path, _ in notices] in ([], [CONF]), out
    assert all("==> Keeping old config file as default." in said for _, said in notices), out
    st = dpkg_status(ns)
    assert st["Version"] == upgraded["version"], st
    assert st["Status"] == "install ok installed", st
    assert upgraded["seconds"] < 300, upgraded["seconds"]


def test_up02_the_edited_configuration_is_kept_byte_for_byte(
        ns: Namespace, before: dict[str, Any], upgraded) -> None:
    assert sha256(ns, CONF) == before["conf_sha256"], ns.out("cat", CONF)
    assert sha256(ns, SCHEDULES_FILE) == before["file_sha256"]
    # with --force-confold a conffile changed in the package leaves the new one beside
    # it; not an error, but worth seeing in the output
    print(ns.sh("ls -la /etc/perfectsched /etc/perfectsched/schedules.d").stdout)
    conffiles = ns.out("dpkg-query", "-W", "-f=${Conffiles}", "perfectsched")
    assert CONF in conffiles, conffiles


def test_up02b_the_configuration_is_no_longer_world_readable(
        ns: Namespace, before: dict[str, Any], upgraded) -> None:
    """0.1.0 installed the configuration 0644: the administrator's edited one (which may
    hold the database password), still of the package's mode and owner, is now root's
    and the daemon's group's only, and so is the schedules directory (issue 38)."""
    assert ns.out("stat", "-c", "%a %U:%G", CONF) == "640 root:perfectsched"
    assert ns.out("stat", "-c", "%a %U:%G", base.SCHEDULES_DIR) == "750 root:perfectsched"
    r = ns.run("runuser", "-u", "nobody", "--", "cat", CONF, check=False)
    assert r.returncode != 0 and "Permission denied" in r.stderr, r
    r = ns.run("runuser", "-u", "nobody", "--", "cat", SCHEDULES_FILE, check=False)
    assert r.returncode != 0 and "Permission denied" in r.stderr, r


def test_up03_the_daemon_runs_the_new_code(
        ns: Namespace, before: dict[str, Any], upgraded: dict[str, Any]) -> None:
    version = upgraded["version"]
    st = wait_for(lambda: (s := ns.show("ActiveState", "SubState", "MainPID"))[
        "ActiveState"] in ("active", "failed", "inactive") and s, 100, "the restarted unit")
    assert (st["ActiveState"], st["SubState"]) == ("active", "running"), (
        f"{st}\n{ns.journal(40)}")
    new_pid = int(st["MainPID"])
    assert new_pid != before["main_pid"], f"not restarted: MainPID still {new_pid}"
    assert ns.out("perfectschedd", "--version") == f"perfectschedd {version}"
    # the old daemon was stopped gracefully (leases released), not killed
    base.journal_showing(ns, r"^master\[\d+\]: stopped$", pid=before["main_pid"])
    workers = ns.children(new_pid)
    assert workers and not set(workers) & set(before["workers"]), (workers, before["workers"])
    # the new daemon brought the database to its schema by itself (no init) and records
    # itself among the hosts
    base.journal_showing(ns, f"perfectschedd {re.escape(version)} starting",
                         r"database schema updated from 1 \(perfectsched 0\.1\.0\) to \d+",
                         pid=new_pid)
    status = ns.ctl("status")
    print(status.stdout)
    hosts = ctl_json(ns, "status")["hosts"]
    assert [h["version"] for h in hosts if h.get("last_seen")] == [version], hosts


def test_up04_every_schedule_is_kept_with_every_field(
        ns: Namespace, before: dict[str, Any], upgraded) -> None:
    ensure_active(ns)
    after_list = {s["key"]: s for s in ctl_json(ns, "list")}
    assert set(after_list) == set(before["list"]), (sorted(before["list"]), sorted(after_list))
    for key in KEYS.values():
        old_show, new_show = before["show"][key], ctl_json(ns, "show", key)
        if after_list[key]["next_time"] != before["list"][key]["next_time"]:
            # A claim advances the time when the run starts; its history row comes when it
            # ends: a run in flight at the listing is waited for, not mistaken for a change.
            wait_for(lambda k=key: len(history(ns, k)) > len(before["history"][k]), 90,
                     f"the run that moved {key}'s next time", lambda: ns.journal(30))
        ran = len(history(ns, key)) > len(before["history"][key])
        # A run moves the times (and a run in flight holds a lease): nothing else.
        moving = RUN_FIELDS if ran else set()
        for name, old in (("list --json", before["list"][key]), ("show --json", old_show)):
            new = after_list[key] if name == "list --json" else new_show
            assert set(new) >= set(old), f"{key}: {name} lost {set(old) - set(new)}"
            # 0.1.0 showed an unset max_attempts as 0; it shows as unset (null) now: the
            # same, retry until success unless the configuration says otherwise.
            changed = {f: (old[f], new[f]) for f in old if f not in moving and old[f] != new[f]
                       and not (f == "max_attempts" and (old[f], new[f]) == (0, None))}
            assert not changed, f"{key}: {name} changed {changed}"
        if ran:
            assert new_show["next_time"] > old_show["next_time"], (old_show, new_show)
            assert new_show["next_time"] % 60 == 0, new_show
    assert ctl_json(ns, "show", KEYS["paused"])["paused"] is True


def test_up05_every_history_row_is_kept(ns: Namespace, before: dict[str, Any], upgraded
                                        ) -> None:
    for key, rows in before["history"].items():
        after = history(ns, key)
        # Rows gain fields (exit code, output, ...: null for 0.1.0's): compare 0.1.0's.
        kept = [{f: r.get(f) for f in rows[0]} for r in after] if rows else []
        missing = [r for r in rows if r not in kept]
        assert not missing, f"{key}: history rows lost by the upgrade: {missing}\nnow: {after}"
    now = ticks(ns)
    assert now[:len(before["ticks"])] == before["ticks"], (before["ticks"], now)


def test_up06_the_every_minute_schedule_runs_again(
        ns: Namespace, before: dict[str, Any], upgraded) -> None:
    key = KEYS["every"]
    new_workers = {str(p) for p in ns.children(main_pid(ns))}
    last = max(r["scheduled_time"] for r in before["history"][key])

    def new_run():
        return [r for r in history(ns, key) if r["scheduled_time"] > last
                and r["worker"].rpartition(":")[2] in new_workers]

    # at most a minute: the next occurrence after the last one that ran
    runs = wait_for(new_run, 90, "a run of the every-minute schedule by the new daemon",
                    lambda: f"{history(ns, key)[:3]}\n{ns.journal(30)}", interval=1)
    assert all(r["outcome"] == "success" for r in runs), runs
    lines = ticks(ns)
    assert {f"tick {key} {r['scheduled_time']} 1" for r in runs} <= set(lines), (runs, lines)


def test_up10_a_row_planted_under_0_1_0_is_paused_and_never_runs(
        ns: Namespace, before: dict[str, Any], upgraded: dict[str, Any]) -> None:
    """After up06: a minute boundary has passed under the new daemon, when the planted
    row (* * * * *) would have run again."""
    row = ctl_json(ns, "show", PLANTED)
    assert row["paused"] is True, row
    assert row["paused_reason"].startswith("refused by perfectschedd: "), row
    # The new daemon's start (the old one runs on while apt unpacks): boot time plus
    # its MainPID's start in clock ticks since boot.
    since = int(ns.sh("echo $(( $(awk '/^btime/ {print $2}' /proc/stat) + "
                      f"$(cut -d' ' -f22 /proc/{main_pid(ns)}/stat) / $(getconf CLK_TCK) ))"
                      ).stdout)
    assert upgraded["started"] - 1 <= since <= time.time(), since
    old_workers = {str(p) for p in before["workers"]}
    assert not [r for r in history(ns, PLANTED)
                if r["outcome"] != "refused" and r["started_at"] >= since - 1
                and r["worker"].rpartition(":")[2] not in old_workers]
    ran = ns.run("cat", ROOTJOB_RAN, check=False).stdout.splitlines()
    late = [x for x in ran if x.startswith(f"{PLANTED} ") and int(x.split()[1]) > since]
    assert not late, ran
    refused = ctl_json(ns, "status")["refused_rows"]
    assert [r["key"] for r in refused] == [PLANTED], refused
    assert f"refused schedule, paused, never runs: {PLANTED!r}" in ns.ctl("status").stdout
    base.journal_showing(ns, rf"schedule '{re.escape(PLANTED)}' refused and paused: "
                         rf"type exec:{re.escape(ROOTJOB)}, creator unknown",
                         pid=main_pid(ns))
    # NEWS.Debian tells the administrator what was paused and how to look.
    debian_news = ns.run("zcat", "/usr/share/doc/perfectsched/NEWS.Debian.gz").stdout
    assert "perfectschedctl status" in debian_news and "exec:" in debian_news, debian_news


def test_up07_release_notes(ns: Namespace, before, upgraded: dict[str, Any]) -> None:
    doc = "/usr/share/doc/perfectsched"
    version = upgraded["version"]
    # NEWS.md: the users' release notes, shipped as documentation.
    news = ns.sh(f'for f in {doc}/NEWS.md {doc}/NEWS.md.gz; do [ -e "$f" ] && zcat -f "$f"; '
                 "done; true").stdout
    assert f"## {version}" in news, f"{doc}/NEWS.md lacks a section for {version}:\n{news}"
    # NEWS.Debian: only what an administrator must act on (apt-listchanges shows it on
    # upgrade).  Optional; when there, it is a Debian changelog whose entries are for
    # versions up to the installed one.
    debian_news = ns.run("zcat", f"{doc}/NEWS.Debian.gz", check=False)
    # 0.2.0 turns 0.1.0's active polkit grant off: the administrator is told how to
    # turn it on again.
    assert debian_news.returncode == 0, debian_news.stderr
    assert "perfectsched-grant enable" in debian_news.stdout, debian_news.stdout
    versions = re.findall(r"^perfectsched \(([^)]+)\) ", debian_news.stdout, re.M)
    assert versions, f"NEWS.Debian.gz has no entry:\n{debian_news.stdout}"
    for v in versions:
        ns.run("dpkg", "--compare-versions", v, "le", version)
    print(f"NEWS.Debian.gz entries: {versions}")


def test_up09_the_polkit_grant_is_off_after_the_upgrade(
        ns: Namespace, before: dict[str, Any], upgraded: dict[str, Any]) -> None:
    """0.1.0 installed its polkit rule active; after the upgrade it is gone and the daemon
    holds no grant (perfectsched-grant enable turns it on)."""
    assert ns.run("test", "-e", "/usr/share/polkit-1/rules.d/perfectsched.rules",
                  check=False).returncode != 0
    r = ns.run("perfectsched-grant", "status", check=False)
    assert r.returncode == 3 and "disabled" in r.stdout, r.stdout + r.stderr
    wait_for(lambda: "polkit grant to start units: not held" in ns.journal(200), 30,
             "the daemon's word on the grant", lambda: ns.journal(60))


def test_up08_no_traceback_in_the_journal(ns: Namespace, before, upgraded) -> None:
    journal = ns.journal()
    assert "Traceback" not in journal, journal[-6000:]
    assert ns.show("ActiveState")["ActiveState"] == "active"
