"""The cron fields of a new schedule (schedules/cronsyntax.py through cron.check): each
refusal names the field, the value and the allowed range; `5L` is the last Friday (stored
as croniter's `L5`, which every croniter release and PerfectSched 0.1.0 read); what the
croniter releases read differently is refused with the reason."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from perfectschedd import InvalidInputError
from perfectschedd.schedules import cron


def refusal(expr: str) -> str:
    with pytest.raises(InvalidInputError) as refused:
        cron.check(expr)
    assert refused.value.field == "cron"
    message = str(refused.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("expr, message", [
    # too large
    ("61 * * * *", "cron: minute '61' is out of range 0-59"),
    ("* 24 * * *", "cron: hour '24' is out of range 0-23"),
    ("* * 32 * *", "cron: day of month '32' is out of range 1-31"),
    ("* * * 13 *", "cron: month '13' is out of range 1-12"),
    ("* * * * 8", "cron: day of week '8' is out of range 0-7"),
    ("0-60 * * * *", "cron: minute '60' in '0-60' is out of range 0-59"),
    # too small
    ("* * 0 * *", "cron: day of month '0' is out of range 1-31"),
    ("* * * 0 *", "cron: month '0' is out of range 1-12"),
    ("-1 * * * *", "cron: minute '-1': a range needs both ends (0-59)"),
    # bad step
    ("*/0 * * * *", "cron: minute step '0' in '*/0' must be at least 1"),
    ("* */x * * *", "cron: hour step 'x' in '*/x' is not a number"),
    ("* * 1-10/0 * *", "cron: day of month step '0' in '1-10/0' must be at least 1"),
    ("* * * */-1 *", "cron: month step '-1' in '*/-1' is not a number"),
    # bad name
    ("* * * foo *", "cron: month 'foo' is not a number 1-12 or a name JAN-DEC"),
    ("* * * * funday", "cron: day of week 'funday' is not a number 0-7 or a name SUN-SAT"),
    ("* * * JAN-FOO *", "cron: month 'FOO' in 'JAN-FOO' is not a number 1-12 or a name "
                        "JAN-DEC"),
    ("mon * * * *", "cron: minute 'mon' is not a number 0-59"),
    # the rest
    ("1,,2 * * * *", "cron: minute '1,,2' has an empty list item"),
    ("0 23-1 * * *", "cron: hour range '23-1' runs backwards: write 23,0-1"),
    ("0 0 * * 5#6", "cron: day of week '5#6': the week '6' is out of range 1-5"),
    ("0 0 * * L", "cron: day of week 'L' needs a day: 5L is the last Friday of the month"),
    ("0 0 15W * *", "W (nearest weekday) is not supported"),
    ("0 0 ? * *", "cron: day of month '?' is not supported: write *"),
    ("0 0 * * 5L,1", "cannot be listed with plain days"),
    # croniter would run these on the day of week alone (cron: either day)
    ("0 0 10 * 5#2", "cron: day of month '10' with day of week '5#2': croniter does not "
                     "read 5#2 beside a day of month as cron would (either day): make two "
                     "schedules"),
    ("0 0 L * 5L", "day of month 'L' with day of week '5L'"),
    ("0 0 */10 * L5", "day of month '*/10' with day of week 'L5'"),
    ("0 0 * * 1-5L", "L takes one day"),
    ("* * * *", "must have five fields"),
    ("@fortnightly", "unknown alias"),
])
def test_refusals_name_the_field_the_value_and_the_range(expr: str, message: str) -> None:
    assert message in refusal(expr)


def test_the_same_message_reaches_add(tmp_path: object) -> None:
    from perfectschedd.schedules.collection import open as open_schedules

    with open_schedules({"type": "rdb_compat", "url": f"sqlite:///{tmp_path}/s.db"}) as sc:
        with pytest.raises(InvalidInputError, match="^cron: minute '61' is out of range "
                                                    "0-59$"):
            sc.add("k", "t", "61 * * * *")
        assert sc.list() == []


def fridays(expr: str) -> list[str]:
    start = int(datetime(2026, 1, 1, tzinfo=UTC).timestamp())
    out, t = [], cron.first_at_or_after(expr, "UTC", start)
    for _ in range(4):
        out.append(datetime.fromtimestamp(t, UTC).strftime("%a %Y-%m-%d"))
        t = cron.next_after(expr, "UTC", t)
    return out


LAST_FRIDAYS = ["Fri 2026-01-30", "Fri 2026-02-27", "Fri 2026-03-27", "Fri 2026-04-24"]


@pytest.mark.parametrize("expr", ["0 0 * * 5L", "0 0 * * FRIL", "0 0 * * fril",
                                  "0 0 * * L5", "0 0 * * LFRI"])
def test_5L_is_the_last_friday_stored_as_croniter_reads_it(expr: str) -> None:
    assert cron.check(expr) == ("0 0 * * L5" if expr != "0 0 * * L5" else expr)
    assert fridays(expr) == LAST_FRIDAYS


@pytest.mark.parametrize("expr, first", [
    ("0 0 L * *", "Sat 2026-01-31"),             # last day of the month
    ("0 0 * * FRI#2", "Fri 2026-01-09"),         # second Friday
    ("0 0 * * 5#2", "Fri 2026-01-09"),
    ("0 0 * * 1#1,5#3", "Mon 2026-01-05"),
    ("0 0 * * 7", "Sun 2026-01-04"),             # 7 is Sunday
    ("0 0 * * 7-7", "Sun 2026-01-04"),
    ("0 0 * JAN-MAR MON-FRI", "Thu 2026-01-01"),
    ("5/15 * * * *", "Thu 2026-01-01"),
])
def test_accepted_forms(expr: str, first: str) -> None:
    cron.check(expr)
    assert fridays(expr)[0] == first


def test_stored_text_is_kept_unless_rewritten() -> None:
    assert cron.check(" 0  0 * * FRI#2 ") == "0  0 * * FRI#2"  # as given (stripped)
    assert cron.check("0 0 * * 7-7") == "0 0 * * 0"
    assert cron.check("@once") == "@once" and cron.check("@Hourly") == "@Hourly"


def test_rows_stored_before_still_evaluate() -> None:
    # What croniter reads but a new schedule may no longer use keeps working for rows
    # that hold it (they were stored by an older release or another host).
    for legacy in ("0 0 1-L * *", "0 0 10 * 5#2"):
        with pytest.raises(InvalidInputError):
            cron.check(legacy)
        assert cron.next_after(legacy, "UTC", 1_700_000_000) > 1_700_000_000
    # ... rewritten for croniter as before the rule came: every croniter release reads
    # 9-9 as 9 (croniter 7 alone would read `0 9-9 10 * 5#2` as every hour).
    assert cron.normalize("0 9-9 10 * 5#2") == "0 9 10 * 5#2"


def test_import_crontab_warns_with_the_same_reason() -> None:
    from perfectschedd.schedules import from_crontab

    done = from_crontab.convert("61 * * * * /bin/true\n0 0 * * 5L /bin/echo last\n",
                                name="t", system=False, user="root",
                                default_timezone="UTC")
    assert [w for w in done.warnings if "not imported" in w or "kept as a comment" in w] \
        == ["t:1: cron: minute '61' is out of range 0-59; kept as a comment"]
    assert "cron: 0 0 * * 5L" in done.text
