"""/periodic/: the HTTP interface of Periodic (github.com/Lupino/periodic, the task system
PerfectSched descends from), so that the curl lines of its README work against any host
with a token added (SPEC "HTTP API and web console"; docs/periodic.md says it for users):

    GET    /periodic/        {FUNC: {func_name, total_worker, total_job, processing}, ...}
    GET    /periodic/FUNC    that func's object
    POST   /periodic/[FUNC]  func, name, args, timeout, sched_at: submit the job FUNC:NAME;
                             with act=remove: remove it
    DELETE /periodic/FUNC    drop the func: delete every schedule of its type

Periodic's words in ours: a func is a task type; a job is the one-off schedule keyed
FUNC:NAME (`@once` at sched_at, data {"args": ARGS}, timeout its timeout policy).  A job
submitted again is replaced in place (`modify` with `at`, so its one run moves to the new
sched_at); a key FUNC:NAME held by a schedule of another type is not touched (409).

Every change and every read is a command of the master's dispatch, asked as the token's
caller: the rules of the control socket and of /api/v1/ hold unchanged (roles, a route's
allow:, no exec: type, schedules files own their schedules), and refusals reach the client
as WebApp makes them, one JSON line.  A token's role is checked before anything is read,
so that a viewer's change is a 403 whatever the func holds.

The figures, from `status` and this host's routes (what the database records of hosts
holds no routes):
- total_job: the schedules of that type (extra runs of `run KEY` are not schedules);
- processing: its occurrences running now, on any host (status' `running`, as the
  housekeeping thread last read it: seconds old at most);
- total_worker: this host's live workers when a route of this host runs the type (a route
  refused here runs none), plus each worker of another host holding one of its
  occurrences now (owner NODE:PID).  A host that routes the type but runs none of it now
  is not seen from here: ask that host.
DELETE is refused (409) while total_worker is not 0, as Periodic drops a func only when no
worker has it; a schedule of a schedules file among the type's refuses it too (409,
nothing deleted).
"""

from __future__ import annotations

import json
import time
import urllib.parse
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any

from perfectschedd.control.auth import Caller, check_command, route_of
from perfectschedd.errors import (
    AlreadyExistsError,
    InvalidInputError,
    NotFoundError,
    PermissionDeniedError,
    describe,
)
from perfectschedd.schedules.cron import ONCE
from perfectschedd.settings.routes import RouteConfig
from perfectschedd.vocabulary.fields import (
    EXEC_TYPE,
    LAST_INSTANT,
    RUN_NOW_MARK,
    SOURCE_FILE,
    SOURCE_FORCED,
)
from perfectschedd.web.api import Ask, body_object
from perfectschedd.web.server import Request, Response, json_error

PREFIX = "/periodic"
METHODS = frozenset({"GET", "HEAD", "POST", "DELETE"})
# The fields of a POST (form-encoded or a JSON object; the query string's too, as Go's
# FormValue reads both), each given once.
FIELDS = ("func", "name", "args", "timeout", "sched_at", "act")
FORM = "application/x-www-form-urlencoded"
JSON = "application/json"
SUCCESS = "SUCCESS"  # Periodic's answer to a change: {"msg": "SUCCESS"}
PAGE = 1000  # schedules read per `list`
NAMED = 5  # keys named in a refusal, at most


def _answer(obj: Any, status: int = 200) -> Response:
    return Response(status, (json.dumps(obj, separators=(",", ":"), allow_nan=False)
                             + "\n").encode(), JSON)


def func_of(path: str) -> str:
    """The FUNC of /periodic/FUNC (percent-decoded; '' for /periodic/ itself)."""
    rest = path[len(PREFIX):]
    try:
        return urllib.parse.unquote(rest[1:] if rest.startswith("/") else rest,
                                    errors="strict")
    except UnicodeDecodeError:
        raise InvalidInputError("func", "not UTF-8 once percent-decoded") from None


