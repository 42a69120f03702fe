"""YAML -> validated, immutable Config: the file read, its top-level keys checked, and
what only the host that runs the jobs can check of it (host_refusals, refuse_routes).
The `routes` section is settings/routes.py's, a notifier settings/notify_spec.py's."""

from __future__ import annotations

import os
import pwd
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from perfectschedd import secretfile
from perfectschedd.errors import ConfigError, InvalidInputError, NotSupportedError, describe
from perfectschedd.paths import DEFAULT_CONFIG_PATH, DEFAULT_SCHEDULES_DIR, DEFAULT_SOCKET
from perfectschedd.settings import notify_spec, runas, unit_props
from perfectschedd.settings.notify_spec import Notifier
from perfectschedd.settings.numbers import number
from perfectschedd.settings.routes import RouteConfig, parse_routes
from perfectschedd.settings.runas import ACCOUNT_NAME

# Documented default port of /metrics (README, perfectschedd(8)); not registered with IANA.
DEFAULT_METRICS_PORT = 9839
DEFAULT_METRICS_LISTEN = f"127.0.0.1:{DEFAULT_METRICS_PORT}"

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
_NODE_NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


# output_limit: the default keeps a screenful of a failing job's last words; history then
# holds up to history_limit x output_limit bytes of output per schedule (docs/performance.md).
# Above the maximum a history row, and a batch of them, would weigh on the database and on
# the workers' memory (a ring of output_limit bytes per running job); below the minimum the
# truncation mark itself would not fit.
DEFAULT_OUTPUT_LIMIT = 4096
OUTPUT_LIMIT_MIN = 64
OUTPUT_LIMIT_MAX = 1 << 20
# log_output_limit: the bytes of an exec run's output its worker logs (stdout and stderr
# together; 0: none).  The default shows the start of an ordinary job's output whole and
# keeps a job printing without end from filling the log's disk and the workers' memory.
DEFAULT_LOG_OUTPUT_LIMIT = 65536


