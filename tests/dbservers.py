"""Throw-away PostgreSQL and MariaDB servers for the test suite and the bench scripts.

Each server runs on 127.0.0.1 on a free port, with its data in a temporary directory,
as the unprivileged service user (``postgres`` / ``mysql``) when we are root.  Nothing
here needs pytest or a Python database driver: administration goes through ``psql`` and
``mariadb`` over the server's private unix socket.

    with PostgresServer() as pg:
        pg.create_database("t1")
        url = pg.url("t1")            # postgresql://sched:sched@127.0.0.1:PORT/t1
        pg.stop_server()              # fault injection: the data directory is kept
        pg.start_server()             # same port, same data
        pg.drop_database("t1")

CLI (bench scripts, manual use)::

    python tests/dbservers.py postgresql [--db NAME] [--port N]
    python tests/dbservers.py mariadb    [--db NAME] [--port N]

prints the URL of a fresh database on stdout, then runs until SIGINT/SIGTERM.

Servers are stopped and their directories removed by ``stop()``, at interpreter exit
(atexit), and - as a last resort when the Python process is killed - the server gets a
parent-death signal; directories left behind by killed runs are removed by the next start.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ctypes
import glob
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import ClassVar

APP_USER = "sched"
APP_PASSWORD = "sched"
DIR_PREFIX = "perfectsched-testdb-"
INSTALL_HINT = "install them with: sudo tests/install-test-deps.sh (or: make test-deps)"

_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")


class DBServerError(RuntimeError):
    """A database server could not be found, started or administered."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (the kernel's pick for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _check_name(name: str) -> str:
    if not _NAME_RE.match(name):
        raise ValueError(f"database name {name!r}: use letters, digits and _ (max 63)")
    return name


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, ppid) of a process from /proc, or None if it does not exist."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1])


def _pid_alive(pid: int) -> bool:
    st = _proc_stat(pid)
    return st is not None and st[0] != "Z"


def _process_tree(pid: int) -> list[int]:
    """`pid` and its direct children (PostgreSQL backends each call setsid(), so the
    process group of the postmaster does not contain them)."""
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _proc_stat(int(entry))
            if st is not None and st[1] == pid:
                children.append(int(entry))
    return [pid, *children]


