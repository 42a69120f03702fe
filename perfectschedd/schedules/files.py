"""Schedules as files (SPEC "Declarative schedules and migration"): reading and checking
them.  Converging the database to them is converge.py's.

A schedules file is a YAML list of entries.  Each file is checked whole: one bad entry
rejects the file (its schedules keep their previous state), and every problem is
reported, one line each, naming the file, the entry and the field.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from perfectschedd.config import privilege_refusal
from perfectschedd.errors import InvalidInputError, describe
from perfectschedd.schedules import filetrust
from perfectschedd.schedules.cron import is_once
from perfectschedd.schedules.policy import DEFAULT, OPTIONS, Policy
from perfectschedd.schedules.validate import (
    check_cron,
    check_data,
    check_int,
    check_key,
    check_timezone,
    check_type,
)
from perfectschedd.settings import notify_spec, runas, unit_props
from perfectschedd.settings.notify_spec import Notifier
from perfectschedd.settings.routes import RouteConfig
from perfectschedd.vocabulary.fields import EXEC_TYPE, SOURCE_FILE, TYPE_MAX

FILE_MAX = 4 << 20      # bytes of one schedules file
ENTRIES_MAX = 20_000    # entries of one file
SUFFIX = ".yml"
ENTRY_KEYS = frozenset({"key", "cron", "type", "exec", "timezone", "delay", "data", "user",
                        "env", "executor", "unit", "notify", *OPTIONS})


@dataclass(frozen=True)
class Entry:
    """One schedule of a file, checked.  What is stored (`stored()`) is all that leaves
    this host: the command, its environment and its user stay in the host's files."""

    key: str
    source: str                          # file:NAME
    cron: str
    type: str                            # the entry's, or exec:KEY
    timezone: str | None                 # None: the configuration's default
    delay: int
    data: str                            # canonical JSON text
    policy: Policy
    exec: tuple[str, ...] | None = None  # argv; a shell line is ("/bin/sh", "-c", LINE)
    env: tuple[tuple[str, str], ...] = ()
    user: str | None = None
    executor: str = "exec"
    unit: tuple[unit_props.Property, ...] = ()
    # The entry's inline `notify:` (or notify_spec.SILENT for `none`): on this host only,
    # as its command.  A notifier's name is stored in the policy instead.
    notify: Notifier | None = None

    def stored(self, default_timezone: str) -> dict[str, Any]:
        """The fields the database holds, as `add` takes them."""
        return {"type": self.type, "cron": self.cron,
                "timezone": self.timezone or default_timezone, "delay": self.delay,
                "data": json.loads(self.data), **self.policy.as_fields()}

    def route(self, refused: str | None = None) -> RouteConfig | None:
        """The route of an exec entry: its own type, on this host only (`refused`: why
        this host does not run it)."""
        if self.exec is None:
            return None
        return RouteConfig(pattern=self.type, exec=self.exec, timeout=self.policy.timeout,
                           env=self.env, user=self.user, append_key=False,
                           executor=self.executor, unit=self.unit, refused=refused,
                           source=self.source, data=self.data)


@dataclass
class Loaded:
    """What a set of files holds."""

    entries: dict[str, Entry] = field(default_factory=dict)  # by key, in file order
    sources: set[str] = field(default_factory=set)           # files read whole
    broken: set[str] = field(default_factory=set)            # files rejected whole
    refused_dirs: set[str] = field(default_factory=set)      # directories not read at all
    owners: dict[str, int] = field(default_factory=dict)     # uid of each file read whole
    errors: list[str] = field(default_factory=list)          # one line per problem
    # Exec entries stored but not run on this host (the privilege rule), by key: one line
    # each.  Refused alone: the rest of their file runs.
    refused: dict[str, str] = field(default_factory=dict)

    def routes(self) -> tuple[RouteConfig, ...]:
        return tuple(r for k, e in self.entries.items()
                     if (r := e.route(self.refused.get(k))) is not None)

    def problems(self) -> list[str]:
        """Every line of what was rejected or refused (files, then entries)."""
        return [*self.errors, *self.refused.values()]

    def notifiers(self) -> tuple[tuple[str, Notifier], ...]:
        """The entries' own inline notifiers (or none), by key."""
        return tuple((k, e.notify) for k, e in self.entries.items() if e.notify is not None)


def source_of(path: Path) -> str:
    return f"{SOURCE_FILE}{path.name}"


