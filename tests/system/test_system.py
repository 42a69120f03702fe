"""System test: the Debian package under a real systemd.

Boots systemd as PID 1 of a private PID/mount/UTS/IPC/cgroup namespace on a
throw-away overlay of the host root (ns-up.sh, ns-init.sh), installs the built
dist/perfectsched_*.deb there with `apt-get install ./file.deb` (the namespace
shares the host network, so Debian dependencies resolve), and checks the unit
end to end: start waits for READY=1, watchdog, control socket, exec jobs into
the journal, reload, metrics, D-Bus, worker replacement, stop, purge.

The root file system under the overlay is the host's own (Debian 12) unless
PERFECTSCHED_NS_ROOTFS names another: a suite (`trixie`: Debian 13, built once with
mmdebstrap by rootfs.sh and cached in /var/cache/perfectsched-ns) or a directory.  The
same .deb, built on the host, is installed on either; `make test-system` runs every
module on both.

Needs root (CI runs as root); without it, or without the tools, the test FAILS,
it does not skip.  It never changes host state: /proc/sys and /sys stay
read-only inside, everything written lands in a tmpfs upper layer, and the
namespace is always torn down (fixture finalizer + atexit + SIGTERM/SIGHUP
handler; namespaces left by a killed run are reaped on the next run).

Run:  make test-system            (builds the .deb first; both releases)
      PERFECTSCHED_DEB=path/to.deb python3 -m pytest -m system tests/system
      PERFECTSCHED_NS_ROOTFS=trixie ...          (the same on Debian 13)
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = pytest.mark.system

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
NS_LAB = Path(os.environ.get("PERFECTSCHED_NS_LAB", "/tmp/perfectsched-systest"))
# ns-up.sh's ROOTFS: "/" (the host's), a suite for rootfs.sh ("trixie"), or a directory
NS_ROOTFS = os.environ.get("PERFECTSCHED_NS_ROOTFS", "/")
INNER_SHARE = "/srv/perfectsched-test"  # where ns-init.sh bind-mounts the share dir
SYS_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
ENV_IN = [f"PATH={SYS_PATH}", "LANG=C.UTF-8", "DEBIAN_FRONTEND=noninteractive",
          "SYSTEMD_PAGER=", "SYSTEMD_COLORS=0", "TERM=dumb"]

UNIT = "perfectschedd.service"
CONF = "/etc/perfectsched/perfectsched.yml"
SCHEDULES_DIR = "/etc/perfectsched/schedules.d"
SOCK = "/run/perfectsched/perfectschedd.sock"
DROPIN_DIR = "/etc/systemd/system/perfectschedd.service.d"
DEFAULT_METRICS_PORT = 9839
SCORE_LIMIT = 2.0
TOKEN = uuid.uuid4().hex[:10]  # makes keys and journal markers unique to this run


# --------------------------------------------------------------------------------------
# the namespace
# --------------------------------------------------------------------------------------

class Namespace:
    """A booted systemd namespace; run() executes a command inside it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.share = NS_LAB / f"share-{name}"
        self.pid: int | None = None
        self.boot_log = ""
        self._down = False

    def _env(self) -> dict[str, str]:
        return dict(os.environ, NS_LAB=str(NS_LAB), SHARE=str(self.share), PATH=SYS_PATH,
                    ROOTFS=NS_ROOTFS)

    def up(self) -> None:
        self.share.mkdir(parents=True, exist_ok=True)
        ns_dir = NS_LAB / f"ns-{self.name}"
        ns_dir.mkdir(parents=True, exist_ok=True)
        (ns_dir / "owner").write_text(f"{os.getpid()}\n")
        r = subprocess.run([str(HERE / "ns-up.sh"), self.name], env=self._env(),
                           capture_output=True, text=True, timeout=180)
        self.boot_log = r.stderr.strip()
        if r.returncode != 0 or not r.stdout.strip().isdigit():
            raise RuntimeError(f"ns-up.sh failed (exit {r.returncode}):\n{r.stderr}")
        self.pid = int(r.stdout.strip())

    def down(self) -> None:
        if self._down:
            return
        self._down = True
        try:
            subprocess.run([str(HERE / "ns-down.sh"), self.name], env=self._env(),
                           capture_output=True, text=True, timeout=120)
        finally:
            shutil.rmtree(self.share, ignore_errors=True)

    def run(self, *argv: str, check: bool = True, timeout: float = 60,
            input: str | None = None) -> subprocess.CompletedProcess[str]:
        assert self.pid is not None and not self._down, "namespace is not up"
        cmd = ["nsenter", "-t", str(self.pid), "-a", "env", "-i", *ENV_IN, *argv]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, input=input)
        if check and r.returncode != 0:
            raise AssertionError(
                f"in namespace: {shlex.join(argv)} -> exit {r.returncode}\n"
                f"--- stdout\n{r.stdout[-4000:]}\n--- stderr\n{r.stderr[-4000:]}")
        return r

    def out(self, *argv: str, **kw) -> str:
        return self.run(*argv, **kw).stdout.strip()

    def sh(self, script: str, *args: str, **kw) -> subprocess.CompletedProcess[str]:
        return self.run("sh", "-c", script, "sh", *args, **kw)

    def write(self, path: str, text: str, mode: str = "0644") -> None:
        self.sh('mkdir -p "$(dirname "$1")" && cat > "$1" && chmod "$2" "$1"', path, mode,
                input=text)

    def show(self, *props: str) -> dict[str, str]:
        out = self.out("systemctl", "show", UNIT, *(f"--property={p}" for p in props))
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def journal(self, lines: int | None = None) -> str:
        argv = ["journalctl", "--no-pager", "-o", "cat", "-u", UNIT]
        if lines:
            argv += ["-n", str(lines)]
        return self.run(*argv, check=False).stdout

    def children(self, pid: int) -> list[int]:
        """The children of `pid` but its job guard (psched-guard): the master's workers."""
        r = self.run("ps", "-o", "pid=,comm=", "--ppid", str(pid), check=False)
        rows = [line.split() for line in r.stdout.splitlines() if line.strip()]
        return sorted(int(row[0]) for row in rows if row[1:] != ["psched-guard"])

    def ctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.run("perfectschedctl", *args, check=check, timeout=30)


