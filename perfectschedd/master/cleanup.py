"""What runs leave behind, cleaned up by the master before anything takes their place.

Nothing of a dead worker's runs survives it: before a replacement is forked, the master
kills the process groups the worker reported and every process marked with one of its
run ids (executors/reaper.py) and stops its systemd units (executors/systemd/bus.py),
then gives the worker's leases back (recording those attempts as `lost`), so the
occurrences run again at once and never beside a leftover copy.  Stopping units waits on
D-Bus and systemd, so it runs on a thread of its own: the loop goes on, and the worker's
replacement and the give-back wait for it (UnitCleanups).

Also here: the sweep for processes an ended run left behind (they land on the master, a
child subreaper), the units of a previous daemon of this host stopped at start, and the
master's last sweep of orphans when it stops.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import threading
import time
from collections.abc import Callable

from perfectschedd.config import Config
from perfectschedd.errors import first_line
from perfectschedd.executors import reaper, runmarks
from perfectschedd.executors.base import signal_name
from perfectschedd.master.processes import Processes
from perfectschedd.master.workertable import WorkerProc, WorkerTable
from perfectschedd.settings import unit_props

log = logging.getLogger("perfectschedd")

SWEEP_EVERY = 1.0  # looking for what ended runs left behind


UnitStopper = Callable[[Callable[[str, str], bool], list[str]], list[str]]


def stop_units_over_dbus(belongs: Callable[[str, str], bool], names: list[str]) -> list[str]:
    from perfectschedd.executors.systemd import bus

    return bus.stop_units(belongs, names)


class UnitCleanups:
    """Dead workers' systemd units being stopped, each on a thread of its own (a hung bus
    or systemd must not stop the master's loop, its watchdog or `status`).  While a
    worker's units stop, its index gets no replacement and its leases are not given back:
    the occurrence must not run again beside them.  Bounded: bus.stop_units gives
    up after 20 s, and then the leases expire as any lease does."""

    def __init__(self, stopper: UnitStopper, wake: Callable[[], None]) -> None:
        self.stopper = stopper
        self.wake = wake
        self.threads: list[tuple[int, threading.Thread]] = []  # (worker index, its clean-up)

    def start(self, index: int, whose: str, belongs: Callable[[str, str], bool],
              names: list[str], then: Callable[[], None] | None) -> None:
        def work() -> None:
            # Units that could not be stopped may still run: their leases are not given
            # back, they expire after alive_time (RuntimeMaxSec bounds the units).
            if stop_units(self.stopper, whose, belongs, names) and then is not None:
                then()
            self.wake()  # the loop frees the index now, not at its next timeout

        thread = threading.Thread(target=work, name=f"units-of-worker-{index}", daemon=True)
        try:
            thread.start()
        except RuntimeError:  # no thread to be had (out of memory or tasks): wait here
            work()
            return
        self.threads.append((index, thread))

    def busy(self) -> set[int]:
        """Indexes whose clean-up still runs (forgetting those that ended)."""
        self.threads = [(i, t) for i, t in self.threads if t.is_alive()]
        return {i for i, _ in self.threads}

    def join(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        for _, thread in list(self.threads):
            thread.join(max(0.0, end - time.monotonic()))


def stop_units(stopper: UnitStopper, whose: str, belongs: Callable[[str, str], bool],
               names: list[str] | None = None) -> bool:
    """Stop (SIGKILL, then wait until inactive) the perfectsched-* units of `whose`; False
    when systemd could not be asked or did not stop them in time."""
    try:
        stopped = stopper(belongs, names or [])
    except Exception as exc:  # noqa: BLE001 - SystemdError, or no fd left to import or connect
        log.error("cannot stop the systemd units of %s: %s; their leases expire after "
                  "alive_time", whose, first_line(exc))
        return False
    if stopped:
        log.warning("stopped %d systemd unit(s) of %s: %s", len(stopped), whose,
                    ", ".join(stopped))
    return True


def runs_units(config: Config) -> bool:
    """Whether this configuration starts systemd units (a route of executor systemd)."""
    return any(r.executor == "systemd" and r.refused is None for r in config.routes)


class RunCleanup:
    """The master's clean-ups of runs: a dead worker's, an ended run's strays, a previous
    daemon's units.  The configuration and the master's pid are passed in by the caller
    (a reload changes the first)."""

    def __init__(self, stopper: UnitStopper, wake: Callable[[], None],
                 procs: Processes) -> None:
        self.units = UnitCleanups(stopper, wake)
        self.procs = procs
        self.next_sweep = 0.0

    def after_death(self, proc: WorkerProc, code: int, config: Config, master_pid: int,
                    give_back: Callable[[str, str], None]) -> None:
        """A worker exited with `code`: nothing of its runs may outlive it, and if it died
        its leases are given back (`give_back(owner, why)`: `why` goes into the history
        of its runs) once they are gone."""
        owner = f"{config.node}:{proc.pid}"
        how = f"killed by {signal_name(-code)}" if code < 0 else f"exit status {code}"
        then = (functools.partial(give_back, owner, f"worker {owner} died ({how}); its run "
                                  "was stopped and the occurrence given back")
                if code != 0 else None)
        # With units, the give-back waits until they have stopped (UnitCleanups).
        units_stopping = bool(code != 0 or proc.runs or proc.units) and \
            self.kill_runs(proc, config, master_pid, then=then)
        if then is not None and not units_stopping:
            then()

    def kill_runs(self, proc: WorkerProc, config: Config, master_pid: int,
                  then: Callable[[], None] | None = None) -> bool:
        """Kill every process of a dead worker's runs (before its replacement starts).
        True when its units are being stopped: `then` runs once they have."""
        units_stopping = False
        if proc.units or runs_units(config):
            from perfectschedd.executors.systemd.unit import owner_mark

            # The units it reported, and any other that names it as its owner (a report
            # lost with the worker): stopped before its leases are given back.
            mark = owner_mark(config.node, proc.pid)
            tag = unit_props.daemon_tag(config.control_socket)
            self.units.start(
                proc.index, f"worker {proc.index} (pid {proc.pid})",
                lambda name, description: description.endswith(mark)
                and unit_props.started_by(description, tag),
                list(proc.units.values()), then)
            proc.units.clear()
            units_stopping = True
        groups = [g for g in proc.runs.values() if g is not None]
        killed = reaper.kill_groups(groups, master_pid)
        dead = proc.pid
        killed += runmarks.kill_marked(lambda r: reaper.worker_of(r) == dead,
                                        me=master_pid)
        if killed:
            log.warning("worker %d (pid %d) died with %d run(s); killed what was left of "
                        "them", proc.index, dead, len(proc.runs) or killed)
        proc.runs.clear()
        return units_stopping

    def stop_previous_units(self, config: Config) -> None:
        """At start, before any worker exists: a previous daemon of this host that died
        without stopping its jobs (killed, crashed) must not have its units run beside
        the occurrences run again now.  Waiting here is what keeps them from running
        twice."""
        if not runs_units(config):
            return
        from perfectschedd.executors.systemd.unit import owner_mark

        mark = owner_mark(config.node, 0).rsplit(":", 1)[0] + ":"
        # Only this instance's: another daemon of this host (another table, database
        # or configuration, one socket each) keeps its units.
        tag = unit_props.daemon_tag(config.control_socket)
        stop_units(self.units.stopper, "a previous daemon of this host",
                   lambda name, description: mark in description
                   and unit_props.started_by(description, tag))

    def sweep_orphans(self, table: WorkerTable, master_pid: int,
                      read_alive: Callable[[int], None]) -> None:
        """Kill the master's children that are not workers and whose run has ended.

        Workers are not subreapers: a process a run left behind (it left the group,
        its parent died) lands here.  Reports are read first (`read_alive(pid)`), so a
        run that just started is known before its first orphan is judged.
        """
        now = time.monotonic()
        if now < self.next_sweep:
            return
        # Once a second: the loop turns for every run event of every worker (thousands a
        # second in a burst of exec jobs), and /proc reads on each turn showed.
        self.next_sweep = now + SWEEP_EVERY
        strays = reaper.strays(master_pid, lambda pid: table.get(pid) is not None)
        if not strays:
            return
        for proc in table:
            read_alive(proc.pid)
        active = {r for p in table for r in p.runs}
        for pid in strays:
            run = runmarks.run_id(pid)
            if run is not None and run in active:
                continue
            if run is not None:
                log.warning("killing pid %d, left behind by run %s that has ended", pid, run)
            runmarks.kill(pid)

    def kill_orphans(self, spare: int | None = None) -> None:
        """Job processes re-parented to us (their worker died) must not outlive us.  The
        guard (`spare`) ends by itself once we are gone (executors/guard.py)."""
        me = str(os.getpid())
        pids = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == spare:
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if stat.rsplit(")", 1)[1].split()[1] == me:
                pids.append(int(entry))
        for pid in pids:
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                self.procs.kill(pid, signal.SIGKILL)
        for pid in pids:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
