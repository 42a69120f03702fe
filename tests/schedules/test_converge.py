"""schedules/converge.py: reconciling schedules files with the store (a real SQLite file):
what is added, changed, removed or refused, what the changes list says, and the entries'
wire form for `apply`."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from typing import Any

import pytest

import perfectschedd
from perfectschedd.errors import InvalidInputError
from perfectschedd.schedules import deletions
from perfectschedd.schedules.collection import ScheduleCollection
from perfectschedd.schedules.converge import (
    ADDED,
    CHANGED,
    DIFFERS,
    REFUSED,
    REMOVED,
    UNCHANGED,
    Change,
    converge,
    from_wire,
    summary,
    to_wire,
)
from perfectschedd.schedules.files import Entry, check_entry

T0 = 1_700_002_800
JOBS, OTHER = "file:jobs.yml", "file:other.yml"


@pytest.fixture
def sc(sqlite_url: str) -> Iterator[ScheduleCollection]:
    with perfectschedd.open({"type": "rdb_compat", "url": sqlite_url,
                             "timezone": "Europe/Paris"}) as c:
        yield c


def entry(key: str, source: str = JOBS, **fields: Any) -> Entry:
    raw = {"key": key, "cron": "0 3 * * *", **({} if "exec" in fields else {"type": "t"}),
           **fields}
    return check_entry(raw, source, need_user_support=False)


def entries(*es: Entry) -> dict[str, Entry]:
    return {e.key: e for e in es}


def actions(changes: list[Change]) -> list[tuple[str, str]]:
    return [(c.action, c.key) for c in changes]


def rows(sc: ScheduleCollection) -> dict[str, Any]:
    return {i.key: i.as_dict() for i in sc.list()}


def test_missing_entries_are_added_with_their_source_and_fields(
        sc: ScheduleCollection) -> None:
    wanted = entries(entry("nightly", data={"n": 1}),
                     entry("hourly", cron="@hourly", timezone="Asia/Tokyo", max_attempts=3),
                     entry("weekly", OTHER, cron="@weekly", jitter=60))
    changes = converge(sc, wanted, {JOBS, OTHER}, now=T0, creators={JOBS: 1234})
    assert actions(changes) == [(ADDED, "nightly"), (ADDED, "hourly"), (ADDED, "weekly")]
    assert [c.line() for c in changes] == ["added nightly", "added hourly", "added weekly"]
    got = rows(sc)
    assert {k: v["source"] for k, v in got.items()} == {
        "nightly": JOBS, "hourly": JOBS, "weekly": OTHER}
    assert got["nightly"]["timezone"] == "Europe/Paris"  # the configuration's default
    assert got["nightly"]["data"] == {"n": 1}
    assert got["hourly"]["timezone"] == "Asia/Tokyo" and got["hourly"]["max_attempts"] == 3
    assert got["weekly"]["jitter"] == 60
    # The creator: the uid given for the entry's file, else this process's.
    assert sc.store.get("nightly").creator == 1234
    assert sc.store.get("weekly").creator == os.geteuid()
    # The next time follows the cron from `now`.
    assert got["hourly"]["next_time"] == T0  # first at or after now (a whole hour)


def test_equal_entries_are_not_written(sc: ScheduleCollection) -> None:
    wanted = entries(entry("a"), entry("b", cron="* * * * *"))
    converge(sc, wanted, {JOBS}, now=T0)
    task = sc.poll(now=T0 + 60)  # b is running: its lease must stay
    assert task is not None and task.key == "b"
    before = {k: sc.store.get(k) for k in wanted}
    changes = converge(sc, wanted, {JOBS}, now=T0 + 3600)
    assert actions(changes) == [(UNCHANGED, "a"), (UNCHANGED, "b")]
    assert {k: sc.store.get(k) for k in wanted} == before  # fence, times, lease as they were
    assert sc.store.get("b").owner is not None


def test_a_changed_entry_is_modified_and_the_change_named(sc: ScheduleCollection) -> None:
    converge(sc, entries(entry("a", data={"v": 1}), entry("b")), {JOBS}, now=T0)
    fence_b = sc.store.get("b").fence
    changes = converge(sc, entries(entry("a", cron="30 6 * * *", data={"v": 2}, grace=60),
                                   entry("b")), {JOBS}, now=T0)
    assert [c.line() for c in changes] == ["changed a (cron, data, grace)", "unchanged b"]
    info = sc["a"].info()
    assert info.cron == "30 6 * * *" and info.data == {"v": 2} and info.policy.grace == 60
    # A new cron recomputes the next time (06:30 Paris after T0), as `modify` does.
    assert info.next_time == sc.add("probe", "t", "30 6 * * *", now=T0).info().next_time
    assert sc.store.get("b").fence == fence_b


def test_an_entry_that_left_its_file_is_removed_only_from_the_sources_given(
        sc: ScheduleCollection) -> None:
    converge(sc, entries(entry("a"), entry("b"), entry("c", OTHER)), {JOBS, OTHER}, now=T0)
    # b left jobs.yml; other.yml is not among the sources to prune (a broken file).
    changes = converge(sc, entries(entry("a")), {JOBS}, now=T0)
    assert actions(changes) == [(UNCHANGED, "a"), (REMOVED, "b")]
    assert changes[1].line() == "removed b"
    assert set(rows(sc)) == {"a", "c"}
    # Now other.yml is given, and empty: c goes.
    assert actions(converge(sc, {}, {OTHER}, now=T0)) == [(REMOVED, "c")]
    assert set(rows(sc)) == {"a"}


def test_a_key_made_with_add_is_never_overwritten_nor_removed(sc: ScheduleCollection) -> None:
    sc.add("manual", "t", "@daily", data={"mine": True}, now=T0)
    before = sc.store.get("manual")
    changes = converge(sc, entries(entry("manual", cron="* * * * *", data={"x": 1})),
                       {JOBS}, now=T0)
    assert [c.line() for c in changes] == [
        "refused manual (the key belongs to api (made with add))"]
    assert sc.store.get("manual") == before
    # Not in any file: pruning the files' sources leaves it alone.
    assert converge(sc, {}, {JOBS, OTHER}, now=T0) == []
    assert sc.store.get("manual") == before


def test_a_key_of_another_file_is_refused(sc: ScheduleCollection) -> None:
    converge(sc, entries(entry("k", OTHER)), {OTHER}, now=T0)
    before = sc.store.get("k")
    changes = converge(sc, entries(entry("k", JOBS, cron="5 5 * * *")), {JOBS}, now=T0)
    assert [c.line() for c in changes] == ["refused k (the key belongs to file:other.yml)"]
    assert sc.store.get("k") == before


def test_dry_run_lists_the_changes_and_writes_nothing(sc: ScheduleCollection) -> None:
    converge(sc, entries(entry("keep"), entry("edit"), entry("gone")), {JOBS}, now=T0)
    before = rows(sc)
    changes = converge(sc, entries(entry("keep"), entry("edit", cron="1 1 * * *"),
                                   entry("new")), {JOBS}, now=T0, dry_run=True)
    assert sorted(actions(changes)) == [(ADDED, "new"), (CHANGED, "edit"),
                                        (REMOVED, "gone"), (UNCHANGED, "keep")]
    assert rows(sc) == before


def test_with_what_was_applied_before_another_hosts_version_is_not_written_back(
        sc: ScheduleCollection) -> None:
    mine = entries(entry("a"), entry("b"), entry("c"))
    converge(sc, mine, {JOBS}, now=T0)
    # Another host (other files of the same name) changed a, deleted b, added d.
    sc["a"].modify(cron="9 9 * * *")
    sc["b"].delete()
    sc.add("d", "t", "@daily", source=JOBS, file_entry=True, now=T0)
    changes = converge(sc, mine, {JOBS}, previous=mine, now=T0)
    assert [c.line() for c in changes] == [
        "differs a (the database has another cron; not written)",
        "differs b (removed from the database elsewhere; not added again)",
        "unchanged c",
        "differs d (in file:jobs.yml of another host only; not removed)"]
    assert sc["a"].info().cron == "9 9 * * *"
    assert set(rows(sc)) == {"a", "c", "d"}
    # What this host itself changed in its files is written, whatever `previous` says.
    edited = entries(entry("a", cron="7 7 * * *"), entry("c"))
    changes = converge(sc, edited, {JOBS}, previous=mine, now=T0)
    assert actions(changes) == [(CHANGED, "a"), (UNCHANGED, "c"),
                                (DIFFERS, "d")]
    assert sc["a"].info().cron == "7 7 * * *"


def test_allow_and_replace_are_refused_alone_while_an_older_host_works(
        sc: ScheduleCollection) -> None:
    """SPEC "Upgrades": an entry an older live host could not honour is refused alone,
    naming the host, and its stored schedule stays; once no older host is live, it is
    written."""
    sc.store.record_host("old", "0.1.9", 1, T0 - 60, T0 - 1)
    sc.add("b", "t", "0 3 * * *", source=JOBS, now=T0)
    wanted = entries(entry("a", concurrency="allow"), entry("b", concurrency="replace"),
                     entry("c"))
    changes = converge(sc, wanted, [JOBS], now=T0)
    assert actions(changes) == [(REFUSED, "a"), (REFUSED, "b"), (ADDED, "c")]
    assert "concurrency: allow" in changes[0].detail and "old (0.1.9)" in changes[0].detail
    assert not sc["a"].exists() and sc["b"].info().concurrency == "forbid"
    later = T0 + 3600  # the old host is no longer live
    assert actions(converge(sc, wanted, [JOBS], now=later)) == [
        (ADDED, "a"), (CHANGED, "b"), (UNCHANGED, "c")]
    assert sc["b"].info().concurrency == "replace"


def test_summary_counts_by_action() -> None:
    changes = [Change(ADDED, "a"), Change(ADDED, "b"), Change(REFUSED, "c", "why"),
               Change(REMOVED, "d")]
    assert summary(changes) == {"changes": ["added a", "added b", "refused c (why)",
                                            "removed d"],
                                "counts": {ADDED: 2, REFUSED: 1, REMOVED: 1}}
    assert summary([]) == {"changes": [], "counts": {}}


def test_wire_form_round_trips_and_carries_no_command(sc: ScheduleCollection) -> None:
    es = entries(entry("a", data={"x": [1]}, timezone="UTC", misfire="skip", grace=5),
                 entry("b", OTHER, cron="@hourly", delay=30),
                 entry("c", exec="echo secret", env={"TOKEN": "s3cret"}))
    wire = to_wire(es)
    assert "secret" not in repr(wire) and "s3cret" not in repr(wire)
    by_key = {w["key"]: w for w in wire}
    assert by_key["a"]["misfire"] == "skip" and by_key["a"]["grace"] == 5
    assert "timezone" not in by_key["b"]
    back = from_wire(wire)
    for key in ("a", "b"):
        assert back[key] == es[key]
    assert back["c"].stored("UTC") == es["c"].stored("UTC")
    assert back["c"].exec is None
    # Converging the wire form stores what the files would have stored.
    converge(sc, back, {JOBS, OTHER}, now=T0)
    assert rows(sc)["c"]["type"] == es["c"].type


BAD_WIRE: list[tuple[Any, str]] = [
    ({"key": "a"}, "entries"),
    ("text", "entries"),
    ([1, 2], "entries"),
    ([{"key": "a", "cron": "@daily", "type": "t"}], "source"),
    ([{"key": "a", "cron": "@daily", "type": "t", "source": "api"}], "source"),
    ([{"key": "a", "cron": "@daily", "type": "t", "source": "file:"}], "source"),
    ([{"key": "a", "cron": "@daily", "type": "t", "source": 5}], "source"),
    ([{"key": "a", "cron": "@daily", "type": "t", "source": "file:" + "x" * 300}], "source"),
    ([{"key": "a", "cron": "not cron", "type": "t", "source": JOBS}], "cron"),
    ([{"key": "a", "cron": "@daily", "type": "t", "source": JOBS, "grace": -1}], "grace"),
    ([{"key": "a", "cron": "@daily", "type": "t", "source": JOBS, "bogus": 1}], "bogus"),
    ([{"key": "a", "cron": "@daily", "type": "t", "source": JOBS},
      {"key": "a", "cron": "@hourly", "type": "t", "source": OTHER}], "key"),
]


@pytest.mark.parametrize(("items", "field"), BAD_WIRE, ids=[f for _, f in BAD_WIRE])
def test_bad_wire_entries_are_refused_naming_the_field(items: Any, field: str) -> None:
    with pytest.raises(InvalidInputError) as info:
        from_wire(items)
    assert info.value.field == field, str(info.value)


def forced_delete(sc: ScheduleCollection, key: str) -> None:
    """What `delete --force` stores (control/commands.py _delete)."""
    sc[key].delete(marker=lambda info: deletions.marker(key, info.source, info.as_dict()))


def test_a_forced_delete_holds_until_its_entry_changes(sc: ScheduleCollection) -> None:
    mine = entries(entry("gone"), entry("kept"))
    converge(sc, mine, {JOBS}, now=T0)
    forced_delete(sc, "gone")
    # Nothing known (a daemon's start, apply) or the same entry applied before: not added.
    for previous in (None, mine):
        for dry_run in (True, False):
            changes = converge(sc, mine, {JOBS}, previous=previous, now=T0,
                               dry_run=dry_run)
            assert [c.line() for c in changes] == [
                "deleted gone (deleted with --force: the file's entry is not added again "
                "until it changes)", "unchanged kept"]
    assert set(rows(sc)) == {"kept"} and len(sc.deleted_markers()) == 1
    # The entry changed: added, and the marker is gone.
    edited = entries(entry("gone", cron="5 5 * * *"), entry("kept"))
    assert converge(sc, edited, {JOBS}, previous=mine, now=T0)[0].action == ADDED
    assert sc["gone"].info().cron == "5 5 * * *" and sc.deleted_markers() == {}


def test_a_forced_delete_ends_when_its_entry_leaves_the_file(sc: ScheduleCollection) -> None:
    mine = entries(entry("gone"), entry("kept"), entry("elsewhere", OTHER))
    converge(sc, mine, {JOBS, OTHER}, now=T0)
    forced_delete(sc, "gone")
    forced_delete(sc, "elsewhere")
    without = entries(entry("kept"))
    # Another host's files never had it: its convergence keeps the marker.
    converge(sc, without, {JOBS}, previous=without, now=T0)
    # Only the file pruned forgets its markers; a dry run forgets none.
    converge(sc, without, {JOBS}, previous=mine, now=T0, dry_run=True)
    assert len(sc.deleted_markers()) == 2
    converge(sc, without, {JOBS}, previous=mine, now=T0)
    assert list(sc.deleted_markers().values()) == [
        sc.deleted_markers()[deletions.name("elsewhere")]]
    # Back in the file as it was: added again.
    assert actions(converge(sc, mine, {JOBS}, now=T0))[0] == (ADDED, "gone")


def test_a_key_added_again_elsewhere_ends_the_forced_delete(sc: ScheduleCollection) -> None:
    mine = entries(entry("k"))
    converge(sc, mine, {JOBS}, now=T0)
    forced_delete(sc, "k")
    sc.add("k", "t", "@daily", now=T0)  # made with add: its own key now
    assert sc.deleted_markers() == {}
    assert [c.line() for c in converge(sc, mine, {JOBS}, now=T0)] == [
        "refused k (the key belongs to api (made with add))"]
    # A 0.1.0 host's add leaves the marker (it knows none): the next convergence that
    # sees the row forgets it.
    sc["k"].delete()
    converge(sc, mine, {JOBS}, now=T0)
    forced_delete(sc, "k")
    assert [c.action for c in converge(sc, mine, {JOBS}, now=T0)] == ["deleted"]
    row = sc.build_row("k", "t", "0 3 * * *", source=JOBS, now=T0)
    with sc.store.engine.begin() as conn:
        conn.execute(sc.store.t.insert().values(**dataclasses.asdict(row)))
    assert len(sc.deleted_markers()) == 1
    assert actions(converge(sc, mine, {JOBS}, now=T0)) == [(UNCHANGED, "k")]
    assert sc.deleted_markers() == {}


def test_a_forced_delete_marker_fits_the_meta_table_whatever_the_source() -> None:
    long_source = "file:" + "n" * 295
    value = deletions.marker("k", long_source, {})
    assert len(value) == 255 and deletions.marker_of_source(value, long_source)
    assert not deletions.marker_of_source(value, JOBS)
    assert deletions.marker_of_source(deletions.marker("k", JOBS, {}), JOBS)
    assert len(deletions.name("k" * 256)) == 64
