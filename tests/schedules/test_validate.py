"""schedules/validate.py: the input checks every door shares, refusals in one line."""

from __future__ import annotations

import pytest

from perfectschedd.errors import InvalidInputError
from perfectschedd.schedules.validate import check_int


@pytest.mark.parametrize("value", [10**400, -(10**400), float("inf"), float("nan"), 1.5,
                                   True, "3", None, -1])
def test_check_int_refuses_what_is_not_a_whole_number_in_range(value: object) -> None:
    """A JSON request may carry an integer beyond a float's range: it is the field's
    refusal, not an internal error (OverflowError)."""
    with pytest.raises(InvalidInputError) as info:
        check_int("limit", value, minimum=0, maximum=100)
    assert str(info.value).startswith("limit: must be a whole number")


def test_check_int_takes_whole_numbers_in_range() -> None:
    assert check_int("limit", 0, maximum=100) == 0
    assert check_int("limit", 100.0, maximum=100) == 100
    assert type(check_int("limit", 7.0, maximum=100)) is int
