"""A crontab as a schedules file (perfectschedctl import-crontab): the rules of
crontab(5), Debian's cron and cronie, written out as schedules-file entries (files.py).

- Blank lines and lines starting with `#` are skipped; `NAME=value` (spaces around `=`
  allowed, the value optionally in matching quotes) sets a variable for the lines after
  it: CRON_TZ and TZ become their `timezone`, SHELL their shell, MAILTO their `notify`
  (below), any other name their `env`.
- cron runs the next occurrence whatever the last one's exit status: every entry gets
  `max_attempts: 1` (a failed run is recorded and not retried).
- cron mails a job's output (MAILTO's rule): `MAILTO=ADDRESS[,ADDRESS...]` becomes
  `notify: {mail: ADDRESSES, when: output}`, `MAILTO=""` `notify: none`, and without
  MAILTO the crontab's owner (--user, or a system crontab's user column) gets the mail,
  as from cron, with a comment saying so.
- A job line is five fields (or an @alias) then, in a system crontab (/etc/crontab,
  /etc/cron.d), the user, then the command: the rest of the line.  An unescaped `%` ends
  the command; what follows it is the command's standard input, each further `%` a
  newline; `\\%` is a literal `%`.
- @reboot has no equivalent (a cluster does not boot), and a line that does not parse is
  kept as a comment; both are reported on stderr.

A user crontab's jobs run as its user: --user NAME or its spool path
(/var/spool/cron/crontabs/NAME) says who, and nothing else may (they would run as the
daemon's user).  A file cron itself would not read (cron(8): /etc/crontab and /etc/cron.d
root's and not writable by others, cron.d names by run-parts' rule, a spool crontab its
user's) is refused in one line.

Keys are stable: the same user and command give the same key wherever the line moves
and whatever its schedule, so `apply` after an edited crontab changes only what changed.
They read OWNER-PROGRAM-HASH (a user crontab) or FILE-PROGRAM-HASH (a system one).
"""

from __future__ import annotations

import hashlib
import os
import pwd
import re
import shlex
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from perfectschedd.errors import InvalidInputError
from perfectschedd.schedules import cron, filetrust
from perfectschedd.schedules.validate import check_timezone
from perfectschedd.settings.notify_spec import DEFAULT_SENDMAIL

_ENV_LINE = re.compile(r"""^\s*(?P<q>["']?)(?P<name>[^=\s"']+)(?P=q)\s*=\s*(?P<value>.*)$""")
_TIME_ALIASES = frozenset(cron.ALIASES)
# Words skipped when naming a key after its command: they say nothing about the job.
_NOT_A_NAME = frozenset({"cd", "test", "[", "[[", "if", "then", "command", "exec", "nice",
                         "ionice", "env", "sudo", "true", "flock", "timeout", "-v", "-n",
                         "-x", "-e", "-d", "!", "{", "("})
HEREDOC_END = "PERFECTSCHED_INPUT"


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (a command with its input) as literal blocks, as written."""


def _str(dumper: yaml.SafeDumper, text: str) -> yaml.Node:
    style = "|" if "\n" in text else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_Dumper.add_representer(str, _str)


@dataclass
class Imported:
    text: str                                       # the schedules file
    warnings: list[str] = field(default_factory=list)
    entries: int = 0
    user_column_warned: bool = False  # said once per file (_user_column)


def system_timezone() -> str | None:
    """The host's zone name (cron runs jobs in local time), from $TZ or /etc/localtime."""
    tz = os.environ.get("TZ", "").lstrip(":")
    if tz:
        return tz
    try:
        target = os.readlink("/etc/localtime")
    except OSError:
        return None
    marker = "zoneinfo/"
    return target.split(marker, 1)[1] if marker in target else None


def split_command(text: str) -> tuple[str, str | None]:
    """crontab(5)'s `%`: (command, standard input or None)."""
    command: list[str] = []
    i = 0
    while i < len(text):
        c = text[i]
        if c == "\\" and i + 1 < len(text) and text[i + 1] == "%":
            command.append("%")
            i += 2
            continue
        if c == "%":
            rest = text[i + 1:]
            return "".join(command), rest.replace("\\%", "\0").replace("%", "\n") \
                .replace("\0", "%")
        command.append(c)
        i += 1
    return "".join(command), None


def _unquote(value: str) -> str:
    value = value.strip()
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
        return value[1:-1]
    return value