def _signal_all(pids: Sequence[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _parent_death_signal(sig: int) -> Callable[[], None]:
    """preexec_fn: deliver `sig` to the child when the thread that started it dies."""
    def setup() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, int(sig), 0, 0, 0)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    return setup


def _remove_stale_dirs() -> None:
    """Clean up after runs that were killed: their Python process (first pid in owner.pid)
    is gone.  Servers still running there (e.g. frozen by pause_server, which defers the
    parent-death signal) are killed, then the directory is removed."""
    for d in glob.glob(os.path.join(tempfile.gettempdir(), DIR_PREFIX + "*")):
        try:
            with open(os.path.join(d, "owner.pid")) as f:
                pids = [int(x) for x in f.read().split()]
        except (OSError, ValueError):
            pids = []
        if not pids:
            # No owner yet: a start may be in progress; only remove it when clearly old.
            try:
                if time.time() - os.stat(d).st_mtime < 3600:
                    continue
            except OSError:
                continue
        elif _pid_alive(pids[0]):
            continue
        for pid in pids[1:]:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = f.read()
            except OSError:
                continue
            if d.encode() in cmdline:  # still our server, not a reused pid
                tree = _process_tree(pid)
                _signal_all(tree, signal.SIGKILL)
                _signal_all(tree, signal.SIGCONT)
        shutil.rmtree(d, ignore_errors=True)


class _Server:
    """Common life cycle; subclasses provide the engine-specific commands."""

    kind: ClassVar[str] = ""
    scheme: ClassVar[str] = ""
    service_user: ClassVar[str] = ""

    _live: ClassVar[set[_Server]] = set()
    _atexit_registered: ClassVar[bool] = False
    _class_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, port: int | None = None, start_timeout: float = 60.0) -> None:
        self._wanted_port = port
        self.port: int = 0
        self.base_dir: str = ""
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.startup_seconds: float = 0.0

    # ----------------------------------------------------------------- public API
    def start(self) -> _Server:
        """Create a fresh data directory, start the server and create the app user."""
        if self.base_dir:
            raise DBServerError(f"{self.kind} server already started")
        self._check_binaries()
        t0 = time.monotonic()
        _remove_stale_dirs()
        self.base_dir = tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{self.kind}-")
        with open(os.path.join(self.base_dir, "owner.pid"), "w") as f:
            f.write(f"{os.getpid()}\n")
        self._register()
        try:
            os.chmod(self.base_dir, 0o755)
            if self._as_root():
                pw = pwd.getpwnam(self.service_user)
                os.chown(self.base_dir, pw.pw_uid, pw.pw_gid)
            self._init_data_dir()
            for attempt in range(5):
                self.port = self._wanted_port or free_port()
                try:
                    self.start_server()
                    break
                except DBServerError:
                    # Another process may have taken the port between pick and bind.
                    if self._wanted_port or attempt == 4 or port_is_free(self.port):
                        raise
            self._create_app_user()
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - t0
        return self

    def stop(self) -> None:
        """Stop the server (if running) and delete its data. Safe to call repeatedly."""
        try:
            self.stop_server()
        finally:
            if self.base_dir:
                shutil.rmtree(self.base_dir, ignore_errors=True)
                self.base_dir = ""
            with self._class_lock:
                self._live.discard(self)

    def start_server(self) -> None:
        """(Re)start the server process on self.port with the existing data directory."""
        if not self.base_dir:
            raise DBServerError("start() first: there is no data directory")
        if self.running:
            return
        log = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            self.proc = subprocess.Popen(
                self._server_argv(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,  # own process group: Ctrl-C reaches only us
                user=self.service_user if self._as_root() else None,
                group=self.service_user if self._as_root() else None,
                extra_groups=[] if self._as_root() else None,
                preexec_fn=_parent_death_signal(self._death_signal()),
                env=self._server_env(),
                cwd=self.base_dir,
            )
        finally:
            os.close(log)
        deadline = time.monotonic() + self.start_timeout
        while True:
            if self.proc.poll() is not None:
                self.proc = None
                raise DBServerError(
                    f"{self.kind} server exited during start on port {self.port};"
                    f" log {self.log_path}:\n{self.log_tail()}"
                )
            if self._ready():
                return
            if time.monotonic() > deadline:
                self.stop_server(mode="immediate")
                raise DBServerError(
                    f"{self.kind} server not ready after {self.start_timeout} s;"
                    f" log:\n{self.log_tail()}"
                )
            time.sleep(0.05)

    def stop_server(self, mode: str = "fast", timeout: float = 30.0) -> None:
        """Stop the server process but keep the data directory (see start_server).

        mode "fast": clean shutdown (open connections are cut); "immediate": a crash
        (PostgreSQL immediate shutdown / SIGKILL for MariaDB), recovery on next start.
        """
        proc = self.proc
        if proc is None:
            return
        if mode not in ("fast", "immediate"):
            raise ValueError(f"mode must be 'fast' or 'immediate', not {mode!r}")
        self.resume_server()
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, self._stop_signal(mode))
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                _signal_all(_process_tree(proc.pid), signal.SIGKILL)
                proc.wait(10)
        self.proc = None
        self._after_stop()

    def pause_server(self) -> None:
        """Freeze every server process (SIGSTOP): new and open connections hang instead of
        failing, as with a server behind a dead network.  resume_server() thaws it."""
        if self.proc is not None:
            os.kill(self.proc.pid, signal.SIGSTOP)  # first: it forks no new child then
            _signal_all(_process_tree(self.proc.pid)[1:], signal.SIGSTOP)

    def resume_server(self) -> None:
        if self.proc is not None:
            _signal_all(_process_tree(self.proc.pid), signal.SIGCONT)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def log_path(self) -> str:
        return os.path.join(self.base_dir, "server.log")

    def log_tail(self, lines: int = 30) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return "(no log)"

    def url(self, dbname: str) -> str:
        """SQLAlchemy URL without a driver; the code under test picks the driver."""
        return f"{self.scheme}://{APP_USER}:{APP_PASSWORD}@127.0.0.1:{self.port}/{dbname}"

    def create_database(self, name: str) -> str:
        """Create an empty database owned by/granted to the app user; returns its URL."""
        raise NotImplementedError

    def drop_database(self, name: str) -> None:
        """Drop a database (cutting its open connections); no error if it does not exist."""
        raise NotImplementedError

    def __enter__(self) -> _Server:
        if not self.base_dir:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<{type(self).__name__} 127.0.0.1:{self.port} {state} {self.base_dir}>"

    # ------------------------------------------------------------------ internals
    @staticmethod
    def _as_root() -> bool:
        return os.geteuid() == 0

    def _register(self) -> None:
        with self._class_lock:
            self._live.add(self)
            if not _Server._atexit_registered:
                atexit.register(_stop_all)
                _Server._atexit_registered = True

    def _note_server_pid(self) -> None:
        if self.proc is not None and self.base_dir:
            with open(os.path.join(self.base_dir, "owner.pid"), "a") as f:
                f.write(f"{self.proc.pid}\n")

    def _run(
        self, argv: Sequence[str], *, as_service_user: bool = False, input: str | None = None
    ) -> str:
        cmd = list(argv)
        if as_service_user and self._as_root():
            cmd = ["runuser", "-u", self.service_user, "--", *cmd]
        r = subprocess.run(
            cmd,
            input=input,
            capture_output=True,
            text=True,
            env=self._server_env(),
            cwd=self.base_dir or None,
        )
        if r.returncode != 0:
            raise DBServerError(
                f"{self.kind}: {' '.join(cmd)} failed ({r.returncode}):\n{r.stdout}{r.stderr}"
            )
        return r.stdout

    def _server_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "MYSQL"))}
        env["LC_ALL"] = "C.UTF-8"
        env["LANG"] = "C.UTF-8"
        env["TZ"] = "UTC"
        return env

    def _after_stop(self) -> None:
        pass

    # engine specific
    def _check_binaries(self) -> None:
        raise NotImplementedError

    def _init_data_dir(self) -> None:
        raise NotImplementedError

    def _server_argv(self) -> list[str]:
        raise NotImplementedError

    def _ready(self) -> bool:
        raise NotImplementedError

    def _create_app_user(self) -> None:
        raise NotImplementedError

    def _stop_signal(self, mode: str) -> int:
        raise NotImplementedError

    def _death_signal(self) -> int:
        raise NotImplementedError


