"""schedules/collection.py: the public API's validation.  Every bad input of SPEC is
refused with a message naming the field, and nothing already stored changes."""

from __future__ import annotations

import json
import pathlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import perfectschedd
from perfectschedd import (
    ConfigError,
    InvalidInputError,
    NotSupportedError,
    ScheduleCollection,
    ScheduleError,
)
from perfectschedd.vocabulary.fields import DATA_MAX, KEY_MAX

T0 = 1_700_002_800


def snapshot(sc: ScheduleCollection) -> list[dict[str, Any]]:
    return [i.as_dict() for i in sc.list()]


@pytest.fixture
def sc(sqlite_url: str) -> Iterator[ScheduleCollection]:
    with perfectschedd.open({"type": "rdb_compat", "url": sqlite_url}) as c:
        c.add("existing", "t", cron="0 * * * *", data={"keep": True}, now=T0)
        yield c


def test_public_names() -> None:
    for name in ("ScheduleError", "AlreadyFinishedError", "NotFoundError", "PreemptedError",
                 "AlreadyExistsError", "NotSupportedError", "ConfigError",
                 "ProcessStopError", "open", "ScheduleCollection", "Schedule", "Task"):
        assert hasattr(perfectschedd, name), name
    for child in ("AlreadyFinishedError", "NotFoundError", "PreemptedError",
                  "AlreadyExistsError", "NotSupportedError"):
        assert issubclass(getattr(perfectschedd, child), ScheduleError)
    assert not issubclass(ConfigError, ScheduleError)
    assert not issubclass(perfectschedd.ProcessStopError, ScheduleError)


BAD_ADDS: list[tuple[str, dict[str, Any]]] = [
    ("cron", {"cron": "not a cron"}),
    ("cron", {"cron": "61 * * * *"}),
    ("cron", {"cron": "* * * *"}),
    ("cron", {"cron": "@sometimes"}),
    ("cron", {"cron": ""}),
    ("cron", {"cron": None}),
    ("cron", {"cron": "0 0 30 2 *"}),  # parses, but never fires
    ("timezone", {"timezone": "Mars/Olympus"}),
    ("timezone", {"timezone": ""}),
    ("data", {"data": "[1, 2]"}),
    ("data", {"data": [1, 2]}),
    ("data", {"data": "not json"}),
    ("data", {"data": 42}),
    ("data", {"data": '"a string"'}),
    ("data", {"data": {"x": "y" * DATA_MAX}}),
    ("data", {"data": {"x": float("nan")}}),
    ("data", {"data": {"x": object()}}),
    ("key", {"key": ""}),
    ("key", {"key": "k" * (KEY_MAX + 1)}),
    ("key", {"key": "line\nbreak"}),
    ("key", {"key": 123}),
    ("type", {"type": ""}),
    ("delay", {"delay": -1}),
    ("delay", {"delay": 1.5}),
    ("delay", {"delay": "10"}),
    ("start", {"start": "tomorrow"}),
    ("at", {"at": -5}),
]


@pytest.mark.parametrize(("field", "change"), BAD_ADDS, ids=[f for f, _ in BAD_ADDS])
def test_bad_add_is_refused_naming_the_field(sc: ScheduleCollection, field: str,
                                             change: dict[str, Any]) -> None:
    before = snapshot(sc)
    request: dict[str, Any] = {"key": "new", "type": "t", "cron": "0 * * * *", "now": T0}
    request.update(change)
    with pytest.raises(InvalidInputError) as info:
        sc.add(**request)
    assert info.value.field == field
    assert str(info.value).startswith(f"{field}: ")
    assert snapshot(sc) == before
    # The same request against an existing key is refused the same way, not as a duplicate.
    if field != "key":
        request["key"] = "existing"
        with pytest.raises(InvalidInputError):
            sc.add(**request)
        assert snapshot(sc) == before


BAD_MODIFIES: list[tuple[str, dict[str, Any]]] = [
    ("cron", {"cron": "bad"}),
    ("timezone", {"timezone": "Nowhere/Land"}),
    ("data", {"data": "[]"}),
    ("delay", {"delay": -3}),
    ("type", {"type": ""}),
    ("at", {"at": -1}),
    ("at", {"at": "soon"}),
    ("modify", {}),
]


@pytest.mark.parametrize(("field", "change"), BAD_MODIFIES, ids=[f for f, _ in BAD_MODIFIES])
def test_bad_modify_changes_nothing(sc: ScheduleCollection, field: str,
                                   change: dict[str, Any]) -> None:
    task = sc.poll(now=T0 + 3600)
    assert task is not None
    before = snapshot(sc)
    with pytest.raises(InvalidInputError) as info:
        sc["existing"].modify(now=T0, **change)
    assert info.value.field == field
    assert snapshot(sc) == before
    task.finish()  # the holder's lease survived the refused modify


def test_modify_at_moves_the_next_run(sc: ScheduleCollection) -> None:
    """`at`: the next run then, as add's --at: a @once schedule's one occurrence moves
    with it; a cron schedule's next occurrence keeps its time and runs then."""
    due = sc["existing"].info().next_time
    sc["existing"].modify(at=T0 + 7200, now=T0)
    info = sc["existing"].info()
    assert (info.next_time, info.next_run_time) == (due, T0 + 7200)
    sc.add("one", "t", "@once", at=T0 + 60, now=T0)
    sc["one"].modify(at=T0 + 600, data={"v": 2}, now=T0)
    info = sc["one"].info()
    assert (info.next_time, info.next_run_time, info.data) == (T0 + 600, T0 + 600, {"v": 2})
    assert sc.poll(now=T0 + 599) is None
    task = sc.poll(now=T0 + 600)
    assert task is not None and task.key == "one"
    task.finish()
    # Through the commands, as the daemon's dispatch calls them.
    from perfectschedd.control import commands

    sc.add("two", "t", "@once", at=T0 + 60, now=T0)
    shown = commands.execute(sc, "modify", {"key": "two", "at": T0 + 90}, now=T0)
    assert (shown["next_time"], shown["next_run_time"]) == (T0 + 90, T0 + 90)