@dataclass(frozen=True)
class Config:
    url: str
    type: str = "rdb_compat"
    table: str = "perfectsched"
    log: str | None = None
    poll_interval: float = 1.0
    timezone: str = "UTC"
    alive_time: int = 300
    retry_wait: int = 300
    # Retry back-off: retry_wait doubles per failed attempt, up to this.
    retry_wait_max: int = 3600
    # Failed attempts after which an occurrence is given up, for schedules that set no
    # max_attempts of their own; 0: retry until success (the original's way).
    max_attempts: int = 0
    # How long after it was due one occurrence may still be put off by SCHED_LATER (or a
    # python handler's retry(wait=N)); past it the occurrence is given up.  0: no bound.
    later_limit: int = 86400
    workers: int = 2
    # Tasks one worker process runs at once (threads); a long job must not block a worker.
    concurrency: int = 8
    control_socket: str = DEFAULT_SOCKET
    # Group whose members may use the control socket (besides root and the daemon's user).
    control_group: str | None = None
    # The HTTP listener: /metrics, /healthz, the API and the console (0.1.0's name for
    # it, metrics_listen, is read too).
    http_listen: tuple[str, int] | None = ("127.0.0.1", DEFAULT_METRICS_PORT)
    http_listen_key: str = "http_listen"  # the name the file used, for messages
    # (certificate file, key file): HTTPS.
    http_tls: tuple[str, str] | None = None
    # The API and the console on a non-loopback address without TLS (tokens in clear).
    http_insecure: bool = False
    # /metrics and /healthz ask for a token (any role) too.
    metrics_token: bool = False
    dbus: bool = False
    # D-Bus address (e.g. unix:path=/run/x.sock) instead of the system bus; for tests.
    dbus_address: str | None = None
    # How long a graceful stop waits for running tasks before releasing them.
    shutdown_timeout: float = 30.0
    # Grace between TERM and KILL when a handler times out or the daemon stops.
    kill_grace: float = 5.0
    # A worker that sends no liveness ping for this long is killed and replaced.
    worker_timeout: float = 30.0
    routes: tuple[RouteConfig, ...] = ()
    history_limit: int = 100
    # Runs that ended longer ago than this are removed, of every key, deleted schedules'
    # too (each existing schedule keeps its newest run); 0: no age limit.
    history_keep_days: float = 90.0
    # Bytes of each run's output kept in its history row (the tail); 0: none.
    output_limit: int = DEFAULT_OUTPUT_LIMIT
    # Bytes of each exec run's output written to the daemon's log (the first); 0: none.
    log_output_limit: int = DEFAULT_LOG_OUTPUT_LIMIT
    # Schedules files (*.yml) the daemon converges the database to; None: none.
    schedules_dir: str | None = DEFAULT_SCHEDULES_DIR
    # The most schedules with series of their own on /metrics (root's and files' first);
    # the rest are counted, not shown.  0: none.
    schedule_metrics_max: int = 500
    # Whether the file names schedules_dir (then it must exist: schedules_dir_refusal).
    schedules_dir_named: bool = field(default=False, compare=False)
    # This host's name in lease owners ("node:pid") and status; default: the hostname.
    node_name: str | None = None
    # Named notifiers (`--notify NAME` stores a name), the default one, the mail program.
    notifiers: tuple[tuple[str, Notifier], ...] = ()
    notify: Notifier | None = None
    sendmail: str = notify_spec.DEFAULT_SENDMAIL
    # Who runs exec notifiers and sendmail when the daemon's uid may start units (root);
    # set by refuse_routes: notify_as (None: as the daemon itself) and, when they cannot
    # run on this host at all (the grant is on), notify_refused saying why.
    notify_user: str = "nobody"
    notify_as: str | None = None
    notify_refused: str | None = None
    # Schedules files' entries' own `notify:` (inline or none), by key: on this host only,
    # as their commands (set by master/file_schedules.FileSchedules.load).
    entry_notify: tuple[tuple[str, Notifier], ...] = ()
    source: str | None = field(default=None, compare=False)

    @property
    def node(self) -> str:
        return self.node_name or socket.gethostname()

    def notifier(self, name: str) -> Notifier | None:
        for known, notifier in self.notifiers:
            if known == name:
                return notifier
        return None

    def all_notifiers(self) -> list[Notifier]:
        """Every notifier this configuration may use (for the host checks)."""
        found = [n for _, n in self.notifiers]
        found += [n for n in (self.notify, *(r.notify for r in self.routes)) if n is not None]
        found += [n for _, n in self.entry_notify]
        return found


# A configuration file larger than this is refused unread (it is a few kB).
CONFIG_MAX = 1 << 20

_KNOWN_KEYS = {
    "type", "url", "password_file", "table", "log", "poll_interval", "timezone", "alive_time",
    "retry_wait",
    "retry_wait_max", "max_attempts", "later_limit",
    "workers", "concurrency", "control_socket", "control_group", "metrics_listen", "dbus",
    "dbus_address", "http_listen", "http_tls", "http_insecure", "metrics_token",
    "shutdown_timeout", "kill_grace", "worker_timeout", "routes", "history_limit",
    "history_keep_days", "output_limit", "log_output_limit", "schedule_metrics_max",
    "node_name", "schedules_dir", "notifiers", "notify", "sendmail", "notify_user",
}


# Per-schedule series are a scrape's size and Prometheus' memory: 10,000 keys of 5
# series each are about 3 MB a scrape.
SCHEDULE_METRICS_CEILING = 10_000


def _schedule_metrics_max(raw: Mapping[str, Any]) -> int:
    value = number(raw, "schedule_metrics_max", 500, minimum=0, integer=True)
    if value > SCHEDULE_METRICS_CEILING:
        raise ConfigError(f"schedule_metrics_max: at most {SCHEDULE_METRICS_CEILING}, "
                          f"got {value}")
    return int(value)


