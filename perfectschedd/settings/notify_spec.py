"""What a notifier is, and how the configuration and schedules files write one (SPEC
"Failures and notifications").

Low in the layers (the config reads everyone's notifiers with it), so it knows no store,
no schedule and no worker: only the checked form of a notifier and of a `notify:` that
refers to one.  Errors raise ValueError("field: reason"); the caller adds where it was.

A notifier comes only from files root writes (the configuration, schedules files): it
holds a command or a destination, and those never travel through the control socket or
the database, which hold a notifier's name at most.
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from perfectschedd import secretfile
from perfectschedd.errors import describe

KINDS = ("exec", "mail", "webhook")
WHENS = ("change", "every-failure", "output")
DEFAULT_WHEN = "change"
DEFAULT_SENDMAIL = "/usr/sbin/sendmail"
# A notifier's name: what `--notify NAME` stores in a schedule's policy.
NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")
# The words that mean "no notifier" where a `notify:` is read.
NONE_WORDS = ("none",)
# One recipient as cron's MAILTO takes them: user@host, or a local user name (sendmail
# delivers it here); several are separated by commas.  No spaces, quotes, brackets or
# line breaks: the value becomes a To: header, and nothing may be injected after it.
_ADDRESS = re.compile(r"^[^\s<>,;:\"()\[\]\\@]+(@[^\s<>,;:\"()\[\]\\@]+)?$")
_URL_MAX = 2048
# A webhook's secrets in files of their own (secretfile.py): read when it is sent, so a
# new token needs no reload; the daemon reads them at start and on reload as well.
WEBHOOK_FILES = ("webhook_file", "token_file")


@dataclass(frozen=True)
class Notifier:
    """One checked notifier.  `target`: the argv (exec), the address (mail), the URL
    (webhook; "" when `url_file` holds it).  `name`: its name in `notifiers:`, or a label
    of where an inline one was written (for logs).  `url_file`, `token_file`: a webhook's
    URL and bearer token, as secretfile references (the files are read when sent)."""

    kind: str
    target: tuple[str, ...] | str
    when: str = DEFAULT_WHEN
    name: str = "inline"
    url_file: str | None = None
    token_file: str | None = None

    def secret_files(self) -> list[tuple[str, str]]:
        """(field, reference) of each secret file this notifier reads."""
        return [(f, ref) for f, ref in (("webhook_file", self.url_file),
                                        ("token_file", self.token_file)) if ref is not None]


# `notify: none`: no notification for what it applies to, whatever a lower level says.
SILENT = Notifier(kind="none", target="", when=DEFAULT_WHEN, name="none")


def within(where: str, exc: Exception) -> str:
    """`exc`'s "field: reason" under `where` ("notifiers.x.exec: ..."); a message about
    the object itself starts with ": "."""
    text = str(exc)
    return f"{where}{text}" if text.startswith(":") else f"{where}.{text}"


def check_name(value: Any, field: str = "notify") -> str:
    if not isinstance(value, str) or not NAME.match(value):
        raise ValueError(f"{field}: a notifier name is 1-64 letters, digits, '_', '.' or "
                         f"'-', got {describe(value)}")
    return value


def parse(raw: Any, name: str = "inline") -> Notifier:
    """One notifier as written: a mapping with exactly one kind and an optional when."""
    if not isinstance(raw, Mapping):
        raise ValueError(f": must be a mapping with one of {', '.join(KINDS)}, "
                         f"got {describe(raw)}")
    unknown = sorted(str(k) for k in raw if k not in (*KINDS, *WEBHOOK_FILES, "when"))
    if unknown:
        raise ValueError(f"{unknown[0]}: unknown key (known: {', '.join(KINDS)}, "
                         f"{', '.join(WEBHOOK_FILES)}, when)")
    kinds = [k for k in KINDS if k in raw]
    if "webhook_file" in raw:
        if "webhook" in raw:
            raise ValueError("webhook_file: the URL comes from webhook or from "
                             "webhook_file, not both")
        kinds.append("webhook")
    if len(kinds) != 1:
        raise ValueError(f": needs exactly one of {', '.join(KINDS)} (or webhook_file)")
    kind = kinds[0]
    if "token_file" in raw and kind != "webhook":
        raise ValueError("token_file: only for a webhook")
    when = raw.get("when", DEFAULT_WHEN)
    if when not in WHENS:
        raise ValueError(f"when: must be one of {', '.join(WHENS)}, got {describe(when)}")
    if kind == "webhook":
        return _webhook(raw, str(when), name)
    value = raw[kind]
    target: tuple[str, ...] | str
    if kind == "exec":
        if not isinstance(value, list) or not value or \
                not all(isinstance(a, str) and "\0" not in a for a in value) or not value[0]:
            raise ValueError("exec: must be a non-empty list of strings (an argv)")
        if not value[0].startswith("/"):
            # No PATH search: the daemon's PATH is not the author's, and a relative
            # program would run whatever the working directory holds.
            raise ValueError(f"exec: the program must be an absolute path, got "
                             f"{describe(value[0])}")
        target = tuple(value)
    elif kind == "mail":
        if not isinstance(value, str) or \
                not all(_ADDRESS.match(a) for a in value.split(",")):
            raise ValueError(f"mail: must be addresses such as ops@example.com or a local "
                             f"user, separated by commas, "
                             f"got {describe(value)}")
        target = value
    return Notifier(kind=kind, target=target, when=str(when), name=name)


def _webhook(raw: Mapping[str, Any], when: str, name: str) -> Notifier:
    """A webhook: its URL written (`webhook`) or in a file (`webhook_file`, for a URL that
    is itself the secret), and a bearer token from a file (`token_file`)."""
    refs = {f: secretfile.check_ref(raw[f], f) for f in WEBHOOK_FILES if f in raw}
    url = check_url(raw["webhook"]) if "webhook" in raw else ""
    return Notifier(kind="webhook", target=url, when=when, name=name,
                    url_file=refs.get("webhook_file"), token_file=refs.get("token_file"))


def webhook_secrets(notifier: Notifier) -> tuple[str, str | None]:
    """A webhook's URL and bearer token (None: none), its files read now.  Raises
    ValueError("field: reason")."""
    url = notifier.target
    assert isinstance(url, str)
    if notifier.url_file is not None:
        try:
            url = check_url(secretfile.read(notifier.url_file, "webhook_file"))
        except secretfile.SecretError:
            raise
        except ValueError:
            # check_url's message would print the URL, which is the secret here.
            raise ValueError(f"webhook_file: {notifier.url_file} does not hold an http:// "
                             "or https:// URL with a host and a good port") from None
    token = None
    if notifier.token_file is not None:
        token = secretfile.read(notifier.token_file, "token_file")
    return url, token


def check_url(value: Any) -> str:
    if not isinstance(value, str) or len(value) > _URL_MAX or \
            any(c.isspace() or ord(c) < 32 for c in value):
        raise ValueError(f"webhook: must be an http:// or https:// URL, got {describe(value)}")
    parts = urllib.parse.urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"webhook: must be an http:// or https:// URL with a host, "
                         f"got {describe(value)}")
    try:
        parts.port  # noqa: B018 - a bad port raises here, not at the first failure
    except ValueError:
        raise ValueError(f"webhook: bad port in {describe(value)}") from None
    return value


def parse_ref(raw: Any, named: Mapping[str, Notifier], label: str = "inline") -> Notifier:
    """A `notify:` as written where root writes: a name of `named`, `none` (SILENT), or
    an inline notifier.  Errors read "notify...: reason"."""
    if isinstance(raw, str):
        if raw in NONE_WORDS:
            return SILENT
        check_name(raw)
        found = named.get(raw)
        if found is None:
            known = ", ".join(sorted(named)) or "none are defined"
            raise ValueError(f"notify: no notifier named {raw!r} in notifiers: ({known})")
        return found
    try:
        return parse(raw, label)
    except ValueError as exc:
        raise ValueError(within("notify", exc)) from None


def parse_table(raw: Any) -> dict[str, Notifier]:
    """The configuration's `notifiers:` mapping of names to notifiers."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ValueError("notifiers: must be a mapping of names to notifiers")
    out: dict[str, Notifier] = {}
    for name, spec in raw.items():
        check_name(name, "notifiers")
        if name in NONE_WORDS:
            raise ValueError(f"notifiers.{name}: this name means no notifier")
        try:
            out[name] = parse(spec, name)
        except ValueError as exc:
            raise ValueError(within(f"notifiers.{name}", exc)) from None
    return out
