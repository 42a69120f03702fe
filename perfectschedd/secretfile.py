"""Secrets read from files instead of the configuration: the database password
(`password_file:`), a webhook's token and URL (`token_file:`, `webhook_file:`).

The configuration is readable by the daemon's group, whose members use perfectschedctl;
a secret in a file of its own (best a systemd credential) need not be (docs/security.md,
"Secrets").  A name without a slash is a systemd credential, `LoadCredential=NAME:PATH`
in the unit, read from `$CREDENTIALS_DIRECTORY`; anything else must be an absolute path.

Errors are SecretError (a ValueError) of one line, "field: reason", that names the file
and never prints what it holds.
"""

from __future__ import annotations

import os
import re
import stat
from typing import Any

from perfectschedd.errors import describe

# A password or a token is short; a larger file is a wrong path, not a secret.
SECRET_MAX = 4096
# systemd's rule for a credential's name (a file name), kept to what a unit file can say.
_CREDENTIAL = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.@-]{0,254}$")


class SecretError(ValueError):
    """A secret file that cannot be used; the message is "field: reason"."""


def check_ref(value: Any, field: str) -> str:
    """A secret's file as written: an absolute path, or a credential name."""
    if not isinstance(value, str) or not value or "\0" in value:
        raise SecretError(f"{field}: must be an absolute path or a systemd credential "
                          f"name, got {describe(value)}")
    if not value.startswith("/") and not _CREDENTIAL.match(value):
        raise SecretError(f"{field}: {value!r} is neither an absolute path nor a "
                          "systemd credential name (LoadCredential=NAME:PATH)")
    return value


def path_of(ref: str, field: str) -> str:
    """The file a reference names: a credential is looked up where systemd put it."""
    if ref.startswith("/"):
        return ref
    directory = os.environ.get("CREDENTIALS_DIRECTORY")
    if not directory:
        raise SecretError(f"{field}: {ref!r} is a systemd credential name, and no "
                          "credentials are given here ($CREDENTIALS_DIRECTORY is unset: "
                          f"LoadCredential={ref}:PATH in the unit; outside it, an "
                          "absolute path)")
    return os.path.join(directory, ref)


def read(ref: str, field: str) -> str:
    """The secret: the file's text without its final line break.  Refused: a file that
    cannot be read, is not a regular file, is readable by every user (it is no secret
    then: whoever wrote it so should know), is empty, larger than SECRET_MAX bytes, not
    UTF-8, or holds more than one line."""
    path = path_of(ref, field)
    try:
        # O_NONBLOCK: a FIFO put there must not hang a start or a reload.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except OSError as exc:
        raise SecretError(f"{field}: cannot read {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SecretError(f"{field}: {path} is not a regular file")
        if st.st_mode & stat.S_IROTH:
            raise SecretError(f"{field}: {path} is readable by every user (mode "
                              f"{stat.S_IMODE(st.st_mode):04o}): `chmod o-r {path}`, and "
                              "change the secret if others may have read it")
        data = b""
        while len(data) <= SECRET_MAX:
            chunk = os.read(fd, SECRET_MAX + 1 - len(data))
            if not chunk:
                break
            data += chunk
    except OSError as exc:
        raise SecretError(f"{field}: cannot read {path}: {exc.strerror}") from None
    finally:
        os.close(fd)
    if len(data) > SECRET_MAX:
        raise SecretError(f"{field}: {path} is larger than {SECRET_MAX} bytes")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise SecretError(f"{field}: {path} is not UTF-8 text") from None
    text = text.removesuffix("\n").removesuffix("\r")
    if not text:
        raise SecretError(f"{field}: {path} is empty")
    if any(ord(c) < 32 or ord(c) == 127 for c in text):
        raise SecretError(f"{field}: {path} holds more than one line or a control "
                          "character")
    return text
