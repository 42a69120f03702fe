"""Who an HTTP client is: a bearer token (or a console session that holds one), checked
against the tokens every host shares in the database, and the throttle of bad guesses.

A token's secret is checked against its salted slow hash (vocabulary/tokens.py) once; the
answer is kept here by a digest of the secret, so a client polling the API pays the
slow hash once, not per request.  The tokens' rows are read again at most every
REFRESH seconds, so a token revoked (or expired) on any host is refused here within
REFRESH plus one read (SPEC: 5 s).  When the rows cannot be read for STALE seconds (a
hung or unreachable database) every token is refused with 503: an old copy of the rows
would keep honouring a revoked token.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from perfectschedd.control.auth import Caller
from perfectschedd.vocabulary import tokens

log = logging.getLogger("perfectschedd")

REFRESH = 2.0
STALE = 5.0
UNKNOWN_REREAD = 0.5  # a token id newer than every row read: read again, at most this often
# Bad credentials from one address: this many within WINDOW, and it gets 429 for BLOCK.
BAD_MAX = 10
WINDOW = 60.0
BLOCK = 60.0
VERIFIED_MAX = 4096  # secrets whose slow hash was checked, kept by digest
CLIENTS_MAX = 65536  # addresses whose bad guesses are counted


class CredentialError(Exception):
    """Refused: `status` 401 (no or bad credentials), 429 (throttled), 503 (the tokens
    cannot be read)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Identity:
    token_id: int
    name: str
    role: str

    def caller(self, group_gid: int) -> Caller:
        """The caller this token is, on a daemon whose control group is `group_gid`."""
        return Caller.of_token(self.token_id, self.name, self.role, group_gid)


class Credentials:
    """`read_tokens`: the tokens' rows (Store.tokens(), through the master's database
    thread with its deadline)."""

    def __init__(self, read_tokens: Callable[[], Sequence[Any]]) -> None:
        self.read_tokens = read_tokens
        self.lock = threading.Lock()
        self.refreshing = threading.Lock()
        self.rows: dict[int, Any] = {}
        self.read_at: float | None = None  # monotonic time of the last good read
        self.verified: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self.bad: dict[str, collections.deque[float]] = {}
        self.blocked: dict[str, float] = {}
        self.reread_at = float("-inf")  # the last reading for an unknown token id

    # -- throttle ---------------------------------------------------------------------------

    def check_throttle(self, client: str) -> None:
        now = time.monotonic()
        with self.lock:
            until = self.blocked.get(client)
            if until is not None and until > now:
                raise CredentialError(429, f"too many bad credentials from {client}: try "
                                      f"again in {int(until - now) + 1} s")
            if until is not None:
                del self.blocked[client]

    def _count_bad(self, client: str) -> None:
        now = time.monotonic()
        with self.lock:
            if len(self.bad) >= CLIENTS_MAX:
                self.bad.clear()  # a flood of addresses: start counting again
            times = self.bad.setdefault(client, collections.deque())
            times.append(now)
            while times and times[0] < now - WINDOW:
                times.popleft()
            if len(times) >= BAD_MAX:
                self.blocked[client] = now + BLOCK
                del self.bad[client]
                log.warning("http: %d bad credentials from %s within %d s: refused for "
                            "%d s", BAD_MAX, client, WINDOW, BLOCK)

    # -- tokens -----------------------------------------------------------------------------

    def _current_rows(self) -> dict[int, Any]:
        now = time.monotonic()
        age = None if self.read_at is None else now - self.read_at
        # One reader at a time; while the rows are fresh enough the others go on with
        # them, else they wait for that read (bounded: it has a deadline of its own).
        if (age is None or age >= REFRESH) and self.refreshing.acquire(
                timeout=STALE if age is None or age >= STALE else 0):
            self._read_rows()
        if self.read_at is None or time.monotonic() - self.read_at >= STALE + REFRESH:
            raise CredentialError(503, "cannot check credentials: the database does not "
                                  "answer")
        return self.rows

    def identify(self, secret: str | None, client: str) -> Identity:
        """The token whose secret this is; CredentialError otherwise (each bad one
        counted against `client`)."""
        if not secret:
            self.check_throttle(client)
            raise CredentialError(401, "credentials needed: send Authorization: Bearer "
                                  "TOKEN (perfectschedctl token add)")
        token_id = tokens.token_id_of(secret)
        rows = self._current_rows()
        # A throttled address keeps the tokens it already proved (no slow hash is asked
        # for them): loopback is every local user's address, and one of them guessing
        # must not lock Prometheus or the other users' clients out.
        known = rows.get(token_id) if token_id is not None else None
        if known is None or not self._proved(secret, known):
            self.check_throttle(client)
        if token_id is not None and token_id not in rows and token_id > max(rows, default=0):
            # A token made since the last reading (on any host): read again rather than
            # refuse it for up to REFRESH; at most every UNKNOWN_REREAD, as a stranger
            # may name ids at will.
            rows = self._reread_for_unknown()
        row = rows.get(token_id) if token_id is not None else None
        if row is None or not self._matches(secret, row):
            self._count_bad(client)
            raise CredentialError(401, "bad credentials")
        state = tokens.state(row.revoked_at, row.expires_at, time.time())
        if state == tokens.REVOKED:
            self._count_bad(client)
            raise CredentialError(401, f"token {row.name} was revoked")
        if state == tokens.EXPIRED:
            raise CredentialError(401, f"token {row.name} has expired")
        return Identity(row.id, row.name, row.role)

    def _reread_for_unknown(self) -> dict[int, Any]:
        now = time.monotonic()
        with self.lock:
            due = now - self.reread_at >= UNKNOWN_REREAD
            if due:
                self.reread_at = now
        if due and self.refreshing.acquire(timeout=STALE):
            self._read_rows()
        return self.rows

    def _read_rows(self) -> None:
        """Read the rows (`refreshing` held, released here); on an error they stay as
        they were, and _current_rows refuses them once too old."""
        try:
            rows = {r.id: r for r in self.read_tokens()}
            with self.lock:
                self.rows, self.read_at = rows, time.monotonic()
        except Exception as exc:  # noqa: BLE001 - see above
            log.debug("http: cannot read the tokens: %s", exc)
        finally:
            self.refreshing.release()

    @staticmethod
    def _digest(secret: str, row: Any) -> bytes:
        return hashlib.sha256(f"{row.hash}\0{secret}".encode()).digest()

    def _proved(self, secret: str, row: Any) -> bool:
        """Whether `secret` was checked against `row`'s hash already (no slow hash)."""
        digest = self._digest(secret, row)
        with self.lock:
            if self.verified.get(digest) == row.id:
                self.verified.move_to_end(digest)
                return True
        return False

    def _matches(self, secret: str, row: Any) -> bool:
        if self._proved(secret, row):
            return True
        digest = self._digest(secret, row)
        if not tokens.verify(secret, row.hash):
            return False
        with self.lock:
            self.verified[digest] = row.id
            while len(self.verified) > VERIFIED_MAX:
                self.verified.popitem(last=False)
        return True

    def still_valid(self, token_id: int) -> Identity | None:
        """The token of a console session, if it is neither revoked nor expired now."""
        row = self._current_rows().get(token_id)
        if row is None or tokens.state(row.revoked_at, row.expires_at,
                                            time.time()) != tokens.LIVE:
            return None
        return Identity(row.id, row.name, row.role)


def bearer(header: str | None) -> str | None:
    """The secret of an `Authorization: Bearer SECRET` header (None: none)."""
    if not header:
        return None
    scheme, _, value = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return None
    return value.strip() or None
