"""What a job run as a systemd unit may ask of systemd (SPEC "Jobs as systemd units"):
its unit's name, and the `unit:` properties of a route or entry, checked and converted to
D-Bus (name, signature, value) triples when the configuration or file loads.

Nothing here talks to D-Bus (executors/systemd/unit.py does): a bad property is refused
at load with one line naming it, never when a job starts.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

from perfectschedd.errors import describe

EXECUTORS = ("exec", "systemd")
UNIT_PREFIX = "perfectsched-"
UNIT_SUFFIX = ".service"
# systemd's UNIT_NAME_MAX (256) less its NUL.
UNIT_NAME_MAX = 255
# systemd writes this directory when it boots as the init system (sd_booted(3)).
SYSTEMD_MARKER = "/run/systemd/system"

Property = tuple[str, str, Any]  # (D-Bus property name, signature, value)

_ESCAPE_KEEP = re.compile(r"[A-Za-z0-9:_.]")
_DIGEST = 16  # hex digits of a long key's hash in its unit name
_ENDS_AS_TIME = re.compile(r"-[0-9]+$")
_ENDS_AS_DIGEST = re.compile(f"_[0-9a-f]{{{_DIGEST}}}$")
_UINT64_MAX = 2**64 - 1
_DIGITS_MAX = 40  # of a size or percentage written as text
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGTPE]?)B?\s*$", re.IGNORECASE)
_PERCENT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$")
_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50,
               "E": 1 << 60}


class UnitPropertyError(ValueError):
    """A `unit:` property that is not allowed, or whose value is bad; str() is one line
    naming it."""


def systemd_booted() -> bool:
    """Whether systemd runs this host (the executor needs its D-Bus API)."""
    return os.path.isdir(SYSTEMD_MARKER)


def escape(text: str) -> str:
    """`systemd-escape TEXT`: any text becomes a valid part of a unit name ("/" -> "-",
    other bytes outside [A-Za-z0-9:_.] -> \\xNN, a leading "." too)."""
    out = []
    for i, ch in enumerate(text):
        if ch == "/":
            out.append("-")
        elif _ESCAPE_KEEP.match(ch) and not (i == 0 and ch == "."):
            out.append(ch)
        else:
            out.extend(f"\\x{b:02x}" for b in ch.encode("utf-8"))
    return "".join(out)


def unit_name(key: str, scheduled_time: int, attempt: int = 1) -> str:
    """perfectsched-<escaped key>-<scheduled_time>.service, and -<attempt> from the second
    attempt on (a retry of one occurrence is a unit of its own, in history and journal).
    A key too long for systemd's 255 characters is cut and followed by _<hash of the whole
    key>, so two long keys never share a name.

    Unique per (key, scheduled_time >= 0, attempt >= 1) by construction: the escaped key
    never ends in "-<digits>" (else key a/5 at time 2 would be key a at time 5, attempt 2),
    so the name reads back one way only; a short key's never ends in "_<16 hex digits>",
    which a long key's always does."""
    tail = f"-{int(scheduled_time)}" + (f"-{int(attempt)}" if attempt > 1 else "") + \
        UNIT_SUFFIX
    escaped = _unit_escape(key)
    room = UNIT_NAME_MAX - len(UNIT_PREFIX) - len(tail)
    if len(escaped) > room:
        digest = hashlib.sha256(key.encode("utf-8")).hexdigest()[:_DIGEST]
        cut = escape(key)[:room - _DIGEST - 1]
        # Never end on half an escape (\x4 of \x41): the name stays readable.
        cut = re.sub(r"\\(x[0-9a-f]?)?$", "", cut)
        escaped = f"{cut}_{digest}"
    return f"{UNIT_PREFIX}{escaped}{tail}"


def _unit_escape(key: str) -> str:
    """escape(), but a trailing "/<digits>" escapes its '/' as \\x2f and a trailing
    "_<16 hex digits>" its '_' as \\x5f (unit_name's two rules); systemd-escape
    --unescape still reads the key back."""
    escaped = escape(key)
    if _ENDS_AS_TIME.search(escaped):
        cut = escaped.rindex("-")
        return f"{escaped[:cut]}\\x2f{escaped[cut + 1:]}"
    if _ENDS_AS_DIGEST.search(escaped):
        cut = len(escaped) - _DIGEST - 1
        return f"{escaped[:cut]}\\x5f{escaped[cut + 1:]}"
    return escaped


def daemon_tag(control_socket: str) -> str:
    """What a unit's Description says of the daemon instance that started it: two
    daemons of one host (one node name, other tables or databases) never stop each
    other's units.  Its control socket names it: one daemon per socket (its lock)."""
    return f"[daemon {socket_digest(control_socket)}]"


def socket_digest(control_socket: str) -> str:
    """Twelve hex digits naming a daemon instance of this host by its control socket."""
    digest = hashlib.sha256(control_socket.encode("utf-8", "surrogateescape")).hexdigest()
    return digest[:12]


def started_by(description: str, tag: str) -> bool:
    """Whether a unit was started by the daemon instance of `tag` (or by a release that
    tagged none: 0.1.0, one instance per node as far as it knew)."""
    return tag in description or "[daemon " not in description


def bus_path(unit: str) -> str:
    """The unit's object path (systemd's bus label escaping: every byte outside
    [A-Za-z0-9] as _xx)."""
    label = "".join(chr(b) if chr(b).isascii() and chr(b).isalnum() else f"_{b:02x}"
                    for b in unit.encode("utf-8"))
    return f"/org/freedesktop/systemd1/unit/{label}"


# -- the `unit:` whitelist -------------------------------------------------------------------


