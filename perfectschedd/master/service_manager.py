"""What the master tells systemd (sd_notify): READY, RELOADING, STOPPING, STATUS= lines,
and the watchdog's WATCHDOG=1 at half the interval systemd asked for.  Outside systemd
(no NOTIFY_SOCKET) the messages go nowhere."""

from __future__ import annotations

import os

import sdnotify


class ServiceManager:
    def __init__(self) -> None:
        self.notifier = sdnotify.SystemdNotifier()
        self.watchdog_interval = _watchdog_interval()
        self.last_watchdog = 0.0

    def notify(self, *lines: str) -> None:
        self.notifier.notify("\n".join(lines))

    def watchdog(self, now: float, healthy: bool) -> None:
        """WATCHDOG=1 when one is due (`now`: monotonic) and the daemon is `healthy`."""
        if self.watchdog_interval is None:
            return
        if now - self.last_watchdog < self.watchdog_interval:
            return
        if healthy:
            self.last_watchdog = now
            self.notify("WATCHDOG=1")


def _watchdog_interval() -> float | None:
    """Half of systemd's WatchdogSec= for this process, taken out of the environment (the
    workers must not inherit it); None without a watchdog."""
    usec = os.environ.pop("WATCHDOG_USEC", None)
    wpid = os.environ.pop("WATCHDOG_PID", None)
    if not usec or (wpid and wpid.isdigit() and int(wpid) != os.getpid()):
        return None
    try:
        return int(usec) / 1e6 / 2
    except ValueError:
        return None
