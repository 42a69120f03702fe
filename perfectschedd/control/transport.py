"""What the control transports share: the socket (server.py), D-Bus (dbus_server.py) and
HTTP (web/).  Each of them asks Supervisor.dispatch() for one request of a known caller;
here is what they must agree on around that call:

- which pool a request runs on (RequestPools: a quick command never queues behind
  requests that wait on the database);
- how a request that ended in an exception reaches the wire (refusal_of: one ladder from
  the exception to an error type and a one-line message; protocol.REFUSALS says how each
  transport shows the type);
- how much of a `list` one answer holds (list_page on the socket, one_page on D-Bus): an
  answer waits whole in the daemon's memory until the client takes it.

The transports keep only what is theirs: sockets and peer credentials, D-Bus plumbing,
HTTP routing and tokens.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from sqlalchemy.exc import SQLAlchemyError

from perfectschedd import __version__
from perfectschedd.control import commands, protocol, registry
from perfectschedd.control.auth import Caller
from perfectschedd.errors import ConfigError, InvalidInputError, ScheduleError, first_line

# One request of a caller: the daemon's Supervisor.dispatch.
Dispatch = Callable[[str, dict[str, Any], Caller], Any]
# One request, the caller known.
Ask = Callable[[str, dict[str, Any]], Any]

# A frame longer than this is not peeked at for its command (peek_command): a quick
# command's request is small, and a large frame is read once, by the pool that runs it.
_PEEK_MAX = 512


def is_quick(cmd: str | None) -> bool:
    """Whether `cmd` is a quick command (registry: answered from the daemon's own state,
    never the database)."""
    command = registry.COMMANDS.get(cmd) if cmd is not None else None
    return command is not None and command.quick


def peek_command(frame: bytes) -> str | None:
    """The command a small request frame names, read without checking the rest (the
    pool that runs the request checks it fully); None for a large or malformed frame."""
    if len(frame) > _PEEK_MAX:
        return None
    try:
        request = json.loads(frame)
    except ValueError:
        return None
    if not isinstance(request, dict) or not isinstance(request.get("cmd"), str):
        return None
    return request["cmd"]


class RequestPools:
    """A transport's two thread pools: one for the requests that may wait on the
    database, and a small one for the quick commands (`status`), so that those answer
    while the database is slow."""

    def __init__(self, name: str, threads: int, quick_threads: int) -> None:
        self.slow = ThreadPoolExecutor(threads, thread_name_prefix=f"{name}-req")
        self.quick = ThreadPoolExecutor(quick_threads, thread_name_prefix=f"{name}-quick")

    def of(self, cmd: str | None) -> ThreadPoolExecutor:
        """The pool that runs a request for `cmd`."""
        return self.quick if is_quick(cmd) else self.slow

    def shutdown(self) -> None:
        """Run nothing more; requests already running end on their own."""
        for pool in (self.slow, self.quick):
            pool.shutdown(wait=False, cancel_futures=True)


def refusal_of(exc: Exception, client: str | None, log: logging.Logger, *,
               note_versions: bool = True, what: str = "request") -> tuple[str, str]:
    """(error type, one-line message) of a request that ended in `exc`, as every
    transport answers it (protocol.REFUSALS says how each shows the type).

    `client`: its version, when it said; a refusal of a command or argument one end does
    not know then notes both versions, unless `note_versions` is False (D-Bus callers
    are not perfectschedctl, and say no version).  A bug is logged with its traceback,
    as "`what` failed"."""
    if isinstance(exc, protocol.ProtocolError):
        return "ProtocolError", str(exc)
    if isinstance(exc, ScheduleError):
        message = str(exc)
        if note_versions and isinstance(exc, InvalidInputError) and any(
                m in message for m in protocol.UNKNOWN_TO_ONE_END):
            message += protocol.versions_note(client, __version__)
        return protocol.error_type(exc), message
    if isinstance(exc, ConfigError):
        return "ConfigError", str(exc)
    if isinstance(exc, SQLAlchemyError):
        orig = getattr(exc, "orig", None) or exc
        return "DatabaseError", f"database error: {first_line(orig)}"
    log.error("%s failed", what, exc_info=exc)
    return "InternalError", f"internal error: {exc}"


def one_page(args: dict[str, Any]) -> dict[str, Any]:
    """A `list` request's arguments, asking for at most one page (protocol.LIST_PAGE):
    for a transport that answers in one message; callers page on with
    {"after": <last key>}.  A limit that is not a whole number is left for the command
    to refuse."""
    limit = args.get("limit")
    if limit is None or (type(limit) is int and limit > protocol.LIST_PAGE):
        return {**args, "limit": protocol.LIST_PAGE}
    return args


def list_page(ask: Ask, args: dict[str, Any]) -> bytes:
    """A `list` answer of at most LIST_PAGE schedules and about LIST_PAGE_BYTES, with a
    "more" marker when the client asked for more than that (or for all).

    Rows are read in batches sized to what is left of the byte budget, so a page of large
    schedules never has a thousand of them in memory at once."""
    want = commands.check_limit(args.get("limit"))
    page = protocol.LIST_PAGE if want is None else min(want, protocol.LIST_PAGE)
    items: list[bytes] = []
    size = 0
    after = args.get("after")
    batch = _FIRST_BATCH
    more = False
    while len(items) < page:
        count = min(batch, page - len(items))
        rows = ask("list", {**args, "after": after, "limit": count + 1} if after is not None
                   else {**args, "limit": count + 1})
        for row in rows[:count]:
            item = protocol.encode_item(row)
            if items and size + len(item) > protocol.LIST_PAGE_BYTES:
                more = True
                break
            items.append(item)
            size += len(item) + 1
            after = row["key"]
        if more or len(rows) <= count:
            more = more or len(rows) > count
            break
        # The next batch holds about what is left of the byte budget at this row size.
        batch = max(_FIRST_BATCH, (protocol.LIST_PAGE_BYTES - size) * len(items) // size)
    else:
        more = len(items) == page and _has_after(ask, args, after)
    if want is not None and len(items) >= want:
        more = False
    return protocol.ok_page(items, after if more and items else None)


# Rows read by a page's first query: a schedule holds up to 64 kB of data.
_FIRST_BATCH = 16


def _has_after(ask: Ask, args: dict[str, Any], after: str | None) -> bool:
    rest = {**args, "limit": 1} if after is None else {**args, "after": after, "limit": 1}
    return bool(ask("list", rest))