def _stop_all() -> None:
    for srv in list(_Server._live):
        with contextlib.suppress(Exception):
            srv.stop()


def _pg_bindir() -> str | None:
    env = os.environ.get("PERFECTSCHED_PG_BINDIR")
    if env:
        return env
    cands = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"),
        key=lambda p: int(p.split("/")[4]) if p.split("/")[4].isdigit() else 0,
    )
    if cands:
        return os.path.dirname(cands[-1])
    found = shutil.which("initdb")
    return os.path.dirname(found) if found else None


class PostgresServer(_Server):
    """A throw-away PostgreSQL cluster (Debian: /usr/lib/postgresql/<newest>/bin)."""

    kind = "postgresql"
    scheme = "postgresql"
    service_user = "postgres"

    def __init__(self, port: int | None = None, start_timeout: float = 60.0) -> None:
        super().__init__(port, start_timeout)
        self.bindir = _pg_bindir() or ""

    @property
    def data_dir(self) -> str:
        return os.path.join(self.base_dir, "data")

    def _check_binaries(self) -> None:
        missing = [
            b for b in ("initdb", "postgres", "psql")
            if not (self.bindir and os.access(os.path.join(self.bindir, b), os.X_OK))
        ]
        if missing:
            raise DBServerError(
                f"PostgreSQL binaries not found ({', '.join(missing)} in"
                f" {self.bindir or '/usr/lib/postgresql/*/bin'}); {INSTALL_HINT}"
            )
        if self._as_root():
            try:
                pwd.getpwnam(self.service_user)
            except KeyError:
                raise DBServerError(f"no user {self.service_user!r}; {INSTALL_HINT}") from None

    def _init_data_dir(self) -> None:
        self._run(
            [
                os.path.join(self.bindir, "initdb"), "-D", self.data_dir, "-U", "postgres",
                "--auth-local=trust", "--auth-host=scram-sha-256", "-E", "UTF8",
                "--locale=C.UTF-8", "--no-sync", "--no-instructions",
            ],
            as_service_user=True,
        )

    def _server_argv(self) -> list[str]:
        return [
            os.path.join(self.bindir, "postgres"), "-D", self.data_dir,
            "-c", "listen_addresses=127.0.0.1", "-c", f"port={self.port}",
            "-c", f"unix_socket_directories={self.base_dir}",
            # No fsync (an OS crash may lose data), but every commit is written before it
            # returns: committed data survives a crash of the server (stop_server immediate).
            "-c", "fsync=off", "-c", "full_page_writes=off",
            "-c", "max_connections=200", "-c", "shared_buffers=64MB",
            "-c", "timezone=UTC", "-c", "log_timezone=UTC",
            "-c", "logging_collector=off", "-c", "log_min_messages=warning",
        ]

    def _ready(self) -> bool:
        # Line 8 of postmaster.pid is the postmaster status ("ready" once accepting).
        try:
            with open(os.path.join(self.data_dir, "postmaster.pid")) as f:
                lines = f.read().splitlines()
        except OSError:
            return False
        if len(lines) >= 8 and lines[7].strip() == "ready":
            self._note_server_pid()
            return True
        return False

    def _stop_signal(self, mode: str) -> int:
        return signal.SIGINT if mode == "fast" else signal.SIGQUIT

    def _death_signal(self) -> int:
        return signal.SIGINT  # fast shutdown when the test process dies

    def psql(self, sql: str, dbname: str = "postgres") -> str:
        """Run SQL as the superuser over the private unix socket; returns unaligned rows."""
        return self._run(
            [
                os.path.join(self.bindir, "psql"), "-X", "-q", "-A", "-t",
                "-v", "ON_ERROR_STOP=1", "-h", self.base_dir, "-p", str(self.port),
                "-U", "postgres", "-d", dbname, "-c", sql,
            ]
        )

    def _create_app_user(self) -> None:
        self.psql(f"CREATE ROLE {APP_USER} LOGIN PASSWORD '{APP_PASSWORD}'")

    def create_database(self, name: str) -> str:
        # PG 15: only the owner may CREATE in schema public -> the app role owns it.
        self.psql(f'CREATE DATABASE "{_check_name(name)}" OWNER {APP_USER}')
        return self.url(name)

    def drop_database(self, name: str) -> None:
        self.psql(f'DROP DATABASE IF EXISTS "{_check_name(name)}" WITH (FORCE)')


