"""Who runs a job and in what environment: the `user` and `env` of an exec route or of a
schedules file's exec entry, checked the same way for both."""

from __future__ import annotations

import os
import pwd
import re
from collections.abc import Mapping
from typing import Any

from perfectschedd.errors import InvalidInputError, describe

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


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
