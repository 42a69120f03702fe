"""The master's worker table and its decisions: which workers to start, which to kill as
unresponsive, which to drain after a reload, how long to back off when they keep dying.

A reload never stops a job: the old generation drains (stops claiming, runs its jobs to
their end, then exits), side by side with earlier drains.  Bound: a new generation
starts only while the workers already there number at most DRAIN_ROOM x `workers`, so
at most (1 + DRAIN_ROOM) x `workers` worker processes ever exist; a reload beyond that
waits (`reload_pending`) until drains end.

No processes and no clock here: the supervisor passes `now` (monotonic seconds) and acts
on the answers through its process layer (processes.py), so every decision is tested
in-process (tests/master/test_workertable.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from perfectschedd.worker import pipe

log = logging.getLogger("perfectschedd")

QUICK_DEATH = 10.0  # a worker that dies sooner than this counts towards the back-off
BACKOFF_MAX = 30.0
# Workers (draining or not) a new generation may start beside, in units of `workers`.
DRAIN_ROOM = 2


@dataclass
class WorkerProc:
    pid: int
    index: int
    generation: int
    wake_w: int
    alive_r: int
    started: float
    last_seen: float
    pinged: bool = False
    # Monotonic time it was told to drain (a reload): it claims nothing more, runs its
    # jobs to their end and exits; it is not replaced.
    draining_since: float | None = None
    drain_sent: bool = False  # the drain byte is in its wake pipe
    wake_others: bool = False  # it gave back queued occurrences: the others look now
    running: int = 0
    db_ok: bool = True
    loop_age: float = 0.0  # seconds since its main loop turned, as of its last ping
    in_db: bool = False    # its main loop was inside a database call
    buf: bytearray = field(default_factory=bytearray)
    # Its exec and unit runs: run id -> process group (None until spawned, or a unit).
    runs: dict[str, int | None] = field(default_factory=dict)
    # Its unit runs (executor systemd): run id -> unit name.
    units: dict[str, str] = field(default_factory=dict)
    refused_line: bool = False  # it wrote a line that is no message (logged once)
    # The polkit grant came on: it must stop its runs as the daemon's user (pipe.GRANT
    # sent: grant_sent) and has not yet said none is left (pipe.GrantDone).
    grant_pending: bool = False
    grant_sent: bool = False

    def report(self, line: bytes, now: float) -> None:
        """One line of its alive pipe (worker/pipe.py): a ping or a run event.  A line
        that is neither is not a sign of life: said once for this worker, then ignored."""
        try:
            msg = pipe.parse(line)
        except pipe.PipeError as exc:
            if not self.refused_line:
                self.refused_line = True
                log.error("worker %d (pid %d): %s; ignored (said once per worker)",
                          self.index, self.pid, exc)
            return
        self.last_seen = now
        self.pinged = True
        if isinstance(msg, pipe.Ping):
            self.running, self.db_ok = msg.running, msg.db_ok
            if msg.loop_age is not None and msg.in_db is not None:
                self.loop_age, self.in_db = msg.loop_age, msg.in_db
        elif isinstance(msg, pipe.Spawning):
            self.runs[msg.run] = None
        elif isinstance(msg, pipe.Spawned):
            self.runs[msg.run] = msg.pgid
        elif isinstance(msg, pipe.UnitStarting):
            self.units[msg.run] = msg.unit
        elif isinstance(msg, pipe.GaveBack):
            self.wake_others = True
        elif isinstance(msg, pipe.GrantDone):
            self.grant_pending = False
        else:
            self.runs.pop(msg.run, None)
            self.units.pop(msg.run, None)


@dataclass(frozen=True)
class Exit:
    """What the table made of a worker's exit."""

    proc: WorkerProc
    lived: float
    unexpected: bool             # not draining, not stopping: it died and is replaced
    backoff: float | None = None  # set when it died young: the next start waits this long