def wait_for(cond: Callable[[], object], timeout: float, what: str,
             diag: Callable[[], str] | None = None, interval: float = 0.25):
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            extra = f"\n{diag()}" if diag else ""
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}{extra}")
        time.sleep(interval)


def journal_showing(ns: Namespace, *patterns: str, unit: str = UNIT, lines: int = 400,
                    timeout: float = 30, pid: str | int | None = None) -> str:
    """The unit's journal (its last `lines`, or all of process `pid`) once every regular
    expression matches it.  The daemon's lines reach journald through its log writer
    thread, so they can come after what a test saw of the same moment (the unit active
    or stopped, a reply, a job's unit stopped)."""
    argv = ["journalctl", "--no-pager", "-o", "cat", "-u", unit,
            *(["-n", str(lines)] if pid is None else [f"_PID={pid}"])]

    def found() -> str | None:
        text = ns.run(*argv, check=False).stdout
        return text if all(re.search(p, text, re.M) for p in patterns) else None
    return wait_for(found, timeout, f"{patterns} in the journal of {unit}"
                    + (f", process {pid}" if pid is not None else ""),
                    lambda: ns.journal(60))


def _running(pid: int) -> bool:
    """True if pid is a live (not zombie) process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def _reap_stale_namespaces() -> None:
    """Tear down namespaces whose owning test process died without cleaning up."""
    if not NS_LAB.is_dir():
        return
    for ns_dir in NS_LAB.glob("ns-*"):
        try:
            owner = int((ns_dir / "owner").read_text().strip())
        except (OSError, ValueError):
            owner = 0
        if owner and owner != os.getpid() and _running(owner):
            continue  # another test run's namespace, still in use
        name = ns_dir.name[3:]
        subprocess.run([str(HERE / "ns-down.sh"), name], capture_output=True, timeout=120,
                       env=dict(os.environ, NS_LAB=str(NS_LAB), PATH=SYS_PATH))
        shutil.rmtree(NS_LAB / f"share-{name}", ignore_errors=True)


def _require_host() -> None:
    problems = []
    if os.geteuid() != 0:
        problems.append("must run as root (it boots systemd in a namespace)")
    for tool in ("unshare", "nsenter", "script", "setsid", "pgrep", "apt-get"):
        if shutil.which(tool, path=SYS_PATH) is None:
            problems.append(f"missing tool {tool}")
    if not os.access("/lib/systemd/systemd", os.X_OK):
        problems.append("systemd is not installed (/lib/systemd/systemd)")
    if problems:
        pytest.fail("system test cannot run: " + "; ".join(problems), pytrace=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _port_busy(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


# --------------------------------------------------------------------------------------
# fixtures
# --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def deb_file() -> Path:
    _require_host()
    path = os.environ.get("PERFECTSCHED_DEB")
    if path:
        deb = Path(path)
    else:
        debs = sorted(REPO.glob("dist/perfectsched_*.deb"), key=lambda p: p.stat().st_mtime)
        if not debs:
            r = subprocess.run(["make", "-C", str(REPO), "deb"], capture_output=True, text=True,
                               timeout=1800, env=dict(os.environ, PATH=SYS_PATH))
            assert r.returncode == 0, f"make deb failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
            debs = sorted(REPO.glob("dist/perfectsched_*.deb"),
                          key=lambda p: p.stat().st_mtime)
        assert debs, "no dist/perfectsched_*.deb (run `make deb`)"
        deb = debs[-1]
    assert deb.is_file(), f"{deb} does not exist"
    return deb


@pytest.fixture(scope="module")
def ns(request: pytest.FixtureRequest, deb_file: Path):
    _require_host()
    _reap_stale_namespaces()
    space = Namespace(f"t{os.getpid()}")
    atexit.register(space.down)
    request.addfinalizer(space.down)

    def _on_signal(signum, frame):  # SIGTERM/SIGHUP: unwind so finalizers + atexit run
        raise KeyboardInterrupt(f"signal {signum}")

    old = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGHUP)}
    request.addfinalizer(lambda: [signal.signal(s, h) for s, h in old.items()])
    try:
        space.up()
    except Exception as exc:  # noqa: BLE001
        space.down()
        pytest.fail(f"could not boot systemd in a namespace: {exc}", pytrace=False)
    print(space.boot_log)
    # the namespace must not be able to write kernel settings of the host
    assert space.out("findmnt", "-n", "-o", "OPTIONS", "/proc/sys").split(",")[0] == "ro"
    return space


@pytest.fixture(scope="module")
def installed(ns: Namespace, deb_file: Path) -> dict[str, object]:
    shutil.copy2(deb_file, ns.share / deb_file.name)
    busy = _port_busy(DEFAULT_METRICS_PORT)
    t0 = time.monotonic()
    argv = ["apt-get", "install", "-y", "-q", f"{INNER_SHARE}/{deb_file.name}"]
    r = ns.run(*argv, check=False, timeout=900)
    if r.returncode != 0:  # stale or missing package lists: refresh them (inside only)
        ns.run("apt-get", "update", "-q", timeout=600)
        r = ns.run(*argv, timeout=900)
    took = time.monotonic() - t0
    print(f"apt-get install took {took:.1f}s")
    state = ns.out("dpkg-query", "-W", "-f=${db:Status-Status}", "perfectsched", check=False)
    assert state == "installed", f"dpkg state {state!r} after apt-get install:\n{r.stdout}"
    return {"apt_output": r.stdout + r.stderr, "seconds": took, "port_busy": busy}


def systest_config(port: int, workers: int = 2, reloaded: bool = False) -> str:
    # JSON is YAML: no quoting trouble with the shell snippets below.
    routes: list[dict[str, object]] = [
        {"type": "systest", "exec": [
            "/bin/sh", "-c",
            'echo "systest-out key=$1 type=$PERFECTSCHED_TYPE attempt=$PERFECTSCHED_ATTEMPT '
            'scheduled=$PERFECTSCHED_SCHEDULED_TIME data=$(cat)"; echo "systest-err key=$1" >&2',
            "systest-job"]},
    ]
    if reloaded:
        routes += [
            {"type": "systest-reloaded", "exec": [
                "/bin/sh", "-c", 'echo "systest-reloaded-out key=$1"', "systest-job"]},
            {"type": "systest-sleep", "exec": [
                "/bin/sh", "-c", 'echo "systest-sleep-start key=$1"; sleep 8', "systest-job"]},
        ]
    return json.dumps({
        "type": "rdb_compat",
        "url": "sqlite:////var/lib/perfectsched/perfectsched.db",
        "control_socket": SOCK,
        "metrics_listen": f"127.0.0.1:{port}",
        "dbus": True,
        "workers": workers,
        "poll_interval": 0.5,
        "retry_wait": 2,
        "routes": routes,
    }, indent=2) + "\n"


@pytest.fixture(scope="module")
def systest(ns: Namespace, installed) -> dict[str, object]:
    """The test's config in /etc/perfectsched (host network: a free metrics port)."""
    port = _free_port()
    ns.write(CONF, systest_config(port), mode="0644")
    ns.run("systemctl", "restart", UNIT, check=False, timeout=150)
    return {"port": port}


