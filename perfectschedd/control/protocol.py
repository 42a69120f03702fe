"""The control protocol: newline-delimited JSON, one request -> one response.

Request:  {"cmd": "list", "args": {...}, "client": "0.2.0"}\\n
Response: {"ok": true, "result": ...}\\n
      or  {"ok": false, "error": {"type": "NotFoundError", "message": "..."},
           "daemon": "0.2.0"}\\n

"client" and "daemon" (0.2.0 on) are the versions of the two ends: a command one end does
not know is refused naming both.  0.1.0 daemons refuse a request with "client" (unknown
field): clients then ask again without it (see perfectschedctl/client.py).

A request frame (without its newline) may be at most MAX_FRAME bytes; a larger one is
refused with a ProtocolError and the connection closed.  A connection may carry many
requests, answered in order.  The full description is docs/protocol.md.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from perfectschedd.vocabulary.fields import MAX_DEPTH, json_depth

# Most runs one `history` request returns.
HISTORY_MAX = 1000
# Most characters of output one `history` answer carries (the newest runs' first; older
# runs then say "output_omitted"): as LIST_PAGE_BYTES, what a client that does not read
# may pin in the daemon.  `history --attempt`/`logs` ask for one run, which always fits.
HISTORY_OUTPUT_BYTES = 2 << 20
# Largest attempt number a `history` request may ask for.
ATTEMPT_MAX = (1 << 31) - 1
# Most schedules one `list` answer holds on the socket and D-Bus, and the most bytes it
# may take: an answer waits whole in the daemon's memory until the client reads it, so a
# client that does not read must not be able to pin more than this per connection.
# Clients ask again with {"after": <last key>} (perfectschedctl does).
LIST_PAGE = 1000
LIST_PAGE_BYTES = 512 * 1024

MAX_FRAME = 1 << 20

# NamedTuple, not a dataclass, here and in registry.py: perfectschedctl loads both at
# every start, and dataclasses loads inspect (with ast, dis, tokenize): about 7 ms more.
class Refusal(NamedTuple):
    """How a refused request reaches each client."""

    exit_status: int  # perfectschedctl's
    dbus_name: str    # the D-Bus error
    meaning: str
    http_status: int  # the HTTP API's (SPEC "HTTP API and web console")


EXIT_REFUSED = 1
DBUS_ERROR_PREFIX = "org.perfectsched1.Error."
# Error types a client may see (by the socket's "type"), for every command; anything
# else is reported as "InternalError".
REFUSALS: dict[str, Refusal] = {
    name: Refusal(EXIT_REFUSED, DBUS_ERROR_PREFIX + name, meaning, http)
    for name, http, meaning in (
        ("InvalidInputError", 400, "a field (named in the message) is not acceptable; also "
                                   "unknown commands and arguments"),
        ("NotFoundError", 404, "no schedule has this key"),
        ("AlreadyExistsError", 409, "add of a key that exists"),
        ("PreemptedError", 409, "the task's lease was lost"),
        ("AlreadyFinishedError", 409, "the task was already finished"),
        ("NotSupportedError", 400, "not possible in this daemon/config"),
        ("ConfigError", 400, "a configuration problem"),
        ("PermissionDenied", 403, "the caller may not use the daemon"),
        # 409 instead when a schedules file owns the schedule (PermissionDeniedError.conflict)
        ("PermissionDeniedError", 403, "the caller may not do this: a route that runs as "
                                       "another user, a schedules file's schedule, --force "
                                       "(not root), a token's role"),
        ("ProtocolError", 400, "the frame is not a valid request (bad JSON, too large, ...)"),
        ("DatabaseError", 503, "the database refused the request"),
        ("DatabaseUnavailableError", 503, "the database does not answer"),
        ("Busy", 503, "too many connections; try again"),
        ("ScheduleError", 400, "a refused request"),
        ("InternalError", 500, "a bug; the daemon logs it and goes on"),
    )}
ERROR_TYPES = frozenset(REFUSALS)


def refusal(type_: str) -> Refusal:
    return REFUSALS.get(type_, REFUSALS["InternalError"])


class ProtocolError(Exception):
    """A frame that is not a valid request or response."""


class RemoteError(Exception):
    """An error answered by the daemon; `daemon` is its version (None before 0.2.0)."""

    def __init__(self, type_: str, message: str, daemon: str | None = None) -> None:
        super().__init__(message)
        self.type = type_
        self.daemon = daemon


def encode(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode() + b"\n"


def request(cmd: str, args: dict[str, Any] | None = None, client: str | None = None
            ) -> bytes:
    msg: dict[str, Any] = {"cmd": cmd, "args": args or {}}
    if client is not None:
        msg["client"] = client
    return encode(msg)


def ok(result: Any) -> bytes:
    return encode({"ok": True, "result": result})


def ok_page(items: list[bytes], more_after: str | None) -> bytes:
    """A `list` answer built from items already encoded (encode_item); `more_after`, the
    last key sent, says there is more: ask again with {"after": more_after}."""
    head = b'{"ok":true,"result":[' + b",".join(items) + b"]"
    if more_after is not None:
        head += b',"more":' + encode_item({"after": more_after})
    return head + b"}\n"


def encode_item(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()


def error_type(exc: BaseException) -> str:
    """The name clients see for an exception: its own, or its nearest base's that is one
    of ERROR_TYPES (a subclass such as cron.NoNextOccurrence answers as its base)."""
    for cls in type(exc).__mro__:
        if cls.__name__ in ERROR_TYPES:
            return cls.__name__
    return "InternalError"


def error(type_: str, message: str, daemon: str | None = None) -> bytes:
    if type_ not in ERROR_TYPES:
        type_ = "InternalError"
    # One line for people: the first line of the message, bounded.
    lines = str(message).strip().splitlines() or ["error"]
    msg: dict[str, Any] = {"ok": False, "error": {"type": type_, "message": lines[0][:2000]}}
    if daemon is not None:
        msg["daemon"] = daemon
    return encode(msg)


# The refusals that may come from two ends of different versions (a command or an
# argument one of them does not know).
UNKNOWN_TO_ONE_END = ("unknown command", "unknown argument")


def versions_note(client: str | None, daemon: str | None) -> str:
    """What a refusal of something unknown adds when the two ends differ ("" if not)."""
    if client == daemon:
        return ""
    return (f" (perfectschedctl {client or 'older than 0.2.0'}, perfectschedd "
            f"{daemon or 'older than 0.2.0'}: one of them does not know it; run both at "
            "one version: restart the daemon after an upgrade)")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


# The levels a request puts around a schedule's data: the request, its args, add_many's
# list and its item.  Data within MAX_DEPTH passes the frame's check, so that the
# schedule's own check refuses deeper data naming `data`, not the request.
REQUEST_ENVELOPE = 4


def loads_bounded(text: bytes | str, what: str = "request", depth: int = MAX_DEPTH) -> Any:
    """json.loads with the limits every entry point applies: MAX_FRAME bytes, `depth`
    levels, no NaN/Infinity.  Raises ProtocolError with a one-line reason."""
    if len(text) > MAX_FRAME:
        raise ProtocolError(f"{what} larger than {MAX_FRAME} bytes")
    try:
        msg = json.loads(text, parse_constant=_no_constant)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"{what}: invalid JSON: {exc}") from None
    except ValueError as exc:  # NaN, Infinity
        raise ProtocolError(f"{what}: invalid JSON: {exc}") from None
    except RecursionError:
        raise ProtocolError(f"{what}: nested deeper than {depth} levels") from None
    if json_depth(msg, depth) > depth:
        raise ProtocolError(f"{what}: nested deeper than {depth} levels")
    return msg


def parse_request(line: bytes) -> tuple[str, dict[str, Any]]:
    cmd, args, _ = parse_request_from(line)
    return cmd, args


def parse_request_from(line: bytes) -> tuple[str, dict[str, Any], str | None]:
    """(command, arguments, the client's version or None when it did not say)."""
    msg = loads_bounded(line, depth=MAX_DEPTH + REQUEST_ENVELOPE)
    if not isinstance(msg, dict):
        raise ProtocolError("a request must be a JSON object")
    unknown = set(msg) - {"cmd", "args", "client"}
    if unknown:
        raise ProtocolError(f"request: unknown field(s) {', '.join(sorted(unknown))}")
    client = msg.get("client")
    if client is not None and (not isinstance(client, str) or not 0 < len(client) <= 40):
        raise ProtocolError("request: 'client' must be a version string")
    cmd, args = msg.get("cmd"), msg.get("args", {})
    if not isinstance(cmd, str) or not cmd:
        raise ProtocolError("request: 'cmd' must be a non-empty string")
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise ProtocolError("request: 'args' must be an object")
    return cmd, args, client


def parse_response(line: bytes) -> Any:
    """The result of a response, or RemoteError."""
    return parse_response_full(line)["result"]


def parse_response_full(line: bytes) -> dict[str, Any]:
    """A successful response as a dict ("result", and "more" for a paged `list`), or
    RemoteError."""
    try:
        msg = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"invalid response from the daemon: {exc}") from None
    if not isinstance(msg, dict) or "ok" not in msg:
        raise ProtocolError("invalid response from the daemon")
    if msg["ok"]:
        return {"result": msg.get("result"), "more": msg.get("more")}
    err = msg.get("error") or {}
    if not isinstance(err, dict):
        err = {"message": str(err)}
    daemon = msg.get("daemon")
    raise RemoteError(str(err.get("type", "InternalError")), str(err.get("message", "error")),
                      daemon if isinstance(daemon, str) else None)
