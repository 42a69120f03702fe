"""Unix-socket server: one request -> one dispatch() call -> one response.

Protocol: protocol.py and docs/protocol.md (newline-delimited JSON, MAX_FRAME bytes per
frame).  Every connection is authorised by its peer's credentials (SO_PEERCRED and
SO_PEERGROUPS), by auth.admission's rule: root, the daemon's own user, or a member of
`control_group` (default: the daemon's group).

One thread owns every connection (a selector loop: idle or slow clients cost a buffer, not
a thread); complete requests run on small thread pools, because dispatch() talks to the
database.  A connection has at most one request in flight and is not read meanwhile, so
neither a flood of requests nor a client that never reads its answers grows our buffers.

What the socket shares with D-Bus and HTTP (its pools, the refusal ladder, `list` pages)
is transport.py's; here is only the socket's own: the file, the peers, the frames.
"""

from __future__ import annotations

import errno
import fcntl
import grp
import logging
import math
import os
import queue
import selectors
import socket
import stat
import struct
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from perfectschedd import __version__
from perfectschedd.config import Config
from perfectschedd.control import protocol
from perfectschedd.control.auth import Caller, admission
from perfectschedd.control.transport import (
    Dispatch,
    RequestPools,
    list_page,
    peek_command,
    refusal_of,
)
from perfectschedd.errors import ConfigError
from perfectschedd.fdguard import AcceptGuard

# Connections open at once; one more is answered with a "Busy" error and closed.
MAX_CLIENTS = 256
# A connection with no request in flight and no traffic for this long is closed.
IDLE_TIMEOUT = 60.0
# A request must arrive whole, and its answer be read whole, within this long.
REQUEST_DEADLINE = 10.0
# Requests executed at once (each may wait on the database).
DISPATCH_THREADS = 8
# The quick commands' (`status`) own pool: they never wait behind requests that wait on
# the database (transport.RequestPools).
QUICK_THREADS = 2
_PEERCRED = struct.Struct("3i")
_SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux >= 4.13


