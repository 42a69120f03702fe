"""/api/v1/: the JSON API (SPEC "HTTP API and web console"), each route one command of
the registry, asked through the same dispatch as the control socket and D-Bus, as the
token's caller (control/auth.py says what each role may do).  docs/api.md describes
every route; tests/web/test_api_doc.py holds the two to each other.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

from perfectschedd.control import protocol, registry
from perfectschedd.control.protocol import ATTEMPT_MAX, HISTORY_MAX
from perfectschedd.control.transport import refusal_of
from perfectschedd.errors import InvalidInputError, NotFoundError, PermissionDeniedError
from perfectschedd.schedules import preview
from perfectschedd.vocabulary.fields import PREVIEW_COUNT, PREVIEW_MAX
from perfectschedd.web.server import Request, Response, json_error

Ask = Callable[[str, dict[str, Any]], Any]

log = logging.getLogger("perfectschedd")

PREFIX = "/api/v1/"
PAGE_MAX = 1000
PAGE_DEFAULT = 100
# A page filtered by state reads at most this many schedules (the state is not a
# column: it needs each one's latest run); it may then hold fewer than `limit`, and
# `next` says where to go on.
STATE_SCAN_MAX = 10 * PAGE_MAX
STATES = ("ok", "paused", "running", "queued", "retrying", "failed")

# The body fields of add and modify: every option of the commands, by its long name
# (perfectschedctl's flags without dashes, '-' or '_' alike).
ADD_FIELDS = registry.COMMANDS["add"].args
MODIFY_FIELDS = registry.COMMANDS["modify"].args - {"key"}

# (method, the path's parts after /api/v1/ with {key} and the like as holes) -> handler
ROUTES: list[tuple[str, tuple[str, ...], str]] = [
    ("GET", ("status",), "status"),
    ("GET", ("next",), "next_of_expression"),
    ("GET", ("schedules",), "list"),
    ("POST", ("schedules",), "add"),
    ("GET", ("schedules", "{key}"), "show"),
    ("PATCH", ("schedules", "{key}"), "modify"),
    ("DELETE", ("schedules", "{key}"), "delete"),
    ("POST", ("schedules", "{key}", "pause"), "pause"),
    ("POST", ("schedules", "{key}", "resume"), "resume"),
    ("POST", ("schedules", "{key}", "run"), "run"),
    ("GET", ("schedules", "{key}", "runs"), "runs"),
    ("GET", ("schedules", "{key}", "runs", "{scheduled_time}", "{attempt}", "output"),
     "output"),
    ("GET", ("schedules", "{key}", "next"), "next_of_schedule"),
]


def refused(exc: Exception) -> tuple[int, str]:
    """(HTTP status, one-line message) of a request that ended in `exc`: the transports'
    one ladder (control.transport.refusal_of), protocol.REFUSALS' status for its type, 409
    for a schedule a schedules file owns.  The API and the console answer with it."""
    type_, message = refusal_of(exc, None, log)
    status = protocol.refusal(type_).http_status
    if isinstance(exc, PermissionDeniedError) and exc.conflict:
        status = 409
    return status, message


def _ok(status: int, obj: Any) -> Response:
    return Response(status, (json.dumps(obj, separators=(",", ":"), allow_nan=False)
                             + "\n").encode(), "application/json")


def match(method: str, path: str) -> tuple[str | None, dict[str, str], set[str]]:
    """(handler name or None, the holes' values, the methods the path takes)."""
    parts = [urllib.parse.unquote(p) for p in path[len(PREFIX):].split("/")]
    allowed: set[str] = set()
    for route_method, pattern, name in ROUTES:
        if len(pattern) != len(parts):
            continue
        holes: dict[str, str] = {}
        for want, got in zip(pattern, parts, strict=True):
            if want.startswith("{"):
                holes[want[1:-1]] = got
            elif want != got:
                break
        else:
            if route_method == method or (method == "HEAD" and route_method == "GET"):
                return name, holes, allowed
            allowed.add(route_method)
    return None, {}, allowed


def body_object(request: Request) -> dict[str, Any]:
    """A request's JSON object (an empty body: {}); InvalidInputError otherwise."""
    if not request.body.strip():
        return {}
    try:
        value = json.loads(request.body)
    except (ValueError, RecursionError):
        raise InvalidInputError("body", "must be a JSON object") from None
    if not isinstance(value, dict):
        raise InvalidInputError("body", "must be a JSON object")
    return value


def _options(body: dict[str, Any], known: frozenset[str], what: str) -> dict[str, Any]:
    args = {str(k).replace("-", "_"): v for k, v in body.items()}
    unknown = sorted(set(args) - known)
    if unknown:
        raise InvalidInputError("body", f"unknown field(s) for {what}: {', '.join(unknown)}"
                                f" (known: {', '.join(sorted(known))})")
    return args


def _int_arg(request: Request, name: str, default: int, low: int, high: int) -> int:
    text = request.arg(name)
    if text is None or text == "":
        return default
    if not text.isdigit() or not low <= int(text) <= high:
        raise InvalidInputError(name, f"must be a whole number from {low} to {high}")
    return int(text)


def _bool_arg(request: Request, body: dict[str, Any], name: str) -> bool | None:
    value = body.get(name, request.arg(name))
    if value is None:
        return None
    if value in (True, "true", "1"):
        return True
    if value in (False, "false", "0"):
        return False
    raise InvalidInputError(name, "must be true or false")


def list_page(ask: Ask, prefix: str | None, after: str | None, state: str | None,
              limit: int) -> dict[str, Any]:
    """One keyset page of `list` (the API's and the console's): {"items", "next"}, where
    next is the key to go on after (None: the last page).  Filtered by state, a page
    reads at most STATE_SCAN_MAX schedules and may hold fewer than `limit`."""
    items: list[dict[str, Any]] = []
    scanned = 0
    while True:
        batch = limit + 1 if state is None else min(PAGE_MAX, STATE_SCAN_MAX - scanned)
        args: dict[str, Any] = {"limit": batch}
        if prefix is not None:
            args["prefix"] = prefix
        if after is not None:
            args["after"] = after
        rows = ask("list", args)
        if state is None:
            items = rows[:limit]
            return {"items": items,
                    "next": items[-1]["key"] if len(rows) > limit and items else None}
        for row in rows:
            scanned += 1
            after = row["key"]
            if str(row.get("state", "")).split(" ")[0] == state:
                items.append(row)
                if len(items) == limit:
                    return {"items": items, "next": after}
        if len(rows) < batch:
            return {"items": items, "next": None}
        if scanned >= STATE_SCAN_MAX:
            return {"items": items, "next": after}


class Api:
    def __init__(self, ask: Ask) -> None:
        self.ask = ask

    def handle(self, request: Request, name: str, holes: dict[str, str]) -> Response:
        handler: Callable[[Request, dict[str, str]], Response] = getattr(self, "_" + name)
        return handler(request, holes)

    # -- reading ----------------------------------------------------------------------------

    def _status(self, request: Request, holes: dict[str, str]) -> Response:
        # The latest reading (refreshed every few seconds, `database.figures_age` says
        # how old): a client polling status must not make the master read every
        # schedule on each request.  ?fresh=true asks for a new reading (up to 0.5 s).
        fresh = _bool_arg(request, {}, "fresh") or False
        return _ok(200, self.ask("status", {"fresh": fresh}))

    def _list(self, request: Request, holes: dict[str, str]) -> Response:
        limit = _int_arg(request, "limit", PAGE_DEFAULT, 1, PAGE_MAX)
        state = request.arg("state") or None
        if state is not None and state not in STATES:
            raise InvalidInputError("state", f"must be one of {', '.join(STATES)}")
        return _ok(200, list_page(self.ask, request.arg("prefix") or None,
                                  request.arg("after") or None, state, limit))

    def _show(self, request: Request, holes: dict[str, str]) -> Response:
        return _ok(200, self.ask("show", {"key": holes["key"]}))

    def _runs(self, request: Request, holes: dict[str, str]) -> Response:
        limit = _int_arg(request, "limit", 20, 1, HISTORY_MAX)
        args: dict[str, Any] = {"key": holes["key"], "limit": limit}
        if request.arg("attempt"):
            args["attempt"] = _int_arg(request, "attempt", 1, 1, ATTEMPT_MAX)
        return _ok(200, {"items": self.ask("history", args)})

    def _output(self, request: Request, holes: dict[str, str]) -> Response:
        when, attempt = holes["scheduled_time"], holes["attempt"]
        if not when.isdigit() or not attempt.isdigit() or int(attempt) < 1:
            raise InvalidInputError("path", "…/runs/SCHEDULED_TIME/ATTEMPT/output takes "
                                    "whole numbers (attempt from 1)")
        runs = self.ask("history", {"key": holes["key"], "limit": HISTORY_MAX,
                                    "attempt": int(attempt)})
        run = next((r for r in runs if r.get("scheduled_time") == int(when)), None)
        if run is None:
            raise NotFoundError(f"{holes['key']}: no run of attempt {attempt} of the "
                                f"occurrence at {when} among its newest {HISTORY_MAX}")
        if run.get("withheld"):
            return json_error(403, str(run["withheld"]))
        if run.get("output_omitted"):
            raise InvalidInputError("path", "that run's output is too far back in this "
                                    "answer: ask for it with a smaller history")
        return Response(200, (run.get("output") or "").encode(), "text/plain; charset=utf-8")

    def _next_of_schedule(self, request: Request, holes: dict[str, str]) -> Response:
        count = _int_arg(request, "n", PREVIEW_COUNT, 1, PREVIEW_MAX)
        return _ok(200, preview.of_schedule_shown(self.ask("show", {"key": holes["key"]}),
                                                  count))

    def _next_of_expression(self, request: Request, holes: dict[str, str]) -> Response:
        count = _int_arg(request, "n", PREVIEW_COUNT, 1, PREVIEW_MAX)
        expr = request.arg("cron")
        if not expr:
            raise InvalidInputError("cron", "required")
        tz = request.arg("timezone") or "UTC"
        start = _int_arg(request, "start", int(time.time()), 0, 253402300799)
        return _ok(200, preview.of_expression_shown(expr, tz, start, count))

    # -- changing ---------------------------------------------------------------------------

    def _add(self, request: Request, holes: dict[str, str]) -> Response:
        args = _options(body_object(request), ADD_FIELDS, "add")
        self.ask("add", args)
        return _ok(201, self.ask("show", {"key": args["key"]}))

    def _modify(self, request: Request, holes: dict[str, str]) -> Response:
        args = _options(body_object(request), MODIFY_FIELDS, "modify")
        return _ok(200, self.ask("modify", {**args, "key": holes["key"]}))

    def _delete(self, request: Request, holes: dict[str, str]) -> Response:
        args: dict[str, Any] = {"key": holes["key"]}
        force = _bool_arg(request, {}, "force")
        if force is not None:
            args["force"] = force
        self.ask("delete", args)
        return Response(204)

    def _pause(self, request: Request, holes: dict[str, str]) -> Response:
        return self._pausing("pause", request, holes, ())

    def _resume(self, request: Request, holes: dict[str, str]) -> Response:
        return self._pausing("resume", request, holes, ("skip_missed",))

    def _pausing(self, verb: str, request: Request, holes: dict[str, str],
                 extra: tuple[str, ...]) -> Response:
        body = _options(body_object(request), frozenset({"force", *extra}), verb)
        args: dict[str, Any] = {"key": holes["key"]}
        for name in ("force", *extra):
            value = _bool_arg(request, body, name)
            if value is not None:
                args[name] = value
        return _ok(200, self.ask(verb, args))

    def _run(self, request: Request, holes: dict[str, str]) -> Response:
        _options(body_object(request), frozenset(), "run")
        return _ok(200, self.ask("run", {"key": holes["key"]}))