def _output_limit(raw: Mapping[str, Any]) -> int:
    value: int = number(raw, "output_limit", DEFAULT_OUTPUT_LIMIT, minimum=0, integer=True)
    if value != 0 and not OUTPUT_LIMIT_MIN <= value <= OUTPUT_LIMIT_MAX:
        raise ConfigError(f"output_limit: must be 0 (keep no output) or from "
                          f"{OUTPUT_LIMIT_MIN} to {OUTPUT_LIMIT_MAX} bytes, got {value}")
    return value


def parse_listen(value: Any, key: str = "http_listen") -> tuple[str, int] | None:
    if value is None or value is False or value == "off":
        return None
    if not isinstance(value, str) or ":" not in value:
        raise ConfigError(f"{key}: expected host:port or off, got {describe(value)}")
    host, _, port = value.rpartition(":")
    host = host.strip("[]")
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{key}: bad port in {describe(value)}")
    return host, int(port)


def _http_listen(raw: Mapping[str, Any]) -> tuple[str, int] | None:
    """http_listen, or metrics_listen (its name until 0.3.0), not both."""
    if "http_listen" in raw and "metrics_listen" in raw:
        raise ConfigError("http_listen and metrics_listen (its old name) are both set: "
                          "keep http_listen only")
    key = "metrics_listen" if "metrics_listen" in raw else "http_listen"
    return parse_listen(raw.get(key, DEFAULT_METRICS_LISTEN), key)


def _http_tls(raw: Mapping[str, Any]) -> tuple[str, str] | None:
    value = raw.get("http_tls")
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != {"cert", "key"} or not all(
            isinstance(v, str) and v.startswith("/") for v in value.values()):
        raise ConfigError("http_tls: must be {cert: /PATH, key: /PATH} (absolute paths of "
                          "a PEM certificate chain and its key)")
    for what in ("cert", "key"):
        if not os.access(value[what], os.R_OK):
            raise ConfigError(f"http_tls: {what} {value[what]}: cannot be read")
    return value["cert"], value["key"]


def _flag(raw: Mapping[str, Any], key: str) -> bool:
    value = raw.get(key, False)
    if not isinstance(value, bool):
        raise ConfigError(f"{key}: must be true or false, got {describe(value)}")
    return value


def _with_password(url: str, ref: Any) -> str:
    """`url` with the password of `password_file:` (read now: at every load, so a reload
    and perfectschedctl -c see the file as it is), or `url` as written without one."""
    if ref is None:
        return url
    try:
        ref = secretfile.check_ref(ref, "password_file")
        if url.startswith("sqlite"):
            raise ConfigError("password_file: a SQLite database takes no password")
        from sqlalchemy.engine.url import make_url  # here: only a client with one loads it

        try:
            parsed = make_url(url)
        except Exception:  # noqa: BLE001 - its message would print the URL
            raise ConfigError("url: not a database URL") from None
        if parsed.password is not None:
            raise ConfigError("password_file: url: holds a password as well; keep it in "
                              "the file only (a password in url: is readable by whoever "
                              "reads this configuration)")
        password = secretfile.read(ref, "password_file")
    except secretfile.SecretError as exc:
        raise ConfigError(str(exc)) from None
    for written in (password, password.replace("%", "%25")):
        # SQLAlchemy 1.4 (Debian 12) writes a '%' as it is, and reads "%41" back as "A".
        rendered: str = parsed.set(password=written).render_as_string(hide_password=False)
        if make_url(rendered).password == password:
            return rendered
    raise ConfigError("password_file: this SQLAlchemy cannot carry the password in a URL "
                      "(choose one without '%')")