class WorkerTable:
    def __init__(self, size: int, worker_timeout: float) -> None:
        self.size = size
        self.worker_timeout = worker_timeout
        self.procs: dict[int, WorkerProc] = {}
        self.generation = 0
        self.spawn_failures = 0
        self.next_spawn = 0.0
        self.restarts = 0
        self.reload_since: float | None = None
        # A reload whose generation waits for room (DRAIN_ROOM): its (size, worker_timeout).
        self.reload_pending: tuple[int, float] | None = None

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(list(self.procs.values()))

    def __len__(self) -> int:
        return len(self.procs)

    def add(self, proc: WorkerProc) -> None:
        self.procs[proc.pid] = proc

    def get(self, pid: int) -> WorkerProc | None:
        return self.procs.get(pid)

    # -- decisions ----------------------------------------------------------------------------

    def exited(self, pid: int, now: float, stopping: bool) -> Exit | None:
        """A child exited; None if it was not a worker (an orphaned job process)."""
        proc = self.procs.pop(pid, None)
        if proc is None:
            return None
        lived = now - proc.started
        if proc.draining_since is not None or stopping:
            return Exit(proc, lived, unexpected=False)
        self.restarts += 1
        if lived >= QUICK_DEATH:
            self.spawn_failures = 0
            return Exit(proc, lived, unexpected=True)
        self.spawn_failures += 1
        delay = min(0.5 * 2 ** (self.spawn_failures - 1), BACKOFF_MAX)
        self.next_spawn = now + delay
        return Exit(proc, lived, unexpected=True, backoff=delay)

    def unresponsive(self, now: float) -> list[tuple[WorkerProc, str]]:
        """Workers to kill, with why: silent (no ping: frozen, or holding the GIL), or
        wedged (pings say the main loop stopped outside a database call).  A loop inside a
        database call waits on the database, which has its own timeouts: that worker
        lives, and a replacement would only wait the same way."""
        found = []
        for proc in self:
            silent = now - proc.last_seen
            stalled = 0.0 if proc.in_db else proc.loop_age + silent
            if silent > self.worker_timeout:
                found.append((proc, f"silent for {silent:.0f}s"))
            elif stalled > self.worker_timeout:
                found.append((proc, f"main loop stopped for {stalled:.0f}s outside a "
                                    "database call"))
            else:
                continue
            proc.last_seen = now  # one kill per timeout period
            proc.loop_age = 0.0
        return found

    def missing(self, now: float) -> list[int]:
        """Indexes of the current generation that have no worker and may start now."""
        if now < self.next_spawn:
            return []
        current = {p.index for p in self.active() if p.generation == self.generation}
        return [i for i in range(self.size) if i not in current]

    def surplus(self, now: float) -> list[WorkerProc]:
        """Workers of the current generation beyond `size`; marked draining (their jobs
        run to their end)."""
        extra = [p for p in self.active() if p.generation == self.generation
                 and p.index >= self.size]
        for p in extra:
            p.draining_since = now
        return extra

    # -- reload by generation -----------------------------------------------------------------

    def begin_reload(self, size: int, worker_timeout: float, now: float) -> bool:
        """A reload: a new generation of `size` workers starts, now if there is room
        (start_pending), else once drains have ended.  False when it waits."""
        self.reload_pending = (size, worker_timeout)
        return self.start_pending(now)

    def room(self, size: int) -> bool:
        """Whether a generation of `size` may start: the workers there now (all to be
        drained) are at most DRAIN_ROOM x size."""
        return len(self.procs) <= DRAIN_ROOM * size

    def start_pending(self, now: float) -> bool:
        """Start the pending reload's generation if there is room; True when it started."""
        if self.reload_pending is None or not self.room(self.reload_pending[0]):
            return False
        self.size, self.worker_timeout = self.reload_pending
        self.reload_pending = None
        self.generation += 1
        self.reload_since = now
        self.next_spawn = 0.0
        return True

    def finish_reload(self, now: float) -> list[WorkerProc] | None:
        """Once the new generation is up (or did not come up within worker_timeout), the
        old workers to drain (marked draining); None while the reload goes on."""
        if self.reload_since is None:
            return None
        new = [p for p in self if p.generation == self.generation]
        up = len(new) >= self.size and all(p.pinged for p in new)
        if not up and now - self.reload_since <= self.worker_timeout:
            return None
        self.reload_since = None
        old = [p for p in self.active() if p.generation < self.generation]
        for p in old:
            p.draining_since = now
        return old

    def drains_to_send(self) -> list[WorkerProc]:
        """Draining workers whose drain byte is not in their wake pipe yet (it was full)."""
        return [p for p in self if p.draining_since is not None and not p.drain_sent]

    def draining(self) -> list[WorkerProc]:
        return [p for p in self if p.draining_since is not None]

    def grant_on(self, now: float) -> None:
        """The polkit grant came on: every worker is to stop its runs as the daemon's user
        and drain (pipe.GRANT, which drains it too: no drain byte of its own)."""
        for proc in self:
            proc.grant_pending, proc.grant_sent = True, False
            if proc.draining_since is None:
                proc.draining_since = now
            proc.drain_sent = True

    def grants_to_send(self) -> list[WorkerProc]:
        """Workers told of the grant whose GRANT byte is not in their pipe yet."""
        return [p for p in self if p.grant_pending and not p.grant_sent]

    # -- health -------------------------------------------------------------------------------

    def all_pinged(self) -> bool:
        return bool(self.procs) and all(p.pinged for p in self)

    def any_alive(self, now: float) -> bool:
        return any(now - p.last_seen < self.worker_timeout for p in self)

    def active(self) -> list[WorkerProc]:
        """Workers that take new work (not draining)."""
        return [p for p in self if p.draining_since is None]