def _uint64(name: str, value: Any, amount: Fraction | int | None, limits: str) -> int:
    """`amount`, rounded down, if systemd takes it: a D-Bus uint64 (signature t) and at
    least 1 (0 is refused, or means nothing, for every such property here); else one line
    naming the property and its `limits`.  None: a number too long to be one."""
    whole = None if amount is None else math.floor(amount)
    if whole is None or not 1 <= whole <= _UINT64_MAX:
        raise UnitPropertyError(f"{name}: out of range: {describe(value)} ({limits})")
    return whole


def _exact(digits: str) -> Fraction | None:
    """A decimal number exactly (a float would round 15.9999999999999999999E up past
    uint64); None past _DIGITS_MAX digits, which no value systemd takes has (and int()
    refuses beyond 4300)."""
    return Fraction(digits) if len(digits) <= _DIGITS_MAX else None


def _size(name: str, value: Any) -> Property:
    limits = f"1 to {_UINT64_MAX} bytes, or infinity"
    if value == "infinity":
        return (name, "t", _UINT64_MAX)
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return (name, "t", _uint64(name, value, value, limits))
    m = _SIZE.match(value) if isinstance(value, str) else None
    if m is None:
        raise UnitPropertyError(f"{name}: expected bytes such as 512M or 1G, or infinity, "
                                f"got {describe(value)}")
    number = _exact(m.group(1))
    amount = None if number is None else number * _SIZE_UNITS[m.group(2).upper()]
    return (name, "t", _uint64(name, value, amount, limits))


def _cpu_quota(name: str, value: Any) -> Property:
    m = _PERCENT.match(value) if isinstance(value, str) else None
    if m is None or float(m.group(1)) <= 0:
        raise UnitPropertyError(f"{name}: expected a percentage of one CPU such as 50% "
                                f"or 200%, got {describe(value)}")
    # systemd's unit: CPU time per second of wall time, in microseconds (100% = 1 s).
    number = _exact(m.group(1))
    amount = None if number is None else number * 10_000
    limits = f"0.0001% to {_UINT64_MAX // 10_000}.{_UINT64_MAX % 10_000:04d}%"
    return ("CPUQuotaPerSecUSec", "t", _uint64(name, value, amount, limits))


def _integer(low: int, high: int, signature: str) -> Any:
    def convert(name: str, value: Any) -> Property:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise UnitPropertyError(f"{name}: expected a whole number from {low} to {high}, "
                                    f"got {describe(value)}")
        return (name, signature, value)
    return convert


def _tasks_max(name: str, value: Any) -> Property:
    if value == "infinity":
        return (name, "t", _UINT64_MAX)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UnitPropertyError(f"{name}: expected a number of tasks (at least 1) or "
                                f"infinity, got {describe(value)}")
    return (name, "t", _uint64(name, value, value, f"1 to {_UINT64_MAX} tasks, or infinity"))


def _boolean(name: str, value: Any) -> Property:
    if not isinstance(value, bool):
        raise UnitPropertyError(f"{name}: expected true or false, got {describe(value)}")
    return (name, "b", value)


def _protect_system(name: str, value: Any) -> Property:
    if isinstance(value, bool):
        return (name, "s", "yes" if value else "no")
    if value in ("yes", "no", "full", "strict"):
        return (name, "s", value)
    raise UnitPropertyError(f"{name}: expected true, false, full or strict, got "
                            f"{describe(value)}")


def _absolute(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value.startswith("/") or "\0" in value \
            or "\n" in value:
        raise UnitPropertyError(f"{name}: expected an absolute path, got {describe(value)}")
    return value


def _paths(name: str, value: Any) -> Property:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items:
        raise UnitPropertyError(f"{name}: expected an absolute path or a list of them, got "
                                f"{describe(value)}")
    return (name, "as", [_absolute(name, p) for p in items])


def _working_directory(name: str, value: Any) -> Property:
    if value == "~":  # the user's home, as systemd reads it
        return (name, "s", value)
    return (name, "s", _absolute(name, value))


WHITELIST: dict[str, Any] = {
    "MemoryMax": _size,
    "CPUQuota": _cpu_quota,
    "CPUWeight": _integer(1, 10_000, "t"),
    "IOWeight": _integer(1, 10_000, "t"),
    "Nice": _integer(-20, 19, "i"),
    "TasksMax": _tasks_max,
    "PrivateTmp": _boolean,
    "ProtectSystem": _protect_system,
    "ReadWritePaths": _paths,
    "WorkingDirectory": _working_directory,
}


def convert(raw: Any) -> tuple[Property, ...]:
    """A `unit:` mapping as D-Bus properties of StartTransientUnit; UnitPropertyError
    names the first property that is not allowed or not valid."""
    if raw is None:
        return ()
    if not isinstance(raw, Mapping):
        raise UnitPropertyError(f"expected a mapping of systemd properties such as "
                                f"MemoryMax: 1G, got {describe(raw)}")
    out = []
    for name, value in raw.items():
        conv = WHITELIST.get(name) if isinstance(name, str) else None
        if conv is None:
            raise UnitPropertyError(f"{describe(name)}: not an allowed property (allowed: "
                                    f"{', '.join(WHITELIST)})")
        out.append(conv(name, value))
    return tuple(out)


def check_executor(value: Any, *, runs_here: bool = True) -> str:
    """`executor:` of a route or entry; ValueError (one line) when it is unknown, or is
    systemd on a host that systemd does not run (`runs_here`: this process will run it)."""
    if value is None:
        return "exec"
    if value not in EXECUTORS:
        raise ValueError(f"expected exec or systemd, got {describe(value)}")
    if value == "systemd" and runs_here and not systemd_booted():
        raise ValueError(f"systemd is not running on this host ({SYSTEMD_MARKER} is "
                         "missing); use executor exec")
    return str(value)
