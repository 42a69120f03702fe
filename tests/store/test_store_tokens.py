"""API tokens in the database (store/tokens.py through Store), on every backend (SQLite
file, PostgreSQL, MariaDB): made with a secret shown once and only its hash kept, listed,
found by id, revoked; names unique forever; refusals in one line, storing nothing.
(Not test_tokens.py: the suite imports test modules by their basename, and
tests/control/test_tokens.py has that one.)

Times are passed in (`now=`); nothing sleeps.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from perfectschedd.errors import (
    AlreadyExistsError,
    InvalidInputError,
    NotFoundError,
    ScheduleError,
)
from perfectschedd.store.sql import Store
from perfectschedd.store.tokens import TokenRow
from perfectschedd.vocabulary import tokens

T0 = 1_700_002_800.25


@pytest.fixture
def store(db_url: str) -> Iterator[Store]:
    s = Store(db_url)
    s.init()
    yield s
    s.close()


def one_line(exc: pytest.ExceptionInfo[ScheduleError]) -> str:
    text = str(exc.value)
    assert text and "\n" not in text
    return text


def raw_rows(store: Store) -> list[tuple[object, ...]]:
    with store.engine.connect() as conn:
        return [tuple(r) for r in conn.execute(sa.select(store.backend.tokens))]


def test_add_list_find_and_revoke(store: Store) -> None:
    a_id, a_secret = store.add_token("ci-read", "viewer", "root", None, T0)
    b_id, b_secret = store.add_token("deploy.bot", "operator", "alice", T0 + 86400, T0 + 1)
    assert a_id != b_id and tokens.token_id_of(a_secret) == a_id
    assert tokens.token_id_of(b_secret) == b_id
    listed = store.tokens()
    assert [t.name for t in listed] == ["ci-read", "deploy.bot"]  # by name
    a, b = listed
    assert isinstance(a, TokenRow)
    assert (a.id, a.role, a.created_at, a.created_by, a.expires_at, a.revoked_at) == (
        a_id, "viewer", T0, "root", None, None)
    assert (b.role, b.created_by, b.expires_at) == ("operator", "alice", T0 + 86400)
    # The database holds the hash of each secret, never the secret or its random part.
    assert a.hash.startswith("scrypt$16384$8$1$")
    for row in raw_rows(store):
        for secret in (a_secret, b_secret):
            random_part = secret.split("_", 2)[2]
            assert not any(random_part in str(v) for v in row)
    assert store.token_by_id(a_id) == a and store.token_by_id(b_id) == b
    assert store.token_by_id(max(a_id, b_id) + 100) is None

    assert store.revoke_token("ci-read", T0 + 5) is True
    found = store.token_by_id(a_id)
    assert found is not None and found.revoked_at == T0 + 5
    assert found._replace(revoked_at=None) == a  # nothing else changed
    assert [t.revoked_at for t in store.tokens()] == [T0 + 5, None]


def test_a_secret_verifies_against_its_own_hash_only(store: Store) -> None:
    a_id, a_secret = store.add_token("a", "admin", "root", None, T0)
    b_id, b_secret = store.add_token("b", "viewer", "root", None, T0)
    a, b = store.token_by_id(a_id), store.token_by_id(b_id)
    assert a is not None and b is not None
    assert tokens.verify(a_secret, a.hash) and tokens.verify(b_secret, b.hash)
    last = a_secret[-1]
    changed = a_secret[:-1] + ("A" if last != "A" else "B")
    assert not tokens.verify(changed, a.hash)
    assert not tokens.verify(b_secret, a.hash)  # another token's secret
    # Another token's random part under this token's id.
    assert not tokens.verify(f"pst_{a_id}_{b_secret.split('_', 2)[2]}", a.hash)
    for garbage in ("", "pst_", "garbage", a.hash, f"pst_{a_id}_", "x" * 10_000, None, 42):
        assert not tokens.verify(garbage, a.hash)


def test_a_name_is_never_used_twice(store: Store) -> None:
    store.add_token("ci", "viewer", "root", None, T0)
    with pytest.raises(AlreadyExistsError) as live:
        store.add_token("ci", "admin", "root", None, T0)
    assert "token ci exists" in one_line(live)
    store.revoke_token("ci", T0 + 1)
    with pytest.raises(AlreadyExistsError) as revoked:
        store.add_token("ci", "viewer", "root", None, T0 + 2)
    assert "token ci was revoked" in one_line(revoked)
    assert "choose another name" in one_line(revoked)
    [row] = store.tokens()
    assert (row.role, row.revoked_at) == ("viewer", T0 + 1)


def test_revoking_an_unknown_name_or_twice_is_one_line(store: Store) -> None:
    with pytest.raises(NotFoundError) as unknown:
        store.revoke_token("nope", T0)
    assert one_line(unknown) == "no token named 'nope'"
    store.add_token("once", "viewer", "root", None, T0)
    store.revoke_token("once", T0 + 1)
    with pytest.raises(InvalidInputError) as twice:
        store.revoke_token("once", T0 + 2)
    assert "token once was revoked already" in one_line(twice)
    assert store.tokens()[0].revoked_at == T0 + 1  # the first revocation stands


@pytest.mark.parametrize("name,role,field", [
    ("", "viewer", "name"), ("-lead", "viewer", "name"), ("a b", "viewer", "name"),
    ("x" * 65, "viewer", "name"), ("ünï", "viewer", "name"), ("ok\n", "viewer", "name"),
    ("ok", "root", "role"), ("ok", "Viewer", "role"), ("ok", "", "role"),
])
def test_a_bad_name_or_role_stores_nothing(store: Store, name: str, role: str,
                                           field: str) -> None:
    with pytest.raises(InvalidInputError) as bad:
        store.add_token(name, role, "root", None, T0)
    assert one_line(bad).startswith(f"{field}: ")
    assert store.tokens() == [] and raw_rows(store) == []


def test_a_name_of_64_characters_is_stored_whole(store: Store) -> None:
    name = "n" + "a1._-" * 12 + "xyz"
    assert len(name) == 64
    store.add_token(name, "viewer", "root", None, T0)
    assert [t.name for t in store.tokens()] == [name]


def test_hosts_adding_one_name_at_once_make_one_token(db_url: str) -> None:
    """Each host's Store checks the name, then inserts: of several at once exactly one
    wins, and the others are refused as for any name that exists."""
    stores = [Store(db_url) for _ in range(4)]
    for s in stores:
        s.init()
    start = threading.Barrier(len(stores))
    results: list[object] = []

    def add(s: Store) -> None:
        start.wait()
        try:
            results.append(s.add_token("race", "viewer", "root", None, T0))
        except AlreadyExistsError as exc:
            results.append(exc)

    threads = [threading.Thread(target=add, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    won = [r for r in results if isinstance(r, tuple)]
    assert len(results) == 4 and len(won) == 1, results
    assert all("token race exists" in str(r) for r in results if r not in won)
    [row] = stores[0].tokens()
    assert tokens.verify(won[0][1], row.hash)
    for s in stores:
        s.close()
