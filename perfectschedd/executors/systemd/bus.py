"""The D-Bus side of jobs as systemd units: one connection to systemd per worker process,
on which runs start, watch, stop and read their units (unit.py), and the master's
short-lived one that stops units whose worker is gone.

A run learns its unit's end from signals, never by polling: the start job's JobRemoved,
then the unit's PropertiesChanged to inactive or failed (Subscribe() first: systemd
signals only while a client is subscribed).  The connection lives on an asyncio loop in a
thread of its own (dbus-next's aio API); the task threads wait on it.  A lost connection
(dbus restarted) is made again and the running units are looked at once.  The master's
connection and its thread end before the call returns, so nothing of it crosses a fork.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from typing import Any

from dbus_next import BusType, Message, MessageType, Variant
from dbus_next.aio import MessageBus

from perfectschedd.errors import first_line
from perfectschedd.settings import unit_props

__all__ = ["Systemd", "SystemdError", "Watch", "stop_units"]

logger = logging.getLogger(__name__)

SYSTEMD = "org.freedesktop.systemd1"
MANAGER_PATH = "/org/freedesktop/systemd1"
MANAGER = "org.freedesktop.systemd1.Manager"
UNIT = "org.freedesktop.systemd1.Unit"
SERVICE = "org.freedesktop.systemd1.Service"
PROPERTIES = "org.freedesktop.DBus.Properties"
UNIT_PATTERN = f"{unit_props.UNIT_PREFIX}*{unit_props.UNIT_SUFFIX}"
# A D-Bus call to systemd that takes longer than this is an error (systemd is stuck).
CALL_TIMEOUT = 30.0
# The error of a unit object that no longer exists (systemd collected the unit).
_GONE = "org.freedesktop.DBus.Error.UnknownObject"
_ENDED = ("inactive", "failed")


class SystemdError(RuntimeError):
    """systemd refused or did not answer; str() is one line."""


@dataclass
class Watch:
    """One unit a run waits for.  It has ended once its start job is gone (JobRemoved:
    before that, "inactive" only means not started yet) and its state is inactive or
    failed (PropertiesChanged)."""

    name: str
    path: str
    ended: threading.Event = field(default_factory=threading.Event)
    state: str = ""
    started: bool = False  # the start job is done (whatever its result)

    def update(self, state: str | None = None, started: bool = False) -> None:
        if state is not None:
            self.state = state
        self.started = self.started or started
        if self.started and self.state in _ENDED:
            self.ended.set()


class Systemd:
    """A connection to systemd on a loop thread; its methods are called from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._bus: MessageBus | None = None
        self._watches: dict[str, Watch] = {}   # by object path
        self._by_name: dict[str, Watch] = {}
        self._retry_at = 0.0
        self._lost_logged = False

    def _ensure_connected(self) -> None:
        with self._lock:
            if self._bus is None or not self._bus.connected:
                self._connect()

    def _run(self, coro: Coroutine[Any, Any, Any], timeout: float = CALL_TIMEOUT) -> Any:
        self._ensure_connected()
        assert self._loop is not None
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise SystemdError(f"systemd did not answer within {timeout:g}s") from None
        except SystemdError:
            raise
        except Exception as exc:  # noqa: BLE001 - a lost bus connection and the like
            raise SystemdError(first_line(exc)) from None

    def _connect(self) -> None:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, name="systemd-bus",
                             daemon=True).start()

        async def connect() -> MessageBus:
            bus = await MessageBus(bus_type=BusType.SYSTEM, negotiate_unix_fd=True).connect()
            bus.add_message_handler(self._on_message)
            await call(bus, "/org/freedesktop/DBus", "org.freedesktop.DBus", "AddMatch",
                       "s", [f"type='signal',sender='{SYSTEMD}',path='{MANAGER_PATH}',"
                             f"interface='{MANAGER}',member='JobRemoved'"],
                       destination="org.freedesktop.DBus")
            # systemd sends unit signals only while some client is subscribed.
            await call(bus, MANAGER_PATH, MANAGER, "Subscribe")
            # A new connection after a lost one (dbus restarted): watch the running units
            # again, and look at them once, since signals were missed meanwhile.  (Their
            # start jobs are long done: a run watches its unit once the start returned.)
            for watch in list(self._watches.values()):
                await _add_match(bus, watch.path)
                watch.update(started=True)
                try:  # the old connection's reference went with it (AddRef)
                    await call(bus, watch.path, UNIT, "Ref")
                except SystemdError as exc:
                    # Collected meanwhile, or refused (polkit: verb "ref"): once the
                    # unit ends, systemd collects it before its result is read.
                    logger.warning("unit %s: cannot keep its result for this run (%s)",
                                   watch.name, exc)
            asyncio.ensure_future(_until_disconnected(bus))
            self._bus = bus
            for watch in list(self._watches.values()):
                await self._refresh(watch)
            return bus

        try:
            self._bus = asyncio.run_coroutine_threadsafe(connect(), self._loop).result(
                CALL_TIMEOUT)
        except Exception as exc:  # noqa: BLE001 - any failure to reach the bus, one line
            raise SystemdError(f"cannot reach systemd on the system bus: {first_line(exc)}") \
                from None

    def check(self) -> None:
        """Called while a run waits: a lost bus connection (dbus restarted) is made again,
        at most once a second until systemd is back on the bus; the signals of the old
        connection will never come."""
        if self._bus is None or self._bus.connected:
            return
        now = time.monotonic()
        if now < self._retry_at:
            return
        self._retry_at = now + 1.0
        if not self._lost_logged:
            self._lost_logged = True
            logger.warning("connection to the system bus lost; connecting again")
        try:
            self._run(asyncio.sleep(0))
        except SystemdError:
            return  # not yet: next second
        self._lost_logged = False
        logger.info("connected to the system bus again")

    def _on_message(self, msg: Message) -> None:
        """Runs on the loop thread for every message: a unit's start job ended, or its
        state changed."""
        if msg.message_type != MessageType.SIGNAL:
            return
        if msg.member == "JobRemoved" and msg.interface == MANAGER and len(msg.body) >= 3:
            watch = self._by_name.get(msg.body[2])
            if watch is not None:
                watch.update(started=True)
                if not watch.ended.is_set():  # its state may have changed before
                    asyncio.ensure_future(self._refresh(watch))
            return
        if msg.member != "PropertiesChanged":
            return
        watch = self._watches.get(msg.path)
        if watch is None or not msg.body or msg.body[0] != UNIT:
            return
        changed = msg.body[1]
        if "ActiveState" in changed:
            watch.update(changed["ActiveState"].value)
        elif "ActiveState" in msg.body[2]:  # invalidated only: ask
            asyncio.ensure_future(self._refresh(watch))

    async def _refresh(self, watch: Watch) -> None:
        assert self._bus is not None
        try:
            reply = await call(self._bus, watch.path, PROPERTIES, "Get", "ss",
                               [UNIT, "ActiveState"])
        except SystemdError as exc:
            if _GONE in str(exc):  # collected: it ended
                watch.update("inactive", started=True)
            # Else systemd is not reachable right now (it is back on a restarted bus a
            # moment after us): the connection is made again and the unit looked at.
            return
        watch.update(reply[0].value)

    # -- what a run does -----------------------------------------------------------------

    def start(self, name: str, properties: list[tuple[str, Variant]], fds: list[int]
              ) -> Watch:
        """Start a transient unit and watch it; returns once systemd accepted it."""
        path = unit_props.bus_path(name)
        watch = Watch(name, path)
        self._ensure_connected()  # before the watch: a first connection watches nothing
        self._watches[path] = watch
        self._by_name[name] = watch

        async def start() -> None:
            assert self._bus is not None
            # The match before the start: no change can pass unseen.
            await _add_match(self._bus, path)
            # dbus-next wants a D-Bus struct as a list.
            await call(self._bus, MANAGER_PATH, MANAGER, "StartTransientUnit",
                       "ssa(sv)a(sa(sv))", [name, "fail", [list(p) for p in properties],
                                            []], fds=fds)
        try:
            self._run(start())
        except BaseException:
            self._forget(watch)
            raise
        return watch

    def result(self, name: str, watch: Watch) -> dict[str, Any]:
        """The ended unit's Result, ExecMainCode, ExecMainStatus; then let systemd
        collect it (Unref) and stop watching it."""

        async def read() -> dict[str, Any]:
            assert self._bus is not None
            try:
                reply = await call(self._bus, watch.path, PROPERTIES, "GetAll", "s",
                                   [SERVICE])
                values = {k: v.value for k, v in reply[0].items()
                          if k in ("Result", "ExecMainCode", "ExecMainStatus")}
            except SystemdError as exc:
                values = {"Result": f"unknown ({exc})"}
            for path, iface, member, sig, body, dest in (
                    (watch.path, UNIT, "Unref", "", [], SYSTEMD),
                    ("/org/freedesktop/DBus", "org.freedesktop.DBus", "RemoveMatch", "s",
                     [_rule(watch.path)], "org.freedesktop.DBus")):
                try:
                    await call(self._bus, path, iface, member, sig, body, destination=dest)
                except SystemdError:
                    pass  # gone already, or never referenced
            return values

        try:
            return dict(self._run(read()))
        finally:
            self._forget(watch)

    def _forget(self, watch: Watch) -> None:
        self._watches.pop(watch.path, None)
        self._by_name.pop(watch.name, None)

    def stop(self, name: str) -> None:
        self._run(stop_unit(self._bus_or_raise(), name))

    def kill(self, name: str) -> None:
        self._run(kill_unit(self._bus_or_raise(), name))

    def _bus_or_raise(self) -> MessageBus:
        self._ensure_connected()
        assert self._bus is not None
        return self._bus

    def reset_after_fork(self) -> None:
        """In a forked child: the parent's loop thread does not exist here."""
        self._lock = threading.Lock()
        self._loop = None
        self._bus = None
        self._watches = {}
        self._by_name = {}
        self._retry_at = 0.0
        self._lost_logged = False