def peer_credentials(conn: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end."""
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
    return _PEERCRED.unpack(raw)


def peer_groups(conn: socket.socket) -> set[int]:
    """Supplementary groups of the peer, as the kernel recorded them at connect()."""
    size = 256 * 4
    for _ in range(4):
        try:
            raw = conn.getsockopt(socket.SOL_SOCKET, _SO_PEERGROUPS, size)
        except OSError as exc:
            if exc.errno == errno.ERANGE:
                size *= 4
                continue
            break
        n = len(raw) // 4
        return set(struct.unpack(f"{n}I", raw[:n * 4]))
    # No SO_PEERGROUPS (Linux before 4.13): the peer's egid from SO_PEERCRED alone.
    # Never /proc/PID: the peer may have exited and its PID gone to another process.
    return set()


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    pid: int
    caller: Caller  # as the kernel recorded it at connect()
    inbuf: bytearray = field(default_factory=bytearray)
    outbuf: bytearray = field(default_factory=bytearray)
    busy: bool = False  # a request is being dispatched
    eof: bool = False  # the client will send no more
    closing: bool = False  # close once outbuf is sent
    last_active: float = field(default_factory=time.monotonic)
    events: int = 0
    # When a half-received request or an unread answer must be done by (None: neither is
    # pending): a client trickling bytes, or reading nothing, cannot hold its slot longer.
    deadline: float | None = None


class ControlServer:
    def __init__(self, config: Config, dispatch: Dispatch, *, log: logging.Logger,
                 path: str | None = None, max_clients: int = MAX_CLIENTS,
                 idle_timeout: float = IDLE_TIMEOUT,
                 request_deadline: float = REQUEST_DEADLINE) -> None:
        self.path = os.path.abspath(path or config.control_socket)
        self.dispatch = dispatch
        self.log = log
        self.group_name = config.control_group
        self.group_gid = self.resolve_group(config.control_group)
        self.max_clients = max_clients
        self.accept_guard = AcceptGuard("control socket", log)
        self.idle_timeout = idle_timeout
        self.request_deadline = request_deadline
        self.my_uid = os.geteuid()
        self.sock: socket.socket | None = None
        self.lock_fd: int | None = None
        self.inode: tuple[int, int] | None = None
        self.thread: threading.Thread | None = None
        self.stopping = threading.Event()
        self.pools: RequestPools | None = None
        self.sel: selectors.BaseSelector | None = None
        self.wake_r, self.wake_w = -1, -1
        self.done: queue.SimpleQueue[tuple[_Conn, bytes]] = queue.SimpleQueue()
        self.conns: dict[int, _Conn] = {}

    @staticmethod
    def resolve_group(name: str | None) -> int:
        if name is None:
            return os.getegid()
        try:
            return grp.getgrnam(name).gr_gid
        except KeyError:
            raise ConfigError(f"control_group: no such group {name!r}") from None

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        """Listen on the socket; ConfigError (with the path) when that is impossible."""
        try:
            self._listen()
        except OSError as exc:
            self._release_lock()
            raise ConfigError(f"control_socket: {self.path}: {exc.strerror or exc}") from None
        except ConfigError:
            self._release_lock()
            raise
        self.pools = RequestPools("control", DISPATCH_THREADS, QUICK_THREADS)
        self.sel = selectors.DefaultSelector()
        self.wake_r, self.wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        assert self.sock is not None
        self.sel.register(self.sock, selectors.EVENT_READ, "listen")
        self.sel.register(self.wake_r, selectors.EVENT_READ, "wake")
        self.thread = threading.Thread(target=self._loop, name="control", daemon=True)
        self.thread.start()
        self.log.info("control socket listening on %s", self.path)

    def _listen(self) -> None:
        directory = os.path.dirname(self.path)
        os.makedirs(directory, mode=0o755, exist_ok=True)
        # One daemon per socket path: the lock makes "is it stale?" and "replace it" atomic.
        self.lock_fd = os.open(self.path + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                               0o600)
        try:
            fcntl.flock(self.lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(f"control_socket: another perfectschedd uses {self.path}") \
                from None
        self._check_stale()
        # Bind under a temporary name, set mode and group, listen, then rename into place:
        # the socket never appears with wider permissions, nor before it accepts.
        tmp = os.path.join(directory, f".{os.path.basename(self.path)}.{os.getpid()}.tmp")
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.bind(tmp)
            os.chmod(tmp, 0o660)
            if os.stat(tmp).st_gid != self.group_gid:
                try:
                    os.chown(tmp, -1, self.group_gid)
                except PermissionError:
                    raise ConfigError(
                        f"control_group: cannot give {self.path} to group {self.group_name!r} "
                        f"(the daemon's user must be a member of it)") from None
            sock.listen(128)
            sock.setblocking(False)
            os.rename(tmp, self.path)
        except BaseException:
            sock.close()
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        st = os.stat(self.path)
        self.inode = (st.st_dev, st.st_ino)
        self.sock = sock

    def _check_stale(self) -> None:
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
        except ConnectionRefusedError:
            self.log.info("removing stale control socket %s", self.path)
            os.unlink(self.path)
            return
        except OSError as exc:
            raise ConfigError(f"control_socket: cannot tell whether {self.path} is in use: "
                              f"{exc.strerror or exc}") from None
        finally:
            probe.close()
        raise ConfigError(f"control_socket: another process is listening on {self.path}")

    def fds(self) -> list[int]:
        """Descriptors a forked worker must close."""
        out = [fd for fd in (self.lock_fd, self.wake_r, self.wake_w, self.accept_guard.reserve)
               if fd is not None and fd >= 0]
        if self.sock is not None:
            out.append(self.sock.fileno())
        out.extend(c.sock.fileno() for c in list(self.conns.values()))
        try:  # the epoll descriptor, unless already closed
            fd = self.sel.fileno() if self.sel is not None and hasattr(self.sel, "fileno") else -1
        except (ValueError, OSError):
            fd = -1
        if fd >= 0:
            out.append(fd)
        return out

    def stop(self) -> None:
        self.stopping.set()
        self._wake()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(5.0)
        self.accept_guard.close()
        if self.pools is not None:
            self.pools.shutdown()
        if self.sock is not None:
            self.sock.close()
            self.sock = None
            try:  # only our own socket: a successor may have replaced it
                st = os.stat(self.path)
                if (st.st_dev, st.st_ino) == self.inode:
                    os.unlink(self.path)
            except FileNotFoundError:
                pass
        for fd in (self.wake_r, self.wake_w):
            if fd >= 0:
                os.close(fd)
        self.wake_r = self.wake_w = -1
        self._release_lock()

    def file_intact(self) -> bool:
        """Whether the socket file is still ours (not deleted, not replaced)."""
        try:
            st = os.stat(self.path)
        except OSError:
            return False
        return (st.st_dev, st.st_ino) == self.inode

    def _release_lock(self) -> None:
        if self.lock_fd is not None:
            os.close(self.lock_fd)
            self.lock_fd = None

    def _wake(self) -> None:
        try:
            os.write(self.wake_w, b"x")
        except OSError:
            pass

    # -- the connection loop --------------------------------------------------------------

    def _loop(self) -> None:
        assert self.sel is not None
        try:
            while not self.stopping.is_set():
                for key, mask in self.sel.select(timeout=self._until_idle_expiry()):
                    if key.data == "listen":
                        self._accept()
                    elif key.data == "wake":
                        self._drain_wake()
                    else:
                        conn = key.data
                        if mask & selectors.EVENT_READ:
                            self._read(conn)
                        if mask & selectors.EVENT_WRITE:
                            self._pump(conn)
                self._expire_idle()
        except Exception:  # noqa: BLE001 - log it; the daemon itself goes on
            self.log.exception("control socket loop failed")
        finally:
            for conn in list(self.conns.values()):
                self._close(conn)
            self.sel.close()

    def _accept(self) -> None:
        assert self.sock is not None
        while True:
            try:
                sock, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if not self.accept_guard.exhausted(self.sock, exc):
                    self.log.error("control socket: cannot accept: %s", exc.strerror)
                return
            sock.setblocking(False)
            try:
                pid, uid, gid = peer_credentials(sock)
            except OSError:
                sock.close()
                continue
            caller = Caller.of(uid, {gid} | peer_groups(sock))
            conn = _Conn(sock, pid, caller)
            self.conns[sock.fileno()] = conn
            if len(self.conns) > self.max_clients:
                self._refuse(conn, "Busy", f"busy: {self.max_clients} connections are open; "
                                           "try again")
                continue
            why = admission(caller, self.my_uid, self.group_gid)
            if why is not None:
                self.log.warning("control socket: refused %s (pid %d)", caller.name, pid)
                self._refuse(conn, "PermissionDenied", why)
                continue
            self._update(conn)

    def _refuse(self, conn: _Conn, type_: str, message: str) -> None:
        """Answer with an error, then close the connection."""
        conn.outbuf += protocol.error(type_, message)
        conn.closing = True
        conn.inbuf.clear()
        self._pump(conn)

    def _alive(self, conn: _Conn) -> bool:
        fd = conn.sock.fileno()
        return fd >= 0 and self.conns.get(fd) is conn

    def _read(self, conn: _Conn) -> None:
        try:
            chunk = conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        conn.last_active = time.monotonic()
        if chunk:
            conn.inbuf += chunk
        else:
            conn.eof = True  # answer what is complete; a half-written frame is dropped
        self._pump(conn)

    def _finished(self, conn: _Conn, future: Future[bytes]) -> None:
        """Runs on a pool thread: hand the answer to the loop thread."""
        try:
            answer = future.result()
        except BaseException as exc:  # noqa: BLE001 - cancelled at stop, or a bug in handle
            answer = protocol.error("InternalError", f"internal error: {exc}")
        self.done.put((conn, answer))
        self._wake()

    def _drain_wake(self) -> None:
        try:
            while os.read(self.wake_r, 4096):
                pass
        except OSError:
            pass
        while True:
            try:
                conn, answer = self.done.get_nowait()
            except queue.Empty:
                return
            conn.busy = False
            if self._alive(conn):  # else the client went away meanwhile
                conn.outbuf += answer
                conn.last_active = time.monotonic()
                self._pump(conn)

    def _pump(self, conn: _Conn) -> None:
        """Move one connection on: send pending output, then start its next request."""
        if not self._alive(conn):
            return
        if conn.outbuf:
            try:
                del conn.outbuf[:conn.sock.send(conn.outbuf)]
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:  # EPIPE, ECONNRESET: the client went away
                self._close(conn)
                return
            if conn.outbuf:
                self._update(conn)  # wait until the client reads
                return
        if conn.closing:
            self._close(conn)
            return
        while not conn.busy:
            nl = conn.inbuf.find(b"\n")
            if nl < 0:
                if len(conn.inbuf) > protocol.MAX_FRAME:
                    self._refuse(conn, "ProtocolError",
                                 f"request larger than {protocol.MAX_FRAME} bytes")
                    return
                break
            line = bytes(conn.inbuf[:nl])
            del conn.inbuf[:nl + 1]
            if len(line) > protocol.MAX_FRAME:
                self._refuse(conn, "ProtocolError",
                             f"request larger than {protocol.MAX_FRAME} bytes")
                return
            if not line.strip():
                continue
            assert self.pools is not None
            try:
                future = self.pools.of(peek_command(line)).submit(self.handle, line,
                                                                  conn.caller)
            except RuntimeError:  # the pool is shut down: we are stopping
                self._close(conn)
                return
            conn.busy = True
            future.add_done_callback(lambda f, c=conn: self._finished(c, f))
        if conn.eof and not conn.busy:
            self._close(conn)
            return
        self._update(conn)

    def _update(self, conn: _Conn) -> None:
        """Register interest: write while output is pending, read when idle."""
        if not self._alive(conn):
            return
        if conn.busy or not (conn.inbuf or conn.outbuf):
            conn.deadline = None
        elif conn.deadline is None:
            conn.deadline = time.monotonic() + self.request_deadline
        events = 0
        if conn.outbuf:
            events |= selectors.EVENT_WRITE
        elif not conn.busy and not conn.eof and not conn.closing:
            events |= selectors.EVENT_READ
        if events == conn.events:
            return
        assert self.sel is not None
        if conn.events == 0:
            self.sel.register(conn.sock, events, conn)
        elif events == 0:
            self.sel.unregister(conn.sock)
        else:
            self.sel.modify(conn.sock, events, conn)
        conn.events = events

    def _until_idle_expiry(self) -> float | None:
        """Seconds until the first idle connection times out; None (sleep until something
        happens: every change of state wakes the loop) when none can."""
        due = [min(c.last_active + self.idle_timeout,
                   c.deadline if c.deadline is not None else math.inf)
               for c in self.conns.values() if not c.busy]
        if not due:
            return None
        return max(0.0, min(due) - time.monotonic())

    def _expire_idle(self) -> None:
        now = time.monotonic()
        limit = now - self.idle_timeout
        for conn in list(self.conns.values()):
            if conn.busy:
                continue
            if conn.deadline is not None and now >= conn.deadline:
                self.log.debug("control socket: closing pid %d's connection (request or "
                               "answer not done within %gs)", conn.pid, self.request_deadline)
                self._close(conn)
            elif conn.last_active < limit:
                self._close(conn)

    def _close(self, conn: _Conn) -> None:
        fd = conn.sock.fileno()
        if fd >= 0 and self.conns.get(fd) is conn:
            del self.conns[fd]
            if conn.events and self.sel is not None:
                try:
                    self.sel.unregister(conn.sock)
                except (KeyError, ValueError):
                    pass
            conn.events = 0
        conn.sock.close()

    # -- one request ----------------------------------------------------------------------

    def handle(self, line: bytes, caller: Caller) -> bytes:
        """One request frame of `caller` -> one response frame; never raises."""
        client: str | None = None

        def ask(cmd: str, args: dict[str, Any]) -> Any:
            return self.dispatch(cmd, args, caller)

        try:
            cmd, args, client = protocol.parse_request_from(line)
            if cmd == "list":
                return list_page(ask, args)
            return protocol.ok(ask(cmd, args))
        except Exception as exc:  # noqa: BLE001 - a request never takes the daemon down
            return self._error(*refusal_of(exc, client, self.log))

    @staticmethod
    def _error(type_: str, message: str) -> bytes:
        return protocol.error(type_, message, daemon=__version__)

