"""The master's HTTP listener (`http_listen`): one thread running an asyncio loop that
reads requests and writes answers, and a small pool of threads that make the answers.

Why asyncio streams and not http.server (which served /metrics until 0.2.0) or aiohttp:
http.server holds a thread per connection, so a thousand idle clients are a thousand
threads, or, capped, a thousand clients that lock everyone else out; aiohttp would do,
but adds a dependency (and its C extensions) to every host for what takes a request
line, headers, a body of known length and an answer.  Here an idle connection costs a
descriptor and a coroutine, is cut at its deadline, and gives its place up to a new
client when the listener is full; TLS is the ssl module's, with its handshake timeout.

Nothing a client does reaches the master's loop: answers are made on the pool
(`ANSWER_DEADLINE` each; past it the client gets a 503 in one JSON line while the call
ends on its own, bounded by the database layer's statement deadlines).
"""

from __future__ import annotations

import asyncio
import collections
import http.client
import io
import logging
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from email.message import Message
from typing import Any

from perfectschedd import __version__
from perfectschedd.fdguard import AcceptGuard

log = logging.getLogger("perfectschedd")

HEAD_MAX = 16 * 1024           # request line and headers (431 past it)
HEADERS_MAX = 64               # header lines (431 past them)
BODY_MAX = 1024 * 1024         # a request body (413 past it; SPEC)
HEAD_DEADLINE = 10.0           # from the connection (or the previous answer) to the head
BODY_DEADLINE = 10.0           # the body, once the head is in
IDLE_DEADLINE = 15.0           # a kept-alive connection waiting for its next request
WRITE_DEADLINE = 10.0          # an answer, to a client that reads slowly
ANSWER_DEADLINE = 8.0          # making an answer (a database call); then 503
TLS_HANDSHAKE_DEADLINE = 10.0
REQUESTS_PER_CONNECTION = 100
# Connections open at once.  When full, the oldest one that has not yet sent a whole
# request is closed to make room: idle clients cannot lock out the others.
CONNECTIONS_MAX = 256
NEW, SERVED, CLOSING = "new", "served", "closing"
ANSWER_THREADS = 8

REASONS = {code: http.client.responses.get(code, "") for code in (
    200, 201, 204, 301, 302, 303, 304, 400, 401, 403, 404, 405, 408, 409, 411, 413, 415,
    429, 431, 500, 501, 503)}


@dataclass
class Request:
    method: str
    path: str                      # percent-decoding is the router's (keys may hold '/')
    query: dict[str, list[str]]
    headers: Message
    body: bytes
    client: str                    # the peer's address
    tls: bool

    def header(self, name: str) -> str | None:
        return self.headers.get(name)

    def arg(self, name: str) -> str | None:
        values = self.query.get(name)
        return values[-1] if values else None


@dataclass
class Response:
    status: int
    body: bytes = b""
    content_type: str = "text/plain; charset=utf-8"
    headers: list[tuple[str, str]] = field(default_factory=list)


App = Callable[[Request], Response]