async def call(bus: MessageBus, path: str, interface: str, member: str,
                signature: str = "", body: list[Any] | None = None, *,
                destination: str = SYSTEMD, fds: list[int] | None = None) -> list[Any]:
    reply = await bus.call(Message(destination=destination, path=path, interface=interface,
                                   member=member, signature=signature, body=body or [],
                                   unix_fds=fds or []))
    if reply is None:
        raise SystemdError(f"{member}: no reply")
    if reply.message_type == MessageType.ERROR:
        detail = reply.body[0] if reply.body and isinstance(reply.body[0], str) else ""
        raise SystemdError(f"{member}: {reply.error_name}: {detail}".rstrip(": "))
    return list(reply.body)


async def _until_disconnected(bus: MessageBus) -> None:
    """Takes the connection's end (dbus-next ends its future with EOFError when the bus
    goes away; untaken, asyncio would log it as never retrieved)."""
    try:
        await bus.wait_for_disconnect()
    except Exception:  # noqa: BLE001,S110 - its end is all we wanted to know
        pass


def _rule(path: str) -> str:
    return (f"type='signal',sender='{SYSTEMD}',path='{path}',"
            f"interface='{PROPERTIES}',member='PropertiesChanged'")


async def _add_match(bus: MessageBus, path: str) -> None:
    await call(bus, "/org/freedesktop/DBus", "org.freedesktop.DBus", "AddMatch", "s",
               [_rule(path)], destination="org.freedesktop.DBus")


