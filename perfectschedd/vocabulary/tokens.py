"""API tokens: their names, roles and secrets, and how a secret is checked against the
hash the database keeps (SPEC "HTTP API and web console", Credentials).

A secret is `pst_<id>_<random>`: the id finds the token's row in one look-up, and only
the random part is secret.  The database keeps a salted slow hash of the random part,
never the secret, so every host can check a secret and a copy of the database gives
none away.  A secret is shown once, by `perfectschedctl token add`.

Pure standard library, no SQLAlchemy: the store hashes a new token's secret with it,
and the HTTP listener checks secrets with it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
import secrets

from perfectschedd.errors import InvalidInputError, describe

# What a token may do, least first (the rights of each are the HTTP listener's).
ROLES = ("viewer", "operator", "admin")

NAME_MAX = 64
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")

PREFIX = "pst_"
# The random part as token_urlsafe writes it; token_urlsafe(32) gives 43 characters.
# Longer ones are accepted so that a later version may make them longer.
RANDOM_BYTES = 32
_SECRET = re.compile(r"pst_([1-9][0-9]{0,18})_([A-Za-z0-9_-]{43,128})")
SECRET_MAX = len(PREFIX) + 19 + 1 + 128
ID_MAX = 2**63 - 1  # a BIGINT

# scrypt, not PBKDF2 or bcrypt/argon2: it is in the standard library (hashlib, on
# OpenSSL), so no new dependency on any host, and it is memory-hard, so guessing on
# GPUs costs memory as well as time.  n=2**14, r=8, p=1 (RFC 7914's interactive
# parameters) take 16 MiB and some 50 ms per check.  The parameters are stored with each
# hash, so they can be raised later without invalidating the tokens made before.
SCHEME = "scrypt"
SCRYPT_N, SCRYPT_R, SCRYPT_P = 2**14, 8, 1
SALT_BYTES, HASH_BYTES = 16, 32
# Bounds on parameters read back from a stored hash: a row someone edited must not make
# a check take gigabytes or minutes.
_N_MAX, _R_MAX, _P_MAX = 2**20, 32, 16
HASH_MAX = 255  # the column's length
_STORED = re.compile(r"scrypt\$([0-9]{1,8})\$([0-9]{1,3})\$([0-9]{1,3})"
                     r"\$([A-Za-z0-9+/=]{4,88})\$([A-Za-z0-9+/=]{4,88})")


def check_name(name: object) -> str:
    """A token name, or InvalidInputError saying what one is."""
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise InvalidInputError(
            "name", f"a token name is 1 to {NAME_MAX} letters, digits, '.', '_' or '-', "
                    f"starting with a letter or digit, not {describe(name)}")
    return name


def check_role(role: object) -> str:
    """A role of ROLES, or InvalidInputError naming them."""
    if not isinstance(role, str) or role not in ROLES:
        raise InvalidInputError("role", f"must be {', '.join(ROLES[:-1])} or {ROLES[-1]}, "
                                        f"not {describe(role)}")
    return role


LIVE, EXPIRED, REVOKED = "live", "expired", "revoked"


def state(revoked_at: float | None, expires_at: float | None, now: float) -> str:
    """A token's state at `now`: REVOKED, EXPIRED (at its expiry time already) or LIVE,
    the only one whose secret may be honoured."""
    if revoked_at is not None:
        return REVOKED
    if expires_at is not None and expires_at <= now:
        return EXPIRED
    return LIVE


def new_secret(token_id: int) -> tuple[str, str]:
    """(secret, stored_hash) of a new secret for the token `token_id`."""
    if isinstance(token_id, bool) or not isinstance(token_id, int) or \
            not 0 < token_id <= ID_MAX:
        raise ValueError(f"not a token id: {token_id!r}")
    random_part = secrets.token_urlsafe(RANDOM_BYTES)
    salt = secrets.token_bytes(SALT_BYTES)
    digest = _scrypt(random_part, salt, SCRYPT_N, SCRYPT_R, SCRYPT_P, HASH_BYTES)
    stored = "$".join((SCHEME, str(SCRYPT_N), str(SCRYPT_R), str(SCRYPT_P),
                       _b64(salt), _b64(digest)))
    return f"{PREFIX}{token_id}_{random_part}", stored


def token_id_of(secret: object) -> int | None:
    """The token id a well-formed secret names; None for anything else."""
    parts = _parts(secret)
    return None if parts is None else parts[0]


def verify(secret: object, stored_hash: object) -> bool:
    """Whether `secret` is the one `stored_hash` was made of.  False for a malformed
    secret or hash and for a scheme this version does not know; never raises."""
    parts = _parts(secret)
    if parts is None or not isinstance(stored_hash, str) or len(stored_hash) > HASH_MAX:
        return False
    m = _STORED.fullmatch(stored_hash)
    if m is None:
        return False
    n, r, p = int(m.group(1)), int(m.group(2)), int(m.group(3))
    try:
        salt = base64.b64decode(m.group(4), validate=True)
        want = base64.b64decode(m.group(5), validate=True)
    except (ValueError, binascii.Error):
        return False
    if not (1 < n <= _N_MAX and n & (n - 1) == 0 and 0 < r <= _R_MAX and 0 < p <= _P_MAX
            and salt and 16 <= len(want) <= 64):
        return False
    try:
        got = _scrypt(parts[1], salt, n, r, p, len(want))
    except (ValueError, MemoryError):  # OpenSSL refused the parameters
        return False
    return hmac.compare_digest(got, want)


# Units of --expires: a number and one of these (none: seconds).
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION = re.compile(r"([0-9]{1,9})([smhd]?)")
EXPIRES_MAX = 36500 * 86400  # a hundred years: longer is a typo


def parse_expires(text: object) -> int:
    """Seconds from now of an --expires duration: `90d`, `12h`, `30m`, `45s`, or a
    number of seconds (`3600`; a whole number in a request too); InvalidInputError,
    one line, for anything else."""
    if isinstance(text, int) and not isinstance(text, bool):
        seconds = text
    elif isinstance(text, str) and (m := _DURATION.fullmatch(text.strip())):
        seconds = int(m.group(1)) * _UNITS[m.group(2)]
    else:
        raise InvalidInputError("expires", f"a duration is a whole number with s, m, h or "
                                           f"d (90d, 12h, 30m) or seconds alone, not "
                                           f"{describe(text)}")
    if not 0 < seconds <= EXPIRES_MAX:
        raise InvalidInputError("expires", f"must be from 1 second to {EXPIRES_MAX // 86400}"
                                           f" days, not {describe(text)}")
    return seconds


def _parts(secret: object) -> tuple[int, str] | None:
    """(id, random part) of a well-formed secret, else None."""
    if not isinstance(secret, str) or len(secret) > SECRET_MAX:
        return None
    m = _SECRET.fullmatch(secret)
    if m is None:
        return None
    token_id = int(m.group(1))
    return (token_id, m.group(2)) if token_id <= ID_MAX else None


def _scrypt(random_part: str, salt: bytes, n: int, r: int, p: int, length: int) -> bytes:
    # OpenSSL's default memory bound (32 MiB) is too small for parameters raised later:
    # what these take (128 * r * (n + p)), with room.
    return hashlib.scrypt(random_part.encode(), salt=salt, n=n, r=r, p=p, dklen=length,
                          maxmem=128 * r * (n + p + 2) + (1 << 20))


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")