class _Refused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class HttpListener:
    """Serves `app` on `listen` (host, port) until stop(); raises OSError if it cannot
    bind, ssl.SSLError/OSError if `tls` (cert, key) cannot be loaded."""

    def __init__(self, listen: tuple[str, int], app: App,
                 tls: tuple[str, str] | None = None) -> None:
        host, port = listen
        self.app = app
        self.tls = _tls_context(*tls) if tls is not None else None
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.create_server((host, port), family=family, backlog=128,
                                         reuse_port=False)
        self.sock.setblocking(False)
        self.address: tuple[str, int] = self.sock.getsockname()[:2]
        self.guard = AcceptGuard("http_listen", log)
        self.pool = ThreadPoolExecutor(ANSWER_THREADS, thread_name_prefix="http-answer")
        # Open connections, oldest first, each NEW (no whole request yet: the ones closed
        # to make room), SERVED or CLOSING.
        self.conns: collections.OrderedDict[socket.socket, str] = collections.OrderedDict()
        self.accepting = True
        self.stopping = False
        self.lock = threading.Lock()  # conns, read by fds() from the master's thread
        self.loop = asyncio.new_event_loop()
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._run, name="http", daemon=True)
        self.thread.start()
        self.started.wait(5)

    @property
    def port(self) -> int:
        return int(self.address[1])

    def reconfigure(self, app: App, tls: tuple[str, str] | None) -> None:
        """A reload that keeps the address: new connections get `app` and `tls` (loaded
        first: a key that does not load raises and changes nothing).  A second listener
        cannot bind the address this one holds."""
        context = _tls_context(*tls) if tls is not None else None
        self.app, self.tls = app, context

    # -- the loop's thread ------------------------------------------------------------------

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.add_reader(self.sock.fileno(), self._accept)
        self.loop.call_soon(self.started.set)
        self.loop.run_forever()

    def _accept(self) -> None:
        if len(self.conns) >= CONNECTIONS_MAX:
            # Full, and a client waits: the oldest client that has sent no whole request
            # is closed, and the next one is taken once it is gone (descriptors stay
            # within the cap).
            self._make_room()
            self.loop.remove_reader(self.sock.fileno())
            self.accepting = False
            return
        for _ in range(64):  # a burst of clients is taken in one wake-up
            if len(self.conns) >= CONNECTIONS_MAX:
                return  # the next wake-up, if a client still waits, makes room
            try:
                conn, addr = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if not self.guard.exhausted(self.sock, exc):
                    log.debug("http: accept: %s", exc)
                return
            conn.setblocking(False)
            if conn.family != socket.AF_UNIX:
                # An answer is one write, but without this a kept-alive client's next
                # answer waits for its delayed ACK (some 40 ms): asyncio sets it only on
                # the sockets it accepts itself.
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self.lock:
                self.conns[conn] = NEW
            self.loop.create_task(self._connection(conn, addr))

    def _make_room(self) -> None:
        with self.lock:
            if any(state == CLOSING for state in self.conns.values()):
                return  # one is on its way out already
            victim = next((s for s, state in self.conns.items() if state == NEW), None)
            if victim is None:
                return  # every one is being served: wait for one to end
            self.conns[victim] = CLOSING
        try:
            victim.shutdown(socket.SHUT_RDWR)  # its coroutine sees the end and closes it
        except OSError:
            pass

    def _ended(self, conn: socket.socket) -> None:
        with self.lock:
            self.conns.pop(conn, None)
        if not self.accepting and not self.stopping:
            self.accepting = True
            self.loop.add_reader(self.sock.fileno(), self._accept)

    async def _connection(self, conn: socket.socket, addr: Any) -> None:
        client = addr[0] if isinstance(addr, tuple) else str(addr)
        writer: asyncio.StreamWriter | None = None
        try:
            reader = asyncio.StreamReader(limit=HEAD_MAX, loop=self.loop)
            protocol = asyncio.StreamReaderProtocol(reader, loop=self.loop)
            transport, _ = await self.loop.connect_accepted_socket(
                lambda: protocol, conn, ssl=self.tls,
                ssl_handshake_timeout=TLS_HANDSHAKE_DEADLINE if self.tls else None)
            writer = asyncio.StreamWriter(transport, protocol, reader, self.loop)
            for served in range(REQUESTS_PER_CONNECTION):
                deadline = HEAD_DEADLINE if served == 0 else IDLE_DEADLINE
                keep = await self._one(conn, reader, writer, client, deadline,
                                       last=served == REQUESTS_PER_CONNECTION - 1)
                if not keep:
                    break
        except (TimeoutError, asyncio.IncompleteReadError, OSError) as exc:  # ssl errors too
            log.debug("http: %s: %s", client, exc or type(exc).__name__)
        except Exception:  # noqa: BLE001 - a client's trouble never stops the listener
            log.exception("http: %s: unexpected error", client)
        finally:
            if writer is not None:
                writer.close()
                try:
                    await asyncio.wait_for(writer.wait_closed(), 1.0)
                except (OSError, TimeoutError):
                    pass
            else:
                conn.close()
            self._ended(conn)

    async def _one(self, conn: socket.socket, reader: asyncio.StreamReader,
                   writer: asyncio.StreamWriter, client: str, deadline: float, last: bool
                   ) -> bool:
        """One request and its answer; whether the connection stays open for another."""
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), deadline)
        except asyncio.IncompleteReadError:
            return False  # closed between requests: the usual end
        except asyncio.LimitOverrunError:
            await self._write(writer, _error(431, "request head over "
                                             f"{HEAD_MAX} bytes"), False)
            return False
        try:
            method, target, version, headers = _parse_head(head)
        except _Refused as exc:
            await self._write(writer, _error(exc.status, str(exc)), False)
            return False
        with self.lock:
            if self.conns.get(conn) == NEW:
                self.conns[conn] = SERVED
        try:
            body = await asyncio.wait_for(self._body(reader, headers), BODY_DEADLINE)
        except _Refused as exc:
            await self._write(writer, _error(exc.status, str(exc)), False)
            return False
        keep = not last and version == "HTTP/1.1" and \
            (headers.get("Connection") or "").lower() != "close"
        path, _, query = target.partition("?")
        request = Request(method, path, urllib.parse.parse_qs(query, keep_blank_values=True),
                          headers, body, client, self.tls is not None)
        started = time.monotonic()
        try:
            response = await asyncio.wait_for(
                self.loop.run_in_executor(self.pool, self._answer, request), ANSWER_DEADLINE)
        except TimeoutError:
            response = _error(503, f"no answer within {ANSWER_DEADLINE:g} s (is the "
                              "database reachable?); nothing was changed unless a later "
                              "read shows it")
        log.debug("http: %s %s %s -> %d (%.0f ms)", client, method, path, response.status,
                  (time.monotonic() - started) * 1000)
        await self._write(writer, response, keep, head_only=method == "HEAD")
        with self.lock:
            if self.conns.get(conn) == SERVED:
                self.conns[conn] = NEW  # waiting for its next request: idle again
        return keep

    def _answer(self, request: Request) -> Response:
        try:
            return self.app(request)
        except Exception:  # noqa: BLE001 - a 500 in one line, the traceback in the log
            log.exception("http: %s %s", request.method, request.path)
            return _error(500, "internal error; see the daemon's log")

    @staticmethod
    async def _body(reader: asyncio.StreamReader, headers: Message) -> bytes:
        if headers.get("Transfer-Encoding"):
            raise _Refused(411, "chunked bodies are not taken: send Content-Length")
        length_text = headers.get("Content-Length")
        if length_text is None:
            return b""
        if not length_text.strip().isdigit():
            raise _Refused(400, "bad Content-Length")
        length = int(length_text)
        if length > BODY_MAX:
            raise _Refused(413, f"request body over {BODY_MAX} bytes")
        return await reader.readexactly(length) if length else b""

    @staticmethod
    async def _write(writer: asyncio.StreamWriter, response: Response, keep: bool,
                     head_only: bool = False) -> None:
        lines = [f"HTTP/1.1 {response.status} {REASONS.get(response.status, '')}",
                 f"Server: perfectschedd/{__version__}",
                 f"Content-Type: {response.content_type}",
                 f"Content-Length: {len(response.body)}",
                 "Cache-Control: no-store",
                 "X-Content-Type-Options: nosniff",
                 f"Connection: {'keep-alive' if keep else 'close'}",
                 *(f"{k}: {v}" for k, v in response.headers)]
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        writer.write(head if head_only else head + response.body)  # one segment if it fits
        await asyncio.wait_for(writer.drain(), WRITE_DEADLINE)

    # -- the master's side ------------------------------------------------------------------

    def fds(self) -> list[int]:
        """The listening and connected sockets, which a forked worker closes.  Called in
        the child right after fork, where no other thread runs: no lock."""
        reserve = self.guard.reserve
        return [self.sock.fileno(), *(s.fileno() for s in list(self.conns)),
                *([reserve] if reserve is not None else [])]

    def stop(self) -> None:
        self.stopping = True

        def close_all() -> None:
            if self.accepting:
                self.loop.remove_reader(self.sock.fileno())
            for s in list(self.conns):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            self.loop.call_later(0.2, self.loop.stop)

        if self.loop.is_running():
            self.loop.call_soon_threadsafe(close_all)
            self.thread.join(5)
        self.sock.close()
        self.guard.close()
        self.pool.shutdown(wait=False, cancel_futures=True)
        if not self.loop.is_running():
            self.loop.close()


def _tls_context(cert: str, key: str) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    return context


def _parse_head(head: bytes) -> tuple[str, str, str, Message]:
    line, _, rest = head.partition(b"\r\n")
    try:
        method, target, version = line.decode("ascii").split(" ")
    except (UnicodeDecodeError, ValueError):
        raise _Refused(400, "bad request line") from None
    if version not in ("HTTP/1.0", "HTTP/1.1") or not target.startswith("/"):
        raise _Refused(400, "bad request line")
    if rest.count(b"\r\n") > HEADERS_MAX + 1:
        raise _Refused(431, f"more than {HEADERS_MAX} header lines")
    try:
        headers = http.client.parse_headers(io.BytesIO(rest))
    except (http.client.HTTPException, ValueError):
        raise _Refused(400, "bad headers") from None
    return method, target, version, headers


def json_error(status: int, message: str) -> Response:
    """An error as the API answers it: one JSON line (SPEC)."""
    import json

    return Response(status, (json.dumps({"error": message}) + "\n").encode(),
                    "application/json")


_error = json_error