class MariaDBServer(_Server):
    """A throw-away MariaDB server (Debian 12: 10.11), started with --no-defaults."""

    kind = "mysql"
    scheme = "mysql"
    service_user = "mysql"

    def __init__(self, port: int | None = None, start_timeout: float = 60.0) -> None:
        super().__init__(port, start_timeout)
        self.mariadbd = shutil.which("mariadbd", path="/usr/sbin:/usr/bin:/sbin:/bin") or ""
        self.install_db = shutil.which("mariadb-install-db", path="/usr/bin:/usr/sbin") or ""
        self.client = shutil.which("mariadb", path="/usr/bin:/usr/sbin") or ""

    @property
    def data_dir(self) -> str:
        return os.path.join(self.base_dir, "data")

    @property
    def socket_path(self) -> str:
        return os.path.join(self.base_dir, "mysqld.sock")

    def _check_binaries(self) -> None:
        if not (self.mariadbd and self.install_db and self.client):
            raise DBServerError(
                "MariaDB binaries not found (mariadbd, mariadb-install-db, mariadb);"
                f" {INSTALL_HINT}"
            )
        if self._as_root():
            try:
                pwd.getpwnam(self.service_user)
            except KeyError:
                raise DBServerError(f"no user {self.service_user!r}; {INSTALL_HINT}") from None

    @property
    def tmp_dir(self) -> str:
        """Each instance's own: in the shared /tmp, the bootstrap of one (8 start at once
        under test-slow) failed now and then on a temporary table gone from under it
        ("Could not remove temporary table '/tmp/#sql-temptable-...'", then "Unknown
        table 'mysql.tmp_user_sys'")."""
        return f"{self.base_dir}/tmp"

    def _init_data_dir(self) -> None:
        os.makedirs(self.tmp_dir, exist_ok=True)
        if os.geteuid() == 0:
            pw = pwd.getpwnam(self.service_user)
            os.chown(self.tmp_dir, pw.pw_uid, pw.pw_gid)
        argv = [
            self.install_db, "--no-defaults", f"--datadir={self.data_dir}", "--skip-test-db",
            "--auth-root-authentication-method=normal", "--skip-name-resolve",
            f"--tmpdir={self.tmp_dir}",
        ]
        self._run(argv, as_service_user=True)

    def _server_argv(self) -> list[str]:
        return [
            self.mariadbd, "--no-defaults", f"--datadir={self.data_dir}",
            f"--tmpdir={self.tmp_dir}",
            f"--socket={self.socket_path}", f"--pid-file={self.base_dir}/mariadbd.pid",
            f"--port={self.port}", "--bind-address=127.0.0.1", "--skip-name-resolve",
            "--skip-log-bin",  # no --log-error: it logs to stderr = server.log
            # =2: the log is written (not fsynced) at each commit -> committed data survives
            # a crash of mariadbd (stop_server immediate), only an OS crash may lose it.
            "--innodb-buffer-pool-size=64M", "--innodb-flush-log-at-trx-commit=2",
            "--innodb-doublewrite=0", "--max-connections=300",
            # Debian's /etc/mysql/mariadb.conf.d/50-server.cnf defaults:
            "--character-set-server=utf8mb4", "--collation-server=utf8mb4_general_ci",
            "--default-time-zone=+00:00",
        ]

    def _ready(self) -> bool:
        if not os.path.exists(self.socket_path):
            return False
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                pass
        except OSError:
            return False
        self._note_server_pid()
        return True

    def _stop_signal(self, mode: str) -> int:
        return signal.SIGTERM if mode == "fast" else signal.SIGKILL

    def _death_signal(self) -> int:
        return signal.SIGTERM

    def sql(self, sql: str) -> str:
        """Run SQL as root over the private unix socket; returns tab-separated rows."""
        return self._run(
            [self.client, "--no-defaults", "-S", self.socket_path, "-uroot", "-N", "-B",
             "-e", sql]
        )

    def _create_app_user(self) -> None:
        self.sql(f"CREATE USER '{APP_USER}'@'127.0.0.1' IDENTIFIED BY '{APP_PASSWORD}'")

    def create_database(self, name: str) -> str:
        _check_name(name)
        self.sql(
            f"CREATE DATABASE `{name}`;"
            f" GRANT ALL PRIVILEGES ON `{name}`.* TO '{APP_USER}'@'127.0.0.1'"
        )
        return self.url(name)

    def drop_database(self, name: str) -> None:
        _check_name(name)
        # DROP DATABASE waits for metadata locks held by open transactions: cut them.
        ids = self.sql(
            "SELECT id FROM information_schema.processlist"
            f" WHERE db = '{name}' AND id <> CONNECTION_ID()"
        ).split()
        kills = "".join(f"KILL {int(i)};" for i in ids)
        if kills:
            with contextlib.suppress(DBServerError):  # a connection may just have gone
                self.sql(kills)
        self.sql(f"DROP DATABASE IF EXISTS `{name}`")