def fields_of(request: Request) -> dict[str, Any]:
    """A POST's fields; InvalidInputError for one unknown, given twice, or a body that is
    not what its Content-Type says (checked by the caller: form or JSON)."""
    given: list[tuple[str, Any]] = [(k, v) for k, vs in request.query.items() for v in vs]
    if content_type(request) == JSON:
        given += list(body_object(request).items())
    else:
        try:
            given += urllib.parse.parse_qsl(request.body.decode("utf-8"),
                                            keep_blank_values=True, errors="strict",
                                            max_num_fields=4 * len(FIELDS))
        except (UnicodeDecodeError, ValueError):
            raise InvalidInputError("body", f"must be a form ({FORM}, UTF-8) of at most "
                                    f"{4 * len(FIELDS)} fields") from None
    fields: dict[str, Any] = {}
    for name, value in given:
        if name not in FIELDS:
            raise InvalidInputError(str(name)[:60], f"unknown field (known: "
                                    f"{', '.join(FIELDS)})")
        if name in fields:
            raise InvalidInputError(name, "given twice")
        fields[name] = value
    return fields


def content_type(request: Request) -> str:
    return (request.header("Content-Type") or FORM).split(";")[0].strip().lower()


def _text(fields: dict[str, Any], name: str) -> str:
    value = fields.get(name, "")
    if not isinstance(value, str):
        raise InvalidInputError(name, f"must be text, got {describe(value)}")
    return value


def _seconds(fields: dict[str, Any], name: str) -> int | None:
    """A whole number of seconds (a JSON number, or digits), None when absent or ''."""
    value = fields.get(name)
    if value is None or value == "":
        return None
    number = int(value) if isinstance(value, str) and value.isascii() and \
        value.isdigit() else value
    if isinstance(number, bool) or not isinstance(number, int) or \
            not 0 <= number <= LAST_INSTANT:
        raise InvalidInputError(name, f"must be whole seconds from 0 to {LAST_INSTANT}, "
                                f"got {describe(value)}")
    return number