def test_bad_key_lookups_are_refused(sc: ScheduleCollection) -> None:
    for key in ("", "x" * (KEY_MAX + 1)):
        with pytest.raises(InvalidInputError, match="^key: "):
            sc[key]


def test_add_many_with_one_bad_item_stores_nothing(sc: ScheduleCollection) -> None:
    before = snapshot(sc)
    good = [{"key": f"g{i}", "type": "t", "cron": "* * * * *", "now": T0} for i in range(5)]
    with pytest.raises(InvalidInputError, match="^timezone: "):
        sc.add_many(good + [{"key": "bad", "type": "t", "cron": "* * * * *",
                             "timezone": "Bad/Zone"}])
    with pytest.raises(InvalidInputError, match="^key: "):
        sc.add_many(good + [dict(good[0])])  # a duplicate inside the request
    assert snapshot(sc) == before


def test_limits_are_inclusive_on_every_backend(db_url: str) -> None:
    """The largest key and data accepted are stored and read back intact."""
    with perfectschedd.open({"type": "rdb_compat", "url": db_url}) as sc:
        key = "☃" + "k" * (KEY_MAX - 1)
        filler = DATA_MAX - len(json.dumps({"x": ""}, separators=(",", ":")))
        data = {"x": "d" * filler}
        sc.add(key, "t" * 256, cron="* * * * *", data=data, timezone="America/Argentina/"
               "ComodRivadavia", now=T0)
        info = sc[key].info()
        assert info.key == key and info.data == data
        task = sc.poll(now=T0 + 60)
        assert task is not None and task.key == key and task.data == data


@pytest.mark.parametrize(("raw", "error", "field"), [
    ({"type": "redis", "url": "sqlite:///x.db"}, ConfigError, "type"),
    ({"type": "rdb", "url": "sqlite:///x.db"}, NotSupportedError, "type"),
    ({"url": "sqlite:///x.db"}, ConfigError, "type"),
    ({"type": "rdb_compat", "url": "mongodb://h/db"}, ConfigError, "url"),
    ({"type": "rdb_compat"}, ConfigError, "url"),
])
def test_bad_backend_is_refused(tmp_path: pathlib.Path, raw: dict[str, Any],
                                error: type[Exception], field: str) -> None:
    with pytest.raises(error) as info:
        perfectschedd.open(raw)
    assert str(info.value).startswith(f"{field}: ")
    assert list(tmp_path.iterdir()) == []


def test_open_from_yaml_path(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "c.yml"
    path.write_text(f"type: rdb_compat\nurl: sqlite:///{tmp_path}/db.sqlite\n"
                    f"timezone: Asia/Tokyo\n")
    with perfectschedd.open(str(path)) as sc:
        sc.add("k", "t", cron="0 9 * * *", now=T0)
        assert sc["k"].info().timezone == "Asia/Tokyo"  # the config's default zone
        # 09:00 JST = 00:00 UTC; T0 is 23:00 UTC
        assert sc["k"].info().next_time == T0 + 3600


def _raises(fn: Callable[[], object]) -> BaseException:
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001
        return exc
    raise AssertionError("did not raise")


def test_commands_layer_refuses_the_same_way(sc: ScheduleCollection) -> None:
    from perfectschedd.control import commands

    before = snapshot(sc)
    exc = _raises(lambda: commands.execute(sc, "add", {"key": "n", "type": "t",
                                                       "cron": "0 * * * *",
                                                       "data": [1]}, now=T0))
    assert isinstance(exc, InvalidInputError) and exc.field == "data"
    exc = _raises(lambda: commands.execute(sc, "frobnicate", {}))
    assert isinstance(exc, InvalidInputError) and exc.field == "command"
    assert snapshot(sc) == before
    listed = commands.execute(sc, "list", {})
    assert list(listed[0]) == ["key", "type", "cron", "delay", "timezone", "next_time",
                               "next_run_time", "data", "misfire", "grace", "max_attempts",
                               "retry_wait", "jitter", "timeout", "notify", "concurrency",
                               "metrics", "source", "creator", "paused", "last_outcome",
                               "attempt", "state"]


def test_older_hosts_are_named_and_a_feature_they_cannot_honour_is_refused(
        sc: ScheduleCollection) -> None:
    """SPEC "Upgrades": hosts of an older release are found both ways (a hosts row with
    its version; a 0.1.0 node, which records no row, by the lease it holds), and a refusal
    names them in one line."""
    now = time.time()
    assert sc.older_hosts(now) == []
    sc.refuse_on_older_hosts("--feature", now)  # nobody older: nothing refused
    sc.store.record_host("same", perfectschedd.__version__, 1, now - 60, now)
    sc.store.record_host("gone", "0.1.9", 2, now - 900, now - 600)  # not live
    sc.store.record_host("older", "0.1.9", 3, now - 60, now - 1)
    sc.add("k", "t", cron="* * * * *", next_run_time=int(now) - 1)
    assert "k" in [c.key for c in sc.store.claim(now, 30, "ancient:42", 5)]
    assert sc.older_hosts(now) == ["ancient (0.1.0)", "older (0.1.9)"]
    with pytest.raises(NotSupportedError) as refused:
        sc.refuse_on_older_hosts("--feature", now)
    message = str(refused.value)
    assert "\n" not in message and "--feature" in message
    assert "ancient (0.1.0), older (0.1.9)" in message and "same" not in message
