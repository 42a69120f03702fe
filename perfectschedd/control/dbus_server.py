"""D-Bus face of the control interface: org.perfectsched1.Manager on /org/perfectsched1.

The same operations as the control socket (docs/protocol.md), on the system bus (or the bus
at `dbus_address`).  Every method ends in Supervisor.dispatch(); results are the socket's
JSON results, as a JSON string; a refused request is a D-Bus error named
org.perfectsched1.Error.<Type> (NotFoundError, InvalidInputError, ...) with the socket's
message.  The signal ScheduleChanged(s key, s change) follows every change of a schedule.

Who may call: the bus policy (etc/dbus-1/org.perfectsched1.conf) on the system bus, and,
in any case, the socket's rule (auth.admission): root, the daemon's user, or members of
its group (checked with the bus's GetConnectionCredentials, once per caller).

dbus-next runs an asyncio loop; it gets its own thread, so the master's select loop and
this interface never wait for each other.  Requests run on small thread pools, which
transport.py picks, as it writes their refusals, as for the socket.
"""

# No "from __future__ import annotations": dbus-next reads the D-Bus signatures below from
# the evaluated annotations.

import asyncio
import concurrent.futures
import contextvars
import json
import logging
import os
import pwd
import socket
import threading
from collections import OrderedDict
from typing import Any

from dbus_next import (
    BusType,
    DBusError,
    Message,
    MessageType,
    NameFlag,
    RequestNameReply,
    Variant,
)
from dbus_next.aio import MessageBus
from dbus_next.service import PropertyAccess, ServiceInterface, dbus_property, method, signal

from perfectschedd import __version__
from perfectschedd.control import protocol, registry
from perfectschedd.control.auth import Caller, admission
from perfectschedd.control.transport import Dispatch, RequestPools, one_page, refusal_of
from perfectschedd.errors import ConfigError

BUS_NAME = "org.perfectsched1"
OBJECT_PATH = "/org/perfectsched1"
INTERFACE = "org.perfectsched1.Manager"
ERROR_PREFIX = protocol.DBUS_ERROR_PREFIX
START_TIMEOUT = 10.0
RECONNECT_EVERY = 5.0
# Requests run at once, and the quick commands' own pool (transport.RequestPools).
REQUEST_THREADS = 4
QUICK_THREADS = 1

# D-Bus signatures, as annotations.
S = "s"
U = "u"
ASV = "a{sv}"
SS = "ss"

# The unique bus name of the caller whose method call is being answered (set for each
# call's task by _Bus, read by DBusService.call).
_SENDER: contextvars.ContextVar[str] = contextvars.ContextVar("sender", default="")
_ADD, _MODIFY = registry.COMMANDS["add"], registry.COMMANDS["modify"]



def _unwrap(options: dict[str, Any], what: str, allowed: set[str]) -> dict[str, Any]:
    out = {}
    for name, value in options.items():
        if name not in allowed:
            known = ", ".join(sorted(allowed))
            raise _error("InvalidInputError", f"{what}: unknown option {name!r} (known: {known})")
        out[name] = value.value if isinstance(value, Variant) else value
    return out


def process_groups(pid: int, uid: int) -> set[int]:
    """Primary and supplementary groups of live process `pid`, provided it runs as `uid`
    ({} otherwise, or when it cannot be read).  The bus gives the caller's PID, not a
    handle: the caller may have exited and its PID gone to another process, and that
    process's groups must never be judged as the caller's.  One of the same user holds
    no group that user could not hold."""
    groups: set[int] = set()
    uids: set[int] = set()
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Uid:"):
                    uids.update(int(u) for u in line.split()[1:])
                elif line.startswith("Gid:"):
                    groups.update(int(g) for g in line.split()[1:3])
                elif line.startswith("Groups:"):
                    groups.update(int(g) for g in line.split()[1:])
    except (OSError, ValueError):
        return set()
    return groups if uids == {uid} else set()


def _error(type_: str, message: str) -> DBusError:
    return DBusError(protocol.refusal(type_).dbus_name,
                     (str(message).splitlines() or ["error"])[0])


