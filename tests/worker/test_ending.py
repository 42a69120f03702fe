"""ending.py: the one place a run's task is ended, by its result's outcome."""

from __future__ import annotations

from typing import Any

import pytest

from perfectschedd.errors import PreemptedError
from perfectschedd.executors.base import RunResult
from perfectschedd.vocabulary.outcomes import Outcome
from perfectschedd.worker.ending import end_task, run_and_end


class Recorder:
    def __init__(self, preempted: bool = False) -> None:
        self.key = "k"
        self.preempted = preempted
        self.calls: list[tuple[Any, ...]] = []

    def _end(self, *call: Any) -> None:
        if self.preempted:
            raise PreemptedError(self.key)
        self.calls.append(call)

    def finish(self) -> None:
        self._end("finish")

    def retry(self, wait: float | None = None, *, later: bool = False) -> None:
        self._end("retry", wait, later)

    def release(self) -> None:
        self._end("release")

    def give_back(self) -> None:
        self._end("give_back")


@pytest.mark.parametrize(("outcome", "calls"), [
    (Outcome.SUCCESS, [("finish",)]),
    (Outcome.FAILED, [("retry", None, False)]),
    (Outcome.TIMEOUT, [("retry", None, False)]),
    (Outcome.LATER, [("retry", 7, True)]),
    (Outcome.RELEASED, [("release",)]),
    (Outcome.STOPPED, [("give_back",)]),
    (Outcome.PREEMPTED, []),  # the lease is not ours: nothing is written
])
def test_each_outcome_ends_the_task_its_way(outcome: Outcome, calls: list[Any]) -> None:
    task = Recorder()
    end_task(task, RunResult(outcome, 0.0, retry_wait=7 if outcome is Outcome.LATER
                             else None))
    assert task.calls == calls


def test_a_task_ended_by_its_run_is_not_ended_again() -> None:
    task = Recorder()
    end_task(task, RunResult(Outcome.SUCCESS, 0.0, already_ended=True))
    assert task.calls == []


@pytest.mark.parametrize("outcome", [Outcome.LOST, Outcome.SKIPPED, Outcome.REFUSED,
                                     Outcome.NO_ROUTE, Outcome.DB_ERROR])
def test_outcomes_no_executor_returns_are_refused(outcome: Outcome) -> None:
    with pytest.raises(ValueError, match="no run of an executor"):
        end_task(Recorder(), RunResult(outcome, 0.0))


def test_a_lease_lost_as_the_end_is_written_makes_the_run_preempted() -> None:
    result = run_and_end(Recorder(preempted=True),
                         lambda: RunResult(Outcome.SUCCESS, 0.5, exit_code=0, output="x"))
    assert result.outcome == Outcome.PREEMPTED
    assert result.exit_code is None and result.output is None
    assert result.error is not None and result.error.startswith("lease lost while running")


def test_an_interrupt_gives_the_occurrence_back_and_goes_on() -> None:
    task = Recorder()

    def interrupted() -> RunResult:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_and_end(task, interrupted)
    assert task.calls == [("give_back",)]