def ensure_active(ns: Namespace) -> dict[str, str]:
    st = ns.show("ActiveState", "MainPID")
    if st["ActiveState"] != "active":
        ns.run("systemctl", "start", UNIT, check=False, timeout=150)
        st = ns.show("ActiveState", "MainPID")
    assert st["ActiveState"] == "active", f"{UNIT} is not active:\n{ns.journal(40)}"
    return st


def _journal_has(ns: Namespace, text: str) -> bool:
    return text in ns.journal()


# --------------------------------------------------------------------------------------
# the checks, in order
# --------------------------------------------------------------------------------------

def test_01_unit_verifies_and_scores(ns: Namespace, installed) -> None:
    r = ns.run("systemd-analyze", "verify", f"/lib/systemd/system/{UNIT}", check=False)
    assert r.returncode == 0, f"systemd-analyze verify:\n{r.stdout}{r.stderr}"
    out = ns.out("systemd-analyze", "security", "--no-pager", UNIT)
    m = re.search(rf"Overall exposure level for {re.escape(UNIT)}: ([0-9.]+)", out)
    assert m, out
    score = float(m.group(1))
    print(f"systemd-analyze security: {score}")
    assert score <= SCORE_LIMIT, f"exposure {score} > {SCORE_LIMIT}:\n{out}"


