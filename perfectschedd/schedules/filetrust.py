"""Files that say what runs as whom, trusted as cron trusts its own (cron(8) on Debian:
"/etc/crontab and the files in /etc/cron.d must be owned by root, and must not be group-
or other-writable ... may also be symlinks, provided that both the symlink and the file it
points to are owned by root").

Schedules files and the crontabs that import-crontab reads follow this one rule.  What is
checked is what is opened: owners and modes come from lstat() of each symlink on the way
and fstat() of the open file, never from the path alone.  A refusal is NotTrusted, whose
str() is one line naming the file and the reason.
"""

from __future__ import annotations

import os
import pwd
import stat
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

ROOT = 0
_MAX_LINKS = 40  # as the kernel's own limit on a path's symlinks (ELOOP)


class NotTrusted(Exception):
    """A file or directory that breaks the rule; str() is one line."""


@dataclass(frozen=True)
class Trusted:
    data: bytes
    # Who other than root owns the file, a symlink to it or its directory, as words
    # ("it is owned by uid 999 (perfectsched)"), or None: root owns all of them.
    not_root: str | None = None


def who(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def owners_of(daemon_uid: int) -> frozenset[int]:
    """Root, and the daemon's own user (whose files may not name users: files.py)."""
    return frozenset({ROOT, daemon_uid})


def _not_owners(owners: Collection[int]) -> str:
    others = sorted(set(owners) - {ROOT})
    return "not root" + "".join(f" or {who(u)}" for u in others)


def _check(path: object, st: os.stat_result, owners: Collection[int], what: str = "",
           verdict: str = "rejected") -> str | None:
    """Raise NotTrusted unless `st` is owned by one of `owners` and (unless a symlink,
    whose mode means nothing) writable by its owner only; the owner when not root."""
    if st.st_uid not in owners:
        raise NotTrusted(f"{path}: {what}owned by {who(st.st_uid)}, {_not_owners(owners)}"
                         f": {verdict}")
    if not stat.S_ISLNK(st.st_mode):
        for bit, word in ((stat.S_IWGRP, "group"), (stat.S_IWOTH, "world")):
            if st.st_mode & bit:
                raise NotTrusted(f"{path}: {what}{word}-writable (mode "
                                 f"{stat.S_IMODE(st.st_mode):04o}): {verdict}")
    return None if st.st_uid == ROOT else who(st.st_uid)


def _links(path: Path, owners: Collection[int], verdict: str = "rejected") -> str | None:
    """Walk the symlinks that `path` goes through as its last component, each of which
    must be owned by one of `owners`; who other than root owns one, if anyone."""
    not_root: str | None = None
    current = str(path)
    for _ in range(_MAX_LINKS):
        try:
            st = os.lstat(current)
        except OSError:
            return not_root  # opening it says why it cannot be read
        if not stat.S_ISLNK(st.st_mode):
            return not_root
        what = "a symlink " if current == str(path) else f"its symlink {current} "
        not_root = _check(path, st, owners, what, verdict) or not_root
        current = os.path.join(os.path.dirname(current), os.readlink(current))
    raise NotTrusted(f"{path}: too many levels of symbolic links: {verdict}")


def read(path: Path, owners: Collection[int], limit: int) -> Trusted:
    """At most limit + 1 bytes of a regular file that passes the rule.  OSError when it
    cannot be opened, NotTrusted when it breaks the rule."""
    link_owner = _links(path, owners)
    # O_NONBLOCK: a FIFO put in the file's place must not hang the reader before the
    # S_ISREG check.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotTrusted(f"{path}: not a regular file: rejected")
        if owner := _check(path, st, owners):
            return Trusted(f.read(limit + 1), f"it is owned by {owner}")
        return Trusted(f.read(limit + 1), link_owner and f"a symlink to it is owned by "
                       f"{link_owner}")


def check_dir(path: Path, owners: Collection[int]) -> str | None:
    """A directory whose files are trusted: owned by one of `owners` and writable by its
    owner only (else another user could replace or remove a file of root's), reached
    through symlinks of theirs only.  Who other than root owns it, if anyone."""
    verdict = "none of its files are read"
    link_owner = _links(path, owners, verdict)
    try:
        st = os.stat(path)
    except OSError as exc:
        raise NotTrusted(f"{path}: cannot read: {exc.strerror}: {verdict}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise NotTrusted(f"{path}: not a directory: {verdict}")
    if owner := _check(path, st, owners, verdict=verdict):
        return f"its directory is owned by {owner}"
    return link_owner and f"a symlink to its directory is owned by {link_owner}"
