"""From a claimed occurrence to a run on a thread: the schedule's misfire and grace policy
(catch_up), an overlapping schedule moving on at once (split), the run's turn in its
group (`run KEY` behind a running occurrence: admit, take_turns), and the hold that
heartbeats and fences it from then on (hold)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from perfectschedd.errors import InvalidInputError, PreemptedError
from perfectschedd.executors.base import RunControl, error_line
from perfectschedd.metrics import counters
from perfectschedd.schedules import catchup
from perfectschedd.store.groups import TURN_LOST, TURN_START
from perfectschedd.store.schema import lease_until
from perfectschedd.vocabulary.fields import RUN_NOW_MARK
from perfectschedd.vocabulary.history import history_row
from perfectschedd.vocabulary.outcomes import Outcome

if TYPE_CHECKING:
    from perfectschedd.schedules.task import Task
    from perfectschedd.worker.leases import LeasePipeline

log = logging.getLogger("perfectschedd.worker")

# A run queued for its turn in its group (`run KEY` behind a running occurrence) asks
# again this often at most, and at least once per poll_interval.
GROUP_RECHECK = 0.25


def catch_up(p: LeasePipeline, task: Task) -> bool:
    """Apply the schedule's misfire and grace policy to an occurrence just claimed;
    False when nothing is to run now (the schedule moved on, its lease ended)."""
    now = time.time()
    try:
        plan = catchup.plan(task, now)
    except InvalidInputError as exc:  # no occurrence left: the finish will say so
        log.warning("key=%s: misfire policy not applied: %s", task.key, exc)
        return True
    if plan is None:
        return True
    assert p.sc is not None
    if plan.skipped:
        counters.occurrences_skipped(task.type, len(plan.skipped))
        more = "+" if len(plan.skipped) >= catchup.COUNT_CAP else ""
        log.warning("key=%s: skipped %d%s missed occurrence(s) (misfire %s%s), %s",
                    task.key, len(plan.skipped), more, task.policy.misfire,
                    f", grace {task.policy.grace}s" if task.policy.grace is not None
                    else "", f"running the one of {plan.run}" if plan.run is not None
                    else f"next at {plan.next_time}")
        why = error_line(f"not run: misfire {task.policy.misfire}" + (
            f", grace {task.policy.grace} s" if task.policy.grace is not None else ""))
        p.history.add_many([
            history_row(key=task.key, type=task.type, scheduled_time=t, attempt=0,
                        started_at=now, finished_at=now, outcome=Outcome.SKIPPED,
                        worker=p.sc.owner, error=why)
            for t in reversed(plan.skipped[:p.config.history_limit])])
    if plan.run is None:
        task._end()
        assert plan.next_time is not None
        if p.store.advance([task.advance_to(plan.next_time)]):
            log.warning("key=%s: lease lost while skipping missed occurrences", task.key)
        return False
    if plan.run != task.scheduled_time:
        if not p.store.retarget(task.key, task.fence, plan.run):
            return False  # the lease is gone: nothing of it is ours to run
        task.scheduled_time = plan.run
    return True


def split(p: LeasePipeline, task: Task) -> bool:
    """An occurrence of an allow or replace schedule takes a row of its own, and the
    schedule moves on at once (Task.split_off); False when the lease was lost."""
    if not task.policy.overlaps:
        return True
    assert p.sc is not None
    if task.split_off(p.sc.owner, p.config.alive_time):
        return True
    log.warning("key=%s: lease lost before the occurrence of %d could start",
                task.key, task.scheduled_time)
    return False


def admit_many(p: LeasePipeline, tasks: list[Task], submit: Callable[[Task], None]) -> None:
    """admit each of `tasks`; those of no group (the usual case: nothing to ask the
    database) are held under one turn of the lock, then submitted."""
    plain = [t for t in tasks if t.group is None]
    hold(p, plain)
    for task in plain:
        submit(task)
    for task in tasks:
        if task.group is not None:
            admit(p, task, submit)


def admit(p: LeasePipeline, task: Task, submit: Callable[[Task], None]) -> None:
    """A claimed occurrence is held from now on (heartbeats, self-fencing) and
    starts, unless another run of its schedule runs (its group, `run KEY`): an extra
    run then waits here, queued, and starts once it ends; the schedule's own
    occurrence is given back until then (the end of that run wakes it)."""
    turn = TURN_START if task.group is None else task.group_turn()
    if turn == TURN_LOST:
        log.warning("key=%s: lease lost before the occurrence of %d could start",
                    task.key, task.scheduled_time)
        return
    if turn != TURN_START and RUN_NOW_MARK not in task.key:
        log.info("key=%s: the occurrence of %d waits: another run of the schedule "
                 "goes first", task.key, task.scheduled_time)
        try:
            task.give_back(wait=p.config.alive_time)
        except PreemptedError:
            pass  # changed meanwhile: whoever changed it decides
        return
    hold(p, [task], queued=turn != TURN_START)
    if turn == TURN_START:
        submit(task)
    else:
        log.info("key=%s: queued: starts once the running occurrence of %s has ended",
                 task.key, task.group)


def hold(p: LeasePipeline, tasks: list[Task], queued: bool = False) -> None:
    """From now on `tasks` are held: heartbeated, fenced at their lease's end, and
    (`queued`) waiting for their turn in their group."""
    controls = [RunControl(lease_until(t.claimed_at, p.config.alive_time)
                           - p.fence_lead, p.fence_grace) for t in tasks]
    with p.lock:
        for task, control in zip(tasks, controls, strict=True):
            p.running[task.key] = task
            p.controls[task.key] = control
            if queued:
                p.waiting[task.key] = task


def take_turns(p: LeasePipeline, submit: Callable[[Task], None]) -> None:
    """Ask again for the turn of each run queued here (at most every GROUP_RECHECK):
    those whose turn came start; those whose lease was lost (deleted, replaced,
    not renewed) are let go, never having run."""
    if not p.waiting or time.monotonic() - p.turns_asked < GROUP_RECHECK:
        return
    p.turns_asked = time.monotonic()
    waits: set[str | None] = set()  # groups told to wait this round
    for key, task in list(p.waiting.items()):
        with p.lock:
            control = p.controls.get(key)
        if control is not None and not control.is_set() and task.group in waits:
            continue  # one turn at a time: the others of its group ask next round
        turn = TURN_LOST if control is None or control.is_set() else task.group_turn()
        if turn == TURN_START:
            with p.lock:
                del p.waiting[key]
            submit(task)
        elif turn != TURN_LOST:
            waits.add(task.group)
        else:
            log.warning("key=%s: lease lost while queued; it did not run", key)
            with p.lock:
                del p.waiting[key]
                p.running.pop(key, None)
                p.controls.pop(key, None)