class _WouldBlockIsZero:
    """The bus socket as dbus-next's writer sees it: a send that would block sends 0
    bytes (the writer then waits for the socket to be writable) instead of raising."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def send(self, data: Any) -> int:
        try:
            return self._sock.send(data)
        except (BlockingIOError, InterruptedError):
            return 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


class _Bus(MessageBus):
    """dbus-next's asyncio bus, with two fixes to dbus-next 0.2.3 (Debian 12's, and the
    last on PyPI):

    - its writer treats a send() that would block as a broken connection: a burst of
      ScheduleChanged signals (an add_many of a thousand keys) filled the socket buffer
      and dropped the daemon off the bus, with the requests in flight;
    - an async method that raises (every refused request: DBusError) is answered with the
      error, and that is all: the reply context's __exit__ drops _exit's True, so the
      error, already answered, was re-raised into the event loop, which logged a
      traceback for each refused call.

    And each method call runs as a task that knows its sender (_SENDER): our methods
    answer for that caller.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._writer.sock = _WouldBlockIsZero(self._writer.sock)

    def _make_method_handler(self, interface: Any, method: Any) -> Any:
        if not asyncio.iscoroutinefunction(method.fn):
            return super()._make_method_handler(interface, method)

        def handler(msg: Message, send_reply: Any) -> None:
            def done(fut: "asyncio.Future[Any]") -> None:
                try:
                    body, unix_fds = ServiceInterface._fn_result_to_body(  # noqa: SLF001
                        fut.result(), method.out_signature_tree)
                except Exception as exc:  # noqa: BLE001 - answered as a D-Bus error
                    send_reply.send_error(exc)
                    return
                send_reply(Message.new_method_return(msg, method.out_signature, body,
                                                     unix_fds))

            args = ServiceInterface._msg_body_to_args(msg)  # noqa: SLF001
            context = contextvars.copy_context()
            context.run(_SENDER.set, msg.sender or "")
            task = asyncio.get_running_loop().create_task(method.fn(interface, *args),
                                                          context=context)
            task.add_done_callback(done)

        return handler


class Manager(ServiceInterface):
    """org.perfectsched1.Manager: each method is one control request."""

    def __init__(self, service: "DBusService") -> None:
        super().__init__(INTERFACE)
        self.service = service

    async def _call(self, cmd: str, args: dict[str, Any]) -> str:
        result = await self.service.call(cmd, args)
        return json.dumps(result, separators=(",", ":"))

    @method()
    async def Add(self, key: S, task_type: S, cron: S, data: S, options: ASV) -> S:
        args = {"key": key, "type": task_type, "cron": cron,
                **_unwrap(options, "Add", set(_ADD.args - {"key", "type", "cron", "data"}))}
        if data:
            args["data"] = data
        return await self._call("add", args)

    @method()
    async def List(self, prefix: S) -> S:
        return await self._call("list", {"prefix": prefix} if prefix else {})

    @method()
    async def Show(self, key: S) -> S:
        return await self._call("show", {"key": key})

    @method()
    async def Delete(self, key: S) -> S:
        return await self._call("delete", {"key": key})

    @method()
    async def Modify(self, key: S, changes: ASV) -> S:
        args = _unwrap(changes, "Modify", set(_MODIFY.args - {"key"}))
        return await self._call("modify", {"key": key, **args})

    @method()
    async def Pause(self, key: S) -> S:
        return await self._call("pause", {"key": key})

    @method()
    async def Resume(self, key: S) -> S:
        return await self._call("resume", {"key": key})

    @method()
    async def Run(self, key: S) -> S:
        return await self._call("run", {"key": key})

    @method()
    async def History(self, key: S, limit: U) -> S:
        return await self._call("history", {"key": key, "limit": limit or 20})

    @method()
    async def Status(self) -> S:
        return await self._call("status", {})

    @method()
    async def Reload(self) -> S:
        return await self._call("reload", {})

    @method()
    async def Call(self, command: S, args: S) -> S:
        """Any control request, arguments and result as JSON (as on the socket)."""
        try:
            parsed = protocol.loads_bounded(args, "args") if args else {}
        except protocol.ProtocolError as exc:
            raise _error("ProtocolError", str(exc)) from None
        if not isinstance(parsed, dict):
            raise _error("ProtocolError", "args: must be a JSON object")
        return await self._call(command, parsed)

    @dbus_property(access=PropertyAccess.READ)
    def Version(self) -> S:
        return __version__

    @dbus_property(access=PropertyAccess.READ)
    def Host(self) -> S:
        return socket.gethostname()

    @signal()
    def ScheduleChanged(self, key: str, change: str) -> SS:
        return [key, change]


