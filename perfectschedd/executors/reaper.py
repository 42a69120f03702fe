"""Find and kill what is left of exec runs whose lease is gone.

A run's command leads its own process group, and every process it starts inherits
``PERFECTSCHED_RUN_ID=<worker pid>.<stamp>.<instance>.<n>`` from its environment
(`instance`: the daemon instance and incarnation, see set_instance).  A process that left the
group (``setsid``, a double fork) is still recognised by that variable, and once its
parent dies it is re-parented to the master (a child subreaper): so whatever a run left
behind is either in the run's group, or marked, or a child of the master.

Invariant kept by the callers: nothing of a run outlives its lease.  The worker kills
its run's group when the run ends; the master kills a dead worker's groups and marked
processes before it starts a replacement, and kills its own non-worker children whose
run is no longer running.  What both leaves the group and clears its environment is
only found as the master's child; the systemd executor (cgroups) closes that gap.

Everything here reads /proc (Linux); nothing blocks for long.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable, Iterable
from typing import Protocol, TypeVar

from perfectschedd.executors.runmarks import instance_of, kill_marked, run_id
from perfectschedd.settings.unit_props import socket_digest

# Children this process starts for itself (a notification's hook or sendmail, from the
# master's threads): not left behind by a run, so the master's sweep spares them.  They
# are started under the lock the sweep reads the children under, so a child is either
# known or not yet forked when the sweep looks.
_helpers: set[int] = set()
_helpers_lock = threading.Lock()


class _HasPid(Protocol):
    pid: int


P = TypeVar("P", bound=_HasPid)


def start_helper(start: Callable[[], P]) -> P:
    """Start a child of our own (`start()` forks it); end_helper() once it is reaped."""
    with _helpers_lock:
        proc = start()
        _helpers.add(proc.pid)
    return proc


def end_helper(pid: int) -> None:
    with _helpers_lock:
        _helpers.discard(pid)


def strays(master: int, known: Callable[[int], bool]) -> list[int]:
    """The master's children that are neither `known` (its workers) nor its helpers."""
    with _helpers_lock:
        return [p for p in children(master) if not known(p) and p not in _helpers]


def _after_fork_in_child() -> None:
    """A forked child (a worker) has no helper yet, and the lock may have been held by
    another thread of the parent (a notification starting one) at the fork: that thread
    does not exist here to let it go."""
    global _helpers_lock
    _helpers.clear()
    _helpers_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def children(pid: int) -> list[int]:
    """Direct children of `pid` (all its threads'); [] if it is gone."""
    kids: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return kids
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                kids.extend(int(x) for x in f.read().split())
        except OSError:
            continue
    return kids


def parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat.rsplit(b")", 1)[1].split()[1])


def kill_groups(pgids: Iterable[int], master: int) -> int:
    """SIGKILL the process groups of a dead worker's runs.

    A group whose leader is gone cannot have its id reused while members remain; a
    leader that is still there must be ours (re-parented to `master`, or marked), so a
    recycled pid of a stranger is never signalled.
    """
    count = 0
    for pgid in pgids:
        if os.path.exists(f"/proc/{pgid}") and parent(pgid) != master \
                and run_id(pgid) is None:
            continue
        try:
            os.killpg(pgid, signal.SIGKILL)
            count += 1
        except OSError:
            pass
    return count


# This daemon's instance: set by the master before it forks anything, inherited by its
# workers, which write it into their run ids.
_instance: str | None = None


def set_instance(control_socket: str, master_pid: int) -> str:
    """Name this daemon in the run ids of its workers: its control socket (one daemon per
    socket on a host) and its master's pid (this incarnation of it)."""
    global _instance
    _instance = f"{socket_digest(control_socket)}:{master_pid}"
    return _instance


def instance() -> str:
    """This daemon's instance, or "-" outside a daemon (the library's own runs)."""
    return _instance or "-"


def left_by_earlier_incarnations(run: str) -> bool:
    """Whether a run id is of this daemon (the same control socket), but of a master that
    is not this one: what a daemon killed with all its processes left running."""
    theirs, mine = instance_of(run), instance()
    return theirs is not None and theirs != mine and \
        theirs.partition(":")[0] == mine.partition(":")[0]


def kill_earlier_incarnations(me: int) -> int:
    """At start, before any worker: kill the runs a previous master of this daemon
    instance left behind when it died with its workers and its guard (guard.py)."""
    killed = kill_marked(left_by_earlier_incarnations, me=me)
    if killed:
        logging.getLogger("perfectschedd").warning(
            "killed %d process(es) left running by an earlier start of this daemon (it "
            "died with its workers)", killed)
    return killed


def worker_of(run: str) -> int | None:
    """The worker pid in a run id ("<worker pid>.<n>")."""
    head, _, _ = run.partition(".")
    return int(head) if head.isdigit() else None