@dataclass(frozen=True)
class HostChecks:
    """What only a daemon's host can say of schedules files: who the daemon runs as (the
    files' trust rule, `user:`, the privilege rule), its sendmail (an entry that mails),
    and whether it holds the polkit grant (executor: systemd).  `also_trusted`: further
    owners whose files are read (apply: the caller, whose own files stay theirs)."""

    daemon_uid: int
    sendmail: str
    grant: bool = False
    also_trusted: frozenset[int] = frozenset()

    @classmethod
    def of_status(cls, status: Mapping[str, Any], caller: int) -> HostChecks | None:
        """A daemon's checks as its `status` answer gives them (None: a daemon that does
        not say, older than 0.2.0)."""
        uid, sendmail = status.get("daemon_uid"), status.get("sendmail")
        if not isinstance(uid, int) or not isinstance(sendmail, str):
            return None
        return cls(uid, sendmail, bool(status.get("unit_grant")), frozenset({caller}))


def check(paths: Iterable[str | os.PathLike[str]], host: HostChecks) -> Loaded:
    """The daemon's checks of schedules files, all of them: the daemon runs this on its
    schedules_dir (at start and on reload) and `perfectschedctl apply` on the files it is
    given, with the daemon's HostChecks, so that both reject a file for the same reason,
    in the same words.  Files with an error are rejected whole (`errors`, `broken`); an
    exec entry that the privilege rule forbids here is refused alone (`refused`)."""
    loaded = load(paths, daemon_uid=host.daemon_uid, also_trusted=host.also_trusted)
    _refuse_mail_without_sendmail(loaded, host.sendmail)
    for key, entry in loaded.entries.items():
        if entry.exec is None:
            continue
        why = privilege_refusal(entry.executor, entry.user, host.grant, host.daemon_uid)
        if why is not None:
            loaded.refused[key] = f"schedules file entry {key}: {why}"
    return loaded


def _refuse_mail_without_sendmail(loaded: Loaded, sendmail: str) -> None:
    """A file whose entry mails (an inline `notify: {mail: ...}`) on a host without the
    sendmail program is rejected whole, as any file with an error: what it promises could
    not be kept here (config.notify_refusal says the same of the configuration's
    notifiers)."""
    if os.access(sendmail, os.X_OK):
        return
    for key, entry in list(loaded.entries.items()):
        if entry.notify is not None and entry.notify.kind == "mail":
            if entry.source not in loaded.broken:
                loaded.errors.append(
                    f"{entry.source}: entry {key}: notify: mail needs sendmail, and "
                    f"{sendmail} is not an executable program on this host (install a "
                    "mail transfer agent, or set sendmail: in the configuration)")
            loaded.broken.add(entry.source)
    for key, entry in list(loaded.entries.items()):
        if entry.source in loaded.broken:
            del loaded.entries[key]
    loaded.sources -= loaded.broken
    for source in loaded.broken:
        loaded.owners.pop(source, None)


def load(paths: Iterable[str | os.PathLike[str]], *, need_user_support: bool = True,
         daemon_uid: int | None = None, also_trusted: frozenset[int] = frozenset()
         ) -> Loaded:
    """Read and check files and directories.  `need_user_support`: refuse `user` unless
    this process could run a job as another user (root), as the daemon must; `apply`
    from a workstation only stores what is stored and does not ask.

    `daemon_uid`: the daemon's own user.  Files and directories then follow cron's rule
    (filetrust.py) with root and that user as owners, and a file that is not root's alone
    (nor its symlink's, nor its directory's) may not name a `user` or an `executor`: only
    root decides who a job runs as.  None (perfectschedctl apply): any file the caller can
    read, since what apply sends of it is only what the database stores (to_wire), never
    a command, an environment or a user."""
    owners = None if daemon_uid is None else \
        filetrust.owners_of(daemon_uid) | also_trusted
    loaded = Loaded()
    for path, dir_not_root in _files(paths, owners, loaded):
        source = source_of(path)
        entries, errors = _load_file(path, need_user_support, owners, dir_not_root,
                                     daemon_uid)
        taken = [e.key for e in entries if e.key in loaded.entries]
        errors += [f"{path}: key {k!r} is also in "
                   f"{loaded.entries[k].source[len(SOURCE_FILE):]}" for k in taken]
        if source in loaded.sources or source in loaded.broken:
            errors.append(f"{path}: another file named {path.name} was read already")
        if errors:
            loaded.errors.extend(errors)
            loaded.broken.add(source)
            continue
        loaded.sources.add(source)
        try:  # the creator of its schedules: who may change the file
            loaded.owners[source] = path.stat().st_uid
        except OSError:
            loaded.owners[source] = 0
        for e in entries:
            loaded.entries[e.key] = e
    return loaded