SERVERS: dict[str, type[_Server]] = {
    "postgresql": PostgresServer,
    "postgres": PostgresServer,
    "pg": PostgresServer,
    "mysql": MariaDBServer,
    "mariadb": MariaDBServer,
}


def driver_url(url: str) -> str:
    """Test helper: add the driver an installed SQLAlchemy can use to a plain URL.

    postgresql:// -> +psycopg (SQLAlchemy 2 with psycopg 3) or +psycopg2 (SQLAlchemy 1.4);
    mysql:// -> +pymysql.  Other URLs are returned unchanged.
    """
    if url.startswith("postgresql://"):
        import sqlalchemy

        driver = "psycopg2"
        if int(sqlalchemy.__version__.split(".")[0]) >= 2:
            try:
                import psycopg  # noqa: F401

                driver = "psycopg"
            except ImportError:
                pass
        return f"postgresql+{driver}://" + url[len("postgresql://"):]
    if url.startswith("mysql://"):
        return "mysql+pymysql://" + url[len("mysql://"):]
    return url


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="Run a throw-away database server until SIGINT/SIGTERM;"
        " print the URL of a fresh database on stdout."
    )
    ap.add_argument("kind", choices=sorted(SERVERS))
    ap.add_argument(
        "--db", default="perfectsched", help="database to create (default: %(default)s)"
    )
    ap.add_argument("--port", type=int, default=None, help="port (default: a free one)")
    args = ap.parse_args(argv)

    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, on_signal)
    server = SERVERS[args.kind](port=args.port)
    try:
        server.start()
        url = server.create_database(args.db)
        print(url, flush=True)
        print(
            f"{server.kind} ready in {server.startup_seconds:.2f} s, data in {server.base_dir};"
            " Ctrl-C or SIGTERM stops it and deletes the data",
            file=sys.stderr,
            flush=True,
        )
        while not stop.is_set():
            if not server.running:
                print(f"{server.kind} server died; log:\n{server.log_tail()}", file=sys.stderr)
                return 1
            stop.wait(0.5)
    except DBServerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
