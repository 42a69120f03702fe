"""The control protocol: newline-delimited JSON, one request -> one response.

Request:  {"cmd": "list", "args": {...}}\\n
Response: {"ok": true, "result": ...}\\n
      or  {"ok": false, "error": {"type": "NotFoundError", "message": "..."}}\\n
A frame larger than MAX_FRAME bytes is refused and the connection closed.  A connection
may carry many requests, answered in order.
"""

from __future__ import annotations

import json
from typing import Any

MAX_FRAME = 1 << 20

# Error types a client may see; anything else is reported as "InternalError".
ERROR_TYPES = frozenset({
    "InvalidInputError", "NotFoundError", "AlreadyExistsError", "PreemptedError",
    "AlreadyFinishedError", "NotSupportedError", "ConfigError", "PermissionDenied",
    "ProtocolError", "DatabaseError", "InternalError", "ScheduleError",
})


class ProtocolError(Exception):
    """A frame that is not a valid request or response."""


class RemoteError(Exception):
    """An error answered by the daemon."""

    def __init__(self, type_: str, message: str) -> None:
        super().__init__(message)
        self.type = type_


def encode(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def request(cmd: str, args: dict[str, Any] | None = None) -> bytes:
    return encode({"cmd": cmd, "args": args or {}})


def ok(result: Any) -> bytes:
    return encode({"ok": True, "result": result})


def error(type_: str, message: str) -> bytes:
    if type_ not in ERROR_TYPES:
        type_ = "InternalError"
    return encode({"ok": False, "error": {"type": type_, "message": message}})


def parse_request(line: bytes) -> tuple[str, dict[str, Any]]:
    try:
        msg = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"invalid JSON: {exc}") from None
    if not isinstance(msg, dict):
        raise ProtocolError("a request must be a JSON object")
    cmd, args = msg.get("cmd"), msg.get("args", {})
    if not isinstance(cmd, str) or not cmd:
        raise ProtocolError("request: 'cmd' must be a non-empty string")
    if not isinstance(args, dict):
        raise ProtocolError("request: 'args' must be an object")
    return cmd, args


def parse_response(line: bytes) -> Any:
    """The result of a response, or RemoteError."""
    try:
        msg = json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"invalid response from the daemon: {exc}") from None
    if not isinstance(msg, dict) or "ok" not in msg:
        raise ProtocolError("invalid response from the daemon")
    if msg["ok"]:
        return msg.get("result")
    err = msg.get("error") or {}
    raise RemoteError(str(err.get("type", "InternalError")), str(err.get("message", "error")))
