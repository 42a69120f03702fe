"""Who runs a job and in what environment: the `user` and `env` of an exec route or of a
schedules file's exec entry, checked the same way for both."""

from __future__ import annotations

import errno
import os
import pwd
import re
from collections.abc import Mapping
from typing import Any

from perfectschedd.errors import InvalidInputError, describe

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# A user or group name as the configuration writes one (a route's allow:, notify_user:):
# what useradd takes, and then some.
ACCOUNT_NAME = re.compile(r"^[A-Za-z0-9_.][A-Za-z0-9_.-]{0,63}\$?$")


def check_env(value: Any) -> tuple[tuple[str, str], ...]:
    if value is None:
        return ()
    if not isinstance(value, Mapping):
        raise InvalidInputError("env", "must be a mapping of NAME: value")
    out = []
    for name, text in value.items():
        if not isinstance(name, str) or not _ENV_NAME.match(name):
            raise InvalidInputError("env", f"bad variable name {describe(name)}")
        if isinstance(text, bool) or not isinstance(text, str | int | float):
            raise InvalidInputError("env", f"{name}: must be text, got {describe(text)}")
        text = str(text)
        if "\0" in text:
            raise InvalidInputError("env", f"{name}: contains a NUL character")
        out.append((name, text))
    return tuple(out)


def check_user(value: Any, need_user_support: bool, needs_root: bool = True,
               runner: int | None = None) -> str:
    """`need_user_support`: the caller runs the jobs (the daemon), so the user must exist
    here and, unless systemd sets it (`needs_root` False: executor systemd), the process
    that runs them (`runner`, a uid; default this process) must be root or that user.  A
    client (apply, perfectschedctl -c) checks the form only, or the daemon's way with
    the daemon's uid as `runner`."""
    if not isinstance(value, str) or not value:
        raise InvalidInputError("user", "must be a user name")
    if not need_user_support:
        return value
    try:
        uid = pwd.getpwnam(value).pw_uid
    except KeyError:
        raise InvalidInputError("user", f"no such user {value!r} on this host") from None
    if needs_root and (os.geteuid() if runner is None else runner) not in (0, uid):
        raise InvalidInputError("user", f"running as {value!r} needs the daemon to run as "
                                "root (this one does not)")
    return value


def daemon_user(uid: int | None = None) -> str:
    """The name of the user this process (or the daemon `uid`) runs as (its uid when it
    has no name)."""
    uid = os.geteuid() if uid is None else uid
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


# -- a job's environment: cron's, never the daemon's ------------------------------------

# systemd's default PATH for services (units get it too): exec jobs and units find the
# same programs.  An `env: {PATH: ...}` of the route or entry replaces it, as a crontab's
# PATH= line does.
JOB_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# The locale of a job when the daemon was started without LANG (a container, `env -i`).
DEFAULT_LANG = "C.UTF-8"


def job_lang() -> str:
    """LANG of every job: the daemon's own (under systemd, the system's locale, which
    PID 1 gives every service and so every unit too), else C.UTF-8.  LANG only, not the
    daemon's LC_* or LANGUAGE: cron's jobs get no more."""
    return os.environ.get("LANG") or DEFAULT_LANG


def job_environment(pw: pwd.struct_passwd) -> dict[str, str]:
    """The environment a job of user `pw` starts from (cron's and systemd's): HOME,
    LOGNAME, USER, SHELL (its login shell), PATH and LANG, nothing of the daemon's own
    (which may hold PGPASSWORD, a D-Bus address, PERFECTSCHED_CONFIG...).  The run's
    PERFECTSCHED_* variables and the route's `env:` are the caller's to add."""
    return {"HOME": pw.pw_dir, "LOGNAME": pw.pw_name, "USER": pw.pw_name,
            "SHELL": pw.pw_shell or "/bin/sh", "PATH": JOB_PATH, "LANG": job_lang()}


def account(user: str | None) -> pwd.struct_passwd:
    """The passwd entry of `user`, or of this process's user when None; OSError (ESRCH)
    when the user is gone (removed since the configuration was read)."""
    try:
        return pwd.getpwnam(user) if user is not None else pwd.getpwuid(os.geteuid())
    except KeyError:
        raise OSError(errno.ESRCH, f"no such user {user!r}") from None


def as_user_args(pw: pwd.struct_passwd) -> dict[str, Any]:
    """Popen's arguments to run a process as `pw`, as cron does: its uid, primary and
    supplementary groups, and its home as working directory (/ when it has none).
    Nothing when this process already runs as that user."""
    if pw.pw_uid == os.geteuid():
        return {}
    return {"user": pw.pw_uid, "group": pw.pw_gid,
            "extra_groups": os.getgrouplist(pw.pw_name, pw.pw_gid),
            "cwd": pw.pw_dir if os.path.isdir(pw.pw_dir) else "/"}
