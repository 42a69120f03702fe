"""The `history` command (commands.py) with what each run did: the `attempt` filter `logs
--attempt` asks for, its refusals, and the output budget of one answer (an answer waits
whole in the daemon's memory until its client reads it)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import perfectschedd
from perfectschedd.control import commands, protocol
from perfectschedd.errors import InvalidInputError
from perfectschedd.schedules.collection import ScheduleCollection

T0 = 1_893_456_000


@pytest.fixture
def sc(tmp_path: Path) -> Iterator[ScheduleCollection]:
    with perfectschedd.open({"type": "rdb_compat", "url": f"sqlite:///{tmp_path / 'db'}"}
                            ) as c:
        c.add("k", "t", cron="@daily")
        yield c


def run(attempt: int, output: str | None) -> dict[str, Any]:
    return {"key": "k", "type": "t", "scheduled_time": T0, "attempt": attempt,
            "started_at": T0 + attempt, "finished_at": T0 + attempt + 0.5,
            "outcome": "failed", "worker": "h:1", "output": output, "duration": 0.5,
            "exit_code": attempt, "error": f"exit status {attempt}"}


def test_history_can_ask_for_one_attempt(sc: ScheduleCollection) -> None:
    sc.store.record_runs([run(1, "first\n"), run(2, "second\n"), run(1, "again\n")])
    got = commands.execute(sc, "history", {"key": "k", "attempt": 1})
    assert [(r["attempt"], r["output"]) for r in got] == [(1, "again\n"), (1, "first\n")]
    assert commands.execute(sc, "history", {"key": "k", "attempt": 3}) == []
    for bad in (0, -1, True, "1", 1.5, protocol.ATTEMPT_MAX + 1):
        with pytest.raises(InvalidInputError, match="attempt"):
            commands.execute(sc, "history", {"key": "k", "attempt": bad})


def test_one_answer_carries_a_bounded_amount_of_output_newest_first(
        sc: ScheduleCollection) -> None:
    big = "x" * (protocol.HISTORY_OUTPUT_BYTES // 2 - 10)
    sc.store.record_runs([run(1, big), run(2, big), run(3, big), run(4, "small\n")])
    got = commands.execute(sc, "history", {"key": "k", "limit": 10})
    assert [r["attempt"] for r in got] == [4, 3, 2, 1]
    assert [r["output"] is not None for r in got] == [True, True, True, False]
    assert got[3].get("output_omitted") is True and "output_omitted" not in got[0]
    # Asked for alone (logs --attempt), the oldest run's output comes whole.
    (alone,) = commands.execute(sc, "history", {"key": "k", "attempt": 1})
    assert alone["output"] == big
