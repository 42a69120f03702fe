"""Talk to a running perfectschedd over its Unix socket: send one request, read one answer."""

from __future__ import annotations

import errno
import socket
from typing import Any

from perfectschedd import __version__
from perfectschedd.control import protocol


class DaemonUnavailable(Exception):
    """The daemon cannot be reached (not running, wrong path, no permission)."""


class SocketClient:
    def __init__(self, path: str, timeout: float = 30.0) -> None:
        self.path = path
        self.timeout = timeout
        # Our version, sent with each request; None once a daemon older than 0.2.0
        # refused the field (it knows no "client").
        self.client: str | None = __version__

    def call(self, cmd: str, args: dict[str, Any] | None = None) -> Any:
        if cmd == "list":
            return self.list_all(args or {})
        return self._call(cmd, args)["result"]

    def list_all(self, args: dict[str, Any]) -> list[Any]:
        """`list`, following the daemon's pages ("more") up to args' limit, if any."""
        want = args.get("limit")
        rows: list[Any] = []
        page_args = dict(args)
        while True:
            if isinstance(want, int):
                page_args["limit"] = want - len(rows)
            answer = self._call("list", page_args)
            rows.extend(answer["result"] or [])
            more = answer.get("more")
            if not isinstance(more, dict) or not isinstance(more.get("after"), str) or (
                    isinstance(want, int) and len(rows) >= want):
                return rows
            page_args["after"] = more["after"]

    def _call(self, cmd: str, args: dict[str, Any] | None = None) -> dict[str, Any]:
        try:
            return self._exchange(cmd, args)
        except protocol.RemoteError as exc:
            if self.client is not None and exc.type == "ProtocolError" and \
                    "unknown field(s) client" in str(exc):
                self.client = None  # a 0.1.0 daemon: ask as 0.1.0's clients did
                return self._call(cmd, args)
            if exc.daemon is None and self.client is None and exc.type == \
                    "InvalidInputError" and any(m in str(exc)
                                                for m in protocol.UNKNOWN_TO_ONE_END):
                raise protocol.RemoteError(exc.type, str(exc) + protocol.versions_note(
                    __version__, None)) from None
            raise

    def _exchange(self, cmd: str, args: dict[str, Any] | None) -> dict[str, Any]:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            try:
                sock.connect(self.path)
            except FileNotFoundError:
                raise DaemonUnavailable(
                    f"perfectschedd is not running (no socket at {self.path}; another "
                    "daemon's socket: --socket PATH or PERFECTSCHED_SOCKET)") from None
            except PermissionError:
                raise DaemonUnavailable(
                    f"permission denied on {self.path}: run as root or as a member of the "
                    "daemon's group") from None
            except OSError as exc:
                if exc.errno in (errno.ECONNREFUSED, errno.ENOTSOCK):
                    raise DaemonUnavailable(
                        f"perfectschedd is not running (nothing listens on {self.path})"
                    ) from None
                raise DaemonUnavailable(f"cannot connect to {self.path}: {exc.strerror}") from None
            try:
                sock.sendall(protocol.request(cmd, args, self.client))
            except (BrokenPipeError, ConnectionResetError):
                pass  # refused at once (permission, busy): the answer is waiting to be read
            buf = bytearray()
            while not buf.endswith(b"\n"):
                try:
                    chunk = sock.recv(65536)
                except ConnectionResetError:
                    chunk = b""
                if not chunk:
                    raise DaemonUnavailable("perfectschedd closed the connection without answering")
                buf += chunk
            return protocol.parse_response_full(bytes(buf))
        except TimeoutError:
            raise DaemonUnavailable(
                f"perfectschedd did not answer within {self.timeout:g}s") from None
        finally:
            sock.close()
