"""The web console (SPEC "HTTP API and web console"): an overview, the schedules (prefix
search, state filter, keyset pages of any size) and one schedule (its fields, next 10
fire times with DST marks, its runs with exit code, duration and output, and pause,
resume, run now, delete), answered from the same commands and rules as the API.

HTML made here, on the server, with no script at all: the Content-Security-Policy
forbids every script, every page works in any browser (a phone's too) and with nothing
from other sites, and there is no build step.  Every stored string (keys, types, data,
output, errors) goes through `esc` (html.escape) on its way into a page; nothing else
writes them.  No template library: four small pages do not justify a dependency, and a
single escaping helper is easier to audit than autoescape settings.

A login trades an API token for a session: a random id in an HttpOnly, SameSite=Strict
cookie (Secure, and named __Host-..., under TLS), kept in this process's memory (a
daemon restart logs everyone out), ending when its token is revoked or expires, after
SESSION_IDLE without use, or at logout.  Every form that changes something carries the
session's CSRF token, checked in constant time, and a POST from another origin (Origin
or Sec-Fetch-Site) is refused before that.
"""

from __future__ import annotations

import collections
import hmac
import html
import json
import secrets
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import resources
from typing import Any

from perfectschedd import __version__
from perfectschedd.control.auth import VIEWER, Caller
from perfectschedd.errors import InvalidInputError
from perfectschedd.schedules import preview
from perfectschedd.web.api import list_page, refused
from perfectschedd.web.credentials import CredentialError, Credentials, Identity
from perfectschedd.web.server import Request, Response

Ask = Callable[[str, dict[str, Any], Caller], Any]

SESSION_IDLE = 12 * 3600.0
SESSIONS_MAX = 10_000
PAGE_SIZES = (10, 50, 100, 500, 1000)
STATES = ("ok", "paused", "running", "queued", "retrying", "failed")
CSP = ("default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; "
       "frame-ancestors 'none'; base-uri 'none'")
# same-origin, not no-referrer: under no-referrer a browser sends `Origin: null` with
# the console's own forms, which the origin check must then refuse.
PAGE_HEADERS = (("Referrer-Policy", "same-origin"),)
ACTIONS = ("pause", "resume", "run", "delete")
PATHS = ("/", "/login", "/logout", "/schedules", "/static/console.css")


