"""pause/resume of several keys, --prefix and --all (control/commands.py), on each
database: all or nothing, the cluster-wide pause's marker and meta row, skip-missed.
Whole daemons (restarts, two hosts, 0.1.0 beside) are tests/daemon/test_pause_all.py's."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

import perfectschedd
from perfectschedctl import cli
from perfectschedd.control import commands, registry
from perfectschedd.control.auth import Caller
from perfectschedd.errors import InvalidInputError, NotFoundError, PermissionDeniedError
from perfectschedd.schedules.collection import ScheduleCollection
from perfectschedd.vocabulary.fields import PAUSED_ALL_REASON

ROOT = Caller.of(0, [0])
MEMBER = Caller.of(65534, [65534])  # a control_group member: not root
MINUTE = "* * * * *"


@pytest.fixture
def sc(db_url: str) -> Iterator[ScheduleCollection]:
    with perfectschedd.open({"type": "rdb_compat", "url": db_url}) as sc:
        yield sc


def run(sc: ScheduleCollection, cmd: str, caller: Caller = ROOT, **args: Any) -> Any:
    return commands.execute(sc, cmd, args, caller=caller)


def paused(sc: ScheduleCollection) -> dict[str, tuple[bool, str | None]]:
    return {i.key: (bool(i.paused), i.paused_reason) for i in sc.list()}


def stored(sc: ScheduleCollection) -> list[Any]:
    return sorted((r.key, r.paused, r.paused_reason, r.next_time, r.next_run_time)
                  for r in sc.store.rows())


def add(sc: ScheduleCollection, *keys: str, start: int | None = None,
        source: str | None = None) -> None:
    for key in keys:
        sc.add(key, "t", MINUTE, start=start, source=source)


def test_several_keys_and_a_prefix(sc: ScheduleCollection) -> None:
    add(sc, "a", "b", "app.x", "app.y", "APP.z", "other")
    sc["app.x"].run_now()  # an extra run: only --all pauses it
    assert run(sc, "pause", keys=["a", "b", "a"]) == {"paused": ["a", "b"], "count": 2}
    got = run(sc, "pause", prefix="app.")
    assert got == {"paused": ["app.x", "app.y"], "count": 2}  # the exact prefix, case too
    shown = paused(sc)
    assert {k for k, (p, _) in shown.items() if p} == {"a", "b", "app.x", "app.y"}
    assert all(reason is None for _, reason in shown.values())  # paused on their own
    assert run(sc, "resume", keys=["a", "app.y"]) == {"resumed": ["a", "app.y"],
                                                      "count": 2}
    assert {k for k, (p, _) in paused(sc).items() if p} == {"b", "app.x"}
    # one key: the answer as before (the schedule, shown)
    one = run(sc, "pause", key="other")
    assert one["key"] == "other" and one["paused"] is True


@pytest.mark.parametrize("args, error", [
    ({}, "pause what? give KEY..., --prefix PREFIX or --all"),
    ({"keys": ["a"], "all": True}, "give one of KEY..., --prefix or --all, not KEY... and "
                                   "--all"),
    ({"key": "a", "prefix": "a"}, "not KEY and --prefix"),
    ({"prefix": "a", "all": True}, "not --prefix and --all"),
    ({"all": "yes"}, "all: must be true or false"),
    ({"keys": "a"}, "keys: must be a list of 1 to"),
    ({"keys": ["a", 3]}, "key"),
    ({"keys": ["a", "nosuch", "b", "gone"]}, "schedule(s) not found: nosuch, gone; "
                                             "nothing changed"),
    ({"prefix": "zz"}, "no schedule key starts with 'zz'; nothing changed"),
    ({"prefix": ""}, "prefix: must be a non-empty string"),
    ({"keys": [], "all": False}, "keys: must be a list of 1 to"),
    ({"keys": 0}, "keys: must be a list of 1 to"),
    ({"all": 0}, "all: must be true or false"),
    ({"keys": None, "prefix": {"a": 1}}, "prefix"),
    ({"key": "nosuch"}, "schedule 'nosuch' not found"),
])
def test_bad_requests_change_nothing(sc: ScheduleCollection, args: dict[str, Any],
                                     error: str) -> None:
    add(sc, "a", "b")
    before = stored(sc)
    for cmd in ("pause", "resume"):
        with pytest.raises((InvalidInputError, NotFoundError)) as exc:
            run(sc, cmd, **args)
        assert error.replace("pause what", f"{cmd} what") in str(exc.value)
        assert "\n" not in str(exc.value)
        assert stored(sc) == before
    with pytest.raises(InvalidInputError, match="skip_missed: must be true or false"):
        run(sc, "resume", key="a", skip_missed="yes")
    assert sc.paused_all() is None and stored(sc) == before


def test_a_file_managed_key_among_several_refuses_them_all(sc: ScheduleCollection) -> None:
    add(sc, "app.a", "app.b")
    add(sc, "app.f", source="file:app.yml")
    before = stored(sc)
    for args in ({"keys": ["app.a", "app.f"]}, {"prefix": "app."}):
        with pytest.raises(PermissionDeniedError,
                           match="app.f is managed by .*/app.yml: edit it and reload"):
            run(sc, "pause", **args)
        assert stored(sc) == before
        with pytest.raises(PermissionDeniedError, match="only root may force"):
            run(sc, "pause", MEMBER, force=True, **args)
        assert stored(sc) == before
    assert run(sc, "pause", prefix="app.", force=True)["count"] == 3
    # Forced, the file's schedule is detached from it in the same write.
    assert {r.key: r.source for r in sc.rows_of(keys=["app.a", "app.f"])}["app.f"] \
        == "forced:file:app.yml"


def test_pause_all_marks_rows_and_resume_all_leaves_their_own(
        sc: ScheduleCollection) -> None:
    now = int(time.time())
    add(sc, "a", "own", "exhausted")
    add(sc, "f", source="file:x.yml")
    run(sc, "pause", key="own")
    sc.store.update("exhausted", {"paused": 1, "paused_reason": "paused by perfectschedd: "
                                  "no next occurrence"}, take_lease=False)
    # A member of control_group pauses everything, file-managed schedules included, with
    # no --force: the pause changes no schedule (auth.py says why).
    with pytest.raises(PermissionDeniedError, match="only root may force"):
        run(sc, "pause", MEMBER, all=True, force=True)
    assert sc.paused_all() is None
    got = run(sc, "pause", MEMBER, all=True)
    assert got["all"] is True and got["paused"] == 2 and got["by"] == MEMBER.name
    assert now - 5 <= got["since"] <= now + 5
    assert paused(sc)["a"] == paused(sc)["f"] == (True, PAUSED_ALL_REASON)
    assert paused(sc)["own"] == (True, None)
    # A schedule added (or run) while everything is paused waits for resume --all.
    add(sc, "new")
    run_key = sc["a"].run_now()
    assert paused(sc)["new"] == paused(sc)[run_key] == (True, PAUSED_ALL_REASON)
    again = run(sc, "pause", all=True)  # idempotent: keeps since and by
    assert (again["paused"], again["since"], again["by"]) == (0, got["since"], MEMBER.name)
    # pause KEY of a schedule held by --all: paused on its own from then on
    run(sc, "pause", key="new")
    assert sc.count_paused(with_all=True) == 3 and sc.count_paused(with_all=False) == 3
    done = run(sc, "resume", MEMBER, all=True)
    assert done == {"all": True, "resumed": 3, "skipped_occurrences": 0,
                    "paused_on_their_own": 3}
    shown = paused(sc)
    assert shown["a"] == shown["f"] == shown[run_key] == (False, None)
    assert shown["own"] == shown["new"] == (True, None)
    assert shown["exhausted"][0] is True and sc.paused_all() is None
    # resume --all with nothing paused by --all: nothing to do, no error
    assert run(sc, "resume", all=True)["resumed"] == 0


def test_join_pause_all_pauses_a_row_added_as_the_pause_came(sc: ScheduleCollection) -> None:
    """The insert-then-check of insert_rows: a row stored unpaused by an add that read no
    pause, with the pause recorded meanwhile, is paused by the check after the insert."""
    add(sc, "early")
    sc.store.pause_all('{"since": 1, "by": "x"}')
    sc.store.insert(sc.build_row("late", "t", MINUTE))  # as if read before the pause
    assert sc.store.join_pause_all(["late", "early"]) == 1
    assert paused(sc)["late"] == (True, PAUSED_ALL_REASON)
    sc.store.resume_all()
    assert sc.store.join_pause_all(["late"]) == 0  # no pause: nothing to join


def test_resume_skip_missed_moves_on_and_records_skipped(sc: ScheduleCollection) -> None:
    now = int(time.time())
    start = now - 600
    add(sc, "k", "own", start=start)
    add(sc, "future", start=now + 3600)
    run(sc, "pause", key="own")
    run(sc, "pause", all=True)
    before = {r.key: r for r in sc.store.rows()}
    done = run(sc, "resume", all=True, skip_missed=True)
    rows = {r.key: r for r in sc.store.rows()}
    k = rows["k"]
    assert k.next_time >= now and k.next_time % 60 == 0 and k.next_time - now <= 120
    assert k.next_run_time == k.next_time and not k.paused
    missed = list(range(before["k"].next_time, k.next_time, 60))
    assert len(missed) >= 10 and done["skipped_occurrences"] == len(missed)
    history = sc.history("k", 100)
    assert sorted(h["scheduled_time"] for h in history) == missed
    assert {(h["outcome"], h["error"]) for h in history} == {
        ("skipped", "not run: resumed with --skip-missed")}
    # paused on its own: neither resumed nor moved; a future one: not moved
    assert rows["own"] == before["own"]
    assert (rows["future"].next_time, rows["future"].paused) == (before["future"].next_time,
                                                                 False)
    assert sc.history("own", 10) == [] and sc.history("future", 10) == []
    # resume KEY --skip-missed: the same, one key
    run(sc, "pause", key="own")
    one = run(sc, "resume", key="own", skip_missed=True)
    assert one["paused"] is False and one["skipped_occurrences"] >= 10
    assert one["next_time"] >= now


def test_resume_skip_missed_keeps_an_interval_s_grid(sc: ScheduleCollection) -> None:
    # @every 7s from a start off every round number: the next occurrence after the
    # resume is still start + k * 7, not the moment of the resume.
    start = int(time.time()) - 600 + 3
    sc.add("grid", "t", "@every 7s", start=start)
    run(sc, "pause", key="grid")
    # At a fixed moment: start + 598.5 moves on to start + 602 (86 x 7), not to 599.
    from perfectschedd.schedules import missed
    stored = sc.store.get("grid")
    assert stored is not None
    plan = missed.skip(stored, start + 598.5)
    assert plan is not None and plan.next_time == start + 602, plan
    done = run(sc, "resume", key="grid", skip_missed=True)
    row = sc.store.get("grid")
    assert row is not None and row.next_time >= time.time() - 1
    assert (row.next_time - start) % 7 == 0, (row.next_time, start)
    missed = sorted(h["scheduled_time"] for h in sc.history("grid", 1000))
    assert done["skipped_occurrences"] == len(missed) >= 80
    assert missed == list(range(start, row.next_time, 7))


def test_signals_name_what_changed() -> None:
    pause = registry.COMMANDS["pause"]
    assert pause.changes({"keys": ["a", "b"]}, {"paused": ["a", "b"], "count": 2}) == [
        ("a", "paused"), ("b", "paused")]
    assert pause.changes({"all": True}, {"all": True, "paused": 7}) == [("*", "paused")]
    assert pause.changes({"key": "a"}, {"key": "a", "paused": True}) == [("a", "paused")]


def test_cli_sends_one_key_as_before_and_several_as_keys() -> None:
    parser = cli.build_parser()
    assert cli.request_of(parser.parse_args(["pause", "a"])) == ("pause", {"key": "a"})
    assert cli.request_of(parser.parse_args(["pause", "a", "b"])) == (
        "pause", {"keys": ["a", "b"]})
    assert cli.request_of(parser.parse_args(["resume", "--all", "--skip-missed"])) == (
        "resume", {"all": True, "skip_missed": True})
    assert cli.request_of(parser.parse_args(["pause", "--prefix", "app."])) == (
        "pause", {"prefix": "app."})


def test_cli_bad_input_is_one_line_and_exit_1(sqlite_url: str, tmp_path: Any,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "c.yml"
    config.write_text(f"type: rdb_compat\nurl: {sqlite_url}\n")
    with perfectschedd.open(str(config)) as sc:
        add(sc, "a", "b")
        before = stored(sc)
        for argv in (["pause"], ["pause", "a", "--all"], ["resume", "a", "nosuch"],
                     ["resume", "--prefix", "x", "--all"]):
            capsys.readouterr()
            assert cli.main(["-c", str(config), *argv]) == 1
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and err.startswith("perfectschedctl: "), err
            assert stored(sc) == before


def test_schedules_files_converge_while_everything_is_paused(
        sc: ScheduleCollection) -> None:
    """Files converge as always; what they add is paused with everything, what they change
    keeps its pause, and resume --all releases both."""
    from perfectschedd.schedules.converge import converge
    from perfectschedd.schedules.files import check_entry

    def entries(*crons: tuple[str, str]) -> dict[str, Any]:
        return {key: check_entry({"key": key, "cron": c, "type": "t"}, "file:jobs.yml",
                                 need_user_support=False) for key, c in crons}

    converge(sc, entries(("kept", "0 3 * * *"), ("gone", "0 4 * * *")), [])
    run(sc, "pause", all=True)
    converge(sc, entries(("kept", "0 5 * * *"), ("new", "0 6 * * *")), ["file:jobs.yml"])
    shown = paused(sc)
    assert shown == {"kept": (True, PAUSED_ALL_REASON), "new": (True, PAUSED_ALL_REASON)}
    assert sc["kept"].info().cron == "0 5 * * *"
    run(sc, "resume", all=True)
    assert paused(sc) == {"kept": (False, None), "new": (False, None)}
