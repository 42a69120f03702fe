"""Whether this daemon may start systemd units: the polkit grant (docs/security.md).

A process that may start transient units may start one with User=root, so the uid that
holds the grant is as good as root.  The daemon therefore asks, at start, on reload and
whenever what it watches changes (master/grantwatch.py: the mark below, the polkit rules
directories), whether it holds it, and refuses what would let a job run under that uid
(config.host_refusals): jobs of the exec executor (they run as the daemon's user), and
units that would run as the daemon's user.  No answer counts as a yes (grant_state).

The question is asked the only way that gives systemd's own answer, whatever polkit
rules a site wrote: the daemon starts a unit that does nothing (/bin/true, as the
daemon's user, collected once it ends).  polkit's CheckAuthorization would not do: an
unprivileged caller may not pass the details (the unit's name) that the strict rule of
systemd 257 and later needs.
"""

from __future__ import annotations

import itertools
import logging
import os
import pwd

from perfectschedd.settings import unit_props

log = logging.getLogger("perfectschedd")

PROBE_TIMEOUT = 5.0
# What systemd answers when polkit says no.
_REFUSED = ("org.freedesktop.DBus.Error.AccessDenied",
            "org.freedesktop.DBus.Error.InteractiveAuthorizationRequired")
_probes = itertools.count(1)


def probe_name() -> str:
    return f"{unit_props.UNIT_PREFIX}grant-probe-{os.getpid()}-{next(_probes)}" \
           f"{unit_props.UNIT_SUFFIX}"


def holds_grant(timeout: float = PROBE_TIMEOUT) -> bool:
    """True when systemd starts a unit for this process, False when it refuses;
    SystemdError when it cannot tell (no system bus, no answer in time)."""
    if os.geteuid() == 0:
        return True
    if not unit_props.systemd_booted():
        return False
    # D-Bus only where it is asked.
    from dbus_next import BusType, Variant
    from dbus_next.aio import MessageBus

    from perfectschedd.executors.systemd.bus import (
        MANAGER,
        MANAGER_PATH,
        SystemdError,
        call,
        run_apart,
    )

    user = pwd.getpwuid(os.geteuid()).pw_name
    name = probe_name()
    props = [
        ["Description", Variant("s", "PerfectSched: may this daemon start units?")],
        ["ExecStart", Variant("a(sasb)", [["/bin/true", ["/bin/true"], False]])],
        ["User", Variant("s", user)],
        ["CollectMode", Variant("s", "inactive-or-failed")],
        ["NoNewPrivileges", Variant("b", True)],
    ]
    answer: list[bool] = []

    async def ask() -> None:
        bus = await MessageBus(bus_type=BusType.SYSTEM).connect()
        try:
            await call(bus, MANAGER_PATH, MANAGER, "StartTransientUnit", "ssa(sv)a(sa(sv))",
                       [name, "fail", props, []])
            answer.append(True)
        except SystemdError as exc:
            if any(e in str(exc) for e in _REFUSED):
                answer.append(False)
            else:
                raise
        finally:
            bus.disconnect()

    run_apart(ask, timeout, "grant-probe")
    return answer[0]


def grant_state(timeout: float = PROBE_TIMEOUT) -> tuple[bool, bool]:
    """Whether to take the grant as held, and whether that is a sure answer (False: ask
    again later).  The mark `perfectsched-grant enable` leaves is enough: it is root's
    word, and it is seen by a stat (the rule itself is out of sight: /etc/polkit-1/rules.d
    is polkitd's alone).  Without it systemd is asked (holds_grant); when it cannot
    answer in time, the grant is taken as held: better a refused exec route than a job
    that could become root."""
    mark = enabled_mark()
    if os.path.exists(mark):
        return True, True
    try:
        return holds_grant(timeout), True
    except Exception as exc:  # noqa: BLE001 - SystemdError, OSError: no answer is a yes
        log.warning("cannot ask systemd whether this daemon may start units (%s); taking "
                    "the polkit grant as held, so no job runs as %s, until it answers",
                    str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
                    _user())
        return True, False


def _user() -> str:
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return f"uid {os.geteuid()}"


# What `perfectsched-grant enable` writes beside linking the rule, readable by the daemon
# (packaging/scripts/perfectsched-grant).  PERFECTSCHED_GRANT_MARK moves it, for both
# (root sets the daemon's environment; the tests use it).
ENABLED_MARK = "/etc/perfectsched/polkit-grant-enabled"
# Where polkitd reads rules (polkit 121 and later also the last two).  The daemon's user
# may not read /etc/polkit-1/rules.d, but it sees the directory change when a rule is
# linked or removed there.
RULE_DIRS = ("/etc/polkit-1/rules.d", "/usr/share/polkit-1/rules.d",
             "/run/polkit-1/rules.d", "/usr/local/share/polkit-1/rules.d")


def enabled_mark() -> str:
    return os.environ.get("PERFECTSCHED_GRANT_MARK") or ENABLED_MARK


def signature() -> tuple[object, ...]:
    """What changes when the grant may have: the mark, and each rules directory (an entry
    added or removed changes its mtime).  A few stats: cheap enough for every few
    seconds."""
    out: list[object] = []
    for path in (enabled_mark(), *RULE_DIRS):
        try:
            st = os.stat(path)
        except OSError:
            out.append(None)
            continue
        out.append((st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size))
    return tuple(out)