async def stop_unit(bus: MessageBus, name: str) -> None:
    try:
        await call(bus, MANAGER_PATH, MANAGER, "StopUnit", "ss", [name, "replace"])
    except SystemdError as exc:
        if "NoSuchUnit" not in str(exc):
            raise


async def kill_unit(bus: MessageBus, name: str) -> None:
    try:
        await call(bus, MANAGER_PATH, MANAGER, "KillUnit", "ssi",
                   [name, "all", int(signal.SIGKILL)])
    except SystemdError as exc:
        if "NoSuchUnit" not in str(exc) and "NoSuchProcess" not in str(exc):
            raise


def stop_units(belongs: Callable[[str, str], bool], names: Iterable[str] = (),
               timeout: float = 10.0) -> list[str]:
    """Stop, at once (SIGKILL), every perfectsched-* unit named in `names` or for which
    `belongs(name, description)` holds, and wait until they are inactive; returns the
    units stopped.  For the master: a dead worker's units, a previous instance's."""
    wanted = set(names)
    result: list[str] = []

    async def work() -> None:
        bus = await MessageBus(bus_type=BusType.SYSTEM).connect()
        try:
            units = (await call(bus, MANAGER_PATH, MANAGER, "ListUnitsByPatterns", "asas",
                                [[], [UNIT_PATTERN]]))[0]
            live = {u[0]: u for u in units if u[3] not in _ENDED}
            chosen = [n for n, u in live.items() if n in wanted or belongs(n, u[1])]
            for name in chosen:
                await kill_unit(bus, name)
                await stop_unit(bus, name)
            # Stopped means inactive: the occurrence must not run again beside them.  (A
            # few units, rarely, for a bounded time: looking is simpler here than signals.)
            end = time.monotonic() + timeout
            left = set(chosen)
            while left and time.monotonic() < end:
                for name in list(left):
                    try:
                        reply = await call(bus, unit_props.bus_path(name), PROPERTIES, "Get",
                                           "ss", [UNIT, "ActiveState"])
                        if reply[0].value in _ENDED:
                            left.discard(name)
                    except SystemdError:
                        left.discard(name)  # collected: gone
                if left:
                    await asyncio.sleep(0.05)
            if left:
                raise SystemdError(f"still active after {timeout:.0f}s: "
                                   + ", ".join(sorted(left)))
            result.extend(chosen)
        finally:
            bus.disconnect()

    # Bounded: a dead worker's replacement and its leases wait for this.
    run_apart(work, 2 * timeout, "systemd-cleanup")
    return result


def run_apart(work: Callable[[], Coroutine[Any, Any, None]], timeout: float, name: str
              ) -> None:
    """Run `work()` on an asyncio loop of a thread of its own, ended before the return: the
    caller's thread may have a loop, and nothing of it must cross a later fork.  Its
    failure, or no end within `timeout`, raises SystemdError (one line)."""
    errors: list[BaseException] = []

    def target() -> None:
        try:
            asyncio.run(asyncio.wait_for(work(), timeout))
        except TimeoutError:
            errors.append(SystemdError(f"no answer from systemd within {timeout:g}s"))
        except BaseException as exc:  # noqa: BLE001 - reported to the caller
            errors.append(exc)

    thread = threading.Thread(target=target, name=name)
    thread.start()
    thread.join()
    if errors:
        if isinstance(errors[0], SystemdError):
            raise errors[0]
        raise SystemdError(first_line(errors[0]))
