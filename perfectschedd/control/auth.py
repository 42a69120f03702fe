"""Who is calling, and what they may do: every authorisation rule, written once.

A Caller is a uid and the groups its process holds, as the kernel recorded them for the
control socket (SO_PEERCRED, SO_PEERGROUPS), as the bus did for D-Bus
(GetConnectionCredentials), or this process's own (perfectschedctl -c, the library).
Never the group database's member lists: a user added to a group is judged by what their
processes hold.

The rules (docs/security.md):
- admission(): who may talk to the daemon at all: root, the daemon's user, members of
  control_group.  The socket and D-Bus both ask it, and refuse in its words;
- Access: what one caller's request may do (commands.execute makes one per request, for
  the socket, D-Bus and direct mode alike), and the uid it records as the creator of
  what it adds:
  - a route with `user:` is schedulable and changeable (add, modify, run, apply, pause,
    resume, delete) only by root and the users and groups its `allow:` names; other
    routes are the group's (the `exec:` prefix of types is schedules.check_type's,
    refused to every caller);
  - a schedules file's schedule (source file:NAME) changes through its file, or by root
    with force; once forced (source forced:file:NAME) it is root's: no one else undoes
    root's change.  `apply` by anyone but root changes or prunes only what they made
    (schedules.ownership.owns, which the convergence of files applies);
  - reading is a right too (may_read): a schedule's data, its runs' output and error
    lines go to root, the daemon's user, its creator and its route's `allow:`;
    everyone admitted sees every key and state.  Direct mode (perfectschedctl -c)
    holds the database's credentials, so it reads everything, as root does.  Output
    unescaped (`raw`) is root's only (and direct mode's);
  - `pause --all` and `resume --all` are every admitted caller's, schedules files'
    schedules included, with no force: they change no schedule (each is held with a
    marker that resume --all releases, and its file still owns it), and they are the
    operators' brake, as `reload` is theirs.  By key or prefix, the rule above holds;
- check_root_only(): a command the registry marks root's (`token`: the HTTP API's
  credentials, whose rights reach every schedule) is root's through the daemon (uid 0)
  and in direct mode alike (a root process: reading the configuration gives the
  database's credentials, not root's commands).
"""

from __future__ import annotations

import grp
import os
import pwd
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from perfectschedd.control.registry import Command
from perfectschedd.errors import InvalidInputError, PermissionDeniedError
from perfectschedd.schedules import ownership
from perfectschedd.schedules.ownership import user_name
from perfectschedd.settings.routes import RouteConfig
from perfectschedd.vocabulary.fields import EXEC_TYPE, SOURCE_FILE, SOURCE_FORCED