def test_01b_the_unit_s_programs_come_with_the_package(ns: Namespace, installed) -> None:
    """Every program the unit runs is the package's, an essential package's, or one it
    depends on: a minimal system (a container, a minbase tree) lacks much (procps,
    whose /bin/kill ExecReload= ran before it was perfectschedctl reload)."""
    depends = {alt.split()[0].split(":")[0] for dep in ns.out(
        "dpkg-query", "-W", "-f=${Depends}", "perfectsched").split(",")
        for alt in dep.split("|") if alt.strip()}
    for prop in ("ExecStart", "ExecReload"):
        value = ns.show(prop)[prop]
        m = re.search(r"path=(\S+)", value)
        assert m, f"{prop}={value}"
        # merged /usr: dpkg knows /bin/kill on Debian 12, /usr/bin/kill on Debian 13
        found = ns.sh('dpkg-query -S "$1" 2>/dev/null || dpkg-query -S "$(readlink -f "$1")"',
                      m.group(1), check=False)
        assert found.returncode == 0, f"{prop}: no package ships {m.group(1)}"
        package = found.stdout.split(":")[0]
        essential = ns.out("dpkg-query", "-W", "-f=${Essential}", package) == "yes"
        assert package == "perfectsched" or essential or package in depends, (
            f"{prop} runs {m.group(1)} of {package}, which perfectsched does not depend on "
            f"(Depends: {sorted(depends)})")