def _slug(command: str) -> str:
    for word in command.replace(";", " ").replace("&&", " ").replace("||", " ").split():
        if word in _NOT_A_NAME or "=" in word or word.startswith("-"):
            continue
        name = os.path.basename(word.strip("\"'{}()"))
        name = re.sub(r"\.(sh|py|pl|rb)$", "", name)
        name = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
        if name:
            return name[:40]
    return "job"


def _key(prefix: str, user: str | None, command: str, seen: dict[str, int]) -> str:
    digest = hashlib.blake2b(f"{user or ''}\0{command}".encode(), digest_size=4).hexdigest()
    base = f"{prefix}-{_slug(command)}-{digest}"
    seen[base] = seen.get(base, 0) + 1
    return base if seen[base] == 1 else f"{base}-{seen[base]}"


def _exec(command: str, stdin: str | None, shell: str) -> str | list[str]:
    if stdin is not None:
        command = _with_input(command, stdin, shell)
    return command if shell == "/bin/sh" else [shell, "-c", command]


def _with_input(command: str, stdin: str, shell: str) -> str:
    """A shell line that runs `command` as cron does (`SHELL -c COMMAND`) with `stdin` as
    its standard input, a here-document.  Neither can become code of the line: the
    command is one quoted word, parsed by the inner shell alone (its comment, open quote
    or trailing `&&` reach nothing after it), and the delimiter, quoted so that nothing in
    the text is expanded, is chosen unlike every line of the text (a line equal to it
    would end the document and run the rest)."""
    if not stdin.endswith("\n"):
        stdin += "\n"
    lines = set(stdin.split("\n"))
    end, n = HEREDOC_END, 0
    while end in lines:
        n += 1
        end = f"{HEREDOC_END}_{n}"
    return f"exec {shlex.quote(shell)} -c {shlex.quote(command)} <<'{end}'\n{stdin}{end}"


def _parse_schedule(fields: list[str]) -> tuple[str, list[str]] | None:
    """(cron expression, the words after it) of a job line, or None."""
    if not fields:
        return None
    if fields[0].startswith("@"):
        return fields[0], fields[1:]
    if len(fields) < 6:
        return None
    return " ".join(fields[:5]), fields[5:]


