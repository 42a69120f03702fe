"""Talk to a perfectschedd over its HTTP API (`perfectschedctl --url`), from any machine.

HttpClient has SocketClient's surface, `call(cmd, args)` with the socket's commands and
arguments, and answers what the socket answers, so that cli.py prints the same lines,
the same JSON and the same exit statuses whichever way a command went.  Each command is
a route of perfectschedd/web/api.py (list follows the pages' `next`; pause and resume of
several keys post each one).  An error answer, {"error": ONE LINE} with its status,
becomes the RemoteError the socket would have raised: the line is the daemon's own, the
type is the one protocol.REFUSALS gives that status (STATUS_TYPES); 401, 429 and 503
say what to do about them.  Nothing reached (refused, no such host, TLS, timeout) is
DaemonUnavailable, in one line naming the URL.

The standard library's http.client and ssl, not requests or urllib3: perfectschedctl
depends on nothing else and is installed with the daemon, the requests are few and
plain (one connection kept alive, JSON bodies of known length), and certificates are
checked as ssl checks them by default.  Only cli.py's --url loads this module: ssl and
http.client cost milliseconds of every start that uses the socket.

The rules (perfectschedctl(1), "REMOTE USE"):
  - https:// checks the daemon's certificate and name against the system's CAs, or
    against the CA of --ca-file alone (a private CA); there is no way around the check;
  - http:// only to a loopback address, unless --insecure: elsewhere the token would
    cross the network in clear (the daemon refuses its API there unless http_insecure);
  - the token file is read as the daemon reads its own secrets (secretfile.read): a
    regular file of one line that not every user may read (as ssh refuses a private key
    others can read: a token they could read is theirs too).
"""

from __future__ import annotations

import http.client
import ipaddress
import json
import os
import socket
import ssl
import urllib.parse
from typing import Any

from perfectschedd import ConfigError, __version__, secretfile
from perfectschedd.control import protocol
from perfectschedd.control.protocol import HISTORY_MAX, HISTORY_OUTPUT_BYTES
from perfectschedd.errors import (
    InvalidInputError,
    NotFoundError,
    NotSupportedError,
    PermissionDeniedError,
)

from .client import DaemonUnavailable

API = "/api/v1/"
# A page of `list` (perfectschedd/web/api.py's PAGE_MAX: importing it would load the
# daemon's listener).
PAGE_MAX = 1000

# The error type (and so the exit status) of each status of an error answer: the type
# whose protocol.REFUSALS http_status it is (tests hold the two together); 401 and 429
# (credentials, throttled) are the socket's PermissionDenied, a caller it does not admit.
STATUS_TYPES = {
    400: "InvalidInputError", 401: "PermissionDenied", 403: "PermissionDeniedError",
    404: "NotFoundError", 405: "InvalidInputError", 409: "AlreadyExistsError",
    413: "InvalidInputError", 429: "PermissionDenied", 500: "InternalError",
    503: "DatabaseUnavailableError",
}

# perfectschedctl's commands that work over --url: those of the API's routes, and logs
# and next, which read through them.  Every other command is refused (HOST_ONLY).
REMOTE_COMMANDS = frozenset({"list", "show", "add", "modify", "delete", "pause", "resume",
                             "run", "history", "logs", "next", "status"})
# Why a command is not run over --url, where there is more to say than "on a host".
HOST_ONLY = {
    "reload": "it reloads a daemon's configuration: run it on that host (its socket, or "
              "systemctl reload perfectschedd)",
    "apply": "schedules files converge through the socket of a host of the daemon: run "
             "it there",
    "init": "it opens the database itself: perfectschedctl -c CONFIG init",
    "import-crontab": "it reads a crontab here and talks to no daemon: leave --url out",
    "import-legacy": "it adds many schedules in one request, which the API does not take: "
                     "run it on a host of the daemon",
}


