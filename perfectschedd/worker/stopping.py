"""A worker's runs told to end before they did: all of them (the daemon stops), those
that run as the daemon's user (the polkit grant came on), the queued ones a draining
worker gives back, and what is left at exit."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from sqlalchemy.exc import SQLAlchemyError

from perfectschedd.config import privilege_refusal
from perfectschedd.errors import PreemptedError
from perfectschedd.executors.base import StopReason

if TYPE_CHECKING:
    from perfectschedd.schedules.task import Task
    from perfectschedd.worker.leases import LeasePipeline

log = logging.getLogger("perfectschedd.worker")


def stop_runs(p: LeasePipeline, reason: StopReason) -> None:
    with p.lock:
        controls = list(p.controls.values())
    for control in controls:
        control.stop(reason)


def _as_daemon_user(p: LeasePipeline, task: Task) -> bool:
    """Whether `task` runs as this process's user where that user holds the polkit
    grant: what the grant refuses (config.privilege_refusal), exec and python runs
    and units without another user."""
    handler = p.router.match(task.type)
    return handler is not None and privilege_refusal(
        handler.route.executor, handler.route.user, True) is not None


def stop_runs_as_daemon_user(p: LeasePipeline) -> int:
    """The polkit grant came on (pipe.GRANT): stop every run, started or queued,
    that runs as the daemon's user (StopReason.GRANT: given back untried, its history
    says why); how many were told."""
    with p.lock:
        held = [(t, p.controls.get(k)) for k, t in p.running.items()]
    stopped = 0
    for task, control in held:
        if control is not None and _as_daemon_user(p, task):
            control.stop(StopReason.GRANT)
            stopped += 1
    return stopped


def runs_as_daemon_user(p: LeasePipeline) -> list[str]:
    """The keys of the runs held here that run as the daemon's user."""
    with p.lock:
        tasks = list(p.running.values())
    return [t.key for t in tasks if _as_daemon_user(p, t)]


def give_back_queued(p: LeasePipeline, tasks: list[Task]) -> int:
    """A draining worker's claimed occurrences that no thread started (`tasks`, and
    the runs queued for their turn in a group): back now, to run on another worker;
    how many went back."""
    with p.lock:
        tasks = [*tasks, *p.waiting.values()]
        p.waiting.clear()
        for task in tasks:
            if p.running.get(task.key) is task:
                del p.running[task.key]
                p.controls.pop(task.key, None)
    given = 0
    for task in tasks:
        try:
            task.give_back()
            given += 1
        except PreemptedError:
            log.warning("key=%s: lease lost before it could be given back", task.key)
        except SQLAlchemyError as exc:
            p.set_db(False, exc)
            log.warning("key=%s: could not give it back (database error); it runs "
                        "again when its lease expires", task.key)
    return given


def give_back_leftovers(p: LeasePipeline) -> None:
    """Runs that did not end (python handlers stuck in C code): their occurrences go
    back to run again elsewhere."""
    with p.lock:
        leftover = list(p.running.values())
    for task in leftover:
        try:
            task.give_back()
        except Exception:  # noqa: BLE001 - best effort at exit; the lease expires anyway
            pass
