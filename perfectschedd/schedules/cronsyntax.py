"""The five cron fields as a new schedule may write them: checked field by field, so that
a refusal names the field, the value and the allowed range; the text to store, which
croniter 1.3.5 (Debian 12, and so PerfectSched 0.1.0) reads; and the text croniter
evaluates (for_croniter), which croniter 1.3.5 and 7 read alike.

    field          values                        also
    minute         0-59
    hour           0-23
    day of month   1-31                          L (the last day of the month)
    month          1-12, JAN-DEC
    day of week    0-7 (0 and 7: Sunday), SUN-SAT  N#K (the K-th day N of the month,
                                                 K 1-5), NL or LN (the last day N)
    each field: *, N, N-M, with /STEP after * or N-M (or N: from N to the end), and
    lists of them separated by commas.

Refused with a reason, because the croniter releases disagree on them (hosts would run a
schedule at different times): W (nearest weekday), ?, ranges that run backwards (23-1),
N#K or NL beside plain days in one day-of-week list.
Quartz's `5L` (last Friday) is stored as croniter's `L5`, which every release reads.
"""

from __future__ import annotations

from dataclasses import dataclass

from perfectschedd.errors import InvalidInputError

_MONTHS = ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec")
_DAYS = ("sun", "mon", "tue", "wed", "thu", "fri", "sat")


@dataclass(frozen=True)
class Field:
    name: str
    low: int
    high: int
    names: dict[str, int]
    names_shown: str = ""

    def value(self, text: str, item: str) -> int:
        """One number (or name) of the field, in its range."""
        word = text.lower()
        if word in self.names:
            return self.names[word]
        if not _number(text):
            also = f" or a name {self.names_shown}" if self.names else ""
            where = f" in {item!r}" if item != text else ""
            raise _refuse(f"{self.name} {text!r}{where} is not a number {self.low}-"
                          f"{self.high}{also}")
        number = int(text)
        if not self.low <= number <= self.high:
            where = f" in {item!r}" if item != text else ""
            raise _refuse(f"{self.name} {text!r}{where} is out of range {self.low}-{self.high}")
        return number


MINUTE = Field("minute", 0, 59, {})
HOUR = Field("hour", 0, 23, {})
DAY_OF_MONTH = Field("day of month", 1, 31, {})
MONTH = Field("month", 1, 12, {n: i + 1 for i, n in enumerate(_MONTHS)}, "JAN-DEC")
DAY_OF_WEEK = Field("day of week", 0, 7, {n: i for i, n in enumerate(_DAYS)}, "SUN-SAT")
FIELDS = (MINUTE, HOUR, DAY_OF_MONTH, MONTH, DAY_OF_WEEK)
WEEKS_IN_MONTH = 5


def _number(text: str) -> bool:
    return text.isascii() and text.isdigit()  # not str.isdigit alone: '²' is a digit


def _refuse(message: str) -> InvalidInputError:
    return InvalidInputError("cron", message)


def check(fields: list[str], new: bool = True) -> list[str]:
    """The five fields as they are stored (InvalidInputError naming the first problem):
    each as given, but for the items rewritten for croniter (`5L` as `L5`).  `new`: the
    expression of a new schedule; False for a stored one, which keeps evaluating as it
    did where a rule came later (a day of month beside 5#2)."""
    checked = [",".join(_item(field, item, text) for item in text.split(","))
               for field, text in zip(FIELDS, fields, strict=True)]
    days = fields[4].split(",")
    special = [d for d in days if "#" in d or "l" in d.lower()]
    if special and len(special) != len(days):
        raise _refuse(f"day of week {fields[4]!r}: {special[0]} cannot be listed "
                      "with plain days (croniter releases read that differently): make "
                      "two schedules")
    if new and special and fields[2] != "*":
        # croniter runs such a schedule on the day of week alone, or never (`1 * 5#2`),
        # whatever the day of month says; cron's rule (either day) is what a reader
        # expects.
        raise _refuse(f"day of month {fields[2]!r} with day of week {fields[4]!r}: "
                      f"croniter does not read {special[0]} beside a day of month as cron "
                      "would (either day): make two schedules")
    return checked


