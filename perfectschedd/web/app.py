"""What the HTTP listener answers, by path: /metrics and /healthz (open, unless
`metrics_token: true`), /api/v1/ and /periodic/ (a token's), and the rules every answer
keeps: who the client is (credentials.py), the API off on a non-loopback address without
TLS unless `http_insecure: true`, errors as one JSON line with the status of
protocol.REFUSALS.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Callable, Sequence
from typing import Any

from perfectschedd.control.auth import Caller
from perfectschedd.control.transport import Dispatch
from perfectschedd.settings.routes import RouteConfig
from perfectschedd.web import api, periodic
from perfectschedd.web.console import Console
from perfectschedd.web.credentials import CredentialError, Credentials, Identity, bearer
from perfectschedd.web.server import Request, Response, json_error

log = logging.getLogger("perfectschedd")

# Every answer: no framing by other sites, no referrer leaking keys in URLs.
SECURITY_HEADERS = [
    ("Content-Security-Policy", "default-src 'none'; frame-ancestors 'none'"),
    ("X-Frame-Options", "DENY"),
    ("Referrer-Policy", "no-referrer"),
]


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class WebApp:
    """`render_metrics`: the /metrics body and its content type; `healthy`: /healthz;
    `routes`: the routes of the configuration running now (/periodic/ tells the types this
    host runs)."""

    def __init__(self, dispatch: Dispatch, credentials: Credentials,
                 render_metrics: Callable[[], tuple[bytes, str]],
                 healthy: Callable[[], bool], *, listen_host: str, tls: bool,
                 insecure: bool, metrics_token: bool, group_gid: int,
                 routes: Callable[[], Sequence[RouteConfig]]) -> None:
        self.dispatch = dispatch
        self.credentials = credentials
        self.render_metrics = render_metrics
        self.healthy = healthy
        self.routes = routes
        self.metrics_token = metrics_token
        self.group_gid = group_gid  # control_group's: an operator token holds it
        self.console = Console(dispatch, credentials, group_gid)
        # The API and the console hand out data and take changes: on an address others
        # reach, only over TLS (a token sent in clear is anyone's on the path).
        self.api_refused = None if tls or insecure or is_loopback(listen_host) else (
            f"the API is off on {listen_host} without TLS: set http_tls, or "
            "http_insecure: true to accept tokens in clear")

    def __call__(self, request: Request) -> Response:
        response = self._route(request)
        own = {name for name, _ in response.headers}
        response.headers.extend(h for h in SECURITY_HEADERS if h[0] not in own)
        return response

    def _route(self, request: Request) -> Response:
        path = request.path
        if path in ("/metrics", "/healthz"):
            if request.method not in ("GET", "HEAD"):
                return self._not_allowed({"GET", "HEAD"})
            if self.metrics_token:
                try:
                    self._identify(request)
                except CredentialError as exc:
                    return self._credential_error(exc)
            return self._metrics() if path == "/metrics" else self._health()
        if path.startswith(api.PREFIX):
            return self._api(request)
        if path == periodic.PREFIX or path.startswith(periodic.PREFIX + "/"):
            return self._periodic(request)
        if self.console.serves(path):
            if self.api_refused is not None:
                return json_error(403, self.api_refused)
            return self.console.handle(request)
        return json_error(404, f"no such path: {path[:200]}")

    # -- open endpoints ---------------------------------------------------------------------

    def _metrics(self) -> Response:
        try:
            body, content_type = self.render_metrics()
        except Exception:  # noqa: BLE001 - a scrape must not take the listener down
            log.exception("cannot render /metrics")
            return Response(500, b"cannot render metrics; see the daemon's log\n")
        return Response(200, body, content_type)

    def _health(self) -> Response:
        try:
            ok = bool(self.healthy())
        except Exception:  # noqa: BLE001 - an error means "not healthy", not a 500
            log.exception("health check failed")
            ok = False
        return Response(200 if ok else 503, b"ok\n" if ok else b"unhealthy\n")

    # -- the API ----------------------------------------------------------------------------

    def _identify(self, request: Request) -> Identity:
        return self.credentials.identify(bearer(request.header("Authorization")),
                                         request.client)

    @staticmethod
    def _credential_error(exc: CredentialError) -> Response:
        response = json_error(exc.status, str(exc))
        if exc.status == 401:
            response.headers.append(("WWW-Authenticate", 'Bearer realm="perfectschedd"'))
        return response

    @staticmethod
    def _not_allowed(methods: set[str]) -> Response:
        response = json_error(405, f"method not allowed here (allowed: "
                                   f"{', '.join(sorted(methods))})")
        response.headers.append(("Allow", ", ".join(sorted(methods))))
        return response

    def _api(self, request: Request) -> Response:
        def answer(ask: api.Ask, caller: Caller) -> Response:
            name, holes, allowed = api.match(request.method, request.path)
            if name is None:
                if allowed:
                    return self._not_allowed(allowed)
                return json_error(404, f"no such path: {request.path[:200]}")
            return api.Api(ask).handle(request, name, holes)

        return self._as_token(request, answer)

    def _periodic(self, request: Request) -> Response:
        def answer(ask: api.Ask, caller: Caller) -> Response:
            if request.method not in periodic.METHODS:
                return self._not_allowed(periodic.METHODS)
            return periodic.Periodic(ask, caller, self.routes()).handle(request)

        return self._as_token(request, answer)

    def _as_token(self, request: Request,
                  answer: Callable[[api.Ask, Caller], Response]) -> Response:
        """`answer` for the token the request shows, asking the master's dispatch as its
        caller; a refusal (credentials, or of a command) as one JSON line."""
        if self.api_refused is not None:
            return json_error(403, self.api_refused)
        try:
            identity = self._identify(request)
        except CredentialError as exc:
            return self._credential_error(exc)
        caller = identity.caller(self.group_gid)

        def ask(cmd: str, args: dict[str, Any]) -> Any:
            return self.dispatch(cmd, args, caller)

        try:
            response = answer(ask, caller)
        except Exception as exc:  # noqa: BLE001 - every refusal is one JSON line
            response = json_error(*api.refused(exc))
        if request.method not in ("GET", "HEAD") and response.status < 400:
            log.info("http: %s (%s) %s %s -> %d", caller.name, identity.role,
                     request.method, request.path[:200], response.status)
        return response
