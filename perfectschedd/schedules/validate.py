"""Validation of user input: what a key, a type, a cron expression, a time zone, a
number, a schedule's data may be, and how deep a JSON document may nest.  The one place
that says it for the socket, D-Bus, the CLI, the library, the schedules files and the
importers.

It loads no store (no SQLAlchemy): the importers and the client check input with it and
talk to no database.  The cron module (croniter) is loaded by the checks that need it,
not by the client's protocol, which takes only the depth check from here.
"""

from __future__ import annotations

import json
import math
import re
import unicodedata
from collections.abc import Mapping
from typing import Any

from perfectschedd.errors import InvalidInputError, describe
from perfectschedd.vocabulary.fields import (
    CRON_MAX,
    DATA_MAX,
    EXEC_TYPE,
    KEY_MAX,
    LAST_INSTANT,
    MAX_DEPTH,
    RUN_NOW_MARK,
    TYPE_MAX,
    dumps_data,
    json_depth,
)

_C0 = re.compile("[\x00-\x1f]")


def check_text(field: str, value: Any, limit: int) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidInputError(field, "must be a non-empty string")
    if len(value) > limit:
        raise InvalidInputError(field, f"longer than {limit} characters")
    if _C0.search(value):
        raise InvalidInputError(field, "contains control characters")
    if not value.isascii() and any(0xD800 <= ord(c) <= 0xDFFF for c in value):
        raise InvalidInputError(field, "contains lone surrogates (not valid Unicode text)")
    return value


# Characters a key never holds: controls (C0, DEL, C1), format characters (bidi
# overrides), line and paragraph separators (they split a journald or log line),
# surrogates.
_KEY_FORBIDDEN = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs"})
_ASCII_CONTROL = re.compile("[\x00-\x1f\x7f]")
# Any space (str patterns match Unicode's): a key is one column of `list` and one word of
# the command lines that name it.
_SPACE = re.compile(r"\s")


def check_key(key: Any) -> str:
    """A key for a new schedule: the one place that says what a key may be (socket,
    D-Bus, CLI and library all add through here).  A key reaches exec jobs as their last
    argument, so it never starts with `-` (GNU tools read options after operands), and it
    is written to logs, so it holds no control or separator character, and it is a column
    of `list`, so no space; `@run-` is kept for the keys of extra runs."""
    check_text("key", key, KEY_MAX)
    if key.startswith("-"):
        raise InvalidInputError("key", "must not start with '-' (it reaches jobs as an "
                                "argument)")
    # An ASCII key's only forbidden characters are the controls (categories looked up
    # one character at a time cost more than the rest of an add's checks).
    if _ASCII_CONTROL.search(key) if key.isascii() else any(
            unicodedata.category(c) in _KEY_FORBIDDEN for c in key):
        raise InvalidInputError("key", "contains control, format or line-separator "
                                "characters")
    if _SPACE.search(key):
        raise InvalidInputError("key", "must not contain spaces (a key is one column of "
                                "`list` and one word of a command line)")
    if RUN_NOW_MARK in key:
        raise InvalidInputError("key", f"must not contain {RUN_NOW_MARK!r} (the mark of "
                                "extra runs)")
    return key


def check_type(task_type: Any, *, exec_key: str | None = None) -> str:
    """A task type to store: the one place that says what a type may be (add, modify,
    add_many and so import-legacy, apply, schedules files; socket, D-Bus, direct mode and
    the library all store through here).  `exec:` starts only the type of a schedules
    file's exec entry, exec:KEY, which the hosts whose files hold that entry route to its
    command, as its user: a type chosen by anyone else would feed their data to that
    command.  `exec_key`: the key of the exec entry being stored by the files'
    convergence (converge.py), whose own exec:KEY alone it may store."""
    check_text("type", task_type, TYPE_MAX)
    if task_type.startswith(EXEC_TYPE) and (exec_key is None
                                            or task_type != f"{EXEC_TYPE}{exec_key}"):
        raise InvalidInputError("type", f"{EXEC_TYPE!r} is kept for the exec entries of "
                                "schedules files (exec:KEY runs the command their file "
                                "holds)")
    return task_type


def lookup_key(key: Any, field: str = "key") -> str:
    """A key to look up (or a prefix, or a paging cursor): text of a key's length, but not
    held to check_key's rules, so keys stored before those rules keep working."""
    return check_text(field, key, KEY_MAX)


def key_problem(key: str) -> str | None:
    """Why a stored key would be refused today (it still works), or None."""
    try:
        check_key(key)
    except InvalidInputError as exc:
        return str(exc)
    return None


_NO_DATA = dumps_data({})


def _no_json_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def check_data(data: Any) -> str:
    if data is None:  # most adds carry none
        return _NO_DATA
    if isinstance(data, str):
        if len(data) > DATA_MAX:
            raise InvalidInputError("data", f"larger than {DATA_MAX} bytes")
        try:
            data = json.loads(data, parse_constant=_no_json_constant)
        except json.JSONDecodeError as exc:
            raise InvalidInputError("data", f"not valid JSON: {exc.msg}") from None
        except ValueError as exc:  # NaN, Infinity
            raise InvalidInputError("data", f"not valid JSON: {exc}") from None
        except RecursionError:
            raise InvalidInputError("data", f"nested deeper than {MAX_DEPTH} levels") from None
    if not isinstance(data, Mapping):
        raise InvalidInputError("data", "must be a JSON object")
    # Before anything walks it recursively (json.dumps, the answer's asdict()).
    if json_depth(data) > MAX_DEPTH:
        raise InvalidInputError("data", f"nested deeper than {MAX_DEPTH} levels")
    try:
        text = dumps_data(dict(data))
    except (TypeError, ValueError) as exc:
        raise InvalidInputError("data", f"not serialisable as JSON: {str(exc)[:200]}") from None
    if "\\ud" in text:  # an escaped surrogate: fine in pairs, refused alone (PostgreSQL does)
        try:
            json.dumps(data, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            raise InvalidInputError("data", "contains lone surrogates (not valid Unicode "
                                    "text)") from None
    if len(text.encode()) > DATA_MAX:
        raise InvalidInputError("data", f"larger than {DATA_MAX} bytes")
    return text


def check_int(field: str, value: Any, *, minimum: int = 0,
              maximum: int = LAST_INSTANT) -> int:
    """A whole number in [minimum, maximum]; the default maximum, the last second of year
    9999, bounds every time and duration we store (and keeps them inside 64 bits)."""
    # isfinite only of a float: an int beyond a float's range (JSON allows it) would raise
    # OverflowError there, an internal error instead of this field's refusal.
    if isinstance(value, bool) or not isinstance(value, int | float) or (
            isinstance(value, float) and not math.isfinite(value)):
        raise InvalidInputError(field, f"must be a whole number, got {describe(value)}")
    if int(value) != value or not minimum <= value <= maximum:
        raise InvalidInputError(field, f"must be a whole number from {minimum} to {maximum}, "
                                f"got {describe(value)}")
    return int(value)


def check_timezone(name: Any) -> str:
    if not isinstance(name, str) or not name:
        raise InvalidInputError("timezone", "must be a time zone name such as Asia/Tokyo")
    from perfectschedd.schedules import cron

    cron.zone(name)
    return name


def check_cron(expr: Any) -> str:
    if not isinstance(expr, str):
        raise InvalidInputError("cron", "must be a string")
    if len(expr) > CRON_MAX:
        raise InvalidInputError("cron", f"longer than {CRON_MAX} characters")
    from perfectschedd.schedules import cron

    return cron.check(expr)
