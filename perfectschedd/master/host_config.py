"""The configuration as this host runs it: the configuration as read, with the entries
of its schedules files (file_schedules.py) and every route or entry this host cannot run
marked refused, said once; and the polkit grant to start systemd units, which decides
some of those refusals and which the master watches while it runs (grantwatch.py).

What changes when the grant does (workers stopping their runs, a new generation) is the
supervisor's (Supervisor._grant_changed); what reads a new file is reload_checks.py's.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

from perfectschedd.config import Config, refuse_routes
from perfectschedd.executors.systemd.grant import grant_state, signature
from perfectschedd.master.file_schedules import FileSchedules
from perfectschedd.master.grantwatch import GrantWatch
from perfectschedd.schedules.files import HostChecks
from perfectschedd.settings.runas import daemon_user

log = logging.getLogger("perfectschedd")


class HostConfig:
    def __init__(self, config: Config, poke: Callable[[], None]) -> None:
        # The configuration as read, before this host's view of it: what a change of the
        # grant applies again.
        self.loaded = config
        self.files = FileSchedules()
        # The routes of the configuration this host refuses (config.refuse_routes).
        self.refused_routes: list[str] = []
        # Whether this daemon may start systemd units (the polkit grant; host_grant),
        # re-checked by itself while it runs (grantwatch.py; a root daemon holds every
        # right anyway).
        self.unit_grant = False
        self.grant_watch = None if os.geteuid() == 0 else GrantWatch(
            poke, grant_state, signature)

    def of(self, config: Config, grant: bool | None = None) -> Config:
        """`config` as this host runs it: the schedules files' entries first, and every
        route or entry it cannot run marked refused (reported once).  `grant`: whether
        this daemon holds the polkit grant; None: ask (host_grant)."""
        if grant is None:
            grant, sure = host_grant()
            if self.grant_watch is not None:
                self.grant_watch.settled(sure, time.monotonic())
        self.unit_grant = grant
        config, refused = refuse_routes(config, grant)
        # The checks `perfectschedctl apply` runs too, with this daemon's facts.
        config = self.files.load(config, HostChecks(os.geteuid(), config.sendmail, grant))
        self.report_refused_routes(refused + list(self.files.loaded.refused.values()))
        return config

    def report_refused_routes(self, refused: list[str]) -> None:
        """Say once, in the journal and in status, which routes this host refuses."""
        for why in refused:
            if why not in self.refused_routes:
                log.error("%s; this route is refused, the other routes run", why)
        self.refused_routes = list(refused)

    def problems(self) -> list[str]:
        """What the running configuration refused (routes and entries this host cannot
        run, schedules files rejected, entries whose key is another's), one line each;
        empty once a load took everything."""
        return [*self.refused_routes, *self.files.problems()]

    def grant_changed(self, held: bool) -> Config:
        """The grant came on (`held`) or went off while the daemon ran: the configuration
        running, not re-read, as this host now runs it (said in the journal)."""
        user = daemon_user(os.geteuid())
        if held:
            log.warning("the polkit grant to start units is now held: no job may run as "
                        "%s, the daemon's user; its routes are refused and their running "
                        "jobs stopped", user)
        else:
            log.warning("the polkit grant to start units is now off: routes that run as "
                        "%s run again; those with executor: systemd are refused", user)
        # The watch keeps its own answer (and asks again if that was not sure).
        return self.of(self.loaded, held)

    def grant_change(self) -> bool | None:
        """The grant as the watch now sees it, when that differs from the one applied;
        None when nothing changed (or nobody watches: root)."""
        if self.grant_watch is None:
            return None
        held = self.grant_watch.poll(time.monotonic())
        return held if held is not None and held != self.unit_grant else None


def host_grant() -> tuple[bool, bool]:
    """Whether this daemon may start systemd units (the polkit grant), and whether that
    is a sure answer (grant.grant_state).  Asked only where it decides something: a
    daemon that is not root."""
    if os.geteuid() == 0:
        return False, True
    held, sure = grant_state()
    log.info("polkit grant to start units: %s", "held" if held else "not held")
    return held, sure