def test_02_install_creates_user_enables_and_starts(ns: Namespace, installed) -> None:
    pw = ns.out("getent", "passwd", "perfectsched").split(":")
    assert pw[5] == "/var/lib/perfectsched" and pw[6].endswith("nologin"), pw
    assert ns.out("getent", "group", "perfectsched")
    assert ns.out("systemctl", "is-enabled", UNIT, check=False) == "enabled"
    conffiles = ns.out("dpkg-query", "-W", "-f=${Conffiles}", "perfectsched")
    assert CONF in conffiles and "/etc/logrotate.d/perfectsched" in conffiles, conffiles
    for path in ("/usr/bin/perfectschedd", "/usr/bin/perfectschedctl",
                 "/usr/share/dbus-1/system.d/org.perfectsched1.conf",
                 "/usr/share/bash-completion/completions/perfectschedctl",
                 "/usr/lib/sysusers.d/perfectsched.conf",
                 "/usr/share/man/man8/perfectschedd.8.gz",
                 "/usr/share/man/man1/perfectschedctl.1.gz"):
        ns.run("test", "-e", path)
    # postinst started the unit with the packaged default configuration
    busy = (f"\nnote: 127.0.0.1:{DEFAULT_METRICS_PORT} was already in use on the host, "
            "which the namespace shares" if installed["port_busy"] else "")
    st = wait_for(lambda: (s := ns.show("ActiveState", "SubState", "MainPID"))["ActiveState"]
                  in ("active", "failed", "inactive") and s, 100, "postinst's start")
    assert st["ActiveState"] == "active", (
        f"not started by apt install: {st}{busy}\n{installed['apt_output'][-2000:]}\n"
        f"{ns.journal(40)}")
    main = st["MainPID"]
    assert ns.out("ps", "-o", "user=", "-p", main) == "perfectsched"
    mode, group = ns.out("stat", "-c", "%a %G", SOCK).split()
    assert (mode, group) == ("660", "perfectsched"), (mode, group)
    # The first start, right after install (the bus may not have read the package's
    # policy yet): the daemon owns org.perfectsched1 without a restart.
    ask = ["dbus-send", "--system", "--print-reply", "--dest=org.freedesktop.DBus",
           "/org/freedesktop/DBus", "org.freedesktop.DBus.GetConnectionUnixProcessID",
           "string:org.perfectsched1"]
    r = wait_for(lambda: (x := ns.run(*ask, check=False)).returncode == 0 and x, 40,
                 "org.perfectsched1 after install, without a restart", lambda: ns.journal(30))
    assert r.stdout.split()[-1] == main, r.stdout
    ns.ctl("list")  # root may use the socket


def test_02b_the_configuration_is_not_world_readable(ns: Namespace, installed) -> None:
    """The configuration and the schedules files may hold the database password and
    webhook secrets: root's, readable by the daemon's group only (issue 38), as dpkg
    statoverrides that later upgrades keep.  Before the systest fixture rewrites CONF."""
    assert ns.out("stat", "-c", "%a %U:%G", CONF) == "640 root:perfectsched"
    assert ns.out("stat", "-c", "%a %U:%G", SCHEDULES_DIR) == "750 root:perfectsched"
    overrides = ns.out("dpkg-statoverride", "--list")
    assert f"root perfectsched 640 {CONF}" in overrides.splitlines(), overrides
    r = ns.run("runuser", "-u", "nobody", "--", "cat", CONF, check=False)
    assert r.returncode != 0 and "Permission denied" in r.stderr, r
    # ...and the daemon, in its group, read it: test_02 saw it active.
    assert ns.show("ActiveState")["ActiveState"] == "active", ns.journal(20)


def test_03_start_returns_only_after_ready(ns: Namespace, systest) -> None:
    ns.run("systemctl", "stop", UNIT, timeout=150)
    t0 = time.monotonic()
    r = ns.run("systemctl", "start", UNIT, check=False, timeout=150)
    took = time.monotonic() - t0
    assert r.returncode == 0, f"systemctl start failed: {r.stderr}\n{ns.journal(40)}"
    # Nothing below retries: READY=1 promises all of it.
    st = ns.show("ActiveState", "SubState", "MainPID", "StatusText",
                 "ExecMainStartTimestampMonotonic", "ActiveEnterTimestampMonotonic")
    assert (st["ActiveState"], st["SubState"]) == ("active", "running"), st
    ns.run("test", "-S", SOCK)
    ns.ctl("list", "--json")
    workers = ns.children(int(st["MainPID"]))
    assert len(workers) >= 2, f"workers at READY: {workers}"
    assert st["StatusText"], "no STATUS= sent"
    ready_after = (int(st["ActiveEnterTimestampMonotonic"])
                   - int(st["ExecMainStartTimestampMonotonic"])) / 1e6
    print(f"systemctl start took {took:.2f}s; READY {ready_after:.2f}s after exec; "
          f"status: {st['StatusText']}")
    assert ready_after > 0


