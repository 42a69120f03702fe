"""Whether this daemon may start systemd units: the polkit grant (docs/security.md).

A process that may start transient units may start one with User=root, so the uid that
holds the grant is as good as root.  The daemon therefore asks, at start and on reload,
whether it holds it, and refuses what would let a job run under that uid
(config.host_refusals): jobs of the exec executor (they run as the daemon's user), and
units that would run as the daemon's user.

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

from dbus_next import BusType, Variant
from dbus_next.aio import MessageBus

from perfectschedd.executors.systemd import props as unitprops
from perfectschedd.executors.systemd.bus import (
    MANAGER,
    MANAGER_PATH,
    SystemdError,
    call,
    run_apart,
)

log = logging.getLogger("perfectschedd")

PROBE_TIMEOUT = 5.0
# What systemd answers when polkit says no.
_REFUSED = ("org.freedesktop.DBus.Error.AccessDenied",
            "org.freedesktop.DBus.Error.InteractiveAuthorizationRequired")
_probes = itertools.count(1)


def probe_name() -> str:
    return f"{unitprops.UNIT_PREFIX}grant-probe-{os.getpid()}-{next(_probes)}" \
           f"{unitprops.UNIT_SUFFIX}"


def holds_grant(timeout: float = PROBE_TIMEOUT) -> bool:
    """True when systemd starts a unit for this process, False when it refuses;
    SystemdError when it cannot tell (no system bus, no answer in time)."""
    if os.geteuid() == 0:
        return True
    if not unitprops.systemd_booted():
        return False
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


def grant_state() -> bool:
    """holds_grant(), or when systemd cannot be asked, whether `perfectsched-grant
    enable` left its mark: better a refused exec route than a job that could become
    root.  (The rule itself is out of sight: /etc/polkit-1/rules.d is polkitd's alone.)"""
    try:
        return holds_grant()
    except (SystemdError, OSError) as exc:
        enabled = os.path.exists(ENABLED_MARK)
        log.warning("cannot ask systemd whether this daemon may start units (%s); "
                    "taking the grant as %s (%s %s)", exc, "held" if enabled else "off",
                    ENABLED_MARK, "exists" if enabled else "is absent")
        return enabled


# What `perfectsched-grant enable` writes beside linking the rule, readable by the daemon
# (packaging/scripts/perfectsched-grant).
ENABLED_MARK = "/etc/perfectsched/polkit-grant-enabled"
