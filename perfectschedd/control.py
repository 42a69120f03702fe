"""Unix-socket server: one request -> one dispatch() call -> one response.

Protocol: see protocol.py (newline-delimited JSON, MAX_FRAME bytes per frame).  Every
connection is authorised by its peer's credentials (SO_PEERCRED): root, the daemon's own
user, or a member of `control_group` (or of the socket's group).
"""

from __future__ import annotations

import grp
import logging
import os
import pwd
import socket
import stat
import struct
import threading
from collections.abc import Callable
from typing import Any

from sqlalchemy.exc import DBAPIError

from . import protocol
from .config import Config
from .errors import ConfigError, ScheduleError

Dispatch = Callable[[str, dict[str, Any]], Any]
# Connections served at once; more wait in the listen backlog.
MAX_CLIENTS = 64
IDLE_TIMEOUT = 30.0
_PEERCRED = struct.Struct("3i")


def peer_credentials(conn: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end."""
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    return _PEERCRED.unpack(raw)


def _supplementary_gids(pid: int) -> set[int]:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Groups:"):
                    return {int(g) for g in line.split()[1:]}
    except OSError:
        pass
    return set()


class ControlServer:
    def __init__(self, config: Config, dispatch: Dispatch, *, log: logging.Logger) -> None:
        self.path = config.control_socket
        self.dispatch = dispatch
        self.log = log
        self.group_gid = self._resolve_group(config.control_group)
        self.sock: socket.socket | None = None
        self.thread: threading.Thread | None = None
        self.stopping = threading.Event()
        self.slots = threading.BoundedSemaphore(MAX_CLIENTS)
        self.my_uid = os.geteuid()

    @staticmethod
    def _resolve_group(name: str | None) -> int | None:
        if name is None:
            return None
        try:
            return grp.getgrnam(name).gr_gid
        except KeyError:
            raise ConfigError(f"control_group: no such group {name!r}") from None

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, mode=0o755, exist_ok=True)
        self._remove_stale()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o117)  # the socket is born 0660, never briefly wider
        try:
            sock.bind(self.path)
        finally:
            os.umask(old_umask)
        if self.group_gid is not None:
            os.chown(self.path, -1, self.group_gid)
        os.chmod(self.path, 0o660)
        sock.listen(128)
        self.sock = sock
        self.thread = threading.Thread(target=self._accept_loop, name="control", daemon=True)
        self.thread.start()
        self.log.info("control socket listening on %s", self.path)

    def _remove_stale(self) -> None:
        """Replace a socket file left by a crash, but never a live daemon's socket."""
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise ConfigError(f"control_socket: {self.path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(1.0)
        try:
            probe.connect(self.path)
        except (ConnectionRefusedError, FileNotFoundError):
            os.unlink(self.path)  # stale
            return
        except OSError:
            os.unlink(self.path)
            return
        finally:
            probe.close()
        raise ConfigError(f"control_socket: another perfectschedd is listening on {self.path}")

    def fds(self) -> list[int]:
        return [self.sock.fileno()] if self.sock is not None else []

    def stop(self) -> None:
        self.stopping.set()
        if self.sock is not None:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self.sock.close()
            self.sock = None
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    # -- serving --------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        sock = self.sock
        assert sock is not None
        while not self.stopping.is_set():
            try:
                conn, _ = sock.accept()
            except OSError:
                if self.stopping.is_set():
                    return
                continue
            if not self.slots.acquire(timeout=5.0):
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), name="control-conn",
                             daemon=True).start()

    def authorised(self, conn: socket.socket) -> tuple[bool, str]:
        pid, uid, gid = peer_credentials(conn)
        if uid == 0 or uid == self.my_uid:
            return True, ""
        allowed_gid = self.group_gid
        if allowed_gid is None:
            try:
                allowed_gid = os.stat(self.path).st_gid
            except OSError:
                allowed_gid = os.getegid()
        if gid == allowed_gid or allowed_gid in _supplementary_gids(pid):
            return True, ""
        try:
            who = pwd.getpwuid(uid).pw_name
        except KeyError:
            who = f"uid {uid}"
        return False, f"permission denied: {who} is not root, the daemon's user or in its group"

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(IDLE_TIMEOUT)
            ok, why = self.authorised(conn)
            if not ok:
                conn.sendall(protocol.error("PermissionDenied", why))
                return
            buf = bytearray()
            while not self.stopping.is_set():
                nl = buf.find(b"\n")
                if nl < 0:
                    if len(buf) > protocol.MAX_FRAME:
                        conn.sendall(protocol.error(
                            "ProtocolError", f"request larger than {protocol.MAX_FRAME} bytes"))
                        return
                    chunk = conn.recv(65536)
                    if not chunk:
                        return  # client went away (maybe mid-frame): nothing to do
                    buf += chunk
                    continue
                line, buf = bytes(buf[:nl]), buf[nl + 1:]
                if len(line) > protocol.MAX_FRAME:
                    conn.sendall(protocol.error(
                        "ProtocolError", f"request larger than {protocol.MAX_FRAME} bytes"))
                    return
                if line.strip():
                    conn.sendall(self.handle(line))
        except (OSError, TimeoutError):
            pass
        finally:
            conn.close()
            self.slots.release()

    def handle(self, line: bytes) -> bytes:
        try:
            cmd, args = protocol.parse_request(line)
            return protocol.ok(self.dispatch(cmd, args))
        except protocol.ProtocolError as exc:
            return protocol.error("ProtocolError", str(exc))
        except ScheduleError as exc:
            return protocol.error(type(exc).__name__, str(exc))
        except ConfigError as exc:
            return protocol.error("ConfigError", str(exc))
        except DBAPIError as exc:
            return protocol.error("DatabaseError",
                                  f"database error: {str(exc.orig).splitlines()[0]}")
        except Exception as exc:  # noqa: BLE001 - a request never takes the daemon down
            self.log.exception("control request failed")
            return protocol.error("InternalError", f"internal error: {exc}")