def test_04_notify_and_watchdog(ns: Namespace, systest) -> None:
    st = ns.show("Type", "NotifyAccess", "WatchdogUSec", "Restart", "User", "KillMode")
    assert st["Type"] == "notify" and st["NotifyAccess"] == "main", st
    assert st["WatchdogUSec"] == "30s", st
    assert st["Restart"] == "on-failure" and st["User"] == "perfectsched", st
    # the daemon really pings: with a 2 s watchdog it must stay up, same PID, for 6 s
    ns.write(f"{DROPIN_DIR}/90-systest-watchdog.conf", "[Service]\nWatchdogSec=2s\n")
    try:
        ns.run("systemctl", "daemon-reload")
        ns.run("systemctl", "restart", UNIT, timeout=150)
        before = ns.show("MainPID", "NRestarts", "WatchdogTimestampMonotonic",
                         "WatchdogUSec")
        assert before["WatchdogUSec"] == "2s", before
        time.sleep(6)
        after = ns.show("MainPID", "NRestarts", "ActiveState", "WatchdogTimestampMonotonic")
        assert after["ActiveState"] == "active", f"{after}\n{ns.journal(30)}"
        assert after["MainPID"] == before["MainPID"] and after["NRestarts"] == "0", (
            f"watchdog killed the daemon: {before} -> {after}\n{ns.journal(30)}")
        assert int(after["WatchdogTimestampMonotonic"]) > int(
            before["WatchdogTimestampMonotonic"]), "no WATCHDOG=1 received"
    finally:
        ns.run("rm", "-f", f"{DROPIN_DIR}/90-systest-watchdog.conf")
        ns.run("systemctl", "daemon-reload")
        ns.run("systemctl", "restart", UNIT, check=False, timeout=150)
    assert ns.show("WatchdogUSec")["WatchdogUSec"] == "30s"


def test_05_ctl_add_list_delete(ns: Namespace, systest) -> None:
    ensure_active(ns)
    key = f"systest-ctl-{TOKEN}"
    ns.ctl("add", key, "systest", "30 3 * * *", '{"a": 1}', "-t", "Asia/Tokyo", "-d", "30")
    rows = {s["key"]: s for s in json.loads(ns.ctl("list", "--json").stdout)}
    assert key in rows, rows
    row = rows[key]
    assert (row["type"], row["cron"], row["delay"], row["timezone"], row["data"]) == (
        "systest", "30 3 * * *", 30, "Asia/Tokyo", {"a": 1}), row
    assert row["next_run_time"] == row["next_time"] + 30, row
    table = ns.ctl("list").stdout
    assert key in table and re.search(r"\d+ entries\.", table), table
    dup = ns.ctl("add", key, "systest", "@hourly", check=False)
    assert dup.returncode == 1 and dup.stderr.strip(), dup
    ns.ctl("delete", key)
    assert key not in {s["key"] for s in json.loads(ns.ctl("list", "--json").stdout)}
    gone = ns.ctl("delete", key, check=False)
    assert gone.returncode == 1 and gone.stderr.strip(), gone
    # besides root, members of group perfectsched may use the socket; others may not
    ns.run("useradd", "-M", "-G", "perfectsched", "systest-op", check=False)
    ns.run("useradd", "-M", "systest-other", check=False)
    ns.run("runuser", "-u", "systest-op", "--", "perfectschedctl", "list", "--json")
    other = ns.run("runuser", "-u", "systest-other", "--", "perfectschedctl", "list",
                   check=False)
    assert other.returncode == 1 and other.stderr.strip(), other


def test_06_exec_job_output_in_journal(ns: Namespace, systest) -> None:
    ensure_active(ns)
    key = f"systest-job-{TOKEN}"
    ns.ctl("add", key, "systest", "* * * * *", json.dumps({"token": TOKEN}),
           "--at", str(int(time.time())))
    try:
        wait_for(lambda: _journal_has(ns, f"systest-out key={key}"), 30,
                 "the exec job's stdout in journalctl -u perfectschedd",
                 lambda: ns.journal(40))
        line = next(x for x in ns.journal().splitlines() if f"systest-out key={key}" in x)
        assert "type=systest" in line and "attempt=1" in line and TOKEN in line.split(
            "data=")[1], line
        wait_for(lambda: _journal_has(ns, f"systest-err key={key}"), 10,
                 "the exec job's stderr in the journal", lambda: ns.journal(40))
    finally:
        ns.ctl("delete", key, check=False)


