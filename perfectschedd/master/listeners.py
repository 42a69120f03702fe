"""The master's three listeners: the control socket, the HTTP listener (/metrics, /healthz,
the API: web/) and the D-Bus service.  Started at start, swapped on a reload (what the
new configuration needs opens before what the old one had closes), stopped at stop.

Each serves requests on threads of its own and hands them to the supervisor's
`dispatch`; the HTTP listener asks `healthy` too.  D-Bus is optional: when it cannot be had
the daemon runs on and a thread keeps trying, with back-off.
"""

from __future__ import annotations

import errno
import logging
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any

from perfectschedd import logsetup
from perfectschedd.config import Config
from perfectschedd.errors import ConfigError
from perfectschedd.metrics import exposition, multiproc
from perfectschedd.web.credentials import Credentials

log = logging.getLogger("perfectschedd")

DBUS_RETRY_MAX = 30.0


class Listeners:
    def __init__(self, dispatch: Callable[..., Any], healthy: Callable[[], bool],
                 stopping: Callable[[], bool], on_error: Callable[[str], None],
                 read_tokens: Callable[[], Any], routes: Callable[[], Any]) -> None:
        self.dispatch = dispatch
        self.healthy = healthy
        self.routes = routes  # the running configuration's (a reload swaps them)
        self.stopping = stopping  # the daemon stops: a D-Bus retry gives up
        self.on_error = on_error  # an error status should show (the daemon runs on)
        self.control: Any = None
        self.dbus: Any = None
        self.http: Any = None
        self.dbus_attempt = 0  # a retry thread gives up when this moves on
        # Who an HTTP client is; kept across reloads (its caches are the database's).
        self.credentials = Credentials(read_tokens)

    # -- control socket -------------------------------------------------------------------

    def start_control(self, config: Config) -> None:
        from perfectschedd.control.server import ControlServer

        previous = self.control  # set (and stopped) when a reload moved the socket
        server = ControlServer(config, self.dispatch, log=log)
        try:
            server.start()
        except ConfigError as exc:
            if previous is None:  # at start: the daemon cannot be controlled, so it stops
                log.error("%s", exc)
                raise SystemExit(1) from None
            log.error("%s; keeping the control socket at %s", exc, previous.path)
            self.on_error(str(exc))
            server = ControlServer(config, self.dispatch, log=log,
                                           path=previous.path)
            server.start()
        self.control = server

    # -- HTTP: /metrics, /healthz, the API -------------------------------------------------

    def start_metrics(self, config: Config) -> None:
        if self.http is not None:
            self.http.stop()
            self.http = None
        if config.http_listen is not None:
            self.http = self.serve_http(config)
            self._said_listening(config)

    @staticmethod
    def _said_listening(config: Config) -> None:
        assert config.http_listen is not None
        scheme = "https" if config.http_tls else "http"
        log.info("metrics on %s://%s:%d/metrics", scheme, *config.http_listen)

    def serve_http(self, config: Config) -> Any:
        from perfectschedd.web.server import HttpListener

        listen = config.http_listen
        assert listen is not None
        app = self._web_app(config)
        try:
            return HttpListener(listen, app, config.http_tls)
        except OSError as exc:  # ssl.SSLError too: a certificate that does not load
            key = config.http_listen_key
            hint = (f" (another perfectschedd?  Set {key} to a free port, or off)"
                    if exc.errno == errno.EADDRINUSE else "")
            _refuse_tls(exc)
            raise ConfigError(f"{key}: cannot listen on {listen[0]}:{listen[1]}: "
                              f"{exc.strerror or exc}{hint}") from None

    def _reconfigure_http(self, config: Config) -> None:
        """The listener keeps its address: it takes `config`'s settings in place."""
        try:
            self.http.reconfigure(self._web_app(config), config.http_tls)
        except OSError as exc:
            _refuse_tls(exc)
            raise ConfigError(f"http_tls: {exc.strerror or exc}") from None

    def _web_app(self, config: Config) -> Any:
        from perfectschedd.control.server import ControlServer
        from perfectschedd.web.app import WebApp

        assert config.http_listen is not None
        app = WebApp(self.dispatch, self.credentials, exposition.render_with_type,
                     self.healthy, listen_host=config.http_listen[0],
                     tls=config.http_tls is not None, insecure=config.http_insecure,
                     metrics_token=config.metrics_token,
                     group_gid=ControlServer.resolve_group(config.control_group),
                     routes=self.routes)
        if app.api_refused is not None:
            log.warning("%s: %s", config.http_listen_key, app.api_refused)
        return app

    # -- D-Bus ----------------------------------------------------------------------------

    def start_dbus(self, config: Config) -> None:
        if not config.dbus:
            return
        self.dbus_attempt += 1
        try:
            self.dbus = self._dbus_service(config)
        except Exception as exc:  # noqa: BLE001 - D-Bus is optional; the daemon runs on
            log.error("D-Bus interface not available: %s; trying again with back-off", exc)
            self.dbus = None
            # The bus may not have read our policy yet (right after the package was
            # installed) or may not run yet: keep trying, off the loop.
            threading.Thread(target=self._retry_dbus, args=(self.dbus_attempt, config),
                             name="dbus-retry", daemon=True).start()

    def _dbus_service(self, config: Config) -> Any:
        from perfectschedd.control import dbus_server

        group = self.control.group_gid if self.control is not None else None
        service = dbus_server.DBusService(self.dispatch, log=log,
                                           address=config.dbus_address, group_gid=group)
        service.start()
        return service

    def _retry_dbus(self, attempt: int, config: Config) -> None:
        wait = 1.0
        while True:
            time.sleep(wait)
            wait = min(wait * 2, DBUS_RETRY_MAX)
            if attempt != self.dbus_attempt or self.stopping():
                return  # a reload or a stop took over
            try:
                service = self._dbus_service(config)
            except Exception:  # noqa: BLE001 - said once; the daemon runs on without it
                continue
            if attempt != self.dbus_attempt or self.stopping():
                service.stop()
                return
            self.dbus = service
            return

    # -- reload ---------------------------------------------------------------------------

    def swap(self, old: Config, new: Config) -> None:
        """Open what the new configuration needs before closing what the old one had, so
        a new port in use or an unwritable log path leaves everything as it was."""
        from perfectschedd.control.server import ControlServer

        new_control = new_http = None
        reconfigured = False
        # Same address, other settings: the listener takes them in place (a new one could
        # not bind the address the old one holds).
        in_place = _http_changed(old, new) and self.http is not None and \
            new.http_listen is not None and new.http_listen == old.http_listen
        try:
            # A socket file someone deleted (tmpfiles cleaning, a careless rm) comes back
            # with a reload, as with a restart.
            if new.control_socket != old.control_socket or \
                    new.control_group != old.control_group or \
                    (self.control is not None and not self.control.file_intact()):
                new_control = ControlServer(new, self.dispatch, log=log)
                if new.control_socket == old.control_socket and self.control is not None:
                    self.control.stop()  # same path: it must be free to bind again
                new_control.start()
            if in_place:
                self._reconfigure_http(new)
                reconfigured = True
            elif _http_changed(old, new) and new.http_listen is not None:
                new_http = self.serve_http(new)
            logsetup.setup(new.log)
        except BaseException:
            if new_control is not None:
                new_control.stop()
                if new.control_socket == old.control_socket:
                    self.start_control(old)
            if new_http is not None:
                new_http.stop()
            if reconfigured:
                self._reconfigure_http(old)
            logsetup.setup(old.log)
            raise
        if new_control is not None:
            if self.control is not None and new.control_socket != old.control_socket:
                self.control.stop()
            self.control = new_control
        if in_place:
            self._said_listening(new)
        elif _http_changed(old, new):
            if self.http is not None:
                self.http.stop()
            self.http = new_http
            if new.http_listen is not None:
                self._said_listening(new)

    def swap_dbus(self, old: Config, new: Config) -> None:
        """Once the new configuration is in place: D-Bus on its new bus, or off."""
        if (new.dbus, new.dbus_address) != (old.dbus, old.dbus_address):
            self.dbus_attempt += 1  # stops a retry of the old address
            if self.dbus is not None:
                self.dbus.stop()
                self.dbus = None
            self.start_dbus(new)  # optional: a failure is logged and the daemon runs on

    # -- child processes and stop ---------------------------------------------------------

    def fds(self) -> list[int]:
        """The master's listening fds, which a worker closes after fork."""
        fds: list[int] = []
        for obj in (self.control, self.http, self.dbus):
            if obj is not None and hasattr(obj, "fds"):
                fds.extend(obj.fds())
        fds.extend(multiproc.master_fds())
        return fds

    def stop(self) -> None:
        for obj in (self.control, self.dbus, self.http):
            if obj is not None:
                try:
                    obj.stop()
                except Exception:  # noqa: BLE001 - stopping must go on
                    log.exception("error while stopping a listener")


def _http_changed(old: Config, new: Config) -> bool:
    """Whether a reload needs a new HTTP listener (a certificate renewed in place is
    read again by naming it again: `perfectschedctl reload` after changing http_tls)."""
    def settings(c: Config) -> tuple[Any, ...]:
        # control_group: an operator token holds its gid.
        return (c.http_listen, c.http_tls, c.http_insecure, c.metrics_token, c.control_group)

    return settings(old) != settings(new)


def _refuse_tls(exc: OSError) -> None:
    """A certificate or key that does not load, in one line."""
    if isinstance(exc, ssl.SSLError):
        raise ConfigError(f"http_tls: cannot load the certificate and key: "
                          f"{exc.reason or exc}") from None
