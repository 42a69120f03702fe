"""A throw-away Patroni cluster for the failover fault test: etcd and three PostgreSQL
nodes managed by Patroni, on loopback ports, from Debian 12's packages (patroni 3.0.2,
etcd-server 3.4; tests/install-test-deps.sh installs them).  No pytest here.

    with PatroniCluster(3) as pc:
        url = pc.url()                  # postgresql://sched:sched@/perfectsched?host=...
        leader = pc.leader()            # the node that is primary now
        pc.switchover(to=other)         # a planned switchover (Patroni's REST API)
        pc.kill_postmaster(leader)      # kill -9 of the primary's postmaster
        pc.freeze(leader); pc.thaw(leader)   # SIGSTOP / SIGCONT of its whole process tree

Facts this follows (the shared recipes): Patroni and PostgreSQL run as user postgres;
Patroni's `etcd:` (v2) section with etcd started `--enable-v2=true` (with `etcd3:`,
Patroni 3.0.2 can let a thawed old primary take the leader key back and rewind the new
primary's acknowledged writes; fixed in 3.0.3, patroni PR 2689);
`primary_start_timeout: 0` makes a killed primary fail over instead of restarting in
place; synchronous mode, so that an acknowledged commit is on the standby that may be
promoted.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

from dbservers import (
    APP_PASSWORD,
    APP_USER,
    DBServerError,
    _parent_death_signal,
    _pg_bindir,
    _process_tree,
    _signal_all,
    free_port,
)

SCOPE = "perfectsched-test"
DATABASE = "perfectsched"
SERVICE_USER = "postgres"
SUPERUSER_PASSWORD = "super"
REPLICATION_PASSWORD = "replica"
# Patroni's timings: the leader key lives TTL seconds (a frozen primary loses it then);
# loop_wait + 2 * retry_timeout must stay within it.
TTL = 20
LOOP_WAIT = 2
RETRY_TIMEOUT = 5


def available() -> str | None:
    """Why the cluster cannot run here (None: it can)."""
    for binary in ("/usr/bin/patroni", "/usr/bin/etcd"):
        if not os.access(binary, os.X_OK):
            return f"{binary} missing: run tests/install-test-deps.sh (patroni, etcd-server)"
    if not _pg_bindir():
        return "PostgreSQL binaries missing: run tests/install-test-deps.sh"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam(SERVICE_USER)
        except KeyError:
            return f"no user {SERVICE_USER}"
    return None


class Node:
    def __init__(self, base: Path, name: str) -> None:
        self.name = name
        self.dir = base / name
        self.port = free_port()
        self.rest_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.frozen = False

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def rest(self, path: str, method: str = "GET", body: dict[str, Any] | None = None,
             timeout: float = 3.0) -> tuple[int, Any]:
        """(status, JSON or text) of a call to this node's Patroni REST API; (0, error)
        when it does not answer."""
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(f"http://127.0.0.1:{self.rest_port}{path}", data=data,
                                     method=method)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as res:
                raw = res.read().decode()
                status = res.status
        except urllib.error.HTTPError as exc:
            raw, status = exc.read().decode(), exc.code
        except (OSError, ValueError) as exc:
            return 0, str(exc)
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, raw

    def postmaster_pid(self) -> int | None:
        try:
            return int((self.dir / "data" / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None


class PatroniCluster:
    def __init__(self, n: int = 3) -> None:
        self.n = n
        self.base = Path()
        self.nodes: list[Node] = []
        self.etcd: subprocess.Popen[bytes] | None = None
        self.etcd_port = 0

    # -- life cycle ---------------------------------------------------------------------

    def start(self, timeout: float = 120.0) -> PatroniCluster:
        why = available()
        if why:
            raise DBServerError(why)
        self.base = Path(tempfile.mkdtemp(prefix="perfectsched-patroni-"))
        os.chmod(self.base, 0o755)
        try:
            self._start_etcd()
            self.nodes = [Node(self.base, f"pg{i}") for i in range(self.n)]
            for node in self.nodes:
                node.dir.mkdir()
                self._chown(node.dir)
                (node.dir / "patroni.yml").write_text(json.dumps(self._config(node)))
            self._spawn(self.nodes[0])  # the first bootstraps; the others clone it
            leader = self.wait_leader(timeout)
            for node in self.nodes[1:]:
                self._spawn(node)
            self.psql(leader, f"CREATE ROLE {APP_USER} LOGIN PASSWORD '{APP_PASSWORD}'")
            self.psql(leader, f'CREATE DATABASE "{DATABASE}" OWNER {APP_USER}')
            self.wait_replicas(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for node in self.nodes:
            self.thaw(node)
            if node.proc is not None and node.proc.poll() is None:
                node.proc.send_signal(signal.SIGTERM)
        for node in self.nodes:
            if node.proc is None:
                continue
            try:
                node.proc.wait(30)
            except subprocess.TimeoutExpired:
                _signal_all(_process_tree(node.proc.pid), signal.SIGKILL)
                node.proc.wait(10)
            pid = node.postmaster_pid()
            if pid is not None:  # a postmaster Patroni left behind
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGQUIT)
        if self.etcd is not None and self.etcd.poll() is None:
            self.etcd.kill()
            self.etcd.wait(10)
        if self.base != Path():
            shutil.rmtree(self.base, ignore_errors=True)

    def __enter__(self) -> PatroniCluster:
        return self.start()

    def __exit__(self, t: type[BaseException] | None, v: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    # -- what the tests use ---------------------------------------------------------------

    def url(self, form: str = "repeated") -> str:
        """The application's multi-host URL (no driver), libpq choosing the primary:
        `repeated` (?host=h1:p1&host=h2:p2) or libpq's `comma` form (?host=h1,h2&port=)."""
        if form == "repeated":
            hosts = "&".join(f"host={n.host}" for n in self.nodes)
        else:
            hosts = (f"host={','.join('127.0.0.1' for _ in self.nodes)}"
                     f"&port={','.join(str(n.port) for n in self.nodes)}")
        return (f"postgresql://{APP_USER}:{APP_PASSWORD}@/{DATABASE}?{hosts}"
                "&target_session_attrs=read-write")

    def leader(self) -> Node | None:
        """The node Patroni runs as the primary now (its REST API says so)."""
        for node in self.nodes:
            if node.frozen:
                continue
            status, _ = node.rest("/primary", timeout=1.0)
            if status == 200:
                return node
        return None

    def wait_leader(self, timeout: float = 60.0, not_: Node | None = None) -> Node:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            node = self.leader()
            if node is not None and node is not not_:
                return node
            time.sleep(0.2)
        raise DBServerError(f"no Patroni leader after {timeout}s:\n{self.log_tails()}")

    def wait_replicas(self, timeout: float = 120.0) -> None:
        """Until every node runs: one primary, the others streaming replicas, and one of
        them the synchronous standby."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            leader = self.leader()
            if leader is not None:
                status, body = leader.rest("/cluster")
                members = body.get("members", []) if isinstance(body, dict) else []
                running = [m for m in members if m.get("state") in ("running", "streaming")]
                sync = [m for m in members if m.get("role") == "sync_standby"]
                if status == 200 and len(running) == self.n and sync:
                    return
            time.sleep(0.5)
        raise DBServerError(f"the replicas did not come up in {timeout}s:\n"
                            f"{self.log_tails()}")

    def sync_standby(self) -> Node | None:
        leader = self.leader()
        if leader is None:
            return None
        _, body = leader.rest("/cluster")
        for m in body.get("members", []) if isinstance(body, dict) else []:
            if m.get("role") == "sync_standby":
                return next(n for n in self.nodes if n.name == m["name"])
        return None

    def switchover(self, leader: Node, candidate: Node) -> None:
        status, body = leader.rest("/switchover", "POST",
                                   {"leader": leader.name, "candidate": candidate.name},
                                   timeout=60.0)
        if status != 200:
            raise DBServerError(f"switchover refused: {status} {body}")

    def kill_postmaster(self, node: Node) -> None:
        pid = node.postmaster_pid()
        if pid is None:
            raise DBServerError(f"{node.name}: no postmaster.pid")
        os.kill(pid, signal.SIGKILL)

    def freeze(self, node: Node) -> None:
        """SIGSTOP of the node's whole process tree (Patroni, the postmaster, every
        backend): a hung host whose kernel still acknowledges TCP."""
        assert node.proc is not None
        node.frozen = True
        # Patroni starts the postmaster detached (it outlives a Patroni restart), so the
        # node is two trees.  Each parent first: it starts nothing new then.
        os.kill(node.proc.pid, signal.SIGSTOP)
        _signal_all(_process_tree(node.proc.pid)[1:], signal.SIGSTOP)
        pm = node.postmaster_pid()
        if pm is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pm, signal.SIGSTOP)
            _signal_all(_process_tree(pm)[1:], signal.SIGSTOP)

    def thaw(self, node: Node) -> None:
        if node.proc is None or not node.frozen:
            return
        pm = node.postmaster_pid()
        for root in (node.proc.pid, pm):
            if root is not None:
                _signal_all(_process_tree(root), signal.SIGCONT)
        node.frozen = False

    def psql(self, node: Node, sql: str, dbname: str = "postgres") -> str:
        bindir = _pg_bindir() or ""
        res = subprocess.run(
            [os.path.join(bindir, "psql"), "-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1",
             "-h", str(node.dir), "-p", str(node.port), "-U", "postgres", "-d", dbname,
             "-c", sql], capture_output=True, text=True, timeout=60)
        if res.returncode != 0:
            raise DBServerError(f"psql on {node.name}: {res.stderr.strip()}")
        return res.stdout

    def log_tails(self, lines: int = 15) -> str:
        out = []
        for node in self.nodes:
            try:
                text = (node.dir / "patroni.log").read_text(errors="replace")
            except OSError:
                text = "(no log)"
            out.append(f"--- {node.name}\n" + "".join(text.splitlines(True)[-lines:]))
        return "\n".join(out)

    # -- set-up ---------------------------------------------------------------------------

    def _chown(self, path: Path) -> None:
        if os.geteuid() == 0:
            pw = pwd.getpwnam(SERVICE_USER)
            os.chown(path, pw.pw_uid, pw.pw_gid)

    def _start_etcd(self) -> None:
        self.etcd_port = free_port()
        peer = free_port()
        data = self.base / "etcd"
        log = open(self.base / "etcd.log", "wb")  # noqa: SIM115 - the child keeps it
        self.etcd = subprocess.Popen(
            ["/usr/bin/etcd", "--name", "e0", "--data-dir", str(data),
             "--listen-client-urls", f"http://127.0.0.1:{self.etcd_port}",
             "--advertise-client-urls", f"http://127.0.0.1:{self.etcd_port}",
             "--listen-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
             "--initial-cluster", f"e0=http://127.0.0.1:{peer}",
             "--enable-v2=true", "--log-level", "warn"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
            preexec_fn=_parent_death_signal(signal.SIGTERM))
        log.close()
        end = time.monotonic() + 30
        while time.monotonic() < end:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.etcd_port}/health",
                                            timeout=1) as res:
                    if b"true" in res.read():
                        return
            except OSError:
                pass
            if self.etcd.poll() is not None:
                break
            time.sleep(0.1)
        raise DBServerError("etcd did not start:\n"
                            + (self.base / "etcd.log").read_text(errors="replace")[-2000:])

    def _config(self, node: Node) -> dict[str, Any]:
        return {
            "scope": SCOPE, "name": node.name,
            "log": {"dir": str(node.dir), "file_num": 1, "level": "INFO"},
            "restapi": {"listen": f"127.0.0.1:{node.rest_port}",
                        "connect_address": f"127.0.0.1:{node.rest_port}"},
            "etcd": {"host": f"127.0.0.1:{self.etcd_port}"},
            "watchdog": {"mode": "off"},
            "bootstrap": {
                "dcs": {
                    "ttl": TTL, "loop_wait": LOOP_WAIT, "retry_timeout": RETRY_TIMEOUT,
                    "maximum_lag_on_failover": 1048576, "synchronous_mode": True,
                    "primary_start_timeout": 0,
                    "postgresql": {
                        "use_pg_rewind": True,
                        "parameters": {
                            "wal_level": "replica", "hot_standby": "on",
                            "wal_log_hints": "on", "max_wal_senders": 10,
                            "max_replication_slots": 10, "max_connections": 300,
                            "synchronous_commit": "on",
                        },
                    },
                },
                "initdb": [{"encoding": "UTF8"}, {"locale": "C.UTF-8"}],
                "pg_hba": self._hba(),
            },
            "postgresql": {
                "listen": f"127.0.0.1:{node.port}",
                "connect_address": f"127.0.0.1:{node.port}",
                "data_dir": str(node.dir / "data"),
                "bin_dir": _pg_bindir(),
                "pgpass": str(node.dir / "pgpass"),
                # A fresh replica's base backup starts at once, not after a spread
                # checkpoint (minutes).
                "basebackup": [{"checkpoint": "fast"}],
                "authentication": {
                    "superuser": {"username": "postgres", "password": SUPERUSER_PASSWORD},
                    "replication": {"username": "replicator",
                                    "password": REPLICATION_PASSWORD},
                    "rewind": {"username": "postgres", "password": SUPERUSER_PASSWORD},
                },
                "parameters": {
                    "unix_socket_directories": str(node.dir),
                    "shared_buffers": "32MB", "fsync": "off",
                    "timezone": "UTC", "log_timezone": "UTC",
                    "log_min_messages": "warning",
                },
                "pg_hba": self._hba(),
            },
            "tags": {"nofailover": False, "noloadbalance": False, "clonefrom": False,
                     "nosync": False},
        }

    @staticmethod
    def _hba() -> list[str]:
        return ["local all all trust",
                "host replication replicator 127.0.0.1/32 scram-sha-256",
                "host all all 127.0.0.1/32 scram-sha-256"]

    def _spawn(self, node: Node) -> None:
        log = open(node.dir / "patroni.out", "wb")  # noqa: SIM115 - the child keeps it
        root = os.geteuid() == 0
        node.proc = subprocess.Popen(
            ["/usr/bin/patroni", str(node.dir / "patroni.yml")],
            stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd=node.dir,
            start_new_session=True,
            user=SERVICE_USER if root else None, group=SERVICE_USER if root else None,
            extra_groups=[] if root else None,
            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": str(node.dir)},
            preexec_fn=_parent_death_signal(signal.SIGTERM))
        log.close()