def check_command(name: str) -> None:
    """Refuse, in one line, a command that does not go over --url."""
    if name not in REMOTE_COMMANDS:
        why = HOST_ONLY.get(name, "run it on a host of the daemon, through its socket")
        raise InvalidInputError("command", f"{name} does not go over --url: {why}")


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def key_path(key: str, *rest: str) -> str:
    """The path of a schedule's route: its key percent-encoded whole ('/' too), and a
    key of dots encoded, so that nothing on the way reads it as a step up."""
    quoted = urllib.parse.quote(key, safe="")
    if quoted in (".", ".."):
        quoted = quoted.replace(".", "%2E")
    return "/".join(("schedules", quoted, *rest))


def read_token(path: str, field: str) -> str:
    """The token of a file; ConfigError, in one line, for a file that will not do."""
    try:
        return secretfile.read(os.path.abspath(os.path.expanduser(path)), field)
    except secretfile.SecretError as exc:
        raise ConfigError(str(exc)) from None


def parse_url(url: str, insecure: bool, field: str = "--url") -> urllib.parse.SplitResult:
    """`url` as the client takes it, or ConfigError naming `field`."""
    parts = urllib.parse.urlsplit(url)
    try:
        parts.port  # noqa: B018 - a bad port raises
    except ValueError:
        raise ConfigError(f"{field}: {url!r}: bad port") from None
    if parts.scheme not in ("https", "http") or not parts.hostname:
        raise ConfigError(f"{field}: {url!r} is not an https:// (or http://) URL: "
                          "https://HOST:PORT of the daemon's http_listen")
    if parts.username or parts.password or parts.query or parts.fragment:
        raise ConfigError(f"{field}: {url!r}: only https://HOST:PORT[/PATH] (the token "
                          "goes in --token-file, not in the URL)")
    if parts.scheme == "http" and not insecure and not is_loopback(parts.hostname):
        raise ConfigError(f"{field}: refusing to send a token in clear to "
                          f"{url.rstrip('/')}: use https:// (the daemon's http_tls), or "
                          "--insecure")
    return parts