def from_mapping(raw: Mapping[str, Any], source: str | None = None) -> Config:
    """Validate a mapping (one environment's section) into a Config."""
    if not isinstance(raw, Mapping):
        raise ConfigError("configuration must be a mapping of keys to values")
    unknown = set(raw) - _KNOWN_KEYS
    if unknown:
        raise ConfigError(f"unknown configuration key(s): {', '.join(sorted(unknown))}")
    backend = raw.get("type")
    if backend is None:
        raise ConfigError("type: required (rdb_compat)")
    if backend == "rdb":
        raise NotSupportedError("type: 'rdb' is not supported; use rdb_compat")
    if backend != "rdb_compat":
        raise ConfigError(f"type: unknown backend {describe(backend)}; use rdb_compat")
    url = raw.get("url")
    if not isinstance(url, str) or not url:
        raise ConfigError("url: required (a SQLAlchemy URL such as sqlite:///path.db)")
    if url.split(":", 1)[0].split("+", 1)[0] not in ("sqlite", "postgresql", "postgres", "mysql"):
        raise ConfigError(f"url: unsupported database {describe(url.split(':', 1)[0])}")
    url = _with_password(url, raw.get("password_file"))
    table = raw.get("table", "perfectsched")
    if not isinstance(table, str) or not _IDENTIFIER.match(table):
        raise ConfigError(f"table: must be an SQL identifier, got {describe(table)}")
    tz = raw.get("timezone", "UTC")
    try:
        if not isinstance(tz, str):
            raise ValueError(tz)
        ZoneInfo(tz)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        raise ConfigError(f"timezone: unknown time zone {describe(tz)}") from None
    log = raw.get("log")
    if log is not None and not isinstance(log, str):
        raise ConfigError("log: must be a file path")
    sock = raw.get("control_socket", DEFAULT_SOCKET)
    if not isinstance(sock, str) or not sock:
        raise ConfigError("control_socket: must be a path")
    group = raw.get("control_group")
    if group is not None and not isinstance(group, str):
        raise ConfigError("control_group: must be a group name")
    node_name = raw.get("node_name")
    if node_name is not None and (not isinstance(node_name, str)
                                  or not _NODE_NAME.match(node_name)):
        raise ConfigError(f"node_name: must be 1-64 letters, digits, '.', '_' or '-', "
                          f"got {describe(node_name)}")
    schedules_dir = raw.get("schedules_dir", DEFAULT_SCHEDULES_DIR)
    if schedules_dir in (False, "off"):
        schedules_dir = None
    if schedules_dir is not None and (not isinstance(schedules_dir, str) or not schedules_dir
                                      or "\0" in schedules_dir):
        raise ConfigError(f"schedules_dir: must be a directory path or off, got "
                          f"{describe(schedules_dir)}")
    try:
        notifiers = notify_spec.parse_table(raw.get("notifiers"))
        default_notify = (notify_spec.parse_ref(raw["notify"], notifiers, "notify")
                          if raw.get("notify") is not None else None)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    notify_user = raw.get("notify_user", "nobody")
    if not isinstance(notify_user, str) or not ACCOUNT_NAME.match(notify_user):
        raise ConfigError(f"notify_user: must be a user name, got {describe(notify_user)}")
    sendmail = raw.get("sendmail", notify_spec.DEFAULT_SENDMAIL)
    if not isinstance(sendmail, str) or not sendmail.startswith("/") or "\0" in sendmail:
        raise ConfigError(f"sendmail: must be an absolute path, got {describe(sendmail)}")
    dbus = raw.get("dbus", False)
    if not isinstance(dbus, bool):
        raise ConfigError("dbus: must be true or false")
    dbus_address = raw.get("dbus_address")
    if dbus_address is not None and (not isinstance(dbus_address, str) or ":" not in dbus_address):
        raise ConfigError("dbus_address: must be a D-Bus address such as unix:path=/run/bus.sock")
    return Config(
        type=backend,
        url=url,
        table=table,
        log=log,
        poll_interval=number(raw, "poll_interval", 1.0, minimum=0.01),
        timezone=tz,
        alive_time=number(raw, "alive_time", 300, minimum=1, integer=True),
        retry_wait=number(raw, "retry_wait", 300, minimum=0, integer=True),
        retry_wait_max=number(raw, "retry_wait_max", 3600, minimum=0, integer=True),
        max_attempts=number(raw, "max_attempts", 0, minimum=0, integer=True),
        later_limit=number(raw, "later_limit", 86400, minimum=0, integer=True),
        workers=number(raw, "workers", 2, minimum=1, integer=True),
        concurrency=number(raw, "concurrency", 8, minimum=1, integer=True),
        control_socket=sock,
        control_group=group,
        http_listen=_http_listen(raw),
        http_listen_key="metrics_listen" if "metrics_listen" in raw else "http_listen",
        http_tls=_http_tls(raw),
        http_insecure=_flag(raw, "http_insecure"),
        metrics_token=_flag(raw, "metrics_token"),
        dbus=dbus,
        dbus_address=dbus_address,
        shutdown_timeout=number(raw, "shutdown_timeout", 30.0, minimum=0),
        kill_grace=number(raw, "kill_grace", 5.0, minimum=0),
        worker_timeout=number(raw, "worker_timeout", 30.0, minimum=2),
        routes=parse_routes(raw.get("routes"), notifiers),
        history_limit=number(raw, "history_limit", 100, minimum=0, integer=True),
        history_keep_days=number(raw, "history_keep_days", 90.0, minimum=0),
        output_limit=_output_limit(raw),
        log_output_limit=number(raw, "log_output_limit", DEFAULT_LOG_OUTPUT_LIMIT,
                                 minimum=0, integer=True),
        schedule_metrics_max=_schedule_metrics_max(raw),
        node_name=node_name,
        schedules_dir=schedules_dir,
        schedules_dir_named="schedules_dir" in raw,
        notifiers=tuple(notifiers.items()),
        notify=default_notify,
        sendmail=sendmail,
        notify_user=notify_user,
        source=source,
    )