def group_name(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return f"gid {gid}"


@dataclass(frozen=True)
class Caller:
    uid: int
    gids: frozenset[int]
    # An HTTP client is the API token it showed: its name and role (TOKEN_ROLES), and as
    # uid minus the token's id, which is what a schedule it adds records as its creator
    # (no user has a negative uid), so that ownership and reading rights work as a user's.
    token: str | None = None
    role: str | None = None

    @classmethod
    def of(cls, uid: int, gids: Iterable[int]) -> Caller:
        return cls(int(uid), frozenset(int(g) for g in gids))

    @classmethod
    def of_token(cls, token_id: int, name: str, role: str, group_gid: int) -> Caller:
        """An operator (or admin) token holds the control group, as a member's process
        does: a route whose allow: names @GROUP lets it in."""
        if role not in TOKEN_ROLES:
            raise ValueError(f"unknown role {role!r}")
        gids = frozenset() if role == VIEWER else frozenset({group_gid})
        return cls(-int(token_id), gids, name, role)

    @classmethod
    def this_process(cls) -> Caller:
        """The process itself: perfectschedctl -c and the library."""
        return cls.of(os.geteuid(), {os.getegid(), *os.getgroups()})

    @property
    def root(self) -> bool:
        return self.uid == 0 and self.token is None

    @property
    def schedules_root(self) -> bool:
        """Root's rights over schedules (force, every route, every schedule's data and
        output): root's, and an admin token's.  Never more: token management and exec
        entries stay root's (`root`)."""
        return self.root or self.role == ADMIN

    @property
    def name(self) -> str:
        return f"token {self.token}" if self.token is not None else user_name(self.uid)


# The roles of API tokens (SPEC "HTTP API and web console"): a viewer reads everything
# but schedules' data and runs' output; an operator has a control_group member's rights;
# an admin root's rights over schedules.
VIEWER, OPERATOR, ADMIN = "viewer", "operator", "admin"
TOKEN_ROLES = (VIEWER, OPERATOR, ADMIN)
# What a token may ask for at all: the schedule commands of the API (never reload,
# apply, init or token management, which stay on the hosts).
TOKEN_COMMANDS = frozenset({"list", "show", "history", "status", "types", "add", "modify",
                            "delete", "pause", "resume", "run"})
READING_COMMANDS = frozenset({"list", "show", "history", "status", "types"})


def check_command(caller: Caller, command: str) -> None:
    """Refuse a command a token's role does not give (a local caller's rights are the
    rules below, by command)."""
    if caller.token is None:
        return
    if command not in TOKEN_COMMANDS:
        raise PermissionDeniedError(f"{command}: not for API tokens ({caller.name}): run "
                                    "it on a host of the daemon")
    if caller.role == VIEWER and command not in READING_COMMANDS:
        raise PermissionDeniedError(f"{command}: {caller.name} has role viewer, which "
                                    "reads only")


def admission(caller: Caller, daemon_uid: int, group_gid: int) -> str | None:
    """None if `caller` may use the daemon (socket, D-Bus), else the refusal."""
    if caller.uid in (0, daemon_uid) or group_gid in caller.gids:
        return None
    allowed = "root" if daemon_uid == 0 else f"root, {user_name(daemon_uid)}"
    return (f"permission denied: {caller.name} may not control perfectschedd (allowed: "
            f"{allowed} and members of group {group_name(group_gid)})")


def check_root_only(cmd: Command, caller: Caller) -> None:
    """Refuse a root-only command (Command.root_only) to anyone but root, in one line,
    before anything is read: through the daemon `caller` is the socket's or the bus's
    word, in direct mode this process."""
    if cmd.root_only is not None and not caller.root:
        raise PermissionDeniedError(f"{cmd.name}: only root {cmd.root_only}, not "
                                    f"{caller.name}")


def route_of(task_type: str, routes: Sequence[RouteConfig]) -> RouteConfig | None:
    """The route that takes `task_type` (the first that matches), or None."""
    return next((r for r in routes if r.matches(task_type)), None)


def allowed_by(allow: Iterable[str], caller: Caller) -> bool:
    """Whether one of `allow` (user names, @group names) names the caller: its uid, or a
    group its process holds.  A name this host does not know names nobody."""
    for name in allow:
        try:
            if name.startswith("@"):
                if grp.getgrnam(name[1:]).gr_gid in caller.gids:
                    return True
            elif pwd.getpwnam(name).pw_uid == caller.uid:
                return True
        except KeyError:
            continue
    return False


def check_force(caller: Caller, force: Any) -> bool:
    """A request's `force` argument: false when absent; true only from root."""
    if force is None:
        return False
    if not isinstance(force, bool):
        raise InvalidInputError("force", "must be true or false")
    if force and not caller.schedules_root:
        raise PermissionDeniedError(f"force: only root may force a change of a schedules "
                                    f"file's schedule, not {caller.name}")
    return force


# What a reader who may not read a schedule's data and output gets in their place.
WITHHELD = ("withheld: a schedule's data and its runs' output are shown to root, its "
            "creator and its route's allow: only")


@dataclass(frozen=True)
class Access:
    """One caller, and the routes of the configuration it reaches.  `reads_all`: the
    caller reads every schedule's data and output (root, the daemon's own user, and
    direct mode, which holds the database's credentials)."""

    caller: Caller
    routes: Sequence[RouteConfig] = ()
    reads_all: bool = False
    raw_ok: bool = False  # may have output unescaped (root; direct mode)

    @property
    def creator(self) -> int:
        """The uid recorded as creator of what this caller adds."""
        return self.caller.uid

    def check_route(self, key: str, task_type: str) -> None:
        """Refuse to make `task_type` run for this caller (add, modify, run, apply) when
        its route runs as another user (`user:`), unless the caller is root or the route's
        `allow:` names them.  Other routes are the group's."""
        route = route_of(task_type, self.routes)
        if route is None or route.user is None or self.caller.schedules_root:
            return
        if allowed_by(route.allow, self.caller):
            return
        who = "root" + (f" and {', '.join(route.allow)}" if route.allow else "")
        raise PermissionDeniedError(
            f"{key}: type {task_type} runs as user {route.user}: only {who} may schedule "
            f"it (its route's allow:), not {self.caller.name}")

    def check_apply_type(self, key: str, task_type: str) -> None:
        """An entry `apply` sends: an exec entry's type (exec:KEY) only from root, who
        writes the files that hold its command; the route rule for every type."""
        if task_type.startswith(EXEC_TYPE) and not self.caller.root:
            raise PermissionDeniedError(
                f"{key}: an exec entry (type {task_type}) is applied by root only: put its "
                "file in schedules_dir, or apply it as root")
        self.check_route(key, task_type)

    def check_change(self, key: str, source: str | None, force: bool,
                     schedules_dir: str | None = None) -> bool:
        """Refuse to change (modify, pause, resume, delete) a schedules file's schedule:
        its file says what it is (`schedules_dir`: where the files are, to name it).
        Root may force it (check_force), which detaches it from the file.  Whether the
        change is one of those: the schedule must then record its new source
        (fields.detached_source).  One root detached (forced:file:NAME) is root's: a
        member's change would undo root's."""
        if source is not None and source.startswith(SOURCE_FORCED + SOURCE_FILE) \
                and not self.caller.schedules_root:
            name = source[len(SOURCE_FORCED + SOURCE_FILE):]
            path = f"{schedules_dir.rstrip('/')}/{name}" if schedules_dir else name
            raise PermissionDeniedError(
                f"{key} was changed by root with --force (detached from {path}): only "
                f"root may change it, not {self.caller.name}")
        if source is None or not source.startswith(SOURCE_FILE):
            return False
        if force:
            return True
        name = source[len(SOURCE_FILE):]
        path = f"{schedules_dir.rstrip('/')}/{name}" if schedules_dir else name
        raise PermissionDeniedError(f"{key} is managed by {path}: edit it and reload (root "
                                    "may --force the change, which detaches it from the "
                                    "file)", conflict=True)

    def owns(self, creator: int | None) -> bool:
        """Whether this caller's `apply` may change or prune a schedules file's schedule
        made by `creator` (the rule is schedules.ownership's: converge obeys it)."""
        return ownership.owns(self.caller.uid, creator)

    def may_read(self, creator: int | None, task_type: str) -> bool:
        """Whether this caller may read the data and the runs' output of a schedule made
        by `creator` (None: unknown, before 0.2.0) of type `task_type`: root, the
        daemon's user and direct mode (reads_all), its creator, its route's allow:."""
        if self.caller.role == VIEWER:
            return False
        if self.reads_all or (creator is not None and creator == self.caller.uid):
            return True
        route = route_of(task_type, self.routes)
        return route is not None and route.user is not None and \
            allowed_by(route.allow, self.caller)

    def check_raw(self, raw: Any) -> bool:
        """A request's `raw` argument (output unescaped): false when absent; true only
        from root (and direct mode)."""
        if raw is None:
            return False
        if not isinstance(raw, bool):
            raise InvalidInputError("raw", "must be true or false")
        if raw and not self.raw_ok:
            raise PermissionDeniedError(f"--raw: only root may read output unescaped, not "
                                        f"{self.caller.name}")
        return raw