class HttpClient:
    """`url`: https://HOST:PORT (or a path under which a proxy serves the API);
    `token`: the API token's secret; `token_source`: where it was read, for messages;
    `fields`: where url and ca_file were given (an option or a variable), for messages."""

    def __init__(self, url: str, token: str, *, token_source: str = "the token",
                 ca_file: str | None = None, insecure: bool = False, timeout: float = 30.0,
                 fields: tuple[str, str] = ("--url", "--ca-file")) -> None:
        parts = parse_url(url, insecure, fields[0])
        self.url = url.rstrip("/")
        self.host, self.port, self.tls = parts.hostname, parts.port, parts.scheme == "https"
        self.prefix = parts.path.rstrip("/")
        self.token, self.token_source = token, token_source
        self.timeout = timeout
        self.context: ssl.SSLContext | None = None
        if self.tls:
            try:
                # The system's CAs; with a CA file, that CA's alone.
                self.context = ssl.create_default_context(cafile=ca_file)
            except FileNotFoundError:
                raise ConfigError(f"{fields[1]}: cannot read {ca_file}: no such file"
                                  ) from None
            except (ssl.SSLError, OSError) as exc:
                raise ConfigError(f"{fields[1]}: cannot use {ca_file}: "
                                  f"{getattr(exc, 'reason', None) or exc}") from None
        self.conn: http.client.HTTPConnection | None = None
        self.used = False  # the connection answered a request already (kept alive)

    @classmethod
    def of_options(cls, url: tuple[str, str], token_file: tuple[str | None, str],
                   ca_file: tuple[str | None, str], insecure: bool) -> HttpClient:
        """From the options, each (value, where it was given: the option or the
        variable)."""
        parse_url(url[0], insecure, url[1])  # a URL that will not do: before the token
        if not token_file[0]:
            raise ConfigError("--url needs an API token: --token-file FILE or "
                              "PERFECTSCHED_TOKEN_FILE (perfectschedctl token add, on a "
                              "host of the daemon, makes one)")
        token = read_token(token_file[0], token_file[1])
        return cls(url[0], token, token_source=f"{token_file[1]} {token_file[0]}",
                   ca_file=ca_file[0], insecure=insecure, fields=(url[1], ca_file[1]))

    # -- the commands -----------------------------------------------------------------------

    def call(self, cmd: str, args: dict[str, Any] | None = None) -> Any:
        handler = getattr(self, "_" + cmd, None) if cmd in _HANDLED else None
        if handler is None:
            raise NotSupportedError(f"{cmd}: not in the HTTP API; run it on a host of the "
                                    "daemon, through its socket")
        return handler(dict(args or {}))

    def _status(self, a: dict[str, Any]) -> Any:
        return self.ask("GET", "status")

    def _list(self, a: dict[str, Any]) -> list[Any]:
        """Every page, following `next`, up to the limit if there is one."""
        want = a.get("limit")
        rows: list[Any] = []
        after = a.get("after")
        if want == 0:
            return rows
        while True:
            query: dict[str, Any] = {"limit": PAGE_MAX if want is None else
                                     min(PAGE_MAX, want - len(rows))}
            if a.get("prefix"):
                query["prefix"] = a["prefix"]
            if after:
                query["after"] = after
            page = self.ask("GET", "schedules", query)
            rows.extend(page.get("items") or [])
            after = page.get("next")
            if not isinstance(after, str) or (want is not None and len(rows) >= want):
                return rows

    def _show(self, a: dict[str, Any]) -> Any:
        return self.ask("GET", key_path(_key(a)))

    def _add(self, a: dict[str, Any]) -> Any:
        _key(a)
        return self.ask("POST", "schedules", body=a)

    def _modify(self, a: dict[str, Any]) -> Any:
        key = _key(a)
        return self.ask("PATCH", key_path(key), body={k: v for k, v in a.items()
                                                         if k != "key"})

    def _delete(self, a: dict[str, Any]) -> Any:
        key = _key(a)
        self.ask("DELETE", key_path(key), {"force": "true"} if a.get("force") else None)
        # The API answers 204, without the count of extra runs the socket gives.
        return {"key": key, "deleted": True}

    def _run(self, a: dict[str, Any]) -> Any:
        return self.ask("POST", key_path(_key(a), "run"))

    def _next(self, a: dict[str, Any]) -> Any:
        query = {"n": a["count"]} if a.get("count") is not None else None
        return self.ask("GET", key_path(_key(a), "next"), query)

    def _pause(self, a: dict[str, Any]) -> Any:
        return self._pausing("pause", "paused", a)

    def _resume(self, a: dict[str, Any]) -> Any:
        return self._pausing("resume", "resumed", a)

    def _pausing(self, verb: str, done_word: str, a: dict[str, Any]) -> Any:
        """One key: its request, answered as the socket answers.  Several: each is a
        request of its own (the API takes one key), after all of them are known to exist,
        so that a key not found changes nothing, as over the socket."""
        for selector, flag in (("all", "--all"), ("prefix", "--prefix")):
            if a.get(selector):
                raise NotSupportedError(
                    f"{verb} {flag}: not over --url (the API {verb}s one key at a time): "
                    f"run it on a host of the daemon, through its socket")
        options = {k: True for k in ("force", "skip_missed") if a.get(k)}
        if "key" in a:
            return self.ask("POST", key_path(_key(a), verb), body=options or None)
        keys = list(dict.fromkeys(a.get("keys") or []))
        if not keys:
            raise InvalidInputError("key", f"{verb} what? give KEY..., --prefix PREFIX or "
                                    "--all")
        missing = [k for k in keys if not self._exists(k)]
        if missing:
            raise NotFoundError(f"schedule(s) not found: {', '.join(missing[:20])}"
                                f"{' ...' if len(missing) > 20 else ''}; nothing changed")
        skipped = 0
        for i, key in enumerate(keys):
            try:
                row = self.ask("POST", key_path(key, verb), body=options or None)
            except protocol.RemoteError as exc:
                if i:
                    raise protocol.RemoteError(exc.type, f"{exc} ({done_word} before it, "
                                               f"each by a request of its own: "
                                               f"{' '.join(keys[:i])})", exc.daemon) from None
                raise
            skipped += int(row.get("skipped_occurrences") or 0)
        result: dict[str, Any] = {done_word: keys, "count": len(keys)}
        if a.get("skip_missed"):
            result["skipped_occurrences"] = skipped
        return result

    def _exists(self, key: str) -> bool:
        try:
            self.ask("GET", key_path(key))
        except protocol.RemoteError as exc:
            if exc.type == "NotFoundError":
                return False
            raise
        return True

    def _history(self, a: dict[str, Any]) -> list[Any]:
        """The runs route; `attempt` (logs --attempt) is chosen here among the newest
        HISTORY_MAX runs (the route does not filter by attempt), and the output of a run
        the answer left out for its size is read from its output route, as the socket
        answers such a request whole."""
        if a.get("raw"):
            raise PermissionDeniedError("--raw: output unescaped is root's, through the "
                                        "socket of a host of the daemon; not over --url")
        key = _key(a)
        limit = a.get("limit", 20)
        attempt = a.get("attempt")
        runs = self.ask("GET", key_path(key, "runs"),
                         {"limit": HISTORY_MAX if attempt is not None else limit})["items"]
        if attempt is None:
            return list(runs)
        runs = [r for r in runs if r.get("attempt") == attempt][:limit]
        budget = HISTORY_OUTPUT_BYTES
        for r in runs:
            if r.get("output_omitted") and budget > 0:
                r["output"] = self.ask_text("GET", key_path(
                    str(r.get("key") or key), "runs", str(r.get("scheduled_time")),
                    str(r.get("attempt")), "output"))
                del r["output_omitted"]
            budget -= len(r.get("output") or "")
        return runs

    # -- HTTP -------------------------------------------------------------------------------

    def ask(self, method: str, path: str, query: dict[str, Any] | None = None,
             body: Any = None) -> Any:
        status, data = self.request(method, path, query, body)
        if status == 204:
            return None
        try:
            return json.loads(data)
        except (UnicodeDecodeError, ValueError):
            raise protocol.ProtocolError(f"{self.url}: the answer to {method} {API}{path} "
                                         "is not JSON") from None

    def ask_text(self, method: str, path: str) -> str:
        return self.request(method, path)[1].decode("utf-8", errors="replace")

    def request(self, method: str, path: str, query: dict[str, Any] | None = None,
                body: Any = None) -> tuple[int, bytes]:
        """(status, body) of a successful answer; RemoteError for an error answer,
        DaemonUnavailable when there is none."""
        target = self.prefix + API + path
        if query:
            target += "?" + urllib.parse.urlencode(query)
        headers = {"Authorization": f"Bearer {self.token}", "Accept": "application/json",
                   "User-Agent": f"perfectschedctl/{__version__}"}
        data = None
        if body is not None:
            data = json.dumps(body, separators=(",", ":"), allow_nan=False).encode()
            headers["Content-Type"] = "application/json"
        while True:
            conn, reused = self._connection(), self.used
            try:
                conn.request(method, target, body=data, headers=headers)
                response = conn.getresponse()
                payload = response.read()
            except (http.client.RemoteDisconnected, ConnectionResetError,
                    BrokenPipeError) as exc:
                self.close()
                if reused and method == "GET":
                    continue  # a kept-alive connection the daemon had closed: once more
                raise self._unavailable(exc) from None
            except (OSError, http.client.HTTPException) as exc:
                self.close()
                raise self._unavailable(exc) from None
            self.used = True
            if response.will_close:
                self.close()
            if response.status < 300:
                return response.status, payload
            raise self._refusal(response, payload)

    def _connection(self) -> http.client.HTTPConnection:
        if self.conn is None:
            if self.tls:
                self.conn = http.client.HTTPSConnection(self.host, self.port,
                                                        timeout=self.timeout,
                                                        context=self.context)
            else:
                self.conn = http.client.HTTPConnection(self.host, self.port,
                                                       timeout=self.timeout)
            self.used = False
        return self.conn

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def _unavailable(self, exc: BaseException) -> DaemonUnavailable:
        where = f"cannot reach perfectschedd at {self.url}"
        if isinstance(exc, ssl.SSLCertVerificationError):
            return DaemonUnavailable(f"{where}: its certificate is not trusted "
                                     f"({exc.verify_message}; a private CA: --ca-file FILE)")
        if isinstance(exc, ssl.SSLError):
            return DaemonUnavailable(f"{where}: TLS failed ({exc.reason or exc}; is the "
                                     "listener http://, without http_tls?)")
        if isinstance(exc, TimeoutError):
            return DaemonUnavailable(f"perfectschedd at {self.url} did not answer within "
                                     f"{self.timeout:g}s")
        if isinstance(exc, ConnectionRefusedError):
            return DaemonUnavailable(f"{where}: connection refused (nothing listens there: "
                                     "the daemon's http_listen?)")
        if isinstance(exc, socket.gaierror):
            return DaemonUnavailable(f"{where}: {self.host}: {exc.strerror}")
        if isinstance(exc, http.client.RemoteDisconnected | ConnectionResetError |
                      BrokenPipeError):
            return DaemonUnavailable(f"{where}: the connection was closed without an answer"
                                     + ("" if self.tls else " (an https:// listener?)"))
        if isinstance(exc, http.client.HTTPException):
            return DaemonUnavailable(f"{where}: not an HTTP answer ({type(exc).__name__})")
        return DaemonUnavailable(f"{where}: "
                                 f"{getattr(exc, 'strerror', None) or exc or type(exc).__name__}")

    def _refusal(self, response: http.client.HTTPResponse, payload: bytes
                 ) -> protocol.RemoteError:
        """The RemoteError of an error answer, with the daemon's line as its message."""
        status = response.status
        server = (response.getheader("Server") or "").strip()
        daemon = server.removeprefix("perfectschedd/") if server.startswith(
            "perfectschedd/") else None
        try:
            message = json.loads(payload)["error"]
        except (UnicodeDecodeError, ValueError, TypeError, KeyError):
            message = None
        if not isinstance(message, str):
            return protocol.RemoteError(
                STATUS_TYPES.get(status, "InternalError"),
                f"{self.url}: HTTP {status} {response.reason}: not an answer of "
                "perfectschedd's API (--url is https://HOST:PORT of its http_listen)")
        message = message.splitlines()[0] if message.strip() else f"HTTP {status}"
        if status == 401:
            message = (f"{self.url} refused the token of {self.token_source}: {message} "
                       "(a new one: perfectschedctl token add, on a host of the daemon)")
        elif status == 429:
            message = f"{self.url} refuses this address for now: {message}"
        elif status == 503:
            message = (f"perfectschedd at {self.url} cannot answer now: {message} (the "
                       "daemon is busy or its database does not answer; try again)")
        elif status in (404, 405) and message.startswith(("no such path",
                                                          "method not allowed")):
            # A route one end does not know: two releases, or not the daemon's listener.
            message += (protocol.versions_note(__version__, daemon) if daemon else
                        f" (is {self.url} perfectschedd's http_listen?)")
        return protocol.RemoteError(STATUS_TYPES.get(status, "InternalError"), message,
                                    daemon)


def _key(a: dict[str, Any]) -> str:
    key = a.get("key")
    if not isinstance(key, str):
        raise InvalidInputError("key", "required")
    return key


# The socket's commands HttpClient answers (call refuses the others).
_HANDLED = frozenset({"status", "list", "show", "add", "modify", "delete", "run", "next",
                      "pause", "resume", "history"})