def notify_refusal(config: Config) -> str | None:
    """What only the daemon's host can check of the notifiers (at start and on reload):
    a mail notifier needs the sendmail program, and a webhook's secret files must be
    readable here (they are read again at each sending).  One line, or None."""
    for notifier in config.all_notifiers():
        for name, ref in notifier.secret_files():
            try:
                secretfile.read(ref, name)
            except secretfile.SecretError as exc:
                where = f"{config.source}: " if config.source else ""
                return f"{where}notifier {notifier.name}: {exc}"
    if any(n.kind == "mail" for n in config.all_notifiers()) and \
            not os.access(config.sendmail, os.X_OK):
        where = f"{config.source}: " if config.source else ""
        return (f"{where}sendmail: {config.sendmail} is not an executable program on this "
                "host, and a mail notifier needs it (install a mail transfer agent, or set "
                "sendmail: to its path)")
    return None


def schedules_dir_refusal(config: Config) -> str | None:
    """A schedules_dir the file names must be a directory (at start and on reload): a
    typo would otherwise read as "no files", and a reload would remove every schedule
    the files held.  The default, unnamed, may be absent (no files).  One line, or None."""
    directory = config.schedules_dir
    if directory is None or not config.schedules_dir_named or os.path.isdir(directory):
        return None
    where = f"{config.source}: " if config.source else ""
    what = "is not a directory" if os.path.lexists(directory) else "does not exist"
    return (f"{where}schedules_dir: {directory} {what} (create it, or set "
            "schedules_dir: off for no schedules files)")


def host_refusals(config: Config, grant: bool = False) -> list[tuple[int, str]]:
    """What only a host that runs the jobs can check (the daemon, at start and on reload):
    routes with `executor: systemd` need systemd to run this host and the polkit grant
    (`grant`: this daemon may start units, executors/systemd/grant.py); a route's `user`
    must exist here, and the daemon be root unless systemd sets the user; and no job may
    run under a uid that may start units (docs/security.md).  Each route this host cannot
    run, by index, with one line saying why."""
    refusals = []
    where = f"{config.source}: " if config.source else ""
    for i, route in enumerate(config.routes):
        why = route_refusal(route, grant)
        if why is not None:
            refusals.append((i, f"{where}routes[{i}].{why}"))
    return refusals


