"""Jobs as systemd transient units (routes and entries with `executor: systemd`).

The invariant is the exec handler's: a unit runs only while its worker holds the
occurrence's lease.  The worker starts the unit (StartTransientUnit, with AddRef so that
systemd keeps the finished unit until its result is read), learns its end from the
unit's PropertiesChanged signals, stops it (StopUnit, then KillUnit SIGKILL after the
grace) on timeout, stop or a lost lease, and says which unit it runs to the master before
the unit can exist.  The master stops a dead worker's units before the occurrence can
run again (`stop_units`), and at start the units a previous instance of the daemon on
this host left behind.  Every unit's Description names its worker ("worker NODE:PID"),
so units are found by their owner even when a report was lost.

One D-Bus connection per worker process, on an asyncio loop in a thread of its own
(dbus-next's aio API; the task threads wait on it).  The master uses a short-lived
connection on its own thread for each (rare) clean-up, so nothing of it crosses a fork.
"""

from __future__ import annotations

import asyncio
import grp
import json
import logging
import os
import pwd
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from typing import Any

from dbus_next import BusType, Message, MessageType, Variant
from dbus_next.aio import MessageBus

from . import unitprops
from .handlers import (
    REASON_TEXT,
    Log,
    Outcome,
    StopReason,
    TaskLike,
    UnitHandler,
    exec_verdict,
    stop_grace,
    stop_reason,
)

logger = logging.getLogger(__name__)

SYSTEMD = "org.freedesktop.systemd1"
MANAGER_PATH = "/org/freedesktop/systemd1"
MANAGER = "org.freedesktop.systemd1.Manager"
UNIT = "org.freedesktop.systemd1.Unit"
SERVICE = "org.freedesktop.systemd1.Service"
PROPERTIES = "org.freedesktop.DBus.Properties"
UNIT_PATTERN = f"{unitprops.UNIT_PREFIX}*{unitprops.UNIT_SUFFIX}"
# How often a waiting run looks at its RunControl (as exec runs do).
_STOP_POLL = 0.1
# A D-Bus call to systemd that takes longer than this is an error (systemd is stuck).
CALL_TIMEOUT = 30.0
# How long the verdict pipe is read after the unit ended (its processes are gone by then).
_VERDICT_WAIT = 2.0
# Our own deadline, beyond RuntimeMaxSec + the stop grace: systemd should have ended it.
_DEADLINE_SLACK = 5.0
_CLD_EXITED = 1
_CLD_CODES = (1, 2, 3)  # exited, killed, dumped; 0: the main process has not ended
# The error of a unit object that no longer exists (systemd collected the unit).
_GONE = "org.freedesktop.DBus.Error.UnknownObject"
_WRAPPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "unitwrap.py")
_ENDED = ("inactive", "failed")


class SystemdError(RuntimeError):
    """systemd refused or did not answer; str() is one line."""


def owner_mark(node: str, pid: int) -> str:
    """The end of a unit's Description naming the worker that runs it."""
    return f"(worker {node}:{pid})"