def _item(field: Field, item: str, text: str) -> str:
    if not item:
        raise _refuse(f"{field.name} {text!r} has an empty list item")
    word = item.lower()
    if word == "?":
        raise _refuse(f"{field.name} '?' is not supported: write *")
    if field is DAY_OF_MONTH:
        if word == "l":
            return item
        if "w" in word:
            raise _refuse(f"{field.name} {item!r}: W (nearest weekday) is not supported "
                          "(croniter 1.3.5, Debian 12's, cannot compute it, and all hosts "
                          "must agree on the times)")
    if field is DAY_OF_WEEK:
        special = _day_of_week_special(item, word)
        if special is not None:
            return special
    base, slash, step = item.partition("/")
    if slash:
        if not _number(step):
            raise _refuse(f"{field.name} step {step!r} in {item!r} is not a number")
        if int(step) < 1:
            raise _refuse(f"{field.name} step {step!r} in {item!r} must be at least 1")
    if base == "*":
        return item
    if "-" in base:
        first, _, last = base.partition("-")
        if not first or not last:
            raise _refuse(f"{field.name} {item!r}: a range needs both ends "
                          f"({field.low}-{field.high})")
        low, high = field.value(first, item), field.value(last, item)
        if low > high:
            upper = first if low == field.high else f"{first}-{field.high}"
            lower = last if high == field.low else f"{field.low}-{last}"
            raise _refuse(f"{field.name} range {base!r} runs backwards: write {upper},{lower}")
        if field is DAY_OF_WEEK and low == 7:
            # Sunday as 7 opening a range: croniter 7 reads 7-7 as every day.
            return f"0{slash}{step}"
        return item
    field.value(base, item)
    return item


def _day_of_week_special(item: str, word: str) -> str | None:
    """N#K and the last day N of the month (NL, LN), as croniter writes them; None for
    any other item."""
    if "#" in word:
        day, _, nth = item.partition("#")
        DAY_OF_WEEK.value(day, item)
        if not _number(nth) or not 1 <= int(nth) <= WEEKS_IN_MONTH:
            raise _refuse(f"day of week {item!r}: the week {nth!r} is out of range "
                          f"1-{WEEKS_IN_MONTH} ({day}#2 is the second of the month)")
        return item
    if "l" not in word:
        return None
    if word == "l":
        raise _refuse("day of week 'L' needs a day: 5L is the last Friday of the month")
    if "-" in word or "/" in word or "," in word:
        raise _refuse(f"day of week {item!r}: L takes one day (5L, FRIL: the last Friday "
                      "of the month), not a range or step")
    if word.startswith("l"):
        number = DAY_OF_WEEK.value(item[1:], item)
        return item if _number(item[1:]) else f"L{number}"
    if word.endswith("l"):
        return f"L{DAY_OF_WEEK.value(item[:-1], item)}"
    raise _refuse(f"day of week {item!r}: L goes before or after one day (5L or L5: the "
                  "last Friday of the month)")
    return None


def for_croniter(fields: list[str]) -> str:
    """Checked fields (check()) as croniter evaluates them alike in 1.3.5 and 7: minute,
    hour and month as the plain list of their values (croniter 7 reads a range `N-N` as
    every value); the days as given but for such ranges (their dom/dow rule is each
    release's own), and Sunday as 0."""
    return " ".join(_expanded(field, text) if field in (MINUTE, HOUR, MONTH) else
                    _days(field, text) for field, text in zip(FIELDS, fields, strict=True))


def _expanded(field: Field, text: str) -> str:
    if text == "*":
        return text
    values: set[int] = set()
    for item in text.split(","):
        base, _, step = item.partition("/")
        if base == "*":
            low, high = field.low, field.high
        elif "-" in base:
            first, _, last = base.partition("-")
            low, high = field.value(first, item), field.value(last, item)
        else:
            low = field.value(base, item)
            high = field.high if step else low
        values.update(range(low, high + 1, int(step) if step else 1))
    return ",".join(map(str, sorted(values)))


def _days(field: Field, text: str) -> str:
    if text == "*":
        return text
    items = []
    for item in text.split(","):
        base, _, step = item.partition("/")
        first, dash, last = base.partition("-")
        if dash and first.lower() == last.lower():
            item = first  # N-N (and N-N/S): the one day
        if field is DAY_OF_WEEK and item in ("7", "7#1", "7#2", "7#3", "7#4", "7#5"):
            item = "0" + item[1:]
        items.append(item)
    if not any("l" in i.lower() or "#" in i for i in items):
        values = {int(v) % 7 if field is DAY_OF_WEEK else int(v)
                  for v in _expanded(field, ",".join(items)).split(",")}
        if values >= set(range(field.low, 7 if field is DAY_OF_WEEK else field.high + 1)):
            # Every day listed: unrestricted, as 1.3.5 reads it (croniter 7 would then
            # take every day, whatever the other day field says).
            return "*"
    return ",".join(items)