def route_refusal(route: RouteConfig, grant: bool) -> str | None:
    """Why this host cannot run `route` ("field: reason"), or None."""
    if route.python is not None:
        return python_refusal(route.user, grant)
    try:
        unit_props.check_executor(route.executor)
    except ValueError as exc:
        return f"executor: {exc}"
    if route.user is not None:
        try:
            runas.check_user(route.user, True, needs_root=route.executor == "exec")
        except InvalidInputError as exc:
            return str(exc)
    return privilege_refusal(route.executor, route.user, grant)


def python_refusal(user: str | None, grant: bool) -> str | None:
    """A python route's rule: its handler runs inside the worker, as the daemon's user, so
    its `user:` may name only that user, and under a root daemon must (root runs it only
    where root wrote `user: root`); under the grant it runs as a uid that may start units
    (privilege_refusal)."""
    me = runas.daemon_user()
    if grant and os.geteuid() != 0:
        return (f"python: a python handler runs inside the daemon, as {me}, which holds "
                "the polkit grant to start units (it could become root): use executor: "
                "systemd with a user:, or turn the grant off (perfectsched-grant disable)")
    if user is None:
        if os.geteuid() == 0:
            return ("user: missing; a python handler runs inside the daemon, and this one "
                    "runs as root: write user: root to run it as root")
        return None
    if user != me:
        return (f"user: a python handler runs inside the daemon, as {me}: user: may only "
                f"name {me}, not {user!r} (use an exec route to run as another user)")
    return None


def privilege_refusal(executor: str, user: str | None, grant: bool,
                      daemon_uid: int | None = None) -> str | None:
    """The privilege model's rule for one route or entry ("field: reason"), or None: no
    job runs as root unless its `user: root` was written by root, and none under a uid
    that may start units (with the grant, the daemon's own).  `daemon_uid`: the daemon's
    user (default: this process's, the daemon itself)."""
    uid = os.geteuid() if daemon_uid is None else daemon_uid
    root = uid == 0
    daemon_user = runas.daemon_user(uid)
    if root and user is None and executor == "exec":
        return ("user: missing; an exec job without user: runs as the daemon's user, and "
                "this daemon runs as root: name the user (user: root only if meant)")
    if executor == "systemd":
        if root:
            if user is None:
                return ("user: missing; a unit without user: runs as the daemon's user, "
                        "and this daemon runs as root: name the user (root only if meant)")
            return None
        if not grant:
            return ("executor: systemd needs the polkit grant, which is off on this host: "
                    f"enable it with `{GRANT_COMMAND}`, then reload")
        if user is None or user == daemon_user:
            return (f"user: the unit would run as {daemon_user}, the daemon's user, "
                    "which holds the polkit grant to start units (it could become root): "
                    "name another user")
        return None
    if grant and not root and (user is None or user == daemon_user):
        return (f"executor: an exec job runs as {daemon_user}, the daemon's user, "
                "which holds the polkit grant to start units (it could become root): use "
                "executor: systemd with a user:, or turn the grant off "
                "(perfectsched-grant disable)")
    return None


# The one command that turns the polkit grant on (packaging/perfectsched-grant).
GRANT_COMMAND = "perfectsched-grant enable"


def refuse_routes(config: Config, grant: bool = False) -> tuple[Config, list[str]]:
    """The configuration with the routes this host cannot run marked refused (they run
    nothing here; the others run), and one line for each.  A route is refused alone so
    that what this host can still run keeps running: after an upgrade that refuses
    something an older version took, a reload, or a host that differs from the others."""
    refusals = host_refusals(config, grant)
    config = _notify_host(config, grant)
    lines = [why for _, why in refusals]
    if config.notify_refused is not None and any(
            n.kind in ("exec", "mail") for n in config.all_notifiers()):
        lines.append(config.notify_refused)
    if not refusals:
        return config, lines
    routes = list(config.routes)
    for i, why in refusals:
        routes[i] = replace(routes[i], refused=why)
    return replace(config, routes=tuple(routes)), lines


def _notify_host(config: Config, grant: bool) -> Config:
    user, refused = notify_runner(config, grant)
    return replace(config, notify_as=user, notify_refused=refused)


