"""The check every number of the configuration passes (its top-level settings, a route's
timeout): a finite number within one bound, so that no value overflows the arithmetic or
the database, and no NaN slips past the comparisons."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from perfectschedd.errors import ConfigError, describe

# Largest number any setting takes (seconds, counts): ten years of seconds.
NUMBER_MAX = 315_360_000


def number(raw: Mapping[str, Any], key: str, default: float, *, minimum: float,
           integer: bool = False) -> Any:
    """`raw[key]` (or `default`) checked: an int if `integer`, else a float."""
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{key}: must be a number, got {describe(value)}")
    if not math.isfinite(value) or abs(value) > NUMBER_MAX:
        # .inf made int() raise, and .nan passes every comparison (an idle loop spun).
        raise ConfigError(f"{key}: must be a finite number up to {NUMBER_MAX:g}, "
                          f"got {describe(value)}")
    if integer and int(value) != value:
        raise ConfigError(f"{key}: must be a whole number, got {describe(value)}")
    if value < minimum:
        raise ConfigError(f"{key}: must be at least {minimum}, got {describe(value)}")
    return int(value) if integer else float(value)