class DBusService:
    def __init__(self, dispatch: Dispatch, *, log: logging.Logger, address: str | None = None,
                 group_gid: int | None = None) -> None:
        self.dispatch = dispatch
        self.log = log
        self.address = address
        self.group_gid = os.getegid() if group_gid is None else group_gid
        self.my_uid = os.geteuid()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.bus: MessageBus | None = None
        self.manager: Manager | None = None
        self.thread: threading.Thread | None = None
        self.pools = RequestPools("dbus", REQUEST_THREADS, QUICK_THREADS)
        self.stopping: asyncio.Event | None = None
        # Unique bus names are never reused: who a caller is, and the verdict on it, hold
        # for its connection.
        self.verdicts: OrderedDict[str, tuple[Caller, str | None]] = OrderedDict()

    # -- lifecycle (called from the master's thread) --------------------------------------

    def start(self) -> None:
        """Connect and own BUS_NAME; raises (with the reason) when that fails."""
        started: concurrent.futures.Future[None] = concurrent.futures.Future()
        self.thread = threading.Thread(target=self._thread, args=(started,), name="dbus",
                                       daemon=True)
        self.thread.start()
        try:
            started.result(START_TIMEOUT)
        except concurrent.futures.TimeoutError:
            self.stop()
            raise ConfigError(f"D-Bus: no answer from the bus within {START_TIMEOUT:g}s") \
                from None
        where = self.address or "the system bus"
        self.log.info("D-Bus interface %s on %s", BUS_NAME, where)

    def stop(self) -> None:
        loop, stopping = self.loop, self.stopping
        if loop is not None and stopping is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(stopping.set)
            except RuntimeError:
                pass
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(5.0)
        self.pools.shutdown()

    def fds(self) -> list[int]:
        """Descriptors a forked worker must close (the bus connection)."""
        bus = self.bus
        fd = getattr(bus, "_fd", None) if bus is not None else None
        return [fd] if isinstance(fd, int) and fd >= 0 else []

    def schedule_changed(self, key: str, change: str) -> None:
        """Emit ScheduleChanged; thread-safe, never raises."""
        loop, manager = self.loop, self.manager
        if loop is None or manager is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._emit, key, change)
        except RuntimeError:
            pass

    def _emit(self, key: str, change: str) -> None:
        if self.manager is not None and self.bus is not None and self.bus.connected:
            self.manager.ScheduleChanged(key, change)

    # -- the D-Bus thread -----------------------------------------------------------------

    def _thread(self, started: "concurrent.futures.Future[None]") -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self.loop = loop
        try:
            loop.run_until_complete(self._main(started))
        except Exception as exc:  # noqa: BLE001 - reported to start() or logged
            if not started.done():
                started.set_exception(exc)
            else:
                self.log.exception("D-Bus interface failed")
        finally:
            loop.close()

    async def _connect(self) -> MessageBus:
        if self.address:
            bus = _Bus(bus_address=self.address)
        else:
            bus = _Bus(bus_type=BusType.SYSTEM)
        await bus.connect()
        self.manager = Manager(self)
        bus.export(OBJECT_PATH, self.manager)
        bus.add_message_handler(self._gate)
        reply = await bus.request_name(BUS_NAME, NameFlag.DO_NOT_QUEUE)
        if reply not in (RequestNameReply.PRIMARY_OWNER, RequestNameReply.ALREADY_OWNER):
            bus.disconnect()
            raise ConfigError(f"D-Bus: the name {BUS_NAME} is owned by another process")
        return bus

    async def _main(self, started: "concurrent.futures.Future[None]") -> None:
        self.stopping = asyncio.Event()
        try:
            self.bus = await self._connect()
        except DBusError as exc:
            raise ConfigError(f"D-Bus: {exc.text}") from None
        except (OSError, ValueError) as exc:
            raise ConfigError(f"D-Bus: cannot connect to {self.address or 'the system bus'}: "
                              f"{exc}") from None
        started.set_result(None)
        while True:
            bus = self.bus
            stop = asyncio.ensure_future(self.stopping.wait())
            gone = asyncio.ensure_future(bus.wait_for_disconnect())
            await asyncio.wait({stop, gone}, return_when=asyncio.FIRST_COMPLETED)
            if self.stopping.is_set():
                gone.cancel()
                bus.disconnect()
                return
            stop.cancel()
            self.log.error("D-Bus connection lost; reconnecting every %gs", RECONNECT_EVERY)
            while not self.stopping.is_set():
                try:
                    await asyncio.wait_for(self.stopping.wait(), RECONNECT_EVERY)
                    return
                except TimeoutError:
                    pass
                try:
                    self.bus = await self._connect()
                    self.log.info("D-Bus interface %s back", BUS_NAME)
                    break
                except Exception as exc:  # noqa: BLE001 - keep trying
                    self.log.debug("D-Bus reconnect failed: %s", exc)

    # -- requests -------------------------------------------------------------------------

    async def call(self, cmd: str, args: dict[str, Any]) -> Any:
        """One control request of the method call's sender, on its pool; refusals become
        D-Bus errors."""
        verdict = self.verdicts.get(_SENDER.get())
        if verdict is None or verdict[1] is not None:  # _gate lets no such call through
            raise _error("PermissionDenied", verdict[1] if verdict is not None else
                         "permission denied: the caller is not known; call again")
        caller = verdict[0]
        loop = asyncio.get_running_loop()
        if cmd == "list":
            # An answer waits whole in memory until the bus takes it: at most one page;
            # callers page on with Call("list", {"after": <last key>}).
            args = one_page(args)
        try:
            return await loop.run_in_executor(self.pools.of(cmd), self.dispatch, cmd, args,
                                              caller)
        except Exception as exc:  # noqa: BLE001 - a request never takes the daemon down
            raise _error(*refusal_of(exc, None, self.log, note_versions=False,
                                     what=f"D-Bus request {cmd}")) from None

    def _gate(self, msg: Message) -> Message | bool | None:
        """Authorise method calls to our object before dbus-next dispatches them.

        Returns None to let the call through, an error Message to refuse it, or True when
        the caller is being looked up (the call is processed again afterwards).
        """
        if msg.message_type != MessageType.METHOD_CALL or msg.path != OBJECT_PATH:
            return None
        if msg.interface in ("org.freedesktop.DBus.Introspectable", "org.freedesktop.DBus.Peer"):
            return None
        sender = msg.sender or ""
        if sender in self.verdicts:
            refusal = self.verdicts[sender][1]
            if refusal is None:
                return None
            return Message.new_error(msg, ERROR_PREFIX + "PermissionDenied", refusal)
        asyncio.ensure_future(self._check_then_process(msg))
        return True

    async def _check_then_process(self, msg: Message) -> None:
        bus = self.bus
        if bus is None:
            return
        sender = msg.sender or ""
        try:
            caller, refusal = await self._check(bus, sender)
        except Exception as exc:  # noqa: BLE001 - cannot tell: refuse, and say why
            refusal = f"permission denied: cannot read the caller's credentials: {exc}"
            bus.send(Message.new_error(msg, ERROR_PREFIX + "PermissionDenied", refusal))
            return
        self.verdicts[sender] = (caller, refusal)
        while len(self.verdicts) > 4096:
            self.verdicts.popitem(last=False)
        if refusal is not None:
            self.log.warning("D-Bus: refused %s", refusal.split(": ", 1)[-1])
        bus._process_message(msg)  # noqa: SLF001 - now _gate has a verdict for the sender

    async def _check(self, bus: MessageBus, sender: str) -> tuple[Caller, str | None]:
        """Who `sender` is, and None if it may call us, else the refusal."""
        reply = await bus.call(Message(
            destination="org.freedesktop.DBus", path="/org/freedesktop/DBus",
            interface="org.freedesktop.DBus", member="GetConnectionCredentials",
            signature="s", body=[sender]))
        if reply is None or reply.message_type == MessageType.ERROR:
            raise RuntimeError(reply.body[0] if reply is not None and reply.body else "no reply")
        creds = {k: v.value for k, v in reply.body[0].items()}
        uid = int(creds["UnixUserID"])
        try:
            primary = {pwd.getpwuid(uid).pw_gid}
        except KeyError:
            primary = set()
        # The groups the calling process holds, as the bus recorded them at connect (like
        # SO_PEERGROUPS on the socket), never the group database's member lists: a user
        # added to the group after logging in, or removed from it, is judged by what the
        # process has.  Its primary group from /proc when we may read it and the process
        # there is still the caller's user's (process_groups), else from its passwd entry.
        groups = {int(g) for g in creds.get("UnixGroupIDs", [])}
        if "ProcessID" in creds:
            groups |= process_groups(int(creds["ProcessID"]), uid) or primary
        else:
            groups |= primary
        caller = Caller.of(uid, groups)
        return caller, admission(caller, self.my_uid, self.group_gid)