def notify_runner(config: Config, grant: bool) -> tuple[str | None, str | None]:
    """Who runs this host's exec notifiers and sendmail (None: the daemon's user), or why
    none may run: never a uid that may start units (docs/security.md).  A root daemon
    runs them as `notify_user`; a daemon holding the polkit grant cannot change its uid,
    so it sends none of them (webhooks still go); otherwise they run as the daemon's
    user, as its jobs do."""
    where = f"{config.source}: " if config.source else ""
    if os.geteuid() == 0:
        try:
            uid = pwd.getpwnam(config.notify_user).pw_uid
        except KeyError:
            return None, (f"{where}notify_user: no such user {config.notify_user!r} on "
                          "this host: exec and mail notifiers are not sent")
        if uid == 0:
            return None, (f"{where}notify_user: {config.notify_user} is root, which may "
                          "start units: name an unprivileged user (default nobody); exec "
                          "and mail notifiers are not sent")
        return config.notify_user, None
    if grant:
        return None, (f"{where}notifiers: exec and mail notifiers would run as "
                      f"{runas.daemon_user()}, the daemon's user, which holds the polkit "
                      "grant to start units: they are not sent while it is on (webhooks "
                      "are); turn the grant off (perfectsched-grant disable) or use "
                      "webhooks")
    return None, None


def _environments(data: Any) -> list[str]:
    """The section names of a multi-environment file (every top-level value a mapping
    with `type` or `url`); [] for a plain configuration."""
    if not isinstance(data, Mapping) or not data or "type" in data or "url" in data:
        return []
    if all(isinstance(v, Mapping) and ("type" in v or "url" in v) for v in data.values()):
        return [k if isinstance(k, str) else describe(k) for k in data]
    return []


def load(config: Mapping[str, Any] | str | os.PathLike[str] | Config | None = None,
         environment: str | None = None) -> Config:
    """Load a Config from a mapping, a YAML path, or the default path."""
    if isinstance(config, Config):
        return config
    source = None
    if config is None:
        config = os.environ.get("PERFECTSCHED_CONFIG") or DEFAULT_CONFIG_PATH
    if isinstance(config, str | os.PathLike):
        source = str(config)
        try:
            with Path(config).open("rb") as f:
                raw_bytes = f.read(CONFIG_MAX + 1)
        except OSError as exc:
            raise ConfigError(f"cannot read {source}: {exc.strerror}") from None
        if len(raw_bytes) > CONFIG_MAX:
            raise ConfigError(f"{source}: larger than {CONFIG_MAX} bytes")
        import yaml  # here: not at import, as perfectschedctl -c imports this module too

        try:
            # Anchors and aliases stay allowed here, unlike in schedules files: root's file,
            # whose environment sections may share a part (`<<: *base`), and no check walks
            # its values unbounded (errors name a value's type, never print it).
            data = yaml.safe_load(raw_bytes.decode("utf-8"))
        except UnicodeDecodeError:
            raise ConfigError(f"{source}: not UTF-8 text") from None
        except (yaml.YAMLError, ValueError) as exc:  # ValueError: a date or number too big
            raise ConfigError(f"{source}: not valid YAML: "
                              f"{(str(exc).splitlines() or ['?'])[0][:200]}") from None
        except RecursionError:
            raise ConfigError(f"{source}: nested too deeply") from None
    else:
        data = config
    if data is None:
        raise ConfigError(f"{source or 'configuration'}: empty")
    if environment is None and _environments(data):
        raise ConfigError(
            f"{source or 'configuration'} has sections for environments "
            f"{', '.join(_environments(data))}: choose one with -e ENV")
    if environment is not None:
        if not isinstance(data, Mapping) or environment not in data:
            known = _environments(data)
            raise ConfigError(f"environment {environment!r} not found in {source or 'config'}"
                              + (f" (it has: {', '.join(known)})" if known else ""))
        data = data[environment]
    try:
        return from_mapping(data, source)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}" if source else str(exc)) from None