def convert(text: str, *, name: str, system: bool, user: str | None = None,
            default_timezone: str | None = None, sendmail: str = DEFAULT_SENDMAIL
            ) -> Imported:
    """A crontab's text as a schedules file.  `name`: where it came from (a comment, and
    the keys' prefix); `system`: lines carry a user column; `user`: the owner of a user
    crontab (set as each entry's `user`); `sendmail`: the program mail goes through (a
    crontab without MAILTO mails its owner only where it exists, see _notify)."""
    can_mail = os.access(sendmail, os.X_OK)
    # A user crontab is named after its owner (its file's name, or "stdin" when piped
    # from `crontab -l`, would change the keys); a system one after its file.
    label = user if user is not None else ("crontab" if name == "stdin" else name)
    prefix = re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-") or "crontab"
    env: dict[str, str] = {}
    tz = default_timezone
    shell = "/bin/sh"
    mailto: str | None = None  # None: no MAILTO line yet (cron mails the owner)
    out: list[str] = [f"# Imported from {name} by perfectschedctl import-crontab.",
                      "# Review, then put it into schedules_dir on each host that should"
                      " run these commands,",
                      "# and reload: a command runs only on hosts whose schedules_dir"
                      " holds its file.", ""]
    result = Imported(text="")
    seen: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{name}:{number}"
        m = _ENV_LINE.match(line)
        fields = line.split()
        if m and not line.startswith("@") and not _looks_like_job(fields, system):
            var, value = m.group("name"), _unquote(m.group("value"))
            if var in ("CRON_TZ", "TZ"):
                try:
                    tz = check_timezone(value)
                except InvalidInputError:
                    result.warnings.append(f"{where}: unknown time zone {value!r}; the lines "
                                           "after it keep the previous one")
                    out.append(f"# {raw.strip()}   (unknown time zone)")
                    continue
                out.append(f"# {var}={value}: the timezone of the entries below")
            elif var == "SHELL":
                shell = value or "/bin/sh"
            elif var == "MAILTO":
                mailto = ",".join(a.strip() for a in value.split(",") if a.strip())
                out.append(f"# MAILTO={value}: output mailed by the entries below" if mailto
                           else '# MAILTO="": the entries below mail nothing')
            else:
                env[var] = value
            continue
        parsed = _parse_schedule(fields)
        problem = None
        if parsed is None:
            problem = "not a crontab line"
        else:
            expr, rest = parsed
            if expr.lower() == "@reboot":
                problem = "@reboot has no equivalent (a cluster does not boot)"
            elif expr.startswith("@") and expr.lower() not in _TIME_ALIASES:
                problem = f"unknown alias {expr}"
            else:
                try:
                    cron.check(expr)  # as `apply` will take the entry
                except InvalidInputError as exc:
                    problem = str(exc)
            if problem is None and system and len(rest) < 2:
                problem = "no user and command (a system crontab has a user column)"
            if problem is None and not rest:
                problem = "no command"
        if problem is not None:
            result.warnings.append(f"{where}: {problem}; kept as a comment")
            out.append(f"# not imported ({problem}): {raw.strip()}")
            continue
        assert parsed is not None
        expr, rest = parsed
        line_user = user
        if system:
            line_user = rest[0]
            # The command is the line after the user column, as written (spacing kept).
            command_text = _after_fields(line, 1 if expr.startswith("@") else 5, 1)
        else:
            command_text = _after_fields(line, 1 if expr.startswith("@") else 5, 0)
            column = _user_column(rest)
            if column is not None and not result.user_column_warned:
                # A copy of /etc/crontab under another name: without --system its user
                # column would silently become the start of each command.
                result.user_column_warned = True
                result.warnings.append(
                    f"{where}: {column!r} is a user of this host, not a command: this "
                    "looks like a system crontab (a user column); give --system, or the "
                    "user names stay part of the commands")
        command, stdin = split_command(command_text)
        entry: dict[str, Any] = {"key": _key(prefix, line_user, command, seen),
                                 "cron": expr.lower() if expr.startswith("@") else expr}
        if tz:
            entry["timezone"] = tz
        entry["exec"] = _exec(command, stdin, shell)
        if line_user:
            entry["user"] = line_user
        if env:
            entry["env"] = dict(env)
        entry["max_attempts"] = 1  # cron runs the next one whatever this one's exit
        notify, mails_owner = _notify(mailto, line_user)
        if mails_owner and not can_mail:
            notify = None
        if notify is not None:
            entry["notify"] = notify
        out.append(f"# {where}: {raw.strip()}")
        if mails_owner and can_mail:
            out.append(f"# (no MAILTO: its output is mailed to its owner {line_user}, "
                       "as cron does)")
        elif mails_owner:
            # A mail notifier where nothing can send mail would get the file refused
            # (the daemon refuses what it cannot keep): say what cron would have done.
            out.append(f"# (no MAILTO: cron would mail its output to its owner {line_user};"
                       f" {sendmail} is not on this host, so nothing is mailed: add notify:"
                       f" {{mail: {line_user}, when: output}} where it is)")
        out.append(yaml.dump([entry], Dumper=_Dumper, sort_keys=False, allow_unicode=True,
                             width=1000).rstrip())
        result.entries += 1
    if result.entries == 0:
        out.append("[]")
    result.text = "\n".join(out) + "\n"
    return result


def _notify(mailto: str | None, owner: str | None) -> tuple[Any, bool]:
    """The `notify` that gives cron's mail (MAILTO's rule: output, to whom), and whether
    it goes to the owner for want of a MAILTO."""
    if mailto is None:
        if owner is None:
            return None, False
        return {"mail": owner, "when": "output"}, True
    if not mailto:
        return "none", False
    return {"mail": mailto, "when": "output"}, False


def _user_column(rest: list[str]) -> str | None:
    """The first word of a user crontab line's command when it reads as a system
    crontab's user column: a user of this host that is no program on the PATH, followed
    by a command; else None."""
    if len(rest) < 2 or not re.fullmatch(r"[a-z_][a-z0-9_.-]*\$?", rest[0]):
        return None
    try:
        pwd.getpwnam(rest[0])
    except KeyError:
        return None
    return None if shutil.which(rest[0]) else rest[0]


def _looks_like_job(fields: list[str], system: bool) -> bool:
    """`NAME=value` lines never start with five schedule fields; a job whose command
    holds `=` does."""
    parsed = _parse_schedule(fields)
    if parsed is None:
        return False
    try:
        cron.normalize(parsed[0])
    except InvalidInputError:
        return False
    return True


