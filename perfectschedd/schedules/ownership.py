"""Who made a schedule, and whose `apply` may change it.

Every schedule records the uid that made it (its creator; None: unknown, made before
creators were recorded).  The convergence of schedules files (converge.py) obeys the
rule below for `apply`, and the control layer (control/auth.py) names users with the
same words; both take it from here, below them.
"""

from __future__ import annotations

import pwd


def known_user_name(uid: int | None) -> str | None:
    """The name of user `uid` on this host, or None (no such user, or no uid)."""
    if uid is None:
        return None
    try:
        return pwd.getpwuid(uid).pw_name
    except (KeyError, OverflowError):
        return None


def user_name(uid: int) -> str:
    return known_user_name(uid) or f"uid {uid}"


def made_by(creator: int | None) -> str:
    """Who made a schedule, for messages."""
    return "an unknown user" if creator is None else user_name(creator)


def owns(uid: int, creator: int | None) -> bool:
    """Whether `apply` by user `uid` may change or prune a schedules file's schedule made
    by `creator`: root's may (root writes the files), anyone else's only their own."""
    return uid == 0 or creator == uid