def test_07_reload_keeps_mainpid_and_applies_config(ns: Namespace, systest) -> None:
    st = ensure_active(ns)
    main = int(st["MainPID"])
    old_workers = ns.children(main)
    assert old_workers, "no workers"
    ns.write(CONF, systest_config(systest["port"], workers=3, reloaded=True))
    ns.run("systemctl", "reload", UNIT, timeout=60)

    def replaced():
        kids = ns.children(main)
        return len(kids) == 3 and not set(kids) & set(old_workers) and kids

    wait_for(replaced, 30, "3 new workers after reload (workers: 2 -> 3)",
             lambda: f"children now {ns.children(main)}, before {old_workers}\n"
                     f"{ns.journal(30)}")
    after = ns.show("MainPID", "NRestarts", "ActiveState")
    assert after == {"MainPID": str(main), "NRestarts": "0", "ActiveState": "active"}, after
    # the new route exists only in the new config
    key = f"systest-reloaded-{TOKEN}"
    ns.ctl("add", key, "systest-reloaded", "* * * * *", "--at", str(int(time.time())))
    try:
        wait_for(lambda: _journal_has(ns, f"systest-reloaded-out key={key}"), 30,
                 "a job of the route added by reload", lambda: ns.journal(40))
    finally:
        ns.ctl("delete", key, check=False)
    assert ns.show("MainPID")["MainPID"] == str(main)


def test_08_metrics_endpoint(ns: Namespace, systest) -> None:
    ensure_active(ns)
    url = f"http://127.0.0.1:{systest['port']}/metrics"
    fetch = ("import sys, urllib.request\n"
             "r = urllib.request.urlopen(sys.argv[1], timeout=10)\n"
             "print(r.status); print(r.read().decode())\n")
    last: list[subprocess.CompletedProcess[str]] = []

    def get():
        last[:] = [ns.run("python3", "-c", fetch, url, check=False)]
        return last[0].returncode == 0 and last[0]

    r = wait_for(get, 15, f"GET {url}",
                 lambda: f"{last[0].stderr.strip().splitlines()[-1:]}\n{ns.journal(20)}")
    status, _, body = r.stdout.partition("\n")
    assert status == "200", r.stdout[:500]
    assert "# TYPE" in body and "perfectsched" in body, body[:2000]
    # counters by task type: the exec jobs of the earlier checks ran
    assert re.search(r'^perfectsched\S*\{[^}]*"systest"', body, re.M), body[:4000]


def test_09_dbus_name_owned_by_daemon(ns: Namespace, systest) -> None:
    st = ensure_active(ns)
    ask = ["dbus-send", "--system", "--print-reply", "--dest=org.freedesktop.DBus",
           "/org/freedesktop/DBus", "org.freedesktop.DBus.GetConnectionUnixProcessID",
           "string:org.perfectsched1"]
    r = wait_for(lambda: (x := ns.run(*ask, check=False)).returncode == 0 and x, 15,
                 "org.perfectsched1 on the system bus", lambda: ns.journal(30))
    assert r.stdout.split()[-1] == st["MainPID"], r.stdout


def test_10_killed_worker_is_replaced_without_restart(ns: Namespace, systest) -> None:
    st = ensure_active(ns)
    main = int(st["MainPID"])
    restarts = ns.show("NRestarts")["NRestarts"]
    workers = ns.children(main)
    assert workers, "no workers"
    victim = workers[0]
    ns.run("kill", "-KILL", str(victim))

    def replaced():
        kids = ns.children(main)
        return victim not in kids and len(kids) >= len(workers) and kids

    new = wait_for(replaced, 30, f"a new worker replacing killed pid {victim}",
                   lambda: f"children: {ns.children(main)}\n{ns.journal(20)}")
    after = ns.show("MainPID", "NRestarts", "ActiveState")
    assert after == {"MainPID": str(main), "NRestarts": restarts, "ActiveState": "active"}, (
        after)
    print(f"worker {victim} killed; workers now {new}")