def _after_fields(line: str, n_schedule: int, n_user: int) -> str:
    """The text of `line` after its first n_schedule + n_user blank-separated words."""
    rest = line
    for _ in range(n_schedule + n_user):
        rest = rest.lstrip()
        cut = re.search(r"\s", rest)
        rest = "" if cut is None else rest[cut.start():]
    return rest.strip()


SPOOL = "/var/spool/cron/crontabs"   # Debian's user crontabs, one per user, named after it
CRON_D = "/etc/cron.d"
CRONTAB_MAX = 4 << 20                # bytes of one crontab
# cron(8) reads a file of /etc/cron.d only if its name passes run-parts(8)'s rule:
# `foo.dpkg-old` or `foo.bak` is ignored (a package's leftover, an editor's copy).
_RUN_PARTS_NAME = re.compile(r"^[A-Za-z0-9_-]+$")


class CrontabRefused(Exception):
    """A crontab that is not imported; str() is one line."""


@dataclass(frozen=True)
class Crontab:
    text: str
    name: str           # its file's name, or "stdin"
    system: bool        # its lines have a user column
    user: str | None    # the owner of a user crontab


def read(path: str, *, user: str | None = None, system: bool = False) -> Crontab:
    """The crontab at `path` ('-': standard input), refused where nothing says whose jobs a
    user crontab holds (--user, or its spool path) or where cron itself would not read
    the file.  OSError when it cannot be read."""
    import sys

    if path == "-":
        _whose(user, system, None, "standard input")
        return Crontab(sys.stdin.read(), "stdin", system, user)
    full = os.path.abspath(path)
    system = system or is_system_path(full)
    spool_user = os.path.basename(full) if os.path.dirname(full) == SPOOL else None
    user = _whose(user, system, spool_user, path)
    if os.path.dirname(full) == CRON_D and not _RUN_PARTS_NAME.match(os.path.basename(full)):
        raise CrontabRefused(f"{path}: cron does not read it: the name of a file in {CRON_D} "
                             "has only letters, digits, _ and - (the run-parts rule)")
    data = _read_as_cron(Path(path), _owners(path, system, spool_user))
    return Crontab(data.decode("utf-8", errors="surrogateescape"), Path(path).name, system,
                   user)


def _whose(user: str | None, system: bool, spool_user: str | None, where: str
           ) -> str | None:
    """The user a user crontab's jobs run as: only --user or its spool path say it (they
    would otherwise run as whoever the daemon runs jobs as)."""
    if system:
        if user is not None:
            raise CrontabRefused("--user is for a user crontab; a system crontab names its "
                                 "users")
        return None
    if user is not None and spool_user is not None and user != spool_user:
        raise CrontabRefused(f"{where}: {spool_user}'s crontab, not {user}'s")
    if user is None and spool_user is None:
        raise CrontabRefused(f"{where}: a user crontab needs --user NAME (whose jobs they "
                             f"are), or its path in {SPOOL}/NAME")
    return user or spool_user


def _owners(path: str, system: bool, spool_user: str | None) -> frozenset[int] | None:
    """Who may own the file for cron to read it (cron(8)): root for /etc/crontab and
    /etc/cron.d, root or its user for a spool crontab; None: not a file cron reads."""
    if system and is_system_path(path):
        return frozenset({filetrust.ROOT})
    if spool_user is None:
        return None
    try:
        return frozenset({filetrust.ROOT, pwd.getpwnam(spool_user).pw_uid})
    except KeyError:
        raise CrontabRefused(f"{path}: no user {spool_user} on this host (cron ignores the "
                             "crontab of a user it does not know)") from None


def _read_as_cron(path: Path, owners: frozenset[int] | None) -> bytes:
    try:
        if owners is None:
            with path.open("rb") as f:
                data = f.read(CRONTAB_MAX + 1)
        else:
            data = filetrust.read(path, owners, CRONTAB_MAX).data
    except filetrust.NotTrusted as exc:
        raise CrontabRefused(str(exc)) from None
    if len(data) > CRONTAB_MAX:
        raise CrontabRefused(f"{path}: larger than {CRONTAB_MAX} bytes")
    return data


def is_system_path(path: str) -> bool:
    p = os.path.abspath(path)
    return p == "/etc/crontab" or os.path.dirname(p) == CRON_D
