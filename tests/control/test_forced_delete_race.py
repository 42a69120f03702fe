"""`delete --force` of a schedules file's schedule racing another change of the key: the
marker (schedules/deletions.py) records the row as it is deleted, in the delete's
transaction, and a key that became another schedule since the checks is not deleted.

The change is made between the command's read and its delete: in the check for older
hosts that a forced delete makes there (the seam a convergence on another host could
fall into), on a real database of each backend."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import perfectschedd
from perfectschedd.control import commands
from perfectschedd.control.auth import Caller
from perfectschedd.errors import ScheduleError
from perfectschedd.schedules import deletions
from perfectschedd.schedules.collection import ScheduleCollection
from perfectschedd.vocabulary.fields import deleted_marker_name

T0 = 1_893_456_000
ROOT = Caller.of(0, [0])


@pytest.fixture
def sc(db_url: str) -> Iterator[ScheduleCollection]:
    with perfectschedd.open({"type": "rdb_compat", "url": db_url}) as c:
        c.add("nightly", "t", cron="@daily", source="file:backup.yml", now=T0)
        yield c


def meanwhile(sc: ScheduleCollection, monkeypatch: pytest.MonkeyPatch, change: Any) -> None:
    checks = sc.refuse_on_older_hosts

    def check_then_change(feature: str, now: float | None = None) -> None:
        checks(feature, now)
        change()

    monkeypatch.setattr(sc, "refuse_on_older_hosts", check_then_change)


def test_an_entry_changed_meanwhile_is_marked_as_it_is_deleted(
        sc: ScheduleCollection, monkeypatch: pytest.MonkeyPatch) -> None:
    before = sc["nightly"].info()
    seen: list[Any] = []

    def converged() -> None:
        sc["nightly"].modify(cron="@hourly", file_entry=True, now=T0)
        seen.append(sc["nightly"].info())

    meanwhile(sc, monkeypatch, converged)
    commands.execute(sc, "delete", {"key": "nightly", "force": True}, now=T0, caller=ROOT)
    assert not sc["nightly"].exists()
    # The entry as the file says it now, not as it was read: the next apply of the file
    # does not add it back.
    (value,) = sc.deleted_markers().values()
    after = seen[0]
    assert value == deletions.marker("nightly", "file:backup.yml", after.as_dict())
    assert value != deletions.marker("nightly", "file:backup.yml", before.as_dict())


def test_a_key_that_became_another_schedule_meanwhile_is_not_deleted(
        sc: ScheduleCollection, monkeypatch: pytest.MonkeyPatch) -> None:
    def replaced() -> None:
        sc["nightly"].delete()
        sc.add("nightly", "t", cron="@weekly", now=T0)  # by `add`: the file's no more

    meanwhile(sc, monkeypatch, replaced)
    with pytest.raises(ScheduleError, match=r"^nightly changed while it was being deleted "
                       r"\(its source is now api\): nothing deleted$"):
        commands.execute(sc, "delete", {"key": "nightly", "force": True}, now=T0, caller=ROOT)
    assert sc["nightly"].info().cron == "@weekly"
    assert deleted_marker_name("nightly") not in sc.deleted_markers()
