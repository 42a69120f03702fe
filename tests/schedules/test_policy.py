"""schedules/policy.py: validation of every option (bad values name the option), the
stored form (to_text/from_text), and the arithmetic (jitter offsets, the due time,
back-off, give-up)."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from typing import Any

import pytest

import perfectschedd
from perfectschedd.errors import InvalidInputError
from perfectschedd.schedules import missed, overdue, policy, preview
from perfectschedd.schedules.collection import ScheduleInfo
from perfectschedd.schedules.policy import DEFAULT, OPTIONS, Policy, check, from_text


def test_defaults_store_as_null_and_read_back_as_defaults() -> None:
    assert DEFAULT.to_text() is None
    assert DEFAULT.to_fields_changed() == {}
    assert from_text(None) is DEFAULT
    assert from_text("") is DEFAULT
    assert set(OPTIONS) == {"misfire", "grace", "max_attempts", "retry_wait", "jitter",
                            "timeout", "notify", "concurrency", "metrics"}


ROUND_TRIPS = [
    {"misfire": "latest"},
    {"misfire": "skip", "grace": 0},
    {"grace": 3600, "max_attempts": 5, "retry_wait": 30},
    {"jitter": 600, "timeout": 2.5},
    {"misfire": "all", "grace": 315_360_000, "max_attempts": 1_000_000,
     "retry_wait": 0, "jitter": 7 * 86400, "timeout": 0.001},
    {"concurrency": "allow"},
    {"concurrency": "replace", "timeout": 60.5},
    {"concurrency": "forbid"},
    {"metrics": True},
    {"metrics": False, "concurrency": "allow"},
]


@pytest.mark.parametrize("options", ROUND_TRIPS)
def test_to_text_from_text_round_trip(options: dict[str, Any]) -> None:
    p = DEFAULT.changed(options)
    text = p.to_text()
    # Only what differs from the defaults is stored, as compact sorted JSON.
    expected = {k: v for k, v in options.items() if v != getattr(DEFAULT, k)}
    if not expected:
        assert text is None
    else:
        assert text is not None and json.loads(text) == expected
        assert text == json.dumps(expected, separators=(",", ":"), sort_keys=True)
    assert from_text(text) == p
    assert from_text(text).as_fields() == {**DEFAULT.as_fields(), **options}


@pytest.mark.parametrize("text", ["not json", "[1, 2]", '"a string"', "42", "{", "null",
                                  '{"misfire": "sometimes"}', '{"grace": -1}'])
def test_unreadable_stored_text_counts_as_the_defaults(text: str) -> None:
    assert from_text(text) == DEFAULT


def test_concurrency_overlaps_only_when_allowed_or_replacing() -> None:
    assert not DEFAULT.overlaps and DEFAULT.concurrency == "forbid"
    assert Policy(concurrency="allow").overlaps and Policy(concurrency="replace").overlaps
    assert DEFAULT.changed({"concurrency": "default"}) == DEFAULT


def test_stored_text_ignores_unknown_options_and_keeps_the_known_ones() -> None:
    assert from_text('{"misfire":"skip","future_option":7}') == Policy(misfire="skip")


BAD: list[tuple[str, Any, str]] = [
    ("misfire", "sometimes", "must be one of all, latest, skip"),
    ("misfire", "", "must be one of"),
    ("misfire", 1, "must be one of"),
    ("misfire", "ALL", "must be one of"),
    ("grace", -1, "must be from 0 to 315360000"),
    ("grace", 315_360_001, "must be from 0 to 315360000"),
    ("grace", 1.5, "must be a whole number"),
    ("grace", "ten", "must be a number of seconds"),
    ("grace", True, "must be a number"),
    ("grace", [], "must be a number"),
    ("grace", math.inf, "must be a number"),
    ("grace", math.nan, "must be a number"),
    ("max_attempts", -1, "must be from 0 to 1000000"),
    ("max_attempts", 1_000_001, "must be from 0 to 1000000"),
    ("max_attempts", "three", "must be a whole number"),
    ("max_attempts", 2.5, "must be a whole number"),
    ("retry_wait", -5, "must be from 0"),
    ("retry_wait", "1e99", "must be from 0 to 315360000"),
    ("jitter", 7 * 86400 + 1, "must be from 0 to 604800"),
    ("jitter", {"a": 1}, "must be a number"),
    ("timeout", 0, "must be from 0.001 to 315360000"),
    ("timeout", -1.0, "must be from 0.001"),
    ("timeout", "fast", "must be a number of seconds"),
    ("timeout", False, "must be a number"),
    ("concurrency", "parallel", "must be one of forbid, allow, replace"),
    ("concurrency", "Allow", "must be one of"),
    ("concurrency", 2, "must be one of"),
    ("metrics", "maybe", "must be true or false, got 'maybe'"),
    ("metrics", 2, "must be true or false"),
    ("colour", "blue", "not a schedule policy option"),
]


@pytest.mark.parametrize(("name", "value", "message"), BAD,
                         ids=[f"{n}={v!r}" for n, v, _ in BAD])
def test_bad_values_are_refused_naming_the_option(name: str, value: Any, message: str) -> None:
    with pytest.raises(InvalidInputError) as info:
        check({name: value})
    assert info.value.field == name
    assert name in str(info.value)
    assert message in str(info.value)
    # A policy is never changed by a refused option.
    p = Policy(misfire="latest", grace=5)
    with pytest.raises(InvalidInputError):
        p.changed({name: value})
    assert p == Policy(misfire="latest", grace=5)


def test_strings_from_a_command_line_are_converted() -> None:
    assert check({"grace": "60", "timeout": "2.5", "max_attempts": "3", "jitter": "1e2",
                  "retry_wait": "0"}) == {"grace": 60, "timeout": 2.5, "max_attempts": 3,
                                          "jitter": 100, "retry_wait": 0}
    out = check({"timeout": 5, "grace": 7.0})
    assert out == {"timeout": 5.0, "grace": 7}
    assert isinstance(out["timeout"], float) and isinstance(out["grace"], int)


def test_none_resets_an_option_to_its_default() -> None:
    p = Policy(misfire="skip", grace=30, max_attempts=4, timeout=9.0)
    q = p.changed({"grace": None, "timeout": None})
    assert q == Policy(misfire="skip", max_attempts=4)
    assert q.to_fields_changed() == {"misfire": "skip", "max_attempts": 4}


def test_effective_grace() -> None:
    assert Policy().effective_grace() is None
    assert Policy(misfire="latest").effective_grace() is None
    assert Policy(misfire="skip").effective_grace() == policy.SKIP_GRACE
    assert Policy(misfire="skip", grace=0).effective_grace() == 0
    assert Policy(grace=42).effective_grace() == 42


def test_jitter_offset_is_fixed_per_key_and_within_bounds() -> None:
    p = Policy(jitter=600)
    offsets = {k: p.offset(k) for k in (f"key-{i}" for i in range(200))}
    assert all(0 <= o < 600 for o in offsets.values())
    assert len(set(offsets.values())) > 100  # spread, not one value for all
    assert {k: Policy(jitter=600).offset(k) for k in offsets} == offsets  # deterministic
    assert Policy(jitter=0).offset("key-1") == 0
    assert Policy(jitter=1).offset("key-1") == 0
    assert policy.jitter_offset("k\udcff", 60) in range(60)  # a lone surrogate still hashes


def test_the_due_time_is_the_occurrence_then_the_delay_then_the_keys_jitter() -> None:
    """The one rule every reader of a due time calls (add, modify, finish, catch-up,
    resume --skip-missed, overdue, `next`)."""
    assert policy.due_time(1_000, "k", 0, 0) == 1_000
    assert policy.due_time(1_000, "k", 30, 0) == 1_030
    assert policy.due_time(1_000, "k", 30, 1) == 1_030  # a jitter of 1 s moves nothing
    # The key's offset is fixed: every host and every release computes the same one.
    assert policy.jitter_offset("k", 600) == 75
    assert policy.jitter_offset("nightly", 600) == 572
    assert policy.due_time(1_000, "k", 30, 600) == 1_000 + 30 + 75
    assert policy.due_time(1_000, "nightly", 0, 600) == 1_572
    assert policy.due_shift("k", 30, 600) == 105
    assert Policy(jitter=600).offset("k") == 75  # the policy's own view agrees


def test_every_reader_of_a_due_time_takes_the_rule(sqlite_url: str) -> None:
    """add, resume --skip-missed, overdue and `next` agree with policy.due_time for a
    schedule with a delay and a jitter (finish: test_task.py; catch-up: test_catchup.py)."""
    t0 = 1_700_002_800  # a whole hour (UTC)
    due = functools.partial(policy.due_time, key="nightly", delay=30, jitter=600)
    with perfectschedd.open({"type": "rdb_compat", "url": sqlite_url}) as sc:
        row = sc.build_row("nightly", "t", "0 * * * *", delay=30, jitter=600, now=t0 + 1)
    assert (row.next_time, row.next_run_time) == (t0 + 3600, due(t0 + 3600))
    skip = missed.skip(row, t0 + 4 * 3600 + 600)  # 10 min past the hour: not yet due
    assert skip is not None and skip.next_run_time == due(skip.next_time)
    assert skip.next_time == t0 + 4 * 3600
    retried = dataclasses.replace(row, attempt=1, next_run_time=t0 + 86400)
    assert overdue.due_of(retried) == due(t0 + 3600)
    shown = preview.of_schedule({**ScheduleInfo.from_row(row).as_dict(), "owner": None}, 3)
    assert [f.run_time for f in shown[1:]] == [due(f.scheduled_time) for f in shown[1:]]


def test_backoff_doubles_up_to_the_cap() -> None:
    p = Policy(retry_wait=10)
    assert [p.backoff(a, 999, 100) for a in (1, 2, 3, 4, 5)] == [10, 20, 40, 80, 100]
    assert p.backoff(0, 999, 100) == 10
    assert p.backoff(10_000, 999, 100) == 100  # no overflow on a huge attempt
    # Without its own wait: the configuration's.
    assert Policy().backoff(2, 30, 3600) == 60
    # A base above the cap is kept, not cut to the cap.
    assert Policy(retry_wait=500).backoff(3, 0, 100) == 500
    assert Policy(retry_wait=0).backoff(5, 30, 3600) == 0.0


def test_gives_up_after_max_attempts_only() -> None:
    assert not Policy().gives_up(10**6)
    p = Policy(max_attempts=3)
    assert [p.gives_up(a) for a in (1, 2, 3, 4)] == [False, False, True, True]
