"""System test: jobs as systemd transient units (`executor: systemd`, issue #17), with
the Debian package installed under a real systemd (the namespace of test_system.py, a
namespace of its own for this module).

Each check runs real jobs through the installed daemon (user perfectsched, hardened
unit) and looks at them from outside: systemctl, journalctl, the polkit rule as the
perfectsched user, `perfectschedctl history` and `logs`.

Run:  make test-system    or, with a built .deb:
      env PATH=/usr/sbin:/usr/bin:/sbin:/bin python3 -m pytest -v -p no:cacheprovider \
          --noconftest -m system tests/system/test_units.py
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

import pytest
import test_system as base
import yaml
from test_system import CONF, SOCK, TOKEN, UNIT, Namespace, ensure_active, wait_for

# The module-scoped fixtures of test_system.py: this module boots a namespace of its own
# and installs the package there.
deb_file, ns, installed = base.deb_file, base.ns, base.installed

pytestmark = pytest.mark.system

SCHEDULES = "/etc/perfectsched/schedules.d/units.yml"


def entry(key: str, command: str, **extra: Any) -> dict[str, Any]:
    # Daily at a time that does not come during the test: every run here is `run KEY`.
    # A user other than perfectsched: with the grant on, none may run as the daemon's.
    return {"key": key, "cron": "17 3 * * *", "exec": ["/bin/sh", "-c", command],
            "executor": "systemd", "user": "nobody", **extra}


# A job that tries to become root through systemd, and says how it went.
ESCAPE = ('if out=$(systemd-run --wait --pipe --quiet -p User=root /usr/bin/id -u 2>&1); '
          'then echo "ESCAPED uid=$out"; else echo "escape refused: $out" | head -c 300; '
          'echo; fi; '
          'if busctl call org.freedesktop.systemd1 /org/freedesktop/systemd1 '
          'org.freedesktop.systemd1.Manager ClearJobs >/dev/null 2>&1; '
          'then echo "ESCAPED ClearJobs"; else echo "ClearJobs refused"; fi')


KEYS = {name: f"unit-{name}-{TOKEN}" for name in
        ("whoami", "oom", "timeout", "later", "sleeper", "leftover", "busrestart",
          "frozenbus", "asdaemon", "drained")}


@pytest.fixture(scope="module")
def units(ns: Namespace, installed) -> dict[str, Any]:
    config = {
        "type": "rdb_compat", "url": "sqlite:////var/lib/perfectsched/perfectsched.db",
        "control_socket": SOCK, "metrics_listen": f"127.0.0.1:{base._free_port()}",
        "workers": 2, "poll_interval": 0.5, "retry_wait": 2, "kill_grace": 2,
        "alive_time": 30,
    }
    # With the grant on, a plain exec route and a unit as the daemon's user are refused.
    config["routes"] = [{"type": f"plain-{TOKEN}", "exec": ["/bin/sh", "-c", ESCAPE]},
                        {"type": f"asroot-{TOKEN}", "exec": ["/usr/bin/id"],
                         "executor": "systemd", "user": "root"},
                        {"type": f"asnobody-{TOKEN}", "exec": ["/usr/bin/id"],
                         "executor": "systemd", "user": "nobody", "allow": ["@ops"]}]
    entries = [
        entry(KEYS["whoami"], 'echo "unit-out uid=$(id -u) key=$PERFECTSCHED_KEY '
                              'attempt=$PERFECTSCHED_ATTEMPT data=$(cat)"; '
                              'echo "unit-err on stderr" >&2; ' + ESCAPE,
              data={"token": TOKEN}),
        entry(KEYS["asdaemon"], "id -u", user=None),
        entry(KEYS["oom"], "exec python3 -c 'b = bytearray(200 * 1024 * 1024)\n"
                           "for i in range(0, len(b), 4096): b[i] = 1\n"
                           "print(\"survived\", len(b))'",
              unit={"MemoryMax": "50M"}, max_attempts=1),
        entry(KEYS["timeout"], "echo timeout-start; exec sleep 60", timeout=2,
              max_attempts=1),
        # SCHED_LATER on its first run only: a run after it keeps its attempt number,
        # so the first is told by its start, within 15 s of `run KEY` (the occurrence).
        entry(KEYS["later"], 'echo "later attempt=$PERFECTSCHED_ATTEMPT"; '
                             'if [ $(( $(date +%s) - PERFECTSCHED_SCHEDULED_TIME )) -lt 15 ]; '
                             'then echo "SCHED_LATER 15"; exit 3; fi'),
        entry(KEYS["sleeper"], 'echo "sleeper start attempt=$PERFECTSCHED_ATTEMPT"; '
                               'exec sleep 300'),
        entry(KEYS["leftover"], 'echo "leftover start"; exec sleep 300'),
        entry(KEYS["busrestart"], 'sleep 6; echo "busrestart done"'),
        entry(KEYS["drained"], 'echo "drained start"; sleep 40; echo "drained end"'),
        entry(KEYS["frozenbus"], 'echo "frozenbus start attempt=$PERFECTSCHED_ATTEMPT"; '
                                 'exec sleep 300'),
    ]
    ns.write(CONF, json.dumps(config, indent=2) + "\n")
    ns.write(SCHEDULES, json.dumps([{k: v for k, v in e.items() if v is not None}
                                    for e in entries], indent=2) + "\n")
    enabled = ns.run("perfectsched-grant", "enable")
    assert "enabled for systemd" in enabled.stdout, enabled.stdout + enabled.stderr
    ns.run("systemctl", "restart", UNIT, timeout=150)
    ensure_active(ns)
    wait_for(lambda: all(k in ns.ctl("list").stdout for k in KEYS.values()), 30,
             "the schedules file's entries in the database", lambda: journal(ns))
    return config


def reload_refusing_routes(ns: Namespace) -> None:
    """systemctl reload under this module's configuration, which refuses a route and an
    entry on purpose (the grant is on): the reload runs the rest and fails naming them
    (its ExecReload is perfectschedctl reload, which exits 1 on any refusal: #28)."""
    r = ns.run("systemctl", "reload", UNIT, timeout=60, check=False)
    assert r.returncode != 0, "a reload that refused routes succeeded"
    ensure_active(ns)  # what it refused runs nothing; the rest of the daemon runs on
    refused = json.loads(ns.ctl("--json", "status").stdout)["refused"]
    assert any("routes[0].executor: an exec job runs as" in line for line in refused), refused


def journal(ns: Namespace, unit: str = UNIT, lines: int = 60) -> str:
    return ns.run("journalctl", "--no-pager", "-o", "cat", "-u", unit, "-n", str(lines),
                  check=False).stdout


def history(ns: Namespace, key: str) -> list[dict[str, Any]]:
    return json.loads(ns.ctl("history", key, "--json").stdout)


def runs_until(ns: Namespace, key: str, pred: Any, timeout: float, what: str
               ) -> list[dict[str, Any]]:
    return wait_for(lambda: (h := history(ns, key)) and pred(h) and h, timeout, what,
                    lambda: f"history: {history(ns, key)}\n{journal(ns)}")


def escaped(key: str) -> str:
    """systemd-escape of the keys used here (letters, digits, "-")."""
    return key.replace("-", "\\x2d")


def bus_path(unit: str) -> str:
    """The D-Bus object path of a unit (sd_bus_path_encode)."""
    return "/org/freedesktop/systemd1/unit/" + "".join(
        c if c.isascii() and c.isalnum() else f"_{ord(c):02x}" for c in unit)


def ref_unit(ns: Namespace, user: str, unit: str) -> Any:
    """The Ref() of a unit by `user` (as a worker does again after a bus restart)."""
    return as_user(ns, user, "busctl", "call", "org.freedesktop.systemd1", bus_path(unit),
                   "org.freedesktop.systemd1.Unit", "Ref")


def active_units(ns: Namespace, key: str) -> list[str]:
    """Active units of runs of `key` (its extra runs, `run KEY`, included)."""
    out = ns.out("systemctl", "list-units", "--no-legend", "--plain", "--state=active",
                 "perfectsched-*")
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [n for n in names if n.startswith(f"perfectsched-{escaped(key)}")]


def unit_times(ns: Namespace, unit: str) -> list[int]:
    """The journal times (µs) of what systemd logged about `unit`."""
    out = ns.run("journalctl", "--no-pager", "-o", "json", "-u", unit, "_PID=1",
                 check=False).stdout
    return [int(json.loads(line)["__REALTIME_TIMESTAMP"]) for line in out.splitlines()
            if line.strip()]


def memory_controller(ns: Namespace) -> bool:
    return "memory" in ns.out("cat", "/sys/fs/cgroup/cgroup.controllers").split()


# --------------------------------------------------------------------------------------


def as_user(ns: Namespace, user: str, *argv: str) -> Any:
    return ns.run("runuser", "-u", user, "--", *argv, check=False, timeout=60)


def test_u00_no_grant_after_install(ns: Namespace, installed) -> None:
    """The grant is off as installed: the daemon's user cannot start a unit as root, nor
    can an exec job (they run as that user), and the daemon says it holds no grant."""
    r = ns.run("perfectsched-grant", "status", check=False)
    assert r.returncode == 3 and "disabled" in r.stdout, r.stdout + r.stderr
    assert ns.run("test", "-e", "/usr/share/polkit-1/rules.d/perfectsched.rules",
                  check=False).returncode != 0, "0.1.0's active rule is still installed"
    r = as_user(ns, "perfectsched", "systemd-run", "--wait", "--pipe", "--quiet", "-p",
                "User=root", "/usr/bin/id", "-u")
    assert r.returncode != 0 and r.stdout.strip() != "0", r.stdout + r.stderr
    config = yaml.safe_load(ns.out("cat", CONF))
    config["routes"] = [{"type": f"escape-{TOKEN}", "exec": ["/bin/sh", "-c", ESCAPE]}]
    ns.write(CONF, json.dumps(config, indent=2) + "\n")
    ns.run("systemctl", "restart", UNIT, timeout=150)
    pid = ensure_active(ns)["MainPID"]
    base.journal_showing(ns, "polkit grant to start units: not held", pid=pid)  # this daemon's
    key = f"escape-{TOKEN}"
    ns.ctl("add", key, f"escape-{TOKEN}", "17 3 * * *")
    ns.ctl("run", key)
    wait_for(lambda: "escape refused" in journal(ns) or "ESCAPED" in journal(ns), 60,
             "the escaping job's verdict", lambda: journal(ns))
    assert "ESCAPED" not in journal(ns, lines=400), journal(ns)


def test_u01_the_polkit_rule(ns: Namespace, installed) -> None:
    """Enabled with the documented command: user perfectsched may start, stop and kill
    perfectsched-*.service units, and may not start, stop or restart any other unit;
    other users get nothing from the rule; the documented command turns it off."""
    r = ns.run("perfectsched-grant", "enable")
    link = ns.out("readlink", "/etc/polkit-1/rules.d/60-perfectsched.rules")
    systemd = int(ns.out("systemctl", "--version").split()[1])
    assert link == ("/usr/share/perfectsched/polkit-1/perfectsched.rules" if systemd >= 257
                    else "/usr/share/perfectsched/polkit-1/perfectsched-before-257.rules")
    assert "perfectsched-" in ns.out("cat", link)
    # The mark the daemon reads when systemd cannot answer it (polkit's directory is not
    # readable by the daemon's user).
    assert ns.out("cat", "/etc/perfectsched/polkit-grant-enabled") == link
    assert ns.run("runuser", "-u", "perfectsched", "--", "test", "-r",
                  "/etc/perfectsched/polkit-grant-enabled", check=False).returncode == 0
    ns.run("systemctl", "restart", "polkit.service")  # reads the rule (it also watches)

    ours = f"perfectsched-x-{TOKEN}.service"
    r = as_user(ns, "perfectsched", "systemd-run", f"--unit={ours}", "--collect",
                "/bin/sleep", "120")
    assert r.returncode == 0, r.stderr
    assert ns.out("systemctl", "is-active", ours, check=False) == "active"
    r = as_user(ns, "perfectsched", "systemctl", "kill", "--signal=SIGCONT", ours)
    assert r.returncode == 0, r.stderr
    # Ref(): a worker's new bus connection keeps its unit's result (test_u08)
    r = ref_unit(ns, "perfectsched", ours)
    assert r.returncode == 0, r.stderr
    r = as_user(ns, "perfectsched", "systemctl", "stop", ours)
    assert r.returncode == 0, r.stderr
    assert ns.out("systemctl", "is-active", ours, check=False) != "active"

    other = f"other-{TOKEN}.service"
    ns.write(f"/etc/systemd/system/{other}", "[Service]\nExecStart=/bin/sleep 600\n")
    ns.run("systemctl", "daemon-reload")
    r = as_user(ns, "perfectsched", "systemctl", "start", other)
    assert r.returncode != 0 and ns.out("systemctl", "is-active", other, check=False) \
        != "active", r.stdout + r.stderr
    ns.run("systemctl", "start", other)
    for argv in (["systemctl", "stop", other], ["systemctl", "kill", other],
                 ["systemctl", "restart", "dbus.service"],
                 ["systemctl", "stop", "ssh.service"],
                 ["systemctl", "stop", "systemd-journald.service"]):
        r = as_user(ns, "perfectsched", *argv)
        assert r.returncode != 0, f"{argv} was allowed"
        assert re.search(r"Access denied|not loaded|not found", r.stderr), r.stderr
    assert ns.out("systemctl", "is-active", other) == "active"
    ns.run("systemctl", "stop", other)
    if systemd >= 257:
        # The strict rule: a transient unit of another name, and requests that name no
        # unit (ClearJobs), are refused too.
        r = as_user(ns, "perfectsched", "systemd-run", f"--unit=elsewhere-{TOKEN}",
                    "/bin/true")
        assert r.returncode != 0 and "Access denied" in r.stderr, r.stdout + r.stderr
        r = as_user(ns, "perfectsched", "busctl", "call", "org.freedesktop.systemd1",
                    "/org/freedesktop/systemd1", "org.freedesktop.systemd1.Manager",
                    "ClearJobs")
        assert r.returncode != 0, r.stdout + r.stderr
        r = ref_unit(ns, "perfectsched", "dbus.service")
        assert r.returncode != 0 and "Access denied" in r.stderr, r.stdout + r.stderr
    # The rule is for perfectsched only.
    r = as_user(ns, "nobody", "systemd-run", f"--unit=perfectsched-y-{TOKEN}", "/bin/true")
    assert r.returncode != 0
    # The documented way to turn it off.
    ns.run("perfectsched-grant", "disable")
    assert ns.run("test", "-e", "/etc/perfectsched/polkit-grant-enabled",
                  check=False).returncode != 0
    try:
        ns.run("systemctl", "restart", "polkit.service")
        r = as_user(ns, "perfectsched", "systemd-run", f"--unit=perfectsched-z-{TOKEN}",
                    "--collect", "/bin/true")
        # No rule answers: polkit's default for manage-units (an administrator's word).
        assert r.returncode != 0 and re.search(
            r"Access denied|Interactive authentication required", r.stderr), r.stdout + r.stderr
    finally:
        ns.run("perfectsched-grant", "enable")
        ns.run("systemctl", "restart", "polkit.service")


def shipped_config() -> str:
    """etc/perfectsched.yml as the package installs it; only its HTTP port changed
    (the namespace shares the host's network, where the packaged port may be taken)."""
    text = (Path(__file__).resolve().parents[2] / "etc" / "perfectsched.yml").read_text()
    port = base._free_port()
    out = re.sub(r"(?m)^http_listen: .*$", f"http_listen: 127.0.0.1:{port}", text)
    assert out != text, text
    return out


# Before the `units` fixture (which restarts the daemon with its own configuration): this
# test writes configurations of its own.
def test_u15_the_grant_takes_effect_at_once(ns: Namespace, installed) -> None:
    """Issue 39 item 6: with the shipped configuration the documented steps work
    (`perfectsched-grant enable && systemctl reload perfectschedd`).  Issue 38: a running
    exec job (as perfectsched) is stopped by `perfectsched-grant enable`, which returns
    only once it is gone, its history saying why; a rule linked by hand, without the
    script, is noticed within seconds."""
    ns.run("perfectsched-grant", "disable")
    ns.write(CONF, shipped_config())
    ns.run("systemctl", "restart", UNIT, timeout=150)
    ensure_active(ns)
    r = ns.sh("perfectsched-grant enable && systemctl reload perfectschedd", check=False,
              timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr + journal(ns)
    status = json.loads(ns.ctl("--json", "status").stdout)
    assert status["unit_grant"] is True and status["refused"] == [], status

    # A running exec job, as perfectsched, while the grant is off.
    ns.run("perfectsched-grant", "disable")
    config = yaml.safe_load(ns.out("cat", CONF))
    config["routes"] = [{"type": f"held-{TOKEN}",
                         "exec": ["/bin/sh", "-c", 'echo "held-job $$"; exec sleep 300']}]
    ns.write(CONF, json.dumps(config, indent=2) + "\n")
    ns.run("systemctl", "restart", UNIT, timeout=150)
    ensure_active(ns)
    key = f"held-{TOKEN}"
    ns.ctl("add", key, f"held-{TOKEN}", "17 3 * * *")
    ns.ctl("run", key)
    text = base.journal_showing(ns, r"held-job \d+")
    pid = re.findall(r"held-job (\d+)", text)[-1]
    assert ns.out("ps", "-o", "user=", "-p", pid) == "perfectsched"
    t0 = time.monotonic()
    r = ns.run("perfectsched-grant", "enable", timeout=60)
    assert time.monotonic() - t0 < 30
    assert "no job runs as its user" in r.stdout, r.stdout + r.stderr
    assert ns.run("kill", "-0", pid, check=False).returncode != 0, "the job still runs"
    runs = runs_until(ns, key, bool, 30, "the stopped run's history")
    assert runs[0]["outcome"] == "stopped", runs
    assert runs[0]["error"].startswith("stopped: the polkit grant was enabled (jobs may not "
                                       "run as perfectsched)"), runs
    base.journal_showing(ns, r"the polkit grant to start units is now held",
                         r"routes\[0\]\.executor: an exec job runs as perfectsched")

    # By hand: the rule linked without the script (no mark).
    ns.run("perfectsched-grant", "disable")
    base.journal_showing(ns, r"the polkit grant to start units is now off")
    before = ns.journal().count("the polkit grant to start units is now held")
    systemd = int(ns.out("systemctl", "--version").split()[1])
    rule = "perfectsched.rules" if systemd >= 257 else "perfectsched-before-257.rules"
    ns.run("ln", "-s", f"/usr/share/perfectsched/polkit-1/{rule}",
           "/etc/polkit-1/rules.d/60-perfectsched.rules")
    wait_for(lambda: ns.journal().count("the polkit grant to start units is now held")
             > before, 30, "the daemon noticing the rule linked by hand",
             lambda: journal(ns))
    ns.run("perfectsched-grant", "enable")  # as test_u01 leaves it


def test_u10_with_the_grant_no_job_runs_as_the_daemon_s_user(ns: Namespace, units) -> None:
    """With the grant on: the exec route and the unit without another user are refused
    alone (journal and status), the other units run, and a unit job cannot become root
    through systemd (it runs as nobody, whom polkit grants nothing)."""
    base.journal_showing(ns, "polkit grant to start units: held",
                         r"routes\[0\]\.executor: an exec job runs as perfectsched, the "
                         r"daemon's user, which holds the polkit grant",
                         rf"schedules file entry {KEYS['asdaemon']}: user: the unit would run "
                         r"as perfectsched")
    refused = json.loads(ns.ctl("--json", "status").stdout)["refused_routes"]
    assert len(refused) == 2, refused
    ns.ctl("run", KEYS["whoami"])
    runs = runs_until(ns, KEYS["whoami"], lambda h: h[0]["outcome"] == "success", 60,
                      "the whoami unit's run")
    out = ns.out("journalctl", "--no-pager", "-o", "cat", "-u", runs[0]["unit"])
    assert "escape refused" in out and "ClearJobs refused" in out and "ESCAPED" not in out, out
    ns.ctl("run", KEYS["asdaemon"])
    time.sleep(3)
    assert history(ns, KEYS["asdaemon"]) == []


def test_u02_runs_as_the_user_with_data_on_stdin_output_in_its_unit(
        ns: Namespace, units) -> None:
    key = KEYS["whoami"]
    ns.ctl("run", key)
    runs = runs_until(ns, key, lambda h: any(r["outcome"] == "success" for r in h), 60,
                      "a successful run")
    run = next(r for r in runs if r["outcome"] == "success")
    unit = run["unit"]
    assert unit and unit.startswith(f"perfectsched-{escaped(key)}") and \
        unit.endswith(".service")
    text = wait_for(lambda: "unit-out" in (t := journal(ns, unit)) and t, 20,
                    "the job's output under its unit", lambda: journal(ns))
    line = next(x for x in text.splitlines() if "unit-out" in x)
    assert "uid=65534" in line and "attempt=1" in line, line
    assert json.loads(line.split("data=", 1)[1]) == {"token": TOKEN}
    assert "unit-err on stderr" in text
    assert "unit-out" not in journal(ns, UNIT, 400)  # not in the daemon's own journal
    table = ns.ctl("history", key).stdout
    assert unit in table and "unit" in table.splitlines()[0], table
    logs = ns.ctl("logs", key).stdout
    assert "uid=65534" in logs, logs
    last = [x for x in ns.ctl("logs", key, "-n", "1").stdout.splitlines()
            if x.strip() and not x.startswith("--")]
    assert len(last) == 1, last


def test_u03_sched_later_still_works(ns: Namespace, units) -> None:
    key = KEYS["later"]
    ns.ctl("run", key)
    runs = runs_until(ns, key, lambda h: [r["outcome"] for r in h][:2] ==
                      ["success", "later"], 60, "a run saying SCHED_LATER, then success")
    # The same occurrence and attempt (SCHED_LATER is no failed attempt): the same unit
    # name, free again once the first ended (CollectMode=inactive-or-failed).
    assert runs[0]["unit"] == runs[1]["unit"]
    assert [r["attempt"] for r in runs[:2]] == [1, 1]
    assert "SCHED_LATER 15" in journal(ns, runs[1]["unit"])


def test_u04_memory_max_ends_in_an_oom_failure(ns: Namespace, units) -> None:
    if not memory_controller(ns):
        why = " (this host binds it to its cgroup v1 hierarchy)" \
            if os.path.isdir("/sys/fs/cgroup/memory") else ""
        pytest.skip(f"no cgroup2 memory controller in the namespace{why}: systemd cannot "
                    "enforce MemoryMax here")
    key = KEYS["oom"]
    for n in (1, 2):  # the first run fails; the next one runs (and fails the same way)
        ns.ctl("run", key)
        runs = runs_until(ns, key, lambda h, n=n: len(h) >= n and h[0]["outcome"] == "failed",
                          90, f"failed run {n}")
        unit = runs[0]["unit"]
        assert "survived" not in journal(ns, unit)
        wait_for(lambda u=unit: f"{u} was killed: out of memory" in journal(ns, UNIT, 400),
                 20, "the daemon's OOM line", lambda: journal(ns))
    assert len({r["unit"] for r in history(ns, key)}) >= 2


def test_u05_timeout_stops_the_unit(ns: Namespace, units) -> None:
    key = KEYS["timeout"]
    t0 = time.monotonic()
    ns.ctl("run", key)
    runs = runs_until(ns, key, lambda h: h[0]["outcome"] == "timeout", 40, "a timeout")
    assert time.monotonic() - t0 < 30
    unit = runs[0]["unit"]
    assert not active_units(ns, key)
    assert "timeout-start" in journal(ns, unit)
    base.journal_showing(ns, r"timed out after 2s")
    # max_attempts 1 holds for the extra run too: no retry after retry_wait (2 s), and
    # its row is gone (0.2.0's first cut retried it without end).
    time.sleep(5)
    assert len(history(ns, key)) == 1, history(ns, key)
    running = json.loads(ns.ctl("--json", "status").stdout).get("running", [])
    assert not [r for r in running if r["key"].startswith(key)], running


def _worker_of(ns: Namespace, unit: str) -> int:
    desc = ns.out("systemctl", "show", unit, "--property=Description", "--value")
    m = re.search(r"\(worker [^:]+:(\d+)\)$", desc)
    assert m, desc
    return int(m.group(1))


def test_u06_a_killed_worker_s_unit_stops_before_the_occurrence_runs_again(
        ns: Namespace, units) -> None:
    key = KEYS["sleeper"]
    ns.ctl("run", key)
    first = wait_for(lambda: active_units(ns, key), 30, "the unit running",
                     lambda: journal(ns))[0]
    worker = _worker_of(ns, first)
    shown = ns.out("systemctl", "show", first, "--property=StopPropagatedFrom",
                   "--property=After", "--property=CollectMode", "--property=Type")
    assert "StopPropagatedFrom=perfectschedd.service" in shown.splitlines(), shown
    assert "CollectMode=inactive-or-failed" in shown and "Type=exec" in shown, shown
    ns.run("kill", "-KILL", str(worker))
    second = wait_for(lambda: [u for u in active_units(ns, key) if u != first], 60,
                      "the occurrence running again", lambda: journal(ns))[0]
    assert first not in active_units(ns, key)
    assert _worker_of(ns, second) != worker
    stopped_at = max(unit_times(ns, first))
    started_at = min(unit_times(ns, second))
    assert stopped_at < started_at, (stopped_at, started_at)
    base.journal_showing(ns, rf"stopped 1 systemd unit\(s\) of worker \d+ \(pid {worker}\): "
                         rf"{re.escape(first)}")
    runs = history(ns, key)
    assert runs[0]["outcome"] == "lost" or any(r["outcome"] == "lost" for r in runs), runs

    # Stopping the daemon stops the units it runs.
    ns.run("systemctl", "stop", UNIT, timeout=150)
    assert not active_units(ns, key), ns.out("systemctl", "list-units", "perfectsched-*")
    ns.run("systemctl", "start", UNIT, timeout=150)
    ensure_active(ns)


def test_u07_a_crashed_daemon_s_units_stop_and_leftovers_are_stopped_at_start(
        ns: Namespace, units) -> None:
    """Every process of the daemon killed at once (nothing of it can stop its units):
    systemd stops them (StopPropagatedFrom=).  A unit that names a worker of this host
    and still runs when the daemon starts (left by an instance that could not stop it)
    is stopped before anything runs; another host's is left alone."""
    key = KEYS["leftover"]
    ensure_active(ns)
    ns.ctl("run", key)
    left = wait_for(lambda: active_units(ns, key), 30, "the unit running",
                    lambda: journal(ns))[0]
    ns.run("systemctl", "kill", "--signal=SIGKILL", UNIT)
    wait_for(lambda: left not in active_units(ns, key), 60, "the crashed daemon's unit gone",
             lambda: journal(ns) + ns.out("systemctl", "list-units", "perfectsched-*"))
    wait_for(lambda: ns.show("ActiveState")["ActiveState"] == "active", 60,
             "the daemon restarted (Restart=on-failure)", lambda: journal(ns))
    ns.ctl("delete", key, "--force", check=False)

    node = ns.out("hostname")
    mine, theirs = f"perfectsched-stray-{TOKEN}.service", f"perfectsched-far-{TOKEN}.service"
    for unit, owner in ((mine, f"{node}:1"), (theirs, "other-host:1")):
        ns.run("systemd-run", f"--unit={unit}", "--collect",
               f"--description=PerfectSched job stray (worker {owner})", "/bin/sleep", "300")
    ns.run("systemctl", "restart", UNIT, timeout=150)
    ensure_active(ns)
    assert ns.out("systemctl", "is-active", mine, check=False) != "active"
    assert ns.out("systemctl", "is-active", theirs, check=False) == "active"
    base.journal_showing(ns, r"stopped 1 systemd unit\(s\) of a previous daemon of this host: "
                         + re.escape(mine))
    ns.run("systemctl", "stop", theirs)


def test_u08_a_restarted_system_bus_loses_no_result(ns: Namespace, units) -> None:
    """The worker's D-Bus connection goes away with dbus: it connects again, watches its
    unit again (the signals of the old connection never come) and still gets its
    result."""
    key = KEYS["busrestart"]
    ensure_active(ns)
    ns.ctl("run", key)
    wait_for(lambda: active_units(ns, key), 30, "the unit running", lambda: journal(ns))
    ns.run("systemctl", "restart", "dbus.service", timeout=60)
    runs = runs_until(ns, key, lambda h: h[0]["outcome"] in ("success", "failed"), 60,
                      "the run's end")
    assert runs[0]["outcome"] == "success", runs
    text = journal(ns, UNIT, 400)
    assert "connected to the system bus again" in text, text


def test_u09_a_frozen_bus_stops_neither_the_master_nor_the_rule(ns: Namespace, units) -> None:
    """dbus-daemon frozen (SIGSTOP) when a worker running a unit is killed: the master's
    loop goes on (its STATUS= says one worker less at once) while it waits for systemd on
    a thread; the unit keeps its lease, so no second copy starts while it cannot be
    stopped; once the bus answers, the unit stops before the occurrence runs again.
    (systemctl reaches systemd over its private socket, not the bus.)"""
    key = KEYS["frozenbus"]
    ensure_active(ns)
    wait_for(lambda: ns.show("StatusText")["StatusText"].startswith("2 workers"), 30,
             "both workers up", lambda: journal(ns))
    ns.ctl("run", key)
    first = wait_for(lambda: active_units(ns, key), 30, "the unit running",
                     lambda: journal(ns))[0]
    worker = _worker_of(ns, first)
    bus = ns.out("systemctl", "show", "--property=MainPID", "--value", "dbus.service")
    assert bus.isdigit() and bus != "0", bus
    ns.run("kill", "-STOP", bus)
    try:
        ns.run("kill", "-KILL", str(worker))
        frozen = time.monotonic()
        wait_for(lambda: ns.show("StatusText")["StatusText"].startswith("1 workers"), 6,
                 "the master's loop noting the death while the bus is frozen",
                 lambda: journal(ns))
        # alive_time is 30 s: only the give-back, held until the unit stops, could run
        # the occurrence again this soon.
        while time.monotonic() - frozen < 6:
            assert active_units(ns, key) == [first]
            time.sleep(0.5)
        assert ns.show("StatusText")["StatusText"].startswith("1 workers")  # index held
    finally:
        ns.run("kill", "-CONT", bus)
    second = wait_for(lambda: [u for u in active_units(ns, key) if u != first], 25,
                      "the occurrence running again", lambda: journal(ns, UNIT, 200))[0]
    assert max(unit_times(ns, first)) < min(unit_times(ns, second))
    # Runs of other tests may run on the same worker: "stopped N ...: a, b, c".
    base.journal_showing(ns, rf"stopped \d+ systemd unit\(s\) of worker \d+ \(pid {worker}\): "
                         rf".*{re.escape(first)}")
    wait_for(lambda: ns.show("StatusText")["StatusText"].startswith("2 workers"), 30,
             "the replacement worker", lambda: journal(ns))
    ns.ctl("delete", key, "--force")  # a schedules file's: root forces it
    wait_for(lambda: not active_units(ns, key), 30, "the run stopped by delete",
             lambda: journal(ns))


def test_u11_schedules_files_follow_cron_s_rules(ns: Namespace, units) -> None:
    """A schedules file owned by nobody, one the group may write, and a symlink to a file
    of nobody's: each rejected whole with its reason, its entries never stored or run;
    the package's own files apply."""
    d = "/etc/perfectsched/schedules.d"
    bad = {name: [{"key": f"{name}-{TOKEN}", "cron": "* * * * *",
                   "exec": ["/bin/sh", "-c", f"echo RAN {name}"], "user": "root",
                   "executor": "systemd"}] for name in ("nobodys", "groupw", "linked")}
    ns.write(f"{d}/nobodys.yml", json.dumps(bad["nobodys"]))
    ns.run("chown", "nobody", f"{d}/nobodys.yml")
    ns.write(f"{d}/groupw.yml", json.dumps(bad["groupw"]), mode="0664")
    ns.write("/srv/linked.yml", json.dumps(bad["linked"]))
    ns.run("chown", "nobody", "/srv/linked.yml")
    ns.run("ln", "-sfn", "/srv/linked.yml", f"{d}/linked.yml")
    try:
        reload_refusing_routes(ns)
        log = wait_for(lambda: (j := journal(ns, lines=300)) and all(
            f"{n}.yml" in j for n in bad) and j, 30, "the three files' lines",
            lambda: journal(ns))
        assert re.search(r"nobodys\.yml: owned by uid 65534 \(nobody\), not root", log), log
        assert re.search(r"groupw\.yml: .*writ", log), log
        assert re.search(r"linked\.yml: .*(nobody|65534)", log), log
        listed = ns.ctl("list").stdout
        assert not any(f"{n}-{TOKEN}" in listed for n in bad), listed
        assert KEYS["whoami"] in listed  # units.yml, root's, still applies
        assert "RAN " not in ns.run("journalctl", "--no-pager", "-o", "cat", "--since",
                                    "-2min", check=False).stdout
    finally:
        ns.run("rm", "-f", f"{d}/nobodys.yml", f"{d}/groupw.yml", f"{d}/linked.yml",
               "/srv/linked.yml")
        reload_refusing_routes(ns)


def test_u12_a_user_crontab_needs_its_user(ns: Namespace, installed) -> None:
    ns.write("/var/tmp/alice.crontab", "17 3 * * * /usr/bin/true\n")
    r = ns.run("perfectschedctl", "import-crontab", "/var/tmp/alice.crontab", check=False)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r
    assert "--user" in r.stderr, r.stderr
    r = ns.run("perfectschedctl", "import-crontab", "/var/tmp/alice.crontab", "--user",
               "nobody")
    assert "user: nobody" in r.stdout, r.stdout


def test_u13_a_group_member_cannot_become_root(ns: Namespace, units) -> None:
    """A member of the daemon's group (who may control it) cannot feed an `exec:` entry of
    root's, change a schedules file's schedule, or schedule a route that runs as another
    user unless its allow: names them; a plain route stays theirs."""
    ns.run("sh", "-c", "getent group ops >/dev/null || groupadd ops; "
           "id alice >/dev/null 2>&1 || useradd -M -G perfectsched alice; "
           "id bob >/dev/null 2>&1 || useradd -M -G perfectsched,ops bob")

    def as_(user: str, *args: str) -> Any:
        return ns.run("runuser", "-u", user, "--", "perfectschedctl", *args, check=False)

    def refused(r: Any, text: str) -> None:
        assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r
        assert text in r.stderr, r.stderr

    def stored() -> set[tuple[Any, ...]]:
        # What a refusal could change; times move with other tests' runs.
        return {(r["key"], r["type"], r["cron"], r["source"], r.get("creator"))
                for r in json.loads(ns.ctl("--json", "list").stdout)
                if "@run-" not in r["key"]} | {
                    (k, v.get("paused")) for k in (KEYS["whoami"],)
                    for v in [json.loads(ns.ctl("--json", "show", k).stdout)]}

    before = stored()
    refused(as_("alice", "add", f"m1-{TOKEN}", f"exec:{KEYS['whoami']}", "17 3 * * *"),
            "exec:")
    refused(as_("alice", "modify", f"x-{TOKEN}", "--type", f"exec:{KEYS['whoami']}"), "")
    for cmd in (["pause", KEYS["whoami"]], ["delete", KEYS["whoami"]],
                ["modify", KEYS["whoami"], "--cron", "* * * * *"]):
        refused(as_("alice", *cmd), "is managed by ")
    refused(as_("alice", "add", f"m2-{TOKEN}", f"asroot-{TOKEN}", "17 3 * * *"),
            "runs as user root: only root may schedule it")
    refused(as_("alice", "add", f"m3-{TOKEN}", f"asnobody-{TOKEN}", "17 3 * * *"),
            "only root and @ops may schedule it")
    assert stored() == before  # nothing stored changed
    r = as_("bob", "add", f"m4-{TOKEN}", f"asnobody-{TOKEN}", "17 3 * * *")
    assert r.returncode == 0, r
    r = as_("alice", "add", f"m5-{TOKEN}", f"plain-{TOKEN}", "17 3 * * *")
    assert r.returncode == 0, r
    shown = json.loads(ns.ctl("--json", "show", f"m5-{TOKEN}").stdout)
    assert shown["creator"] == int(ns.out("id", "-u", "alice"))
    # root may force a change of a file's schedule
    ns.ctl("pause", KEYS["whoami"], "--force")
    ns.ctl("resume", KEYS["whoami"], "--force")
    for key in (f"m4-{TOKEN}", f"m5-{TOKEN}"):
        ns.ctl("delete", key)


def test_u14_a_reload_drains_a_running_unit_to_its_end(ns: Namespace, units) -> None:
    """A reload never stops a job (issue #28): the unit a worker of the old generation
    started runs to its end while that worker drains; status names the worker and the
    run's key meanwhile; one run, a success, in the same unit.  The job outlasts
    shutdown_timeout (30 s): a reload that stopped the old workers would have stopped it."""
    key = KEYS["drained"]
    ns.ctl("run", key)
    unit = wait_for(lambda: active_units(ns, key), 30, "the unit running",
                    lambda: journal(ns))[0]
    worker = _worker_of(ns, unit)
    reload_refusing_routes(ns)

    def drain_of_worker() -> list[dict[str, Any]]:
        status = json.loads(ns.ctl("--json", "status").stdout)
        return [w for w in status.get("draining", []) if w["pid"] == worker and w["keys"]]

    (entry_,) = wait_for(drain_of_worker, 30, "the draining worker in status",
                         lambda: journal(ns))
    # Its run is among the leases the worker holds (not necessarily the only one).
    assert any(k.startswith(key) for k in entry_["keys"]), entry_
    assert active_units(ns, key) == [unit]  # the reload did not stop it
    runs = runs_until(ns, key, bool, 90, "its end")
    assert [(r["outcome"], r["unit"]) for r in runs] == [("success", unit)], runs
    assert "drained end" in journal(ns, unit)
    wait_for(lambda: not drain_of_worker() and
             ns.run("kill", "-0", str(worker), check=False).returncode != 0, 30,
             "the drained worker's exit", lambda: journal(ns))
