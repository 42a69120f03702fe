"""The API tokens table's SQL (schema.tokens_table), and the Store's token methods
(ApiTokens) that run it, each in a Store transaction, so that its write rules (retries,
deadlines, SQLite's writer lock, durable commits) apply to tokens as to schedules.

A token's secret holds its row's id, so a new row is inserted first and its hash set in
the same transaction: no row is ever seen without its hash.  Names are unique forever: a
revoked token keeps its row and its name.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError

from perfectschedd.errors import AlreadyExistsError, InvalidInputError, NotFoundError, describe
from perfectschedd.store.base import StoreBase, retried
from perfectschedd.vocabulary import tokens


class TokenRow(NamedTuple):
    """One API token as stored (its secret is never stored; `hash` is its hash)."""

    id: int
    name: str
    role: str
    hash: str
    created_at: float
    created_by: str
    expires_at: float | None
    revoked_at: float | None


def _row(r: Any) -> TokenRow:
    # Drivers give a BIGINT as int or Decimal, a double as float or Decimal.
    return TokenRow(int(r.id), str(r.name), str(r.role), str(r.hash), float(r.created_at),
                    str(r.created_by), None if r.expires_at is None else float(r.expires_at),
                    None if r.revoked_at is None else float(r.revoked_at))


def exists_error(name: str, revoked: bool) -> AlreadyExistsError:
    if revoked:
        return AlreadyExistsError(f"token {name} was revoked; a name is never used again: "
                                  "choose another name")
    return AlreadyExistsError(f"token {name} exists: choose another name")


def add(conn: Connection, t: sa.Table, name: str, role: str, created_by: str,
        expires_at: float | None, now: float) -> tuple[int, str]:
    """Insert the token and set its hash; (id, secret).  AlreadyExistsError when the
    name is taken, by a live or a revoked token."""
    tokens.check_name(name)
    tokens.check_role(role)
    found = conn.execute(sa.select(t.c.revoked_at).where(t.c.name == name)).first()
    if found is not None:
        raise exists_error(name, found.revoked_at is not None)
    token_id = int(conn.execute(t.insert().values(
        name=name, role=role, hash="", created_at=now, created_by=created_by,
        expires_at=expires_at, revoked_at=None)).inserted_primary_key[0])
    secret, stored = tokens.new_secret(token_id)
    conn.execute(t.update().where(t.c.id == token_id).values(hash=stored))
    return token_id, secret


def listed(conn: Connection, t: sa.Table) -> list[TokenRow]:
    return [_row(r) for r in conn.execute(sa.select(t).order_by(t.c.name))]


def by_id(conn: Connection, t: sa.Table, token_id: int) -> TokenRow | None:
    r = conn.execute(sa.select(t).where(t.c.id == token_id)).first()
    return None if r is None else _row(r)


def revoke(conn: Connection, t: sa.Table, name: str, now: float) -> bool:
    """Revoke the live token `name`: True.  NotFoundError for a name no token has,
    InvalidInputError for one revoked before."""
    if conn.execute(t.update().where(t.c.name == name, t.c.revoked_at.is_(None))
                    .values(revoked_at=now)).rowcount == 1:
        return True
    found = conn.execute(sa.select(t.c.revoked_at).where(t.c.name == name)).first()
    if found is None:
        raise NotFoundError(f"no token named {describe(name)}")
    raise InvalidInputError("name", f"token {name} was revoked already")


class ApiTokens(StoreBase):
    """The Store's API token methods: the functions above, in its transactions."""

    @retried
    def add_token(self, name: str, role: str, created_by: str, expires_at: float | None,
                  now: float) -> tuple[int, str]:
        """Make an API token: (its id, its secret; shown once, only its hash is kept).
        AlreadyExistsError for a name any token has or had (revoked names too)."""
        try:
            with self._tx(durable=True) as conn:
                return add(conn, self.backend.tokens, name, role, created_by,
                                     expires_at, now)
        except IntegrityError:  # another host made one of that name meanwhile
            raise exists_error(name, revoked=False) from None

    @retried
    def tokens(self) -> list[TokenRow]:
        """Every API token, revoked and expired ones too, by name."""
        with self._tx(readonly=True) as conn:
            return listed(conn, self.backend.tokens)

    @retried
    def revoke_token(self, name: str, now: float) -> bool:
        """Revoke the token `name` at `now` (its row stays): True.  NotFoundError for a
        name no token has; InvalidInputError for one revoked already."""
        with self._tx(durable=True) as conn:
            return revoke(conn, self.backend.tokens, name, now)

    @retried
    def token_by_id(self, token_id: int) -> TokenRow | None:
        """The token with this id (the one a secret names: tokens.token_id_of), or None."""
        with self._tx(readonly=True) as conn:
            return by_id(conn, self.backend.tokens, token_id)