def esc(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def when(ts: Any) -> str:
    if ts is None:
        return "-"
    return datetime.fromtimestamp(float(ts), UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def duration(seconds: Any) -> str:
    if seconds is None:
        return "-"
    s = float(seconds)
    return f"{s * 1000:.0f} ms" if s < 1 else f"{s:.1f} s" if s < 120 else f"{s / 60:.1f} min"


def key_path(key: str, *rest: str) -> str:
    return "/schedules/" + "/".join([urllib.parse.quote(key, safe=""), *rest])


@dataclass
class Session:
    identity: Identity
    csrf: str
    last_used: float
    flash: list[str] = field(default_factory=list)


class Sessions:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_id: collections.OrderedDict[str, Session] = collections.OrderedDict()

    def new(self, identity: Identity) -> tuple[str, Session]:
        sid = secrets.token_urlsafe(32)
        session = Session(identity, secrets.token_urlsafe(32), time.monotonic())
        with self.lock:
            self.by_id[sid] = session
            while len(self.by_id) > SESSIONS_MAX:
                self.by_id.popitem(last=False)
        return sid, session

    def get(self, sid: str | None) -> Session | None:
        if not sid:
            return None
        now = time.monotonic()
        with self.lock:
            session = self.by_id.get(sid)
            if session is None:
                return None
            if now - session.last_used > SESSION_IDLE:
                del self.by_id[sid]
                return None
            session.last_used = now
            self.by_id.move_to_end(sid)
            return session

    def end(self, sid: str | None) -> None:
        with self.lock:
            self.by_id.pop(sid or "", None)


def cookies(request: Request) -> dict[str, str]:
    jar: dict[str, str] = {}
    for part in (request.header("Cookie") or "").split(";"):
        name, _, value = part.strip().partition("=")
        if name:
            jar[name] = value
    return jar


def form(request: Request) -> dict[str, str]:
    if not (request.header("Content-Type") or "").startswith(
            "application/x-www-form-urlencoded"):
        raise InvalidInputError("form", "expected a form (application/x-www-form-urlencoded)")
    try:
        fields = urllib.parse.parse_qs(request.body.decode("utf-8"), keep_blank_values=True,
                                       max_num_fields=20)
    except (UnicodeDecodeError, ValueError):
        raise InvalidInputError("form", "not a form") from None
    return {k: v[-1] for k, v in fields.items()}


class Console:
    def __init__(self, ask: Ask, credentials: Credentials, group_gid: int) -> None:
        self.ask = ask
        self.credentials = credentials
        self.group_gid = group_gid
        self.sessions = Sessions()
        self.css = resources.files("perfectschedd.web").joinpath(
            "static/console.css").read_bytes()

    @staticmethod
    def serves(path: str) -> bool:
        return path in PATHS or path.startswith("/schedules/")

    # -- the page around every page -------------------------------------------------------

    def _cookie_name(self, request: Request) -> str:
        return "__Host-perfectsched_session" if request.tls else "perfectsched_session"

    def _page(self, title: str, body: str, session: Session | None, status: int = 200,
              headers: Iterable[tuple[str, str]] = ()) -> Response:
        nav = flash = ""
        if session is not None:
            who = session.identity
            flash = "".join(f'<p class="flash">{esc(m)}</p>' for m in session.flash)
            session.flash.clear()
            nav = (f'<nav><a href="/">Overview</a> <a href="/schedules">Schedules</a>'
                   f'<span class="who">{esc(who.name)} ({esc(who.role)})</span>'
                   f'<form method="post" action="/logout" class="inline">'
                   f'{self._csrf_field(session)}<button>Log out</button></form></nav>')
        text = (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
                f'<meta name="viewport" content="width=device-width, initial-scale=1">'
                f'<title>{esc(title)} - perfectsched</title>'
                f'<link rel="stylesheet" href="/static/console.css"></head><body>'
                f'<header><h1>perfectsched</h1>{nav}</header>'
                f'<main>{flash}<h2>{esc(title)}</h2>'
                f'{body}</main><footer>perfectschedd {esc(__version__)}</footer>'
                f'</body></html>')
        return Response(status, text.encode(), "text/html; charset=utf-8",
                        [("Content-Security-Policy", CSP), *PAGE_HEADERS, *headers])

    @staticmethod
    def _csrf_field(session: Session) -> str:
        return f'<input type="hidden" name="csrf" value="{esc(session.csrf)}">'

    @staticmethod
    def _redirect(location: str, headers: Iterable[tuple[str, str]] = ()) -> Response:
        return Response(303, b"", "text/plain; charset=utf-8",
                        [("Location", location), ("Content-Security-Policy", CSP),
                         *PAGE_HEADERS, *headers])

    # -- entry ------------------------------------------------------------------------------

    def handle(self, request: Request) -> Response:
        path = request.path
        if path == "/static/console.css":
            return Response(200, self.css, "text/css; charset=utf-8",
                            [("Cache-Control", "max-age=3600")])
        if path == "/login":
            return self._login(request)
        sid = cookies(request).get(self._cookie_name(request))
        session = self.sessions.get(sid)
        if session is not None:
            try:
                current = self.credentials.still_valid(session.identity.token_id)
            except CredentialError as exc:
                return self._page("Unavailable", f"<p>{esc(exc)}</p>", None, exc.status)
            if current is None:
                self.sessions.end(sid)
                session = None
            else:
                session.identity = current  # a changed role counts at once
        if session is None:
            if request.method == "GET":
                return self._redirect("/login")
            return self._page("Logged out", '<p>Your session ended. <a href="/login">Log '
                              'in</a> again.</p>', None, 401)
        if request.method == "POST":
            refused = self._check_post(request, session)
            if refused is not None:
                return refused
            if path == "/logout":
                self.sessions.end(sid)
                return self._redirect("/login", [(
                    "Set-Cookie", f"{self._cookie_name(request)}=; Max-Age=0; Path=/; "
                    f"HttpOnly; SameSite=Strict{'; Secure' if request.tls else ''}")])
            if path.startswith("/schedules/"):
                return self._act(request, session)
            return self._page("Not found", "<p>Nothing to post here.</p>", session, 405)
        if request.method not in ("GET", "HEAD"):
            return self._page("Not allowed", "<p>Method not allowed.</p>", session, 405)
        try:
            if path == "/":
                return self._overview(session)
            if path == "/schedules":
                return self._schedules(request, session)
            if path.startswith("/schedules/"):
                key = urllib.parse.unquote(path[len("/schedules/"):])
                return self._schedule(key, session)
        except Exception as exc:  # noqa: BLE001 - one line on the page, as the API does
            return self._refused(exc, session)
        return self._page("Not found", "<p>No such page.</p>", session, 404)

    def _refused(self, exc: Exception, session: Session) -> Response:
        status, message = refused(exc)
        return self._page("Refused", f'<p class="error">{esc(message)}</p>', session, status)

    def _check_post(self, request: Request, session: Session) -> Response | None:
        origin = request.header("Origin")
        host = request.header("Host")
        site = request.header("Sec-Fetch-Site")
        if site is not None and site not in ("same-origin", "none"):
            return self._page("Refused", "<p>A change must come from this console.</p>",
                              session, 403)
        if origin is not None and host is not None and \
                urllib.parse.urlsplit(origin).netloc != host:
            return self._page("Refused", "<p>A change must come from this console.</p>",
                              session, 403)
        try:
            fields = form(request)
        except InvalidInputError as exc:
            return self._page("Refused", f"<p>{esc(exc)}</p>", session, 400)
        if not hmac.compare_digest(fields.get("csrf", "").encode(), session.csrf.encode()):
            return self._page("Refused", "<p>The form's CSRF token is missing or wrong: "
                              "reload the page and try again.</p>", session, 403)
        return None

    # -- login ------------------------------------------------------------------------------

    def _login(self, request: Request) -> Response:
        jar = cookies(request)
        if request.method == "POST":
            # Login CSRF: the form's token must match the cookie set with the form.
            try:
                fields = form(request)
            except InvalidInputError as exc:
                return self._login_form(request, str(exc), 400)
            pre = jar.get("perfectsched_login", "")
            if not pre or not hmac.compare_digest(fields.get("csrf", "").encode(),
                                                  pre.encode()):
                return self._login_form(request, "the form expired: try again", 403)
            try:
                identity = self.credentials.identify(fields.get("token", "").strip(),
                                                     request.client)
            except CredentialError as exc:
                return self._login_form(request, str(exc), exc.status)
            sid, _ = self.sessions.new(identity)
            secure = "; Secure" if request.tls else ""
            return self._redirect("/", [
                ("Set-Cookie", f"{self._cookie_name(request)}={sid}; Path=/; HttpOnly; "
                               f"SameSite=Strict{secure}"),
                ("Set-Cookie", f"perfectsched_login=; Max-Age=0; Path=/login; HttpOnly; "
                               f"SameSite=Strict{secure}")])
        return self._login_form(request, None, 200)

    def _login_form(self, request: Request, error: str | None, status: int) -> Response:
        pre = secrets.token_urlsafe(24)
        secure = "; Secure" if request.tls else ""
        body = (f'{f"<p class=error>{esc(error)}</p>" if error else ""}'
                f'<form method="post" action="/login" class="login">'
                f'<input type="hidden" name="csrf" value="{esc(pre)}">'
                f'<label>API token <input type="password" name="token" autocomplete="off" '
                f'required autofocus></label><button>Log in</button></form>'
                f'<p class="hint">Root makes tokens on a host of the daemon: '
                f'<code>perfectschedctl token add NAME --role viewer</code>.</p>')
        return self._page("Log in", body, None, status, [
            ("Set-Cookie", f"perfectsched_login={pre}; Path=/login; HttpOnly; "
                           f"SameSite=Strict{secure}")])

    # -- pages ------------------------------------------------------------------------------

    def _asker(self, session: Session) -> Callable[[str, dict[str, Any]], Any]:
        caller = session.identity.caller(self.group_gid)
        return lambda cmd, args: self.ask(cmd, args, caller)

    def _overview(self, session: Session) -> Response:
        status = self._asker(session)("status", {"fresh": False})
        hosts = "".join(
            f"<tr><td>{esc(h['name'])}</td><td>{esc(h['version'])}</td>"
            f"<td>{'live' if h.get('live') else 'gone'}</td><td>{when(h.get('last_seen'))}"
            f"</td></tr>" for h in status.get("hosts", []))
        failing = "".join(
            f'<tr>{_key_cell(f["key"])}'
            f"<td>{esc(f.get('state'))}</td><td>{esc(f.get('error') or f.get('withheld'))}"
            f"</td></tr>" for f in status.get("failing", []))
        running = "".join(
            f'<tr>{_key_cell(r["key"])}'
            f"<td>{esc(r.get('owner'))}</td><td>{duration(r.get('age'))}</td></tr>"
            for r in status.get("running", []))
        due = "".join(
            f'<tr>{_key_cell(n["key"])}'
            f"<td>{esc(n['type'])}</td><td>{when(n['run_at'])}</td></tr>"
            for n in status.get("next_due", []))
        states = ", ".join(f"{esc(k)}: {esc(v)}" for k, v in status.get("states", {}).items())
        body = (f'<section class="cards"><div><b>{esc(status.get("schedules"))}</b> '
                f'schedules</div><div><b>{esc(status.get("due"))}</b> due</div>'
                f'<div><b>{esc(status.get("workers_alive"))}</b>/'
                f'{esc(status.get("workers_configured"))} workers on '
                f'{esc(status.get("host"))}</div>'
                f'<div>database {"ok" if status.get("database_ok") else "unreachable"}</div>'
                f'</section><p>{states}</p>'
                f'{_table("Hosts", ("host", "version", "state", "last seen"), hosts)}'
                f'{_table("Failing", ("key", "state", "last error"), failing)}'
                f'{_table("Running now", ("key", "worker", "for"), running)}'
                f'{_table("Next due", ("key", "type", "runs at"), due)}')
        return self._page("Overview", body, session)

    def _schedules(self, request: Request, session: Session) -> Response:
        prefix = request.arg("prefix") or ""
        state = request.arg("state") or ""
        after = request.arg("after") or ""
        size_text = request.arg("limit") or "100"
        limit = int(size_text) if size_text in {str(s) for s in PAGE_SIZES} else 100
        if state and state not in STATES:
            raise InvalidInputError("state", f"must be one of {', '.join(STATES)}")
        page = list_page(self._asker(session), prefix or None, after or None,
                         state or None, limit)
        rows = "".join(
            f'<tr>{_key_cell(i["key"])}'
            f"<td>{esc(i['type'])}</td><td>{esc(i['cron'])}</td>"
            f"<td>{when(i.get('next_run_time'))}</td><td>{esc(i.get('state'))}</td></tr>"
            for i in page["items"])
        options = "".join(f'<option{" selected" if s == state else ""}>{esc(s)}</option>'
                          for s in ("", *STATES))
        sizes = "".join(f'<option{" selected" if s == limit else ""}>{s}</option>'
                        for s in PAGE_SIZES)
        query = {"prefix": prefix, "state": state, "limit": str(limit)}
        more = ""
        if page["next"] is not None:
            more = (f'<a class="next" href="/schedules?'
                    f'{esc(urllib.parse.urlencode({**query, "after": page["next"]}))}">'
                    f'Next page</a>')
        first = (f'<a href="/schedules?{esc(urllib.parse.urlencode(query))}">First page</a>'
                 if after else "")
        body = (f'<form method="get" action="/schedules" class="filters">'
                f'<label>Key starts with <input name="prefix" value="{esc(prefix)}"></label>'
                f'<label>State <select name="state">{options}</select></label>'
                f'<label>Per page <select name="limit">{sizes}</select></label>'
                f'<button>Search</button></form>'
                f'{_table(None, ("key", "type", "cron", "next run", "state"), rows)}'
                f'<p class="pages">{first} {more}</p>')
        return self._page("Schedules", body, session)

    def _schedule(self, key: str, session: Session) -> Response:
        ask = self._asker(session)
        info = ask("show", {"key": key})
        fires = preview.of_schedule_shown(info, 10)
        runs = ask("history", {"key": key, "limit": 20})
        fields = "".join(f"<tr><th>{esc(name)}</th><td>{esc(_shown(info.get(name), name))}"
                         f"</td></tr>"
                         for name in ("key", "type", "cron", "timezone", "delay",
                                      "next_run_time", "state", "paused", "data", "source",
                                      "creator_name", "max_attempts", "retry_wait",
                                      "misfire", "concurrency", "timeout", "notify")
                         if name in info)
        if info.get("withheld"):
            fields += f'<tr><th>data</th><td class="note">{esc(info["withheld"])}</td></tr>'
        times = "".join(
            f"<tr><td>{esc(t['scheduled_local'])}</td><td>{esc(t['run_local'])}</td>"
            f"<td>{esc(_dst(t))}</td></tr>" for t in fires["times"])
        run_rows = "".join(
            f"<tr><td>{when(r.get('started_at'))}</td><td>{esc(r.get('outcome'))}</td>"
            f"<td>{esc(r.get('exit_code') if r.get('exit_code') is not None else '-')}</td>"
            f"<td>{duration(r.get('duration'))}</td><td>{esc(r.get('attempt'))}</td>"
            f"<td>{_output(r)}</td></tr>" for r in runs)
        actions = ""
        if session.identity.role != VIEWER:
            buttons = "".join(
                f'<form method="post" action="{esc(key_path(key, action))}" class="inline">'
                f'{self._csrf_field(session)}<button name="do" value="{action}"'
                f'{" class=danger" if action == "delete" else ""}>'
                f'{"run now" if action == "run" else action}</button></form>'
                for action in ACTIONS)
            actions = f'<p class="actions">{buttons}</p>'
        run_heads = ("started", "outcome", "exit", "took", "attempt", "output")
        body = (f"{actions}{_table(None, ('field', 'value'), fields, vertical=True)}"
                f'{_table("Next 10 fire times", ("occurrence", "runs at", "DST"), times)}'
                f'{_table("Runs", run_heads, run_rows)}')
        return self._page(key, body, session)

    def _act(self, request: Request, session: Session) -> Response:
        rest = request.path[len("/schedules/"):]
        quoted, _, action = rest.rpartition("/")
        key = urllib.parse.unquote(quoted)
        if action not in ACTIONS or not quoted:
            return self._page("Not found", "<p>No such action.</p>", session, 404)
        try:
            result = self._asker(session)(action, {"key": key})
        except Exception as exc:  # noqa: BLE001 - said on the page, one line
            return self._refused(exc, session)
        if action == "delete":
            session.flash.append(f"{key} deleted")
            return self._redirect("/schedules")
        note = result.get("note") if isinstance(result, dict) else None
        session.flash.append(f"{key}: {'run: ' + note if note else action + 'd'}")
        return self._redirect(key_path(key))


def _table(title: str | None, heads: tuple[str, ...], rows: str, vertical: bool = False
           ) -> str:
    caption = f"<h3>{esc(title)}</h3>" if title else ""
    if not rows:
        return f'{caption}<p class="none">none</p>' if title else '<p class="none">none</p>'
    head = "" if vertical else "<tr>" + "".join(f"<th>{esc(h)}</th>" for h in heads) + "</tr>"
    return f'{caption}<div class="scroll"><table>{head}{rows}</table></div>'


def _key_cell(key: str) -> str:
    """A table cell linking to the schedule `key`."""
    return f'<td><a href="{esc(key_path(key))}">{esc(key)}</a></td>'


def _shown(value: Any, name: str = "") -> str:
    if name.endswith("_time") and isinstance(value, int | float):
        return when(value)
    if isinstance(value, dict | list):
        return json.dumps(value, ensure_ascii=False)
    return "-" if value is None else str(value)


def _dst(t: dict[str, Any]) -> str:
    marks = []
    if t.get("repeated"):
        marks.append(f"repeated local time ({'first' if t['repeated'] == 1 else 'second'})")
    if t.get("skipped_before"):
        marks.append("clock set forward: skipped " + ", ".join(t["skipped_before"]))
    return "; ".join(marks)


def _output(run: dict[str, Any]) -> str:
    if run.get("withheld"):
        return '<span class="note">withheld</span>'
    text = run.get("output")
    error = run.get("error")
    shown = f'<div class="error">{esc(error)}</div>' if error else ""
    if text:
        shown += f"<details><summary>output</summary><pre>{esc(text)}</pre></details>"
    return shown or "-"

