"""The `routes` section of the configuration: what one route is (RouteConfig) and the
checks that build it from the file (parse_routes).

Only what the file itself says is checked here, the same for the daemon and for a client
reading the file (perfectschedctl -c); what only the host that runs the jobs can check (the
user exists, systemd runs, the privilege model) is config.host_refusals'.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from perfectschedd.errors import ConfigError, InvalidInputError, describe
from perfectschedd.settings import notify_spec, runas, unit_props
from perfectschedd.settings.notify_spec import Notifier
from perfectschedd.settings.numbers import NUMBER_MAX
from perfectschedd.settings.runas import ACCOUNT_NAME

# The keys of an entry of `routes` (perfectschedd(8) has an entry for each).
ROUTE_KEYS = frozenset({"type", "exec", "python", "timeout", "executor", "unit", "user",
                        "env", "allow", "notify", "metrics"})


@dataclass(frozen=True)
class RouteConfig:
    """One entry of `routes`: which task types go to which handler."""

    pattern: str  # as written: an exact type, or /regexp/
    exec: tuple[str, ...] | None = None
    python: str | None = None
    timeout: float | None = None
    env: tuple[tuple[str, str], ...] = ()  # added to the job's environment
    # Run the job as this user: the daemon is root, or systemd sets it (executor systemd);
    # a python route's runs inside the daemon, so it can only name the daemon's own user.
    # Under a root daemon a route without one is refused (config.route_refusal).
    user: str | None = None
    # Who besides root may schedule this route's types when it has a `user` (user names,
    # @group names; control/auth.py's Access.check_route).  A route without `user` is
    # the group's.
    allow: tuple[str, ...] = ()
    append_key: bool = True  # the key as last argument (a schedules file's entry: never)
    # "systemd": each run is a transient unit (executors/systemd/unit.py) with these
    # properties (unit_props.convert: D-Bus name, signature, value).
    executor: str = "exec"
    unit: tuple[tuple[str, str, Any], ...] = ()
    # Why this host cannot run the route (config.refuse_routes), or None: a refused route
    # still takes the types it matches (first match wins), and runs none of them here.
    refused: str | None = None
    # Who hears of this route's failures (notify_spec.SILENT: nobody); None: the
    # configuration's default.
    notify: Notifier | None = None
    # Its schedules get series of their own on /metrics unless one says otherwise
    # (schedules/policy.py's Policy.metrics; docs/metrics.md).
    metrics: bool = False
    # A schedules file's exec entry: its file (file:NAME), whose own row alone it runs
    # (vocabulary/fields.py's foreign_exec_row); None for the configuration's routes.
    source: str | None = None
    # ...and its data (canonical JSON): row K holding other data (another host's version,
    # or a client's of 0.1.0 not yet overwritten by this host's convergence) is not run
    # here with this host's command.
    data: str | None = None

    @property
    def regexp(self) -> re.Pattern[str] | None:
        if len(self.pattern) >= 2 and self.pattern.startswith("/") and self.pattern.endswith("/"):
            return re.compile(self.pattern[1:-1])
        return None

    def matches(self, task_type: str) -> bool:
        rx = self.regexp
        if rx is None:
            return task_type == self.pattern
        return rx.search(task_type) is not None



def parse_routes(raw: Any, notifiers: Mapping[str, Notifier]) -> tuple[RouteConfig, ...]:
    """The `routes` section, checked: one ConfigError naming the entry and key at the
    first fault.  `notifiers`: the named ones a route's `notify:` may refer to."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise ConfigError("routes: must be a list")
    out = []
    for i, entry in enumerate(raw):
        where = f"routes[{i}]"
        if not isinstance(entry, Mapping):
            raise ConfigError(f"{where}: must be a mapping")
        unknown = set(entry) - ROUTE_KEYS
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
        pattern = entry.get("type")
        if not isinstance(pattern, str) or not pattern:
            raise ConfigError(f"{where}.type: must be a non-empty string")
        route_exec, python = entry.get("exec"), entry.get("python")
        if (route_exec is None) == (python is None):
            raise ConfigError(f"{where}: needs exactly one of exec or python")
        if route_exec is not None and (
            not isinstance(route_exec, list) or not route_exec
            or not all(isinstance(a, str) for a in route_exec)
        ):
            raise ConfigError(f"{where}.exec: must be a non-empty list of strings")
        if python is not None and (not isinstance(python, str) or ":" not in python):
            raise ConfigError(f"{where}.python: must be 'module:Class', got {describe(python)}")
        timeout = entry.get("timeout")
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, int | float)
            or not 0 < timeout <= NUMBER_MAX  # also refuses NaN
        ):
            raise ConfigError(f"{where}.timeout: must be a positive number of seconds")
        try:
            # Whether systemd runs here is the daemon's to check (config.route_refusal): a client
            # reading the same file (perfectschedctl -c) runs no job.
            executor = unit_props.check_executor(entry.get("executor"), runs_here=False)
        except ValueError as exc:
            raise ConfigError(f"{where}.executor: {exc}") from None
        if executor == "systemd" and route_exec is None:
            raise ConfigError(f"{where}.executor: systemd runs exec routes only")
        if "unit" in entry and executor != "systemd":
            raise ConfigError(f"{where}.unit: only with executor: systemd")
        try:
            unit = unit_props.convert(entry.get("unit"))
        except unit_props.UnitPropertyError as exc:
            raise ConfigError(f"{where}.unit: {exc}") from None
        if entry.get("env") is not None and route_exec is None:
            raise ConfigError(f"{where}.env: only for exec routes (a python handler runs "
                              "inside the daemon, in its environment)")
        try:
            # Whether the user exists and may be used here is route_refusal's, as above.
            user = (runas.check_user(entry["user"], False)
                    if entry.get("user") is not None else None)
            env = runas.check_env(entry.get("env"))
        except InvalidInputError as exc:
            raise ConfigError(f"{where}.{exc}") from None
        allow = _allow(where, entry.get("allow"))
        if allow and user is None:
            raise ConfigError(f"{where}.allow: only for a route with user: (a route without "
                              "one is open to control_group)")
        notify = None
        if entry.get("notify") is not None:
            try:
                notify = notify_spec.parse_ref(entry["notify"], notifiers, f"{where}.notify")
            except ValueError as exc:
                raise ConfigError(f"{where}.{exc}") from None
        metrics = entry.get("metrics", False)
        if not isinstance(metrics, bool):
            raise ConfigError(f"{where}.metrics: must be true or false, got "
                              f"{describe(metrics)}")
        route = RouteConfig(
            pattern=pattern,
            notify=notify,
            metrics=metrics,
            exec=tuple(route_exec) if route_exec is not None else None,
            python=python,
            timeout=float(timeout) if timeout is not None else None,
            executor=executor,
            unit=unit,
            user=user,
            env=env,
            allow=allow,
        )
        try:
            route.regexp  # noqa: B018 - compile now so a bad regexp is a config error
        except re.error as exc:
            raise ConfigError(f"{where}.type: bad regular expression: {exc}") from None
        out.append(route)
    return tuple(out)


def _allow(where: str, raw: Any) -> tuple[str, ...]:
    """A route's allow: list of user names and @group names (none: root only)."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise ConfigError(f"{where}.allow: must be a list of user names and @group names")
    seen: list[str] = []
    for name in raw:
        if not isinstance(name, str) or not ACCOUNT_NAME.match(name.removeprefix("@")):
            raise ConfigError(f"{where}.allow: {describe(name)} is not a user name or "
                              "@group name")
        if name in seen:
            raise ConfigError(f"{where}.allow: {name!r} appears twice")
        seen.append(name)
    return tuple(seen)