def _files(paths: Iterable[str | os.PathLike[str]], owners: frozenset[int] | None,
           loaded: Loaded) -> Iterator[tuple[Path, str | None]]:
    """The files named, and the *.yml files of the directories named (sorted), each with
    who other than root owns its directory (if anyone); a directory that breaks the rule
    is one error in `loaded` and yields nothing."""
    for p in map(Path, paths):
        if not p.is_dir():
            yield p, None
            continue
        try:
            not_root = None if owners is None else filetrust.check_dir(p, owners)
        except filetrust.NotTrusted as exc:
            loaded.errors.append(str(exc))
            loaded.refused_dirs.add(str(p))
            continue
        for f in sorted(p.iterdir()):
            if f.name.endswith(SUFFIX) and not f.name.startswith(".") and f.is_file():
                yield f, not_root


def _read(path: Path, owners: frozenset[int] | None) -> filetrust.Trusted:
    if owners is not None:
        return filetrust.read(path, owners, FILE_MAX)
    with path.open("rb") as f:
        return filetrust.Trusted(f.read(FILE_MAX + 1))


def _load_file(path: Path, need_user_support: bool, owners: frozenset[int] | None,
               dir_not_root: str | None, runner: int | None
               ) -> tuple[list[Entry], list[str]]:
    try:
        read = _read(path, owners)
    except filetrust.NotTrusted as exc:
        return [], [str(exc)]
    except OSError as exc:
        return [], [f"{path}: cannot read: {exc.strerror}"]
    raw, not_root = read.data, read.not_root or dir_not_root
    if len(raw) > FILE_MAX:
        return [], [f"{path}: larger than {FILE_MAX} bytes"]
    try:
        data = yaml.load(raw.decode("utf-8"), Loader=_NoAliasLoader)  # a SafeLoader
    except UnicodeDecodeError:
        return [], [f"{path}: not UTF-8 text"]
    except _AliasRefused as exc:
        return [], [f"{path}: YAML anchors and aliases are not allowed (line {exc.line})"]
    except (yaml.YAMLError, ValueError) as exc:  # ValueError: a date or number YAML can't build
        return [], [f"{path}: not valid YAML: {(str(exc).splitlines() or ['?'])[0][:200]}"]
    except RecursionError:
        return [], [f"{path}: nested too deeply"]
    if data is None:
        return [], []  # an empty file (or only comments): no schedules
    if not isinstance(data, list):
        return [], [f"{path}: must be a list of schedule entries"]
    if len(data) > ENTRIES_MAX:
        return [], [f"{path}: more than {ENTRIES_MAX} entries"]
    if not_root is not None and (problem := _names_a_user(data)):
        return [], [f"{path}: {problem}: only a file that root owns may name a user or an "
                    f"executor, and {not_root}: rejected"]
    source = source_of(path)
    entries: list[Entry] = []
    errors: list[str] = []
    seen: set[str] = set()
    for i, raw_entry in enumerate(data, 1):
        where = f"{path}: entry {i}"
        if isinstance(raw_entry, Mapping) and isinstance(raw_entry.get("key"), str):
            where += f" ({raw_entry['key'][:80]})"
        try:
            entry = check_entry(raw_entry, source, need_user_support, runner=runner)
        except InvalidInputError as exc:
            errors.append(f"{where}: {exc}")
            continue
        except RecursionError:
            errors.append(f"{where}: nested too deeply")
            continue
        if entry.key in seen:
            errors.append(f"{where}: key {entry.key!r} appears twice in this file")
            continue
        seen.add(entry.key)
        entries.append(entry)
    return entries, errors


class _AliasRefused(Exception):
    def __init__(self, line: int) -> None:
        super().__init__(f"line {line}")
        self.line = line


