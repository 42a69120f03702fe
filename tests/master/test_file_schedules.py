"""master/file_schedules.py (FileSchedules): the schedules files a daemon loads and
applies, on a real SQLite file: what an apply logs, a broken file or a vanished directory
keeping its schedules, another host's change reported once, never written back."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

import perfectschedd
from perfectschedd.master.file_schedules import FileSchedules
from perfectschedd.schedules.collection import ScheduleCollection


@pytest.fixture
def sc(sqlite_url: str) -> Iterator[ScheduleCollection]:
    with perfectschedd.open({"type": "rdb_compat", "url": sqlite_url,
                             "timezone": "Europe/Paris"}) as c:
        yield c


def rows(sc: ScheduleCollection) -> dict[str, Any]:
    return {i.key: i.as_dict() for i in sc.list()}


def write(path: Path, items: list[dict[str, Any]] | str) -> None:
    path.write_text(items if isinstance(items, str) else yaml.safe_dump(items))


def test_file_schedules_apply_and_a_broken_file_keeps_its_schedules(
        sc: ScheduleCollection, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    sdir = tmp_path / "schedules.d"
    sdir.mkdir(mode=0o755)
    write(sdir / "jobs.yml", [{"key": "a", "cron": "@daily", "type": "t"},
                              {"key": "b", "cron": "@hourly", "type": "t"}])
    write(sdir / "other.yml", [{"key": "c", "cron": "@weekly", "type": "t"}])
    fs = FileSchedules()
    config = dataclasses.replace(sc.config, schedules_dir=str(sdir))
    fs.load(config)
    assert fs.take_pending() and not fs.take_pending()  # due once
    caplog.set_level(logging.INFO, "perfectschedd")
    fs.apply(sc)
    assert set(rows(sc)) == {"a", "b", "c"}
    assert "schedules files: applied 3 entries from 2 file(s): 3 added, 0 changed, " \
        "0 removed" in caplog.text

    # jobs.yml broken: its schedules stay; other.yml emptied: c goes.
    write(sdir / "jobs.yml", "- key: a\n  cron: [unclosed\n")
    write(sdir / "other.yml", [])
    fs.load(config)
    assert fs.take_pending()
    fs.apply(sc)
    assert set(rows(sc)) == {"a", "b"}
    assert "schedules file rejected, its schedules stay as they were" in caplog.text

    # Another host's change is logged once, not written back.
    sc["a"].modify(cron="1 1 * * *")
    caplog.clear()
    fs.apply(sc)
    fs.apply(sc)
    assert caplog.text.count("schedules files: differs a") == 1
    assert sc["a"].info().cron == "1 1 * * *"


def test_file_schedules_without_a_directory_hold_nothing(
        sc: ScheduleCollection, tmp_path: Path) -> None:
    fs = FileSchedules()
    config = dataclasses.replace(sc.config, schedules_dir=str(tmp_path / "missing"))
    assert fs.load(config).routes == config.routes
    fs.apply(sc)
    assert rows(sc) == {}
    assert fs.applied == {}


def test_a_directory_that_vanished_deletes_nothing_an_emptied_one_does(
        sc: ScheduleCollection, tmp_path: Path) -> None:
    """Issue 39 item 2: a schedules_dir gone (the default, which the file need not name)
    keeps its files' schedules as they were; emptied, it removes them."""
    sdir = tmp_path / "schedules.d"
    sdir.mkdir(mode=0o755)
    write(sdir / "jobs.yml", [{"key": "a", "cron": "@daily", "type": "t"}])
    fs = FileSchedules()
    config = dataclasses.replace(sc.config, schedules_dir=str(sdir))
    fs.load(config)
    fs.apply(sc)
    before = rows(sc)
    assert set(before) == {"a"}
    (sdir / "jobs.yml").rename(tmp_path / "jobs.yml")
    sdir.rmdir()
    fs.load(config)
    fs.apply(sc)
    assert rows(sc) == before
    sdir.mkdir(mode=0o755)
    fs.load(config)
    fs.apply(sc)
    assert rows(sc) == {}
