"""The master: fork/reap workers, signals, sd_notify, reload (gunicorn's arbiter, smaller).

One class owns the worker table.  Signal handlers only queue the signal and write to a
self-pipe; the main loop acts.  Workers prove liveness by writing to a pipe; a silent
one is killed and replaced, and a worker that keeps dying is replaced with a back-off.

Nothing of a dead worker's runs survives it: before a replacement is forked, what its
runs left is cleaned up (cleanup.py).

Here: the main loop, the worker pool's upkeep (fork, reap, replace, drain), reload and
stop, and the control requests.  Elsewhere in master/: the worker table's decisions
(workertable.py) and the process layer (processes.py); what a forked worker does first
(worker_start.py); the configuration as this host runs it, its schedules files and the
polkit grant (host_config.py, file_schedules.py, grantwatch.py); a reload's checks
(reload_checks.py); the database, off the loop (database.py, snapshot.py); the status
answer (status.py); systemd's messages (service_manager.py); the self-pipe
(selfpipe.py); the control socket, HTTP and D-Bus (listeners.py); the command line
(main.py).
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import selectors
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from perfectschedd import __version__, logsetup
from perfectschedd.config import Config
from perfectschedd.control import auth, commands, registry
from perfectschedd.control.auth import Caller
from perfectschedd.errors import (
    EXIT_UNUSABLE_DATABASE,
    ConfigError,
    InvalidInputError,
)
from perfectschedd.executors import guard, reaper
from perfectschedd.executors.base import signal_name
from perfectschedd.master import heap
from perfectschedd.master.cleanup import RunCleanup, UnitStopper, stop_units_over_dbus
from perfectschedd.master.database import MasterDatabase
from perfectschedd.master.host_config import HostConfig
from perfectschedd.master.listeners import Listeners
from perfectschedd.master.processes import Processes
from perfectschedd.master.reload_checks import read_new_config, rejection
from perfectschedd.master.selfpipe import SelfPipe
from perfectschedd.master.service_manager import ServiceManager
from perfectschedd.master.status import healthy, status_line, status_reply
from perfectschedd.master.workertable import DRAIN_ROOM, WorkerProc, WorkerTable
from perfectschedd.metrics import exposition
from perfectschedd.metrics.type_labels import exact_types, set_route_types
from perfectschedd.store.urls import engine_url
from perfectschedd.worker import pipe

log = logging.getLogger("perfectschedd")

_PR_SET_CHILD_SUBREAPER = 36
STATUS_EVERY = 2.0
# How long `status` waits for fresh figures from the database before it answers with the
# last ones it has (and their age): it answers within a second whatever the database does.
STATUS_FRESH_WAIT = 0.5
RELOAD_ANSWER_WAIT = 10.0
SPAWN_RETRY = 2.0  # after a fork or pipe failed
TURN_MIN = 0.05  # the loop's duties at most this often when only run reports arrive
REPORT_GATHER = 0.01  # after a turn woken only by run reports, the next one waits this


class Supervisor:
    def __init__(self, config: Config, config_source: str, environment: str | None,
                 processes: Processes | None = None,
                 unit_stopper: UnitStopper = stop_units_over_dbus) -> None:
        self.config = config
        self.config_source = config_source
        self.environment = environment
        self.table = WorkerTable(config.workers, config.worker_timeout)
        self.procs = processes or Processes()
        self.master_pid = os.getpid()
        self.guard: guard.Guard | None = None
        self.signals: list[int] = []
        self.wake_pending = False
        self.selfpipe = SelfPipe()
        self.cleanup = RunCleanup(unit_stopper, self._poke, self.procs)
        self.unit_cleanups = self.cleanup.units
        self.sel = selectors.DefaultSelector()
        self.systemd = ServiceManager()
        self.state = "starting"
        self.started = time.time()
        self.started_mono = time.monotonic()
        self.ready = False
        # Why the daemon must stop with a failure (a database it can never use).
        self.fatal: str | None = None
        self.db = MasterDatabase(config)
        # The configuration as this host runs it (its schedules files, its refusals, the
        # polkit grant).
        self.host = HostConfig(config, self._poke)
        self.config = self.host.of(config)
        self.spawn_postponed = False
        self.gc_frozen = False
        self.last_spawn_error = -SPAWN_RETRY
        self.last_turn = 0.0
        self.turn_deferred = False  # the last wake-up read reports only, its turn put off
        # Control threads waiting for the answer of a reload they asked for.
        self.reload_waiters: list[tuple[threading.Event, list[str | None]]] = []
        self.last_status = 0.0
        self.status_line = ""
        self.last_error: str | None = None
        self.listeners = Listeners(self.dispatch, self._healthy,
                                   lambda: self.state == "stopping", self._listener_error,
                                   self._read_tokens, lambda: self.config.routes)
        # For child processes: fds of the master that a worker must close after fork.
        self.listener_fds: Callable[[], list[int]] = lambda: []

    # -- signals --------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.signals.append(signum)
        self.selfpipe.wake(b"s")

    def _install_signals(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGHUP,
                    signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD):
            signal.signal(sig, self._on_signal)
        self.sel.register(self.selfpipe.r, selectors.EVENT_READ, "signal")

    # -- workers --------------------------------------------------------------------------

    def spawn_worker(self, index: int) -> bool:
        """Fork worker `index`; False (try again next turn) while a thread of the master
        is inside a database call: the child would inherit its locks mid-call, or while
        the store is being opened (database.OPEN_BEFORE_FORK)."""
        with self.db.fork_gate() as clear:
            # Asked even while the store opens: the wish to fork holds the database calls
            # that follow the open back (database.FORK_PRIORITY).
            if not clear or self.db.opening():
                return False
            self._fork_worker(index)
        return True

    def _fork_worker(self, index: int) -> None:
        # Loaded by the master, before the fork and the freeze below: shared by every
        # worker.
        from perfectschedd.master.worker_start import run_worker

        if not self.gc_frozen:
            # What the master built at start (imported modules, mostly) is shared with
            # every worker copy-on-write; a collection in a worker would write to each
            # object's GC header and copy those pages.  Frozen objects are never visited.
            gc.collect()
            gc.freeze()
            self.gc_frozen = True
        heap.trim()  # free pages the worker would otherwise map too

        def child(wake_r: int, alive_w: int) -> int:
            return run_worker(self.config, index, wake_r, alive_w, self.master_pid,
                              self.db, self.sel, self._master_fds)

        pid, wake_w, alive_r = self.procs.fork(child)
        now = time.monotonic()
        generation = self.table.generation
        self.table.add(WorkerProc(pid, index, generation, wake_w, alive_r, now, now))
        self.sel.register(alive_r, selectors.EVENT_READ, pid)
        log.info("worker %d spawned (pid %d, generation %d)", index, pid, generation)

    def _master_fds(self) -> list[int]:
        """The master's descriptors, which a worker closes after the fork."""
        return [*self.selfpipe.fds(), *self.listener_fds(),
                *(fd for w in self.table for fd in (w.wake_w, w.alive_r))]

    def _forget(self, proc: WorkerProc) -> None:
        try:
            self.sel.unregister(proc.alive_r)
        except (KeyError, ValueError):
            pass
        self.procs.close(proc.wake_w, proc.alive_r)

    def reap(self) -> None:
        for pid, code in self.procs.reap():
            proc = self.table.get(pid)
            if proc is None:
                if self.guard is not None and pid == self.guard.pid:
                    self._guard_died(code)
                continue  # an orphaned job process re-parented to us (child subreaper)
            self.read_alive(pid)  # its last run events
            ended = self.table.exited(pid, time.monotonic(), self.state == "stopping")
            assert ended is not None
            self._forget(proc)
            exposition.worker_exited(pid)
            # Before anything else starts: nothing of its runs may outlive it.
            self.cleanup.after_death(proc, code, self.config, self.master_pid,
                                     self._give_back)
            if not ended.unexpected:
                log.info("worker %d (pid %d) exited", proc.index, pid)
                continue
            if code == EXIT_UNUSABLE_DATABASE and self.fatal is None:
                self.fatal = "a worker cannot use the database (its reason is logged above)"
                continue
            exposition.worker_restarted()
            how = f"signal {-code}" if code < 0 else f"status {code}"
            log.error("worker %d (pid %d) died (%s) after %.1fs; replacing it",
                      proc.index, pid, how, ended.lived)
            if ended.backoff is not None and self.table.spawn_failures > 1:
                log.warning("workers keep dying; next start in %.1fs", ended.backoff)

    def manage_workers(self) -> None:
        """Converge the current generation to `workers` processes; kill unresponsive ones."""
        now = time.monotonic()
        for proc, why in self.table.unresponsive(now):
            log.error("worker %d (pid %d) %s; killing it", proc.index, proc.pid, why)
            self.procs.kill(proc.pid, signal.SIGKILL)
        if self.state == "stopping":
            return
        self.spawn_postponed = False
        cleaning = self.unit_cleanups.busy()
        for index in self.table.missing(now):
            if index in cleaning:
                continue  # its predecessor's units are still being stopped
            try:
                started = self.spawn_worker(index)
            except OSError as exc:
                # Out of descriptors or processes (EMFILE, EAGAIN, ENOMEM): the daemon
                # and its running workers go on; the start is tried again shortly.
                self.table.next_spawn = now + SPAWN_RETRY
                if now - self.last_spawn_error >= SPAWN_RETRY:
                    self.last_spawn_error = now
                    log.error("cannot start worker %d: %s; trying again in %.0fs", index,
                              exc.strerror or exc, SPAWN_RETRY)
                break
            if not started:
                self.spawn_postponed = True  # a database call is in flight: next turn
                break
        if self.table.surplus(now):  # beyond `workers`: they drain
            self._send_drains()

    def _give_back(self, owner: str, why: str) -> None:
        """A dead worker's leases back now (its runs were killed, `why` says how): the
        database of the configuration running when its units have stopped."""
        self.db.give_back_leases(owner, why)

    def sweep_orphans(self) -> None:
        """Kill what ended runs left behind (cleanup.RunCleanup.sweep_orphans)."""
        self.cleanup.sweep_orphans(self.table, self.master_pid, self.read_alive)

    def read_alive(self, pid: int) -> None:
        proc = self.table.get(pid)
        if proc is None:
            return
        data = self.procs.read(proc.alive_r)
        if data is None:  # EOF: it exited; reap() takes it from here
            try:
                self.sel.unregister(proc.alive_r)
            except (KeyError, ValueError):
                pass
            return
        if not data:
            return
        proc.buf += data
        lines, proc.buf = pipe.split_lines(proc.buf)
        now = time.monotonic()
        for line in lines:
            proc.report(line, now)
        if proc.wake_others:  # a draining worker gave back what it had not started
            proc.wake_others = False
            self.wake_pending = True

    def wake_workers(self) -> None:
        """A schedule changed: every worker looks for due work now.

        Called from the control and D-Bus threads, so it only asks the main loop, which
        owns the worker pipes (a pipe it just closed could otherwise be a reused fd).
        """
        self.wake_pending = True
        self.selfpipe.wake(b"w")

    def _poke(self) -> None:
        """From another thread: the loop takes a whole turn now."""
        self.selfpipe.wake(b"p")

    def _wake_now(self) -> None:
        self.wake_pending = False
        for proc in self.table:
            self.procs.poke(proc.wake_w)

    # -- control requests (from the control socket and D-Bus threads) ---------------------

    def dispatch(self, cmd: str, args: dict[str, Any], caller: Caller) -> Any:
        """One request of `caller` (as the socket or D-Bus knows it)."""
        command = registry.command(cmd, registry.DAEMON)
        auth.check_command(caller, command.name)  # an API token's role
        auth.check_root_only(command, caller)  # before the database is asked anything
        registry.check_args(command, args)
        routes = self.config.routes  # the configuration running now (reload swaps it)
        if command.name == "status":  # every key and state; errors to their readers
            fresh = args.get("fresh", True)
            if not isinstance(fresh, bool):
                raise InvalidInputError("fresh", "must be true or false")
            return commands.withhold_status(
                self.status(fresh), commands.access_of(caller, routes, registry.DAEMON))
        if command.name == "reload":
            return self._request_reload()
        result = self.db.call(lambda sc: commands.execute(
            sc, cmd, args, where=registry.DAEMON, caller=caller, routes=routes))
        if command.wakes:
            self.wake_workers()
        dbus = self.listeners.dbus
        if dbus is not None:
            for key, change in command.changes(args, result):
                dbus.schedule_changed(key, change)
        return result

    def _read_tokens(self) -> Any:
        """The API tokens' rows, for the HTTP listener (web/credentials.py)."""
        from perfectschedd.web.credentials import STALE

        return self.db.call(lambda sc: sc.store.tokens(), timeout=STALE)

    def _request_reload(self) -> dict[str, Any]:
        """Called from a control thread: the main loop reloads; the answer says whether
        the new configuration was taken."""
        answer: list[str | None] = []
        done = threading.Event()
        self.reload_waiters.append((done, answer))
        self._on_signal(signal.SIGHUP, None)
        deadline = time.monotonic() + RELOAD_ANSWER_WAIT
        if not done.wait(RELOAD_ANSWER_WAIT):
            return {"reload": "requested"}  # the loop is busy: the log will say
        if answer[0] is not None:
            raise ConfigError(f"reload rejected, the running configuration stays: {answer[0]}")
        # What the new files hold is known once the database has been converged to them
        # (an entry whose key is another's is refused there): wait for it, bounded.
        converged = self.host.files.wait_converged(max(0.0, deadline - time.monotonic()))
        problems = self.host.problems()
        # Partly refused: what was refused stays as it was (a rejected file's schedules)
        # or does not run here (a refused route or entry); the rest runs.
        return {"reload": "partial" if problems else "done", "workers": self.config.workers,
                "refused": problems, "files_applied": converged,
                # Its workers wait for drains to end (workertable.DRAIN_ROOM).
                "pending": self.table.reload_pending is not None,
                "draining": len(self.table.draining())}

    def status(self, fresh: bool = True) -> dict[str, Any]:
        """Called from the control threads; never waits on the database for more than
        STATUS_FRESH_WAIT: the figures are the housekeeping thread's snapshot (`fresh`:
        a new reading asked for first; else the latest one as it is)."""
        procs = list(self.table)  # a copy: never iterate the live table
        snap = self.db.fresh_snapshot(STATUS_FRESH_WAIT) if fresh else self.db.snapshot
        return status_reply(
            self.config, procs, snap, self.db.health(), state=self.state,
            started=self.started, last_error=self.last_error,
            refused_routes=self.host.refused_routes, problems=self.host.problems(),
            unit_grant=self.host.unit_grant,
            reload_pending=self.table.reload_pending is not None)

    def _update_status(self) -> None:
        now = time.monotonic()
        if now - self.last_status < STATUS_EVERY:
            return
        self.last_status = now
        db_ok = self.db.health()[0] is not False and all(p.db_ok for p in self.table)
        line = status_line(self.table, db_ok, self.db.snapshot)
        exposition.set_workers(self.config.workers, len(self.table.active()))
        exposition.set_alive_time(self.config.alive_time)  # a reload may change it alone
        set_route_types(exact_types(self.config.routes))
        if line != self.status_line:
            self.status_line = line
            self.systemd.notify(f"STATUS={line}")

    # -- reload / stop --------------------------------------------------------------------

    def reload(self) -> str | None:
        """Re-read the configuration; the reason it was rejected (the running one stays),
        or None once the new one is in place and its workers are starting."""
        mono_usec = int(time.clock_gettime(time.CLOCK_MONOTONIC) * 1e6)
        self.systemd.notify("RELOADING=1", f"MONOTONIC_USEC={mono_usec}", "STATUS=reloading")
        old = self.config
        try:
            new = read_new_config(self.config_source, self.environment, old)
            self.listeners.swap(old, new)
        except Exception as exc:  # noqa: BLE001 - whatever the new file does, the old one runs
            why = rejection(exc)
            log.error("reload failed, keeping the running configuration: %s", why)
            self.last_error = f"reload: {why}"
            self.systemd.notify("READY=1", f"STATUS={self.status_line} (reload failed)")
            return why
        if self.last_error is not None and self.last_error.startswith("reload: "):
            self.last_error = None  # that error is over: this configuration loaded
        self.host.loaded = new
        new = self.host.of(new)  # a bad schedules file is its own error, never fatal
        self.config = new
        if (new.url, new.table) != (old.url, old.table):
            self.db.stop_in_background()
            self.db = MasterDatabase(new)
            self.db.start()
        else:
            self.db.reconfigure(new)
        self.listeners.swap_dbus(old, new)
        # The old generation drains once the new one is up.
        if self.table.begin_reload(new.workers, new.worker_timeout, time.monotonic()):
            log.info("reloading: starting %d new worker(s)", new.workers)
        else:
            self._say_reload_pending()
        return None

    def _watch_grant(self) -> None:
        """Apply a change of the polkit grant seen by the watch (grantwatch.py)."""
        if self.state == "stopping":
            return
        held = self.host.grant_change()
        if held is not None:
            self._grant_changed(held)

    def _grant_changed(self, held: bool) -> None:
        """The grant came on or went off while the daemon ran: its routes are refused or
        taken again as a reload would (from the configuration running, not re-read).
        Coming on, the jobs that run as the daemon's user stop at once, not at their
        end: each worker stops them and drains (pipe.GRANT), and workers of the new
        refusals take their places."""
        if held:
            self.table.grant_on(time.monotonic())
        self.config = self.host.grant_changed(held)
        if held:
            self._send_grants()
        elif self.table.begin_reload(self.config.workers, self.config.worker_timeout,
                                     time.monotonic()):
            log.info("grant off: starting %d new worker(s)", self.config.workers)
        else:
            self._say_reload_pending()
        self.last_status = 0.0

    def _send_grants(self) -> None:
        """pipe.GRANT to each worker told of the grant, once; a full pipe is tried again
        next turn."""
        for proc in self.table.grants_to_send():
            if self.procs.grant(proc.pid, proc.wake_w):
                proc.grant_sent = True
                log.info("worker %d (pid %d) stops its runs as the daemon's user and "
                         "drains: %d running", proc.index, proc.pid, proc.running)

    def _say_reload_pending(self) -> None:
        """The new generation waits for drains to end (workertable.DRAIN_ROOM): the
        master runs the new configuration already; systemd is not kept waiting."""
        n = len(self.table.draining())
        log.warning("reload: the new configuration's workers start once fewer workers run "
                    "(%d now, %d of them draining; at most %d before a new generation)",
                    len(self.table), n, DRAIN_ROOM * self.config.workers)
        self.systemd.notify("READY=1", f"STATUS=reload pending: {n} worker(s) draining")

    def _start_pending_reload(self) -> None:
        if self.table.start_pending(time.monotonic()):
            log.info("reloading: starting %d new worker(s) (drains made room)",
                     self.table.size)

    def _finish_reload(self) -> None:
        old = self.table.finish_reload(time.monotonic())
        if old is not None:
            self._send_drains()
            self.last_status = 0.0
            log.info("reloaded; %d old worker(s) drain", len(old))
            self.systemd.notify("READY=1")
        elif self.table.drains_to_send():
            self._send_drains()

    def _send_drains(self) -> None:
        """Tell each worker marked draining, once; a full pipe is tried again next turn."""
        for proc in self.table.drains_to_send():
            if self.procs.drain(proc.pid, proc.wake_w):
                proc.drain_sent = True
                log.info("worker %d (pid %d, generation %d) drains: %d running", proc.index,
                         proc.pid, proc.generation, proc.running)

    def _guard_died(self, code: int) -> None:
        """Only KILL stops the guard (guard.py): say that a death of the whole daemon
        would now leave its jobs running, until the next start kills them."""
        assert self.guard is not None
        reaper.end_helper(self.guard.pid)
        self.procs.close(self.guard.lifeline)
        self.guard = None
        log.error("the job guard died (%s): if master and workers die together now, their "
                  "jobs run on until the daemon starts again", signal_name(-code)
                  if code < 0 else f"exit status {code}")

    def stop(self) -> None:
        self.state = "stopping"
        log.info("stopping")
        self.systemd.notify("STOPPING=1", "STATUS=stopping")
        self.listeners.stop()
        for p in self.table:
            self.procs.kill(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.config.shutdown_timeout + self.config.kill_grace + 5
        while len(self.table) and time.monotonic() < deadline:
            self.reap()
            time.sleep(0.05)
        for p in self.table:
            log.error("worker %d (pid %d) did not stop; killing it", p.index, p.pid)
            self.procs.kill(p.pid, signal.SIGKILL)
        while len(self.table):
            self.reap()
            time.sleep(0.02)
        self.unit_cleanups.join(25.0)  # their give-backs need the database, still open
        self.cleanup.kill_orphans(spare=self.guard.pid if self.guard else None)
        self.db.stop(timeout=5.0)  # lets the killed workers' leases be given back
        log.info("stopped")

    # -- listeners ------------------------------------------------------------------------

    def _listener_error(self, why: str) -> None:
        self.last_error = why

    def _healthy(self) -> bool:
        return healthy(self.state, list(self.table), self.db.health(),
                       self.config.worker_timeout)

    # -- main loop ------------------------------------------------------------------------

    def run(self) -> int:
        self.master_pid = os.getpid()
        logsetup.set_process_name("master")
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        except OSError:
            pass
        # First, while the master holds no listening socket and runs no thread but the
        # log writer's: the guard inherits nothing it could keep open.
        self.guard = reaper.start_helper(lambda: guard.start(reaper.set_instance(
            self.config.control_socket, self.master_pid), self.config.log))
        self._install_signals()
        self.listener_fds = self.listeners.fds
        # The control socket first: its lock refuses a second daemon before anything of the
        # running one (its metric files, its port) is touched.
        self.listeners.start_control(self.config)
        try:
            exposition.setup_master(self.config)
            self.listeners.start_metrics(self.config)
        except ConfigError as exc:
            log.error("%s", exc)
            self.listeners.stop()  # no control socket file left behind
            return 1
        self.db.start()
        self.listeners.start_dbus(self.config)
        # A previous daemon of this host that died without stopping its jobs: its units
        # stop before any worker exists.
        self.cleanup.stop_previous_units(self.config)
        reaper.kill_earlier_incarnations(self.master_pid)
        log.info("perfectschedd %s starting: %d worker(s), database %s", __version__,
                 self.config.workers, engine_url(self.config.url).render_as_string(
                     hide_password=True))
        self.manage_workers()
        try:
            while True:
                if self._loop_once():
                    break
        finally:
            self.stop()
        return 1 if self.fatal is not None else 0

    def _loop_once(self) -> bool:
        """One turn of the main loop; True when the daemon must stop."""
        if self.db.fatal is not None and self.fatal is None:
            self.fatal = self.db.fatal
        if self.fatal is not None:
            # Waiting will not fix it: fail (the start, under systemd) rather than run
            # workers that can do nothing.
            log.error("%s: %s", "stopping" if self.ready else "cannot start", self.fatal)
            self.systemd.notify(f"STATUS=failed: {self.fatal}"[:400])
            return True
        only_reports = True
        timeout = 0.02 if self.spawn_postponed else 0.5
        if self.turn_deferred:
            # The rest of a turn put off below comes at TURN_MIN, not at the next wake-up:
            # the first pings of the workers, read in such a turn, make the daemon ready.
            timeout = min(timeout, max(0.0, self.last_turn + TURN_MIN - time.monotonic()))
        for key, _ in self.sel.select(timeout=timeout):
            if key.data == "signal":
                only_reports = False
                self.selfpipe.empty()
            else:
                self.read_alive(key.data)
        now = time.monotonic()
        if only_reports and not self.wake_pending and now - self.last_turn < TURN_MIN:
            # Workers report every exec run (thousands a second in a burst): read them,
            # but run the rest of the turn at most every TURN_MIN.  A death comes with
            # SIGCHLD, a signal, which always gets a whole turn.  And let the next
            # reports gather a moment: one wake-up reads many (a signal waits at most
            # REPORT_GATHER for its turn).
            time.sleep(REPORT_GATHER)
            self.turn_deferred = True
            return False
        self.turn_deferred = False
        self.last_turn = now
        if self.wake_pending:
            self._wake_now()
        while self.signals:
            sig = self.signals.pop(0)
            if sig in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT):
                log.info("got %s", signal.Signals(sig).name)
                return True
            if sig in (signal.SIGHUP, signal.SIGUSR1):
                log.info("got %s: reloading", signal.Signals(sig).name)
                why = self.reload()
                waiters, self.reload_waiters = self.reload_waiters, []
                for done, answer in waiters:
                    answer.append(why)
                    done.set()
            elif sig == signal.SIGUSR2:
                logsetup.reopen()
                for p in self.table:
                    self.procs.kill(p.pid, signal.SIGUSR2)
            elif sig == signal.SIGCHLD:
                self.reap()
        self.reap()
        self.sweep_orphans()
        self._start_pending_reload()
        self.manage_workers()
        files = self.host.files
        if self.db.sc is not None and files.take_pending():
            self.db.in_background("applying schedules files", files.apply)
        self._finish_reload()
        self._watch_grant()
        self._send_grants()
        if not self.ready and self.table.all_pinged() and (
                self.db.first_open.is_set()
                or time.monotonic() - self.started_mono > READY_DATABASE_WAIT):
            self.ready = True
            self.state = "running"
            log.info("ready")
            self.systemd.notify("READY=1", f"MAINPID={os.getpid()}")
            # STATUS= says at once what is up, even when the line is the one sent while
            # the database was still opening: the READY message is where one looks.
            self.last_status = 0.0
            self.status_line = ""
        self._update_status()
        # Healthy: the loop runs and at least one worker proved liveness recently.
        now = time.monotonic()
        self.systemd.watchdog(now, self.table.any_alive(now) or self.state == "starting")
        return False


# READY=1 waits this long at most for the first try to open the database: a database
# that is only unreachable does not hold the start, one it can never use stops it.
READY_DATABASE_WAIT = 10.0
