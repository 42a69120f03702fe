"""The outcomes and the one rule of which are failures (vocabulary/outcomes.py)."""

from __future__ import annotations

import pytest

from perfectschedd.vocabulary.outcomes import FAILURES, Outcome, is_failure


def test_outcomes_are_their_stored_strings() -> None:
    assert Outcome.SUCCESS == "success" and str(Outcome.NO_ROUTE) == "no_route"
    assert Outcome("lost") is Outcome.LOST
    assert len({o.value for o in Outcome}) == len(Outcome)


def test_failures_are_failed_timeout_and_lost_as_plain_strings() -> None:
    assert {"failed", "timeout", "lost"} == FAILURES
    assert all(type(f) is str for f in FAILURES)  # what a driver binds


@pytest.mark.parametrize("outcome", [Outcome.FAILED, Outcome.TIMEOUT, Outcome.LOST,
                                     "failed", "timeout", "lost"])
def test_a_failure(outcome: str) -> None:
    assert is_failure(outcome)


@pytest.mark.parametrize("outcome", [Outcome.SUCCESS, Outcome.LATER, Outcome.PREEMPTED,
                                     Outcome.RELEASED, Outcome.STOPPED, Outcome.SKIPPED,
                                     Outcome.REFUSED, Outcome.NO_ROUTE, None, "", "FAILED"])
def test_not_a_failure(outcome: str | None) -> None:
    """A request to run later is an attempt, not a failure; nothing recorded is none."""
    assert not is_failure(outcome)
