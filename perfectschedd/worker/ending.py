"""The one place a run's task is ended.  The executors only run and return a RunResult
(executors/base.py), as APScheduler's executors only return and its scheduler ends the
job once; here the worker writes what the result's outcome means: finish, retry (after
the wait a LATER asked for), release, give back, or nothing when the lease is not ours.

A finish is not written at once: it is queued (:class:`BatchedTask`) and written with
the worker's next claim, in one transaction (claims.py); the others are written now.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from perfectschedd.errors import PreemptedError
from perfectschedd.executors.base import Log, RunResult, lease_lost_while_running
from perfectschedd.vocabulary.outcomes import Outcome

if TYPE_CHECKING:
    from perfectschedd.schedules.task import Task
    from perfectschedd.worker.leases import LeasePipeline

log = logging.getLogger("perfectschedd.worker")


class EndableTask(Protocol):
    """The task's ways to end (schedules.Task's, or BatchedTask's); each writes it."""

    key: str

    def finish(self) -> None: ...

    def retry(self, wait: float | None = None, *, later: bool = False) -> None: ...

    def release(self) -> None: ...

    def give_back(self) -> None: ...


class BatchedTask:
    """The task as the worker ends it: `finish()` is queued and written with the other
    finishes of this worker in one transaction (the daemon's hot path).  A lease lost
    meanwhile is logged and counted when the batch is written, not raised here.
    """

    __slots__ = ("_task", "_queue", "_pipeline")

    def __init__(self, task: Task, pipeline: LeasePipeline) -> None:
        self._task = task
        self._queue = pipeline.finished
        self._pipeline = pipeline

    def __getattr__(self, name: str) -> Any:
        return getattr(self._task, name)

    def finish(self) -> None:
        self._task._end()
        self._task.next_advance()  # now, so that a schedule with no next time is seen here
        if not self._queue:
            self._pipeline.first_finish = time.monotonic()
        self._queue.append(self._task)  # list.append is atomic under the GIL

    def retry(self, wait: float | None = None, *, later: bool = False) -> None:
        self._task.retry(wait, later=later)

    def release(self) -> None:
        self._task.release()

    def give_back(self) -> None:
        self._task.give_back()


def end_task(task: EndableTask, result: RunResult) -> None:
    """Write the end of `task` that its run's `result` says.  Raises PreemptedError when
    the lease was lost meanwhile, and the store's errors."""
    outcome = result.outcome
    if result.already_ended or outcome is Outcome.PREEMPTED:
        return  # written by the run itself; or the lease is not ours: nothing to write
    if outcome is Outcome.SUCCESS:
        task.finish()
    elif outcome is Outcome.LATER:
        # Asked for (SCHED_LATER N, retry(wait=N)), not a failure: max_attempts aside.
        task.retry(wait=result.retry_wait, later=True)
    elif outcome in (Outcome.FAILED, Outcome.TIMEOUT):
        task.retry()
    elif outcome is Outcome.RELEASED:
        task.release()
    elif outcome is Outcome.STOPPED:
        task.give_back()  # untried: the daemon stops, or the grant came on
    else:
        raise ValueError(f"no run of an executor ends {outcome!r}")


def run_and_end(task: EndableTask, run: Callable[[], RunResult], log: Log = log
                ) -> RunResult:
    """`run()` (executors/router.run_task), then end `task` by its result; the result,
    or when the lease was found lost as the end was written, the preempted one (nothing
    written).  An application's KeyboardInterrupt gives the occurrence back and goes
    on up."""
    start = time.monotonic()
    try:
        result = run()
    except KeyboardInterrupt:
        task.give_back()
        raise
    try:
        end_task(task, result)
    except PreemptedError:
        return lease_lost_while_running(task.key, time.monotonic() - start, log)
    return result