class Periodic:
    """One request's answer, asked of the dispatch (`ask`) as `caller`; `routes`: those of
    the configuration this host runs now."""

    def __init__(self, ask: Ask, caller: Caller, routes: Sequence[RouteConfig]) -> None:
        self.ask = ask
        self.caller = caller
        self.routes = routes

    def handle(self, request: Request) -> Response:
        func = func_of(request.path)
        if request.method in ("GET", "HEAD"):
            return self._status(func)
        if request.method == "DELETE":
            return self._drop(func)
        check_command(self.caller, "add")  # a viewer: refused before anything is read
        if content_type(request) not in (FORM, JSON):
            return json_error(415, f"send the fields as {FORM} (curl -d) or {JSON}")
        fields = fields_of(request)
        given = _text(fields, "func")
        if func and given and given != func:
            raise InvalidInputError("func", f"{given!r} in the body, {func!r} in the path")
        func = func or given
        if not func:
            raise InvalidInputError("func", "required (in the path or the body)")
        name = _text(fields, "name")
        if not name:
            raise InvalidInputError("name", "required")
        act = _text(fields, "act")
        if act.lower() == "remove":
            return self._remove(func, name)
        if act:
            raise InvalidInputError("act", f"must be remove, or absent to submit; got "
                                    f"{describe(act)}")
        return self._submit(func, name, fields)

    # -- jobs -------------------------------------------------------------------------------

    def _submit(self, func: str, name: str, fields: dict[str, Any]) -> Response:
        key = f"{func}:{name}"
        sched_at = _seconds(fields, "sched_at")
        if sched_at is None:
            sched_at = int(time.time())
        timeout = _seconds(fields, "timeout") or None  # 0, as in Periodic: none of its own
        args = fields.get("args", "")
        job = {"key": key, "cron": ONCE, "data": {"args": args}, "at": sched_at}
        for _ in range(2):  # a job that ran (and so went) between add and modify: add it
            try:
                self.ask("add", {**job, "type": func,
                                 **({"timeout": timeout} if timeout else {})})
                return _answer({"msg": SUCCESS, "key": key, "sched_at": sched_at,
                                "replaced": False})
            except AlreadyExistsError:
                pass
            try:
                self._job(func, name, key)
                # Replaced whole: the timeout back to the route's when none is given.
                self.ask("modify", {**job, "timeout": timeout})
                return _answer({"msg": SUCCESS, "key": key, "sched_at": sched_at,
                                "replaced": True})
            except NotFoundError:
                continue
        raise AlreadyExistsError(f"{key} was added and removed again while it was being "
                                 "submitted: submit it again")

    def _remove(self, func: str, name: str) -> Response:
        key = f"{func}:{name}"
        self._job(func, name, key)
        self.ask("delete", {"key": key})
        return _answer({"msg": SUCCESS, "key": key})

    def _job(self, func: str, name: str, key: str) -> None:
        """The job exists as a schedule of type `func`: a schedule of another type that
        holds its key is not the job's to change."""
        task_type = self.ask("show", {"key": key})["type"]
        if task_type != func:
            raise AlreadyExistsError(f"{key} is a schedule of type {task_type}, not job "
                                     f"{name} of func {func}: nothing changed")

    # -- funcs ------------------------------------------------------------------------------

    def _schedules(self) -> Iterator[dict[str, Any]]:
        """Every schedule (not the extra runs of `run KEY`), a page at a time."""
        after: str | None = None
        while True:
            rows = self.ask("list", {"limit": PAGE, **({"after": after} if after else {})})
            yield from (r for r in rows if RUN_NOW_MARK not in r["key"])
            if len(rows) < PAGE:
                return
            after = rows[-1]["key"]

    def _runs_here(self, func: str) -> bool:
        route = route_of(func, self.routes)
        return route is not None and route.refused is None

    def _workers(self, func: str, status: dict[str, Any]) -> tuple[int, list[str]]:
        """total_worker, and what it counts (for a refusal)."""
        here = self._runs_here(func)
        host = status.get("host")
        owners = sorted({str(r["owner"]) for r in [*status.get("running", []),
                                                   *status.get("queued", [])]
                         if r.get("type") == func and r.get("owner")
                         and not (here and str(r["owner"]).rpartition(":")[0] == host)})
        alive = int(status.get("workers_alive", 0)) if here else 0
        why = ([f"this host ({host}) routes it to its {alive} workers"] if here else []) + \
            [f"worker {o} runs one of its jobs now" for o in owners[:NAMED]]
        return alive + len(owners), why

    def _stat(self, func: str, status: dict[str, Any], jobs: int) -> dict[str, Any]:
        return {"func_name": func, "total_worker": self._workers(func, status)[0],
                "total_job": jobs,
                "processing": sum(1 for r in status.get("running", [])
                                  if r.get("type") == func)}

    def _status(self, func: str) -> Response:
        status = self.ask("status", {})
        jobs = Counter(self.ask("types", {"type": func} if func else {}))
        running = {r.get("type") for r in status.get("running", [])}
        if func:
            if not jobs[func] and func not in running and route_of(func, self.routes) is None:
                raise NotFoundError(f"no func {func!r}: no schedule has this type and no "
                                    "route of this host takes it")
            return _answer(self._stat(func, status, jobs[func]))
        # The types of the schedules, of the runs, and those this host's routes name
        # (a /regexp/ route names none until a schedule has one of its types).
        funcs = set(jobs) | {t for t in running if isinstance(t, str)} | {
            r.pattern for r in self.routes if r.regexp is None and r.refused is None
            and r.source is None and not r.pattern.startswith(EXEC_TYPE)}
        return _answer({f: self._stat(f, status, jobs[f]) for f in sorted(funcs)})

    def _drop(self, func: str) -> Response:
        if not func:
            raise InvalidInputError("func", "required: DELETE /periodic/FUNC")
        check_command(self.caller, "delete")
        workers, why = self._workers(func, self.ask("status", {}))
        if workers:
            return json_error(409, f"{func}: {'; '.join(why)}: a func is dropped once no "
                                   "worker takes it (remove its route and reload, and let "
                                   "its runs end); nothing deleted")
        rows = [r for r in self._schedules() if r["type"] == func]
        if not rows and route_of(func, self.routes) is None:
            raise NotFoundError(f"no func {func!r}: no schedule has this type")
        filed = [r["key"] for r in rows if str(r.get("source") or "").startswith(SOURCE_FILE)]
        if filed:
            raise PermissionDeniedError(
                f"{func}: {len(filed)} of its schedules are managed by schedules files "
                f"({', '.join(filed[:NAMED])}{' ...' if len(filed) > NAMED else ''}): edit "
                "them and reload; nothing deleted", conflict=True)
        # Those root detached from their file first: refused to anyone else, they are
        # refused before any other is deleted.  The route's rule is the same for all.
        rows.sort(key=lambda r: not str(r.get("source") or "").startswith(SOURCE_FORCED))
        deleted = 0
        for r in rows:
            try:
                self.ask("delete", {"key": r["key"]})
            except NotFoundError:
                continue  # gone meanwhile (a one-off that ran)
            deleted += 1
        return _answer({"msg": SUCCESS, "func": func, "deleted": deleted})