class _NoAliasLoader(yaml.SafeLoader):
    """SafeLoader that refuses the first anchor or alias it meets, before composing
    anything from it: a file of a few hundred bytes of nested aliases composes to
    billions of nodes for whatever walks them (the checks, json.dumps).  A schedules file
    has no need of them; cron has nothing like them."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise _AliasRefused(event.start_mark.line + 1)
        return super().compose_node(parent, index)


def _names_a_user(data: list[Any]) -> str | None:
    """The first entry that says who its job runs as (`user`, or `executor`, as systemd
    runs a unit as the daemon's user or another), as "entry N (KEY): FIELD"."""
    for i, raw in enumerate(data, 1):
        if not isinstance(raw, Mapping):
            continue
        for name in ("user", "executor"):
            if raw.get(name) is not None:
                key = raw.get("key")
                return f"entry {i}" + (f" ({key[:80]})" if isinstance(key, str) else "") + \
                    f": {name}"
    return None


def check_entry(raw: Any, source: str, need_user_support: bool = True,
                stored_only: bool = False, runner: int | None = None) -> Entry:
    """One entry, checked as `add` checks its arguments; InvalidInputError names the
    field.  `stored_only`: an entry as `apply` sends it to the daemon, whose exec entries
    come as their type (exec:KEY) without the command.  `runner`: the uid of the daemon
    that runs it (default: this process)."""
    if not isinstance(raw, Mapping):
        raise InvalidInputError("entry", f"must be a mapping, got {describe(raw)}")
    unknown = sorted(str(k) for k in raw if k not in ENTRY_KEYS)
    if unknown:
        raise InvalidInputError(unknown[0], "unknown field (known: "
                                f"{', '.join(sorted(ENTRY_KEYS))})")
    key = check_key(raw.get("key"))
    if "cron" not in raw:
        raise InvalidInputError("cron", "required")
    expr = check_cron(raw["cron"])
    if is_once(expr):
        raise InvalidInputError("cron", "@once is not for schedules files (it would run "
                                "again after every reload); use perfectschedctl add")
    has_type, has_exec = raw.get("type") is not None, raw.get("exec") is not None
    if has_type == has_exec:
        raise InvalidInputError("type", "needs exactly one of type or exec")
    argv: tuple[str, ...] | None = None
    if has_exec:
        argv = _check_exec(raw["exec"])
        task_type = f"{EXEC_TYPE}{key}"
        if len(task_type) > TYPE_MAX:
            raise InvalidInputError("key", f"longer than {TYPE_MAX - len(EXEC_TYPE)} "
                                    "characters (an exec entry's type is exec:KEY)")
    else:
        # An entry `apply` sends may name its own exec entry's type; a file's may not.
        task_type = check_type(raw["type"], exec_key=key if stored_only else None)
    tz = raw.get("timezone")
    if tz is not None:
        tz = check_timezone(tz)
    delay = check_int("delay", raw.get("delay", 0))
    data = check_data(raw.get("data"))
    local_notify = None
    options = {k: raw[k] for k in OPTIONS if k in raw}
    if isinstance(options.get("notify"), Mapping) or options.get("notify") == "none":
        # An inline notifier holds a command or a destination: it stays in the file, on
        # the hosts that read it (never sent by apply, never stored).
        if stored_only:
            raise InvalidInputError("notify", "only a notifier's name can be sent to the "
                                    "daemon; an inline notifier belongs in its schedules_dir")
        try:
            local_notify = notify_spec.parse_ref(options.pop("notify"), {}, f"entry {key}")
        except ValueError as exc:
            where, _, why = str(exc).partition(": ")
            raise InvalidInputError(where, why) from None
    chosen = DEFAULT.changed(options)
    env = runas.check_env(raw.get("env"))
    if env and argv is None:
        raise InvalidInputError("env", "only for exec entries (a type's route has its own)")
    try:
        executor = unit_props.check_executor(raw.get("executor"), runs_here=need_user_support)
    except ValueError as exc:
        raise InvalidInputError("executor", str(exc)) from None
    if executor != "exec" and argv is None:
        raise InvalidInputError("executor", "only for exec entries")
    if raw.get("unit") is not None and executor != "systemd":
        raise InvalidInputError("unit", "only with executor: systemd")
    try:
        unit = unit_props.convert(raw.get("unit"))
    except unit_props.UnitPropertyError as exc:
        raise InvalidInputError("unit", str(exc)) from None
    user = raw.get("user")
    if user is not None:
        if argv is None:
            raise InvalidInputError("user", "only for exec entries")
        # systemd sets a unit's User=: the daemon need not be root for that.
        user = runas.check_user(user, need_user_support, needs_root=executor == "exec",
                                runner=runner)
    return Entry(key=key, source=source, cron=expr, type=task_type, timezone=tz, delay=delay,
                 data=data, policy=chosen, exec=argv, env=env, user=user, executor=executor,
                 unit=unit, notify=local_notify)


def _check_exec(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        if not value.strip():
            raise InvalidInputError("exec", "must not be empty")
        if "\0" in value:
            raise InvalidInputError("exec", "contains a NUL character")
        return ("/bin/sh", "-c", value)  # as cron runs a crontab line
    if not isinstance(value, list) or not value or not all(isinstance(a, str) for a in value):
        raise InvalidInputError("exec", "must be a shell line or a non-empty list of strings")
    if any("\0" in a for a in value) or not value[0]:
        raise InvalidInputError("exec", "an empty program or a NUL character")
    return tuple(value)