def test_10b_control_group_other_than_the_units(ns: Namespace, systest) -> None:
    """control_group names a group the service user belongs to besides its own: the
    unit's system call filter must let the daemon hand the socket to it (chown)."""
    ns.run("groupadd", "-f", "systest-ops")
    ns.run("usermod", "-aG", "systest-ops", "perfectsched")
    ns.run("useradd", "-M", "-G", "systest-ops", "systest-opsmember", check=False)
    before = ns.out("cat", CONF)
    conf = json.loads(before)
    ns.write(CONF, json.dumps({**conf, "control_group": "systest-ops"}) + "\n")
    try:
        ns.run("systemctl", "restart", UNIT, timeout=150)
        ensure_active(ns)
        group = ns.out("stat", "-c", "%G", SOCK)
        assert group == "systest-ops", (group, ns.journal(30))
        ns.run("runuser", "-u", "systest-opsmember", "--", "perfectschedctl", "status")
    finally:
        ns.write(CONF, before + "\n")
        ns.run("systemctl", "restart", UNIT, check=False, timeout=150)


def test_11_stop_leaves_no_process(ns: Namespace, systest) -> None:
    ensure_active(ns)
    cg = "/sys/fs/cgroup/system.slice/perfectschedd.service"
    # stop while a job runs: it must end with the service
    key = f"systest-sleep-{TOKEN}"
    ns.ctl("add", key, "systest-sleep", "* * * * *", "--at", str(int(time.time())))
    wait_for(lambda: _journal_has(ns, f"systest-sleep-start key={key}"), 30,
             "the sleeping job to start", lambda: ns.journal(30))
    t0 = time.monotonic()
    ns.run("systemctl", "stop", UNIT, timeout=150)
    took = time.monotonic() - t0
    st = ns.show("ActiveState", "MainPID", "Result", "ExecMainStatus", "ExecMainCode")
    assert st["ActiveState"] == "inactive" and st["MainPID"] == "0", st
    assert st["Result"] == "success" and st["ExecMainStatus"] == "0", (
        f"not a graceful exit 0: {st}\n{ns.journal(30)}")
    left = ns.run("pgrep", "-a", "-u", "perfectsched", check=False).stdout.strip()
    assert not left, f"processes left: {left}"
    procs = ns.run("sh", "-c", f"cat {cg}/cgroup.procs 2>/dev/null", check=False).stdout
    assert not procs.strip(), procs
    ns.run("test", "!", "-e", "/run/perfectsched")
    print(f"systemctl stop with a running job took {took:.2f}s")
    assert took < 60


def test_12_purge_removes_cleanly(ns: Namespace, installed) -> None:
    ns.run("rm", "-rf", DROPIN_DIR)
    ns.run("systemctl", "daemon-reload")
    ns.run("apt-get", "purge", "-y", "-q", "perfectsched", timeout=300)
    state = ns.out("dpkg-query", "-W", "-f=${db:Status-Status}", "perfectsched", check=False)
    assert state in ("", "not-installed"), f"dpkg state after purge: {state!r}"
    left = ns.sh(
        'for p in "$@"; do [ -e "$p" ] && echo "$p"; done; true',
        "/etc/perfectsched", "/var/lib/perfectsched", "/var/log/perfectsched",
        "/run/perfectsched", f"/lib/systemd/system/{UNIT}",
        f"/etc/systemd/system/multi-user.target.wants/{UNIT}",
        f"/var/lib/systemd/deb-systemd-helper-enabled/{UNIT}",
        "/usr/bin/perfectschedd", "/usr/bin/perfectschedctl",
        "/usr/lib/python3/dist-packages/perfectschedd",
        "/usr/lib/python3/dist-packages/perfectschedctl",
        "/usr/share/dbus-1/system.d/org.perfectsched1.conf",
        "/etc/logrotate.d/perfectsched", "/usr/lib/sysusers.d/perfectsched.conf",
    ).stdout.split()
    assert not left, f"left after purge: {left}"
    overrides = ns.out("dpkg-statoverride", "--list")
    assert "/etc/perfectsched" not in overrides, overrides
    assert ns.show("LoadState")["LoadState"] == "not-found"
    procs = ns.run("pgrep", "-a", "-u", "perfectsched", check=False).stdout.strip()
    assert not procs, procs
