"""The schedules files the master applies: what it loaded from schedules_dir, what it
applied last (so that it writes only what changed in its own files: schedules/converge.py's
`previous`), what it already reported, and whether an apply is due.

Master-only state: loaded on the main loop (at start, on reload, when the polkit grant
changes: supervisor.py), applied on the database thread (database.py `in_background`),
waited for by a control thread answering `reload`; `lock` guards what they share.
The convergence itself, shared with `perfectschedctl apply`, is schedules/converge.py.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from perfectschedd.config import Config
from perfectschedd.schedules.collection import ScheduleCollection
from perfectschedd.schedules.converge import (
    ADDED,
    CHANGED,
    DELETED,
    DETACHED,
    DIFFERS,
    REFUSED,
    REMOVED,
    converge,
)
from perfectschedd.schedules.files import Entry, HostChecks, Loaded, check
from perfectschedd.vocabulary.fields import EXEC_TYPE

log = logging.getLogger("perfectschedd")

RETRY_AFTER = 30.0  # a convergence the database refused is tried again after this


@dataclass
class FileSchedules:
    """A daemon's schedules files: what it loaded, what it applied, what it reported."""

    directory: str | None = None
    loaded: Loaded = field(default_factory=Loaded)
    applied: dict[str, Entry] | None = None
    applied_sources: set[str] = field(default_factory=set)
    applied_timezone: str | None = None  # the default zone `applied` was written with
    due_at: float | None = None  # monotonic time of the next apply; None: none pending
    reported: set[tuple[str, str, str]] = field(default_factory=set)
    lock: threading.Condition = field(default_factory=threading.Condition)
    # The entries the last convergence refused (their key is another's), one line each.
    refusals: list[str] = field(default_factory=list)
    # Counts loads and convergences: a reload waits for the convergence of its load.
    loads: int = 0
    converged: int = 0

    def load(self, config: Config, host: HostChecks | None = None) -> Config:
        """Read config.schedules_dir with the daemon's checks (files.check; `host`:
        default this process, without the polkit grant); the configuration with the
        entries' routes first.  A file with an error keeps what it held before (logged,
        one line per problem: problems())."""
        if host is None:
            host = HostChecks(os.geteuid(), config.sendmail)
        directory = config.schedules_dir
        missing = directory is not None and not Path(directory).is_dir()
        if directory is None or missing:
            loaded = Loaded()
            if missing:
                # Gone (the unnamed default; a named one is refused before): what its files
                # held stays as it was, as for a file that cannot be read.  An empty
                # directory is an edit, and removes them.
                loaded.broken = self.loaded.sources | self.loaded.broken | \
                    self.applied_sources
                if loaded.broken:
                    log.warning("schedules_dir %s does not exist: the schedules of its "
                                "files stay as they were", directory)
                elif directory != self.directory:
                    log.info("schedules_dir %s does not exist: no schedules files",
                             directory)
        else:
            # As cron: the files, and the directory, are root's or the daemon's own.
            loaded = check([directory], host)
        for line in loaded.errors:
            log.error("schedules file rejected, its schedules stay as they were: %s", line)
        with self.lock:
            if loaded.refused_dirs:
                # Anyone may have removed a file from it: every file known stays as it was.
                loaded.broken |= self.loaded.sources | self.loaded.broken | \
                    self.applied_sources
            for key, entry in self.loaded.entries.items():
                if entry.source in loaded.broken and key not in loaded.entries:
                    loaded.entries[key] = entry
                    if key in self.loaded.refused:
                        loaded.refused[key] = self.loaded.refused[key]
                    if entry.source in self.loaded.owners:
                        loaded.owners[entry.source] = self.loaded.owners[entry.source]
            self.directory = directory
            self.loaded = loaded
            self.due_at = time.monotonic()
            self.loads += 1
        return replace(config, routes=loaded.routes() + config.routes,
                       entry_notify=loaded.notifiers())

    def problems(self) -> list[str]:
        """What the files' last load and convergence rejected or refused, one line each:
        files rejected whole, entries refused (privilege rule, a key that is another's)."""
        with self.lock:
            return [*self.loaded.errors, *self.refusals]

    def wait_converged(self, timeout: float) -> bool:
        """Whether the convergence of the latest load has run, waiting at most
        `timeout` seconds for it (the database thread runs it)."""
        deadline = time.monotonic() + timeout
        with self.lock:
            while self.converged < self.loads:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.lock.wait(left)
            return True

    def take_pending(self) -> bool:
        """Whether an apply is due now; if so it is no longer pending (apply() makes it
        pending again if it fails)."""
        with self.lock:
            if self.due_at is None or time.monotonic() < self.due_at:
                return False
            self.due_at = None
            return True

    def apply(self, sc: ScheduleCollection) -> None:
        """Converge (run by the master's database thread)."""
        with self.lock:
            loaded, previous, loads = self.loaded, self.applied, self.loads
        tz = sc.config.timezone
        if previous is not None and tz != self.applied_timezone:
            # A reload changed the default zone: the entries that name none take it, as
            # at a start (else each would look changed elsewhere: `differs`).
            previous = {k: e for k, e in previous.items() if e.timezone is not None}
        remove_from = (loaded.sources | self.applied_sources) - loaded.broken
        # Rows that name an entry of these files (exec:K) but are not its own: whatever
        # wrote them (0.1.0 stored any type; a database peer), they never run.
        entry_files = {k: e.source for k, e in loaded.entries.items()
                       if e.type == f"{EXEC_TYPE}{k}"}
        try:
            changes = converge(sc, loaded.entries, remove_from, previous=previous,
                               creators=loaded.owners)
            refused = sc.store.refuse_foreign_exec_rows(entry_files)
        except Exception:
            with self.lock:
                if self.due_at is None:
                    self.due_at = time.monotonic() + RETRY_AFTER
            raise
        for row in refused:
            log.warning("schedules files: %s", row.line())
        counts = {a: sum(c.action == a for c in changes) for a in (ADDED, CHANGED, REMOVED)}
        for c in changes:
            if c.action in (ADDED, CHANGED, REMOVED):
                log.info("schedules files: %s", c.line())
            elif c.action in (DIFFERS, REFUSED, DETACHED, DELETED):
                seen = (c.action, c.key, c.detail)
                if seen not in self.reported:
                    self.reported.add(seen)
                    (log.info if c.action in (DETACHED, DELETED) else log.warning)(
                        "schedules files: %s", c.line())
        log.info("schedules files: applied %d entries from %d file(s): %d added, "
                 "%d changed, %d removed", len(loaded.entries), len(loaded.sources),
                 counts[ADDED], counts[CHANGED], counts[REMOVED])
        with self.lock:
            again = {c.key for c in changes if c.again}
            self.applied = {k: e for k, e in loaded.entries.items() if k not in again}
            self.applied_timezone = tz
            self.applied_sources = set(loaded.sources) | (
                self.applied_sources & loaded.broken)
            self.refusals = [f"schedules file entry {c.line()}" for c in changes
                             if c.action == REFUSED]
            self.converged = max(self.converged, loads)
            self.lock.notify_all()