def own_unit() -> str | None:
    """The service this process runs in (its cgroup's last part), for PartOf=/After=;
    None when it does not run in a service (started by hand, in tests)."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        path = line.split(":", 2)[-1]
        for part in reversed(path.split("/")):
            if part.endswith(".service"):
                return part
    return None


# -- the connection ------------------------------------------------------------------------


@dataclass
class _Watch:
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
        self._watches: dict[str, _Watch] = {}   # by object path
        self._by_name: dict[str, _Watch] = {}
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
            raise SystemdError(_text(exc)) from None

    def _connect(self) -> None:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, name="systemd-bus",
                             daemon=True).start()

        async def connect() -> MessageBus:
            bus = await MessageBus(bus_type=BusType.SYSTEM, negotiate_unix_fd=True).connect()
            bus.add_message_handler(self._on_message)
            await _call(bus, "/org/freedesktop/DBus", "org.freedesktop.DBus", "AddMatch",
                        "s", [f"type='signal',sender='{SYSTEMD}',path='{MANAGER_PATH}',"
                              f"interface='{MANAGER}',member='JobRemoved'"],
                        destination="org.freedesktop.DBus")
            # systemd sends unit signals only while some client is subscribed.
            await _call(bus, MANAGER_PATH, MANAGER, "Subscribe")
            # A new connection after a lost one (dbus restarted): watch the running units
            # again, and look at them once, since signals were missed meanwhile.  (Their
            # start jobs are long done: a run watches its unit once the start returned.)
            for watch in list(self._watches.values()):
                await _add_match(bus, watch.path)
                watch.update(started=True)
                try:  # the old connection's reference went with it (AddRef)
                    await _call(bus, watch.path, UNIT, "Ref")
                except SystemdError:
                    pass  # collected meanwhile: its result is lost
            asyncio.ensure_future(_until_disconnected(bus))
            self._bus = bus
            for watch in list(self._watches.values()):
                await self._refresh(watch)
            return bus

        try:
            self._bus = asyncio.run_coroutine_threadsafe(connect(), self._loop).result(
                CALL_TIMEOUT)
        except Exception as exc:  # noqa: BLE001 - any failure to reach the bus, one line
            raise SystemdError(f"cannot reach systemd on the system bus: {_text(exc)}") \
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

    async def _refresh(self, watch: _Watch) -> None:
        assert self._bus is not None
        try:
            reply = await _call(self._bus, watch.path, PROPERTIES, "Get", "ss",
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
              ) -> _Watch:
        """Start a transient unit and watch it; returns once systemd accepted it."""
        path = unitprops.bus_path(name)
        watch = _Watch(name, path)
        self._ensure_connected()  # before the watch: a first connection watches nothing
        self._watches[path] = watch
        self._by_name[name] = watch

        async def start() -> None:
            assert self._bus is not None
            # The match before the start: no change can pass unseen.
            await _add_match(self._bus, path)
            # dbus-next wants a D-Bus struct as a list.
            await _call(self._bus, MANAGER_PATH, MANAGER, "StartTransientUnit",
                        "ssa(sv)a(sa(sv))", [name, "fail", [list(p) for p in properties],
                                             []], fds=fds)
        try:
            self._run(start())
        except BaseException:
            self._forget(watch)
            raise
        return watch

    def result(self, name: str, watch: _Watch) -> dict[str, Any]:
        """The ended unit's Result, ExecMainCode, ExecMainStatus; then let systemd
        collect it (Unref) and stop watching it."""

        async def read() -> dict[str, Any]:
            assert self._bus is not None
            try:
                reply = await _call(self._bus, watch.path, PROPERTIES, "GetAll", "s",
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
                    await _call(self._bus, path, iface, member, sig, body, destination=dest)
                except SystemdError:
                    pass  # gone already, or never referenced
            return values

        try:
            return dict(self._run(read()))
        finally:
            self._forget(watch)

    def _forget(self, watch: _Watch) -> None:
        self._watches.pop(watch.path, None)
        self._by_name.pop(watch.name, None)

    def stop(self, name: str) -> None:
        self._run(_stop(self._bus_or_raise(), name))

    def kill(self, name: str) -> None:
        self._run(_kill(self._bus_or_raise(), name))

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


async def _call(bus: MessageBus, path: str, interface: str, member: str,
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
    await _call(bus, "/org/freedesktop/DBus", "org.freedesktop.DBus", "AddMatch", "s",
                [_rule(path)], destination="org.freedesktop.DBus")


async def _stop(bus: MessageBus, name: str) -> None:
    try:
        await _call(bus, MANAGER_PATH, MANAGER, "StopUnit", "ss", [name, "replace"])
    except SystemdError as exc:
        if "NoSuchUnit" not in str(exc):
            raise


async def _kill(bus: MessageBus, name: str) -> None:
    try:
        await _call(bus, MANAGER_PATH, MANAGER, "KillUnit", "ssi",
                    [name, "all", int(signal.SIGKILL)])
    except SystemdError as exc:
        if "NoSuchUnit" not in str(exc) and "NoSuchProcess" not in str(exc):
            raise


def _text(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]


_client = Systemd()
os.register_at_fork(after_in_child=_client.reset_after_fork)


# -- one run -------------------------------------------------------------------------------


def properties(task: TaskLike, handler: UnitHandler, name: str, *, node: str, kill_grace: float,
               stderr_index: int = 0) -> list[tuple[str, Variant]]:
    """The transient unit of one run (StartTransientUnit's properties)."""
    route = handler.route
    argv = [*handler.argv, task.key] if route.append_key else list(handler.argv)
    python = sys.executable or "/usr/bin/python3"
    # The wrapper by its path, not -m perfectschedd.unitwrap: importing the package would
    # load the whole library (SQLAlchemy...) into every job, and count against MemoryMax.
    wrapped = [python, "-I", _WRAPPER, "--", *argv]
    env = [f"PERFECTSCHED_KEY={task.key}", f"PERFECTSCHED_TYPE={task.type}",
           f"PERFECTSCHED_SCHEDULED_TIME={int(task.scheduled_time)}",
           f"PERFECTSCHED_ATTEMPT={int(task.attempt)}", f"PERFECTSCHED_UNIT={name}",
           *(f"{k}={v}" for k, v in route.env)]
    props: list[tuple[str, Variant]] = [
        ("Description", Variant("s", f"PerfectSched job {task.key} "
                                     f"{owner_mark(node, os.getpid())}")),
        ("Type", Variant("s", "exec")),
        ("ExecStart", Variant("a(sasb)", [[python, wrapped, False]])),
        ("SyslogIdentifier", Variant("s", os.path.basename(argv[0]) or "perfectsched-job")),
        ("StandardInput", Variant("s", "data")),
        ("StandardInputData", Variant("ay", json.dumps(task.data).encode())),
        ("StandardOutput", Variant("s", "journal")),
        ("StandardErrorFileDescriptor", Variant("h", stderr_index)),
        ("Environment", Variant("as", env)),
        ("CollectMode", Variant("s", "inactive-or-failed")),
        # systemd keeps the unit (and its Result) until we Unref it or our bus
        # connection closes: a quick command's result cannot be collected unread.
        ("AddRef", Variant("b", True)),
        ("TimeoutStopUSec", Variant("t", int(kill_grace * 1_000_000))),
    ]
    if handler.timeout is not None:
        props.append(("RuntimeMaxUSec", Variant("t", int(handler.timeout * 1_000_000))))
    if route.user is not None:
        try:
            pw = pwd.getpwnam(route.user)
        except KeyError:  # removed since the file was read: this run fails, logged
            raise SystemdError(f"no such user {route.user!r}") from None
        props.append(("User", Variant("s", pw.pw_name)))
        try:
            props.append(("Group", Variant("s", grp.getgrgid(pw.pw_gid).gr_name)))
        except KeyError:
            props.append(("Group", Variant("s", str(pw.pw_gid))))
    daemon_unit = own_unit()
    if daemon_unit is not None:
        # Stopping the daemon (or its failing) stops its jobs.  StopPropagatedFrom=, not
        # PartOf=: PartOf= also propagates restarts, and systemd would run the job again
        # (a new invocation, outside any lease) whenever the daemon restarts or is
        # restarted after a crash.  After=: jobs stop before the daemon does.
        props.append(("StopPropagatedFrom", Variant("as", [daemon_unit])))
        props.append(("After", Variant("as", [daemon_unit])))
    props.extend((n, Variant(sig, value)) for n, sig, value in route.unit)
    return props


def run(task: TaskLike, handler: UnitHandler, log: Log, stop: Any, kill_grace: float,
        node: str, on_unit: Callable[[str], None] | None) -> tuple[Outcome, int | None, str]:
    """Run one task as a unit and end it (as handlers.run_task's exec branch does)."""
    key = task.key
    name = unitprops.unit_name(key, task.scheduled_time, task.attempt)
    verdict_r, verdict_w = os.pipe()
    try:
        try:
            props = properties(task, handler, name, node=node, kill_grace=kill_grace)
            if on_unit is not None:
                on_unit(name)  # the master knows the unit before it can exist
            watch = _client.start(name, props, [verdict_w])
        except SystemdError as exc:
            log.error("%s: cannot start unit %s: %s", key, name, exc)
            task.retry()
            return Outcome.FAILED, None, name
        finally:
            os.close(verdict_w)  # the unit holds its own copy
        log.info("%s: running as unit %s", key, name)
        why = _wait(watch, name, key, handler.timeout, log, stop, kill_grace)
        state = _client.result(name, watch)
        last = _read_verdict(verdict_r)
    finally:
        os.close(verdict_r)
    return end_task(task, name, state, last, why, stop, handler.timeout, log), \
        exit_code(state), name


def exit_code(state: dict[str, Any]) -> int | None:
    """The command's exit status from ExecMainCode/ExecMainStatus, or -signal."""
    if "ExecMainStatus" not in state or state.get("ExecMainCode") not in _CLD_CODES:
        return None
    status = int(state["ExecMainStatus"])
    return status if state.get("ExecMainCode") == _CLD_EXITED else -status


def end_task(task: TaskLike, name: str, state: dict[str, Any], last: str, why: str | None,
             stop: Any, timeout: float | None, log: Log) -> Outcome:
    """End the task by how its unit ended: `why` we stopped it (stop, timeout) first,
    then the unit's Result (timeout, oom-kill, start failures), then the exec protocol
    (the last stdout line, else the exit status) as for an exec run."""
    key = task.key
    result = str(state.get("Result", "unknown"))
    code = exit_code(state)
    if why == "stop":
        if stop_reason(stop) is StopReason.SHUTDOWN:
            task.give_back()
            return Outcome.STOPPED
        return Outcome.PREEMPTED  # nothing to write: the lease is not ours
    if why == "timeout" or result == "timeout":
        log.warning("%s: unit %s timed out after %gs and was stopped", key, name,
                    timeout or 0)
        task.retry()
        return Outcome.TIMEOUT
    if result == "oom-kill":
        log.error("%s: unit %s was killed: out of memory (OOM, its MemoryMax)", key, name)
        task.retry()
        return Outcome.FAILED
    if result not in ("success", "exit-code", "signal", "core-dump") or code is None:
        log.error("%s: unit %s failed: result %s%s", key, name, result,
                  f", status {code}" if code is not None else
                  " (no exit status: its result was lost)" if result == "success" else "")
        task.retry()
        return Outcome.FAILED
    return exec_verdict(task, last, code, log)


def _wait(watch: _Watch, name: str, key: str, timeout: float | None, log: Log, stop: Any,
          kill_grace: float) -> str | None:
    """Wait for the unit to end; stop it on a stop request, or if it outlives its
    RuntimeMaxSec by far.  Returns why we stopped it (None: it ended by itself)."""
    deadline = time.monotonic() + timeout + kill_grace + _DEADLINE_SLACK \
        if timeout is not None else None
    why: str | None = None
    kill_at: float | None = None
    killed = False
    while not watch.ended.wait(_STOP_POLL):
        now = time.monotonic()
        try:
            _client.check()
            if why is None and stop is not None and stop.is_set():
                why = "stop"
                log.warning("%s: %s; stopping unit %s", key, REASON_TEXT[stop_reason(stop)],
                            name)
                _client.stop(name)
                kill_at = now + stop_grace(stop, kill_grace)
            elif why is None and deadline is not None and now >= deadline:
                why = "timeout"
                log.warning("%s: unit %s still runs %gs past its timeout; stopping it", key,
                            name, now - deadline + _DEADLINE_SLACK)
                _client.stop(name)
                kill_at = now + kill_grace
            if kill_at is not None and not killed and now >= kill_at:
                log.warning("%s: unit %s still running %gs after the stop; sending SIGKILL",
                            key, name, kill_grace)
                _client.kill(name)
                killed = True
        except SystemdError as exc:
            log.error("%s: cannot stop unit %s: %s", key, name, exc)
    return why


def _read_verdict(fd: int) -> str:
    """The last stdout line unitwrap wrote to the pipe ("" if none came)."""
    os.set_blocking(fd, False)
    data = b""
    end = time.monotonic() + _VERDICT_WAIT
    while time.monotonic() < end:
        ready, _, _ = select.select([fd], [], [], max(0.0, end - time.monotonic()))
        if not ready:
            break
        try:
            chunk = os.read(fd, 8192)
        except BlockingIOError:
            continue
        if not chunk:
            break
        data += chunk
    return data.decode("utf-8", "replace").strip()


# -- the master's clean-up -----------------------------------------------------------------


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
            units = (await _call(bus, MANAGER_PATH, MANAGER, "ListUnitsByPatterns", "asas",
                                 [[], [UNIT_PATTERN]]))[0]
            live = {u[0]: u for u in units if u[3] not in _ENDED}
            chosen = [n for n, u in live.items() if n in wanted or belongs(n, u[1])]
            for name in chosen:
                await _kill(bus, name)
                await _stop(bus, name)
            # Stopped means inactive: the occurrence must not run again beside them.
            end = time.monotonic() + timeout
            left = set(chosen)
            while left and time.monotonic() < end:
                for name in list(left):
                    try:
                        reply = await _call(bus, unitprops.bus_path(name), PROPERTIES, "Get",
                                            "ss", [UNIT, "ActiveState"])
                        if reply[0].value in _ENDED:
                            left.discard(name)
                    except SystemdError:
                        left.discard(name)  # collected: gone
                if left:
                    await asyncio.sleep(0.05)
            result.extend(chosen)
        finally:
            bus.disconnect()

    # A thread of its own: the caller's thread may have a loop, and none must survive.
    errors: list[BaseException] = []

    def target() -> None:
        try:
            # Bounded: the master's loop (and its watchdog) waits for this.
            asyncio.run(asyncio.wait_for(work(), 2 * timeout))
        except BaseException as exc:  # noqa: BLE001 - reported to the caller
            errors.append(exc)

    thread = threading.Thread(target=target, name="systemd-cleanup")
    thread.start()
    thread.join()
    if errors:
        if isinstance(errors[0], SystemdError):
            raise errors[0]
        raise SystemdError(_text(errors[0]))
    return result
