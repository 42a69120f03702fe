"""Per-schedule policies (SPEC "Schedule policies"): what they may be, how they are
stored, and their arithmetic.  The decisions themselves run in Python on the claiming
worker, so every database backend gets them from this one module.

Stored as one nullable column: the JSON of the options that differ from the defaults
(NULL for a schedule that sets none, as every schedule made before policies existed).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from functools import lru_cache
from typing import Any

from perfectschedd.errors import InvalidInputError, describe
from perfectschedd.settings import notify_spec

MISFIRES = ("all", "latest", "skip")
# A due occurrence while another of the schedule runs: waits (forbid), runs beside it
# (allow), or stops it and starts (replace).
CONCURRENCIES = ("forbid", "allow", "replace")
# `misfire: skip` without a grace: an occurrence that has not started this long after its
# due time is a missed one.  (A claim normally starts within poll_interval.)
SKIP_GRACE = 10
# Bounds, so that every value fits the database and the arithmetic.
_SECONDS_MAX = 10 * 365 * 86400
_ATTEMPTS_MAX = 1_000_000
_JITTER_MAX = 7 * 86400


@dataclass(frozen=True)
class Policy:
    misfire: str = "all"
    grace: int | None = None          # seconds; None: no deadline
    # None: the config's max_attempts (itself 0 unless set); 0: unlimited.  Stored when
    # set, 0 included, so that a schedule's own value wins over the config's.
    max_attempts: int | None = None
    retry_wait: int | None = None     # seconds before the 2nd attempt; None: the config's
    jitter: int = 0                   # seconds; each key gets a fixed offset in [0, jitter)
    timeout: float | None = None      # seconds; None: the route's
    # A name of the handling host's `notifiers:` (never a command or a destination: those
    # stay in the files root writes); None: the file entry's, the route's, the config's.
    notify: str | None = None
    concurrency: str = "forbid"
    # Series of its own on /metrics (last success, last failure, state, next due; docs/
    # metrics.md); None: the route's `metrics:`, else none.  Stored when set, False
    # included, so that a schedule may refuse its route's default.
    metrics: bool | None = None

    # -- stored form ----------------------------------------------------------------------

    def to_text(self) -> str | None:
        changed = self.to_fields_changed()
        return json.dumps(changed, separators=(",", ":"), sort_keys=True) if changed else None

    def to_fields_changed(self) -> dict[str, Any]:
        """The options that differ from the defaults."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) != f.default}

    def as_fields(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def changed(self, options: Mapping[str, Any]) -> Policy:
        """This policy with validated `options` (a `modify`); None resets one."""
        return replace(self, **{k: (v if v is not None else _DEFAULTS[k])
                                for k, v in check(options).items()})

    # -- arithmetic -----------------------------------------------------------------------

    @property
    def overlaps(self) -> bool:
        """Whether an occurrence runs beside the others of its schedule, each on a row
        of its own (allow, replace), rather than in turn on the schedule's row."""
        return self.concurrency != "forbid"

    def offset(self, key: str) -> int:
        """The key's jitter: the same on every host, every occurrence, every restart."""
        return jitter_offset(key, self.jitter)

    def effective_grace(self) -> int | None:
        if self.grace is not None:
            return self.grace
        return SKIP_GRACE if self.misfire == "skip" else None

    def backoff(self, attempt: int, default_wait: float, cap: float) -> float:
        """Wait after failed attempt `attempt`: the base (this policy's retry_wait, else
        `default_wait`), doubled per attempt since the first, at most `cap` (or the base,
        if that is larger)."""
        base = float(self.retry_wait if self.retry_wait is not None else default_wait)
        if base <= 0:
            return 0.0
        return min(max(cap, base), base * 2.0 ** min(max(0, attempt - 1), 62))

    def attempts_allowed(self, default: int = 0) -> int:
        """The schedule's max_attempts, else `default` (the config's); 0: unlimited."""
        return self.max_attempts if self.max_attempts is not None else default

    def gives_up(self, attempt: int, default: int = 0) -> bool:
        """Whether failed attempt `attempt` is the occurrence's last: the schedule's
        max_attempts, or `default` (the config's) where it sets none."""
        allowed = self.attempts_allowed(default)
        return allowed > 0 and attempt >= allowed


DEFAULT = Policy()
_DEFAULTS = {f.name: f.default for f in fields(Policy)}
OPTIONS = tuple(_DEFAULTS)


@lru_cache(maxsize=4096)
def from_text(text: str | None) -> Policy:
    """The stored form back; an unreadable one (hand-edited) counts as the defaults."""
    if not text:
        return DEFAULT
    try:
        raw = json.loads(text)
        return DEFAULT.changed({k: v for k, v in raw.items() if k in _DEFAULTS})
    except (ValueError, TypeError, AttributeError):
        return DEFAULT


def jitter_offset(key: str, jitter: int) -> int:
    if jitter <= 1:
        return 0
    digest = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % jitter


# -- the due time: the one rule of when an occurrence may run -----------------------------

def due_shift(key: str, delay: int, jitter: int) -> int:
    """How long after its occurrence (the cron time, PERFECTSCHED_SCHEDULED_TIME) an
    occurrence of the schedule `key` is due: its delay, then the key's jitter offset."""
    return delay + jitter_offset(key, jitter)


def due_time(occurrence: int, key: str, delay: int, jitter: int) -> int:
    """When the occurrence `occurrence` of the schedule `key` is due: its time, the
    delay, the key's jitter offset.  Every reader of a due time (the claim's next_run_time,
    catch-up, resume --skip-missed, overdue, `next`) takes it from here."""
    return occurrence + due_shift(key, delay, jitter)


def check(options: Mapping[str, Any]) -> dict[str, Any]:
    """Validate policy options (any subset; None, or the word "default" as a command line
    gives it, means "the default"), naming the bad one; returns them normalised."""
    out: dict[str, Any] = {}
    for name, value in options.items():
        if name not in _DEFAULTS:
            raise InvalidInputError(name, "not a schedule policy option")
        if value is None or value == "default":
            out[name] = None
            continue
        if name == "misfire":
            if value not in MISFIRES:
                raise InvalidInputError("misfire", f"must be one of {', '.join(MISFIRES)}, "
                                        f"got {describe(value)}")
            out[name] = value
        elif name == "concurrency":
            if value not in CONCURRENCIES:
                raise InvalidInputError("concurrency", f"must be one of "
                                        f"{', '.join(CONCURRENCIES)}, got {describe(value)}")
            out[name] = value
        elif name == "notify":
            # '' or none: the schedule's own notifier is cleared (it inherits again).
            if value in ("", *notify_spec.NONE_WORDS):
                out[name] = None
                continue
            try:
                out[name] = notify_spec.check_name(value)
            except ValueError as exc:
                raise InvalidInputError("notify", str(exc).partition(": ")[2]) from None
        elif name == "metrics":
            out[name] = _switch(value)
        elif name == "timeout":
            out[name] = _number(name, value, minimum=0.001, maximum=_SECONDS_MAX,
                                integer=False)
        elif name == "max_attempts":
            out[name] = _number(name, value, minimum=0, maximum=_ATTEMPTS_MAX)
        elif name == "jitter":
            out[name] = _number(name, value, minimum=0, maximum=_JITTER_MAX)
        else:  # grace, retry_wait
            out[name] = _number(name, value, minimum=0, maximum=_SECONDS_MAX)
    return out


def _number(name: str, value: Any, *, minimum: float, maximum: float,
            integer: bool = True) -> Any:
    if isinstance(value, str):  # from a command line or a schedules file
        try:
            value = float(value) if "." in value or "e" in value.lower() else int(value)
        except ValueError:
            unit = "a whole number" if name == "max_attempts" else "a number of seconds"
            raise InvalidInputError(name, f"must be {unit}, got {describe(value)}") from None
    if isinstance(value, bool) or not isinstance(value, int | float) or \
            not math.isfinite(value):
        raise InvalidInputError(name, f"must be a number, got {describe(value)}")
    if integer and int(value) != value:
        raise InvalidInputError(name, f"must be a whole number, got {describe(value)}")
    if not minimum <= value <= maximum:
        raise InvalidInputError(name, f"must be from {_plain(minimum)} to {_plain(maximum)}, "
                                f"got {describe(value)}")
    return int(value) if integer else float(value)


def _plain(bound: float) -> str:
    # "315360000", not the "3.1536e+08" of :g, in a message a person reads
    return str(int(bound)) if float(bound).is_integer() else f"{bound:g}"


_YES = ("true", "yes", "on", "1")
_NO = ("false", "no", "off", "0")


def _switch(value: Any) -> bool:
    """metrics: a YAML or JSON boolean, or the words a command line gives."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):  # the command line's 1 and 0
        return bool(value)
    if isinstance(value, str) and value.lower() in _YES + _NO:
        return value.lower() in _YES
    raise InvalidInputError("metrics", f"must be true or false, got {describe(value)}")
