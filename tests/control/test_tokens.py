"""API tokens: vocabulary/tokens.py (names, roles, secrets and their hashes, --expires), and
`perfectschedctl token add|list|revoke` as users meet it, through a real daemon's socket
(and D-Bus) and in direct mode (-c): root's only, refusals in one line that store
nothing, the secret shown once by `add` and never by `list` or in the log.

The table and the Store's methods on every backend are tests/store/test_store_tokens.py's.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import test_callers
from daemon_harness import Daemon, foreign_ctl
from test_callers import AS_NOBODY, Bus, ctl_as, needs_dbus, needs_root, refused

import perfectschedd
from perfectschedctl import cli
from perfectschedd.control import commands, registry
from perfectschedd.errors import InvalidInputError, PermissionDeniedError
from perfectschedd.vocabulary import tokens

open_dir = test_callers.open_dir  # the fixture: a directory other users can traverse

T0 = 1_700_002_800.0
SECRET = re.compile(r"pst_[0-9]+_[A-Za-z0-9_-]{43}")


# -- vocabulary/tokens.py ----------------------------------------------------------------------

def test_a_new_secret_names_its_token_and_verifies() -> None:
    secret, stored = tokens.new_secret(42)
    assert re.fullmatch(r"pst_42_[A-Za-z0-9_-]{43}", secret)
    assert tokens.token_id_of(secret) == 42
    scheme, n, r, p, salt, digest = stored.split("$")
    assert (scheme, n, r, p) == ("scrypt", "16384", "8", "1")
    assert len(base64.b64decode(salt)) == 16 and len(base64.b64decode(digest)) == 32
    assert len(stored) <= tokens.HASH_MAX
    # The hash is of the random part alone, salted.
    random_part = secret.split("_", 2)[2]
    assert base64.b64decode(digest) == hashlib.scrypt(
        random_part.encode(), salt=base64.b64decode(salt), n=2**14, r=8, p=1, dklen=32)
    assert tokens.verify(secret, stored)
    again, stored_again = tokens.new_secret(42)
    assert again != secret and stored_again != stored  # a new random part and salt
    assert not tokens.verify(again, stored) and not tokens.verify(secret, stored_again)


def test_a_hash_made_with_raised_parameters_still_verifies() -> None:
    """The parameters are read from the stored hash: raising them later leaves the
    tokens made before working, and theirs work too."""
    secret, _ = tokens.new_secret(7)
    salt = os.urandom(16)
    digest = hashlib.scrypt(secret.split("_", 2)[2].encode(), salt=salt, n=2**15, r=8, p=2,
                            dklen=32, maxmem=64 << 20)
    stored = f"scrypt$32768$8$2${base64.b64encode(salt).decode()}$" \
             f"{base64.b64encode(digest).decode()}"
    assert tokens.verify(secret, stored)


@pytest.mark.parametrize("stored", [
    "", "scrypt", "bcrypt$16384$8$1$AAAAAAAAAAAAAAAAAAAAAA==$AAAA", "plain-text",
    "scrypt$16384$8$1$not base64!$AAAA", "scrypt$16385$8$1$AAAAAAAAAAAAAAAAAAAAAA==$"
    + "A" * 44, "scrypt$4294967296$8$1$AAAAAAAAAAAAAAAAAAAAAA==$" + "A" * 44,
    "scrypt$16384$999$1$AAAAAAAAAAAAAAAAAAAAAA==$" + "A" * 44,
    "scrypt$16384$8$1$$" + "A" * 44, "scrypt$16384$8$1$AAAAAAAAAAAAAAAAAAAAAA==$AA==",
    "scrypt$16384$8$1$AAAAAAAAAAAAAAAAAAAAAA==$" + "A" * 44 + "$extra", "x" * 10_000,
    None, 42,
])
def test_a_malformed_or_unknown_hash_never_verifies(stored: Any) -> None:
    secret, _ = tokens.new_secret(1)
    assert tokens.verify(secret, stored) is False


@pytest.mark.parametrize("secret", [
    "", "pst_", "pst_1_", "pst_1_short", "pst_0_" + "a" * 43, "pst_01_" + "a" * 43,
    "pst_-1_" + "a" * 43, "pst_1_" + "a" * 42, "pst_1_" + "a" * 43 + "!",
    "PST_1_" + "a" * 43, "pst_1_" + "a" * 43 + "\n", " pst_1_" + "a" * 43,
    "pst_1_" + "a" * 129, "pst_99999999999999999999_" + "a" * 43,
    "pst_9223372036854775808_" + "a" * 43, "pst_1_" + "a" * 10**6, "pst_١_" + "a" * 43,
    None, 1, b"pst_1_" + b"a" * 43, ["pst_1_" + "a" * 43],
])
def test_a_malformed_secret_names_no_token(secret: Any) -> None:
    assert tokens.token_id_of(secret) is None
    _, stored = tokens.new_secret(1)
    assert tokens.verify(secret, stored) is False


def test_the_largest_id_is_a_bigint() -> None:
    secret, stored = tokens.new_secret(2**63 - 1)
    assert tokens.token_id_of(secret) == 2**63 - 1 and tokens.verify(secret, stored)
    for bad in (0, -1, 2**63, True, "1"):
        with pytest.raises(ValueError):
            tokens.new_secret(bad)  # type: ignore[arg-type]


def test_a_token_is_live_until_it_expires_or_is_revoked() -> None:
    assert tokens.state(None, None, T0) == tokens.LIVE == "live"
    assert tokens.state(None, T0 + 1, T0) == "live"
    assert tokens.state(None, T0, T0) == tokens.EXPIRED == "expired"
    assert tokens.state(T0 - 5, T0 + 1, T0) == tokens.REVOKED == "revoked"
    assert tokens.state(T0 - 5, T0 - 9, T0) == "revoked"


@pytest.mark.parametrize("text,seconds", [
    ("90d", 90 * 86400), ("12h", 43200), ("30m", 1800), ("45s", 45), ("3600", 3600),
    ("1", 1), (" 7d ", 7 * 86400), (600, 600), ("36500d", 36500 * 86400),
])
def test_expires_durations(text: Any, seconds: int) -> None:
    assert tokens.parse_expires(text) == seconds


@pytest.mark.parametrize("text", [
    "", "0", "0d", "-5", "1y", "1w", "1.5h", "90 d", "1h30m", "d", "12H", "36501d",
    "9" * 10, "٣d", None, 1.5, True, -1, 0, [1],
])
def test_a_bad_expires_is_one_line(text: Any) -> None:
    with pytest.raises(InvalidInputError) as exc:
        tokens.parse_expires(text)
    message = str(exc.value)
    assert message.startswith("expires: ") and "\n" not in message and len(message) < 200


@pytest.mark.parametrize("name,ok", [
    ("a", True), ("ci-read", True), ("deploy.bot_2", True), ("9lives", True),
    ("a" * 64, True), ("a" * 65, False), ("", False), ("-x", False), (".x", False),
    ("_x", False), ("a b", False), ("a/b", False), ("a\n", False), ("é", False),
    ("a:b", False),
])
def test_token_names(name: str, ok: bool) -> None:
    assert bool(tokens.NAME.fullmatch(name)) is ok
    if ok:
        assert tokens.check_name(name) == name
    else:
        with pytest.raises(InvalidInputError, match="^name: "):
            tokens.check_name(name)


def test_the_registry_names_the_roles_it_cannot_import() -> None:
    """perfectschedctl's help lists the roles without loading vocabulary/tokens.py (and
    hashlib) at every start: held to tokens.ROLES here."""
    assert tokens.ROLES == ("viewer", "operator", "admin")
    role = next(a for a in registry.COMMANDS["token"].cli if a.dest == "role")
    assert role.help == f"add: {', '.join(tokens.ROLES[:-1])} or {tokens.ROLES[-1]}"
    for r in tokens.ROLES:
        assert tokens.check_role(r) == r
    assert registry.COMMANDS["token"].where == {registry.DAEMON, registry.DIRECT}


# -- the command ------------------------------------------------------------------------------

@pytest.fixture
def daemon(daemon_factory: Any) -> Daemon:
    return daemon_factory().start()


def stored_tokens(d: Daemon) -> list[dict[str, Any]]:
    """Every token's row, read from the database itself (no command)."""
    with perfectschedd.open(str(d.config_path)) as sc:
        return [t._asdict() for t in sc.store.tokens()]


def test_root_adds_lists_and_revokes_through_the_daemon(daemon: Daemon) -> None:
    d = daemon
    out = d.ctl("token", "add", "ci-read", "--role", "viewer").stdout
    lines = out.splitlines()
    assert lines[0] == "added token ci-read (role viewer, expires never)"
    assert SECRET.fullmatch(lines[1]), out
    assert "not shown again" in lines[2] and len(lines) == 3
    secret = lines[1]
    added = d.ctl_json("token", "add", "deploy", "--role", "operator", "--expires", "90d")
    assert SECRET.fullmatch(added["secret"])
    assert (added["name"], added["role"], added["created_by"]) == ("deploy", "operator",
                                                                   "root")
    assert added["expires_at"] == pytest.approx(added["created_at"] + 90 * 86400)
    assert "hash" not in added

    [ci, deploy] = stored_tokens(d)
    assert tokens.verify(secret, ci["hash"]) and tokens.verify(added["secret"], deploy["hash"])
    assert tokens.token_id_of(secret) == ci["id"]

    listed = d.ctl_json("token", "list")
    assert [(t["name"], t["role"], t["created_by"], t["state"]) for t in listed] == [
        ("ci-read", "viewer", "root", "live"), ("deploy", "operator", "root", "live")]
    assert listed[1]["expires_at"] == added["expires_at"]
    text = d.ctl("token", "list").stdout
    header, *rows, total = text.splitlines()
    assert header.split() == ["name", "role", "created", "created_by", "expires", "state"]
    assert rows[0].split()[:2] == ["ci-read", "viewer"] and rows[0].split()[-2:] == [
        "never", "live"]
    assert re.search(r"deploy +operator +\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \+0000 +root +"
                     r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \+0000 +live$", rows[1]), rows[1]
    assert total == "2 tokens."

    assert d.ctl("token", "revoke", "ci-read").stdout == "revoked token ci-read\n"
    assert [t["state"] for t in d.ctl_json("token", "list")] == ["revoked", "live"]
    assert stored_tokens(d)[0]["revoked_at"] is not None

    # Neither list nor the log ever shows a secret or a hash; the log names each change
    # and who made it.
    listed_all = d.ctl("token", "list").stdout + d.ctl("--json", "token", "list").stdout
    d.wait_log("token ci-read revoked by root")  # the log's writer thread: the last line
    log = d.log()
    for shown in (listed_all, log):
        assert not SECRET.search(shown)
        assert "scrypt$" not in shown and secret.split("_", 2)[2] not in shown
    assert "token ci-read added (role viewer, no expiry) by root" in log
    assert re.search(r"token deploy added \(role operator, expires \d{4}-\d\d-\d\d "
                     r"\d\d:\d\d:\d\d UTC\) by root", log), log
    assert "token ci-read revoked by root" in log


@pytest.mark.parametrize("args,texts", [
    (["add", "ok", "--role", "root"], ["role: must be viewer, operator or admin, not 'root'"]),
    (["add", "ok"], ["role: required: give --role viewer|operator|admin"]),
    (["add", "bad name", "--role", "viewer"], ["name: a token name is 1 to 64"]),
    (["add", "x" * 65, "--role", "viewer"], ["name: a token name is 1 to 64"]),
    (["add", "ok", "--role", "viewer", "--expires", "1y"], ["expires: a duration"]),
    (["add", "ok", "--role", "viewer", "--expires", "0"], ["expires: must be from 1 second"]),
    (["add", "--role", "viewer"], ["name: required"]),
    (["list", "ok"], ["name: token list takes no NAME"]),
    (["revoke", "ok", "--role", "admin"], ["role: token revoke takes no --role"]),
    (["revoke", "missing"], ["no token named 'missing'"]),
    (["frob"], ["action: must be add, list or revoke, not 'frob'"]),
])
def test_bad_requests_are_one_line_and_store_nothing(daemon: Daemon, args: list[str],
                                                     texts: list[str]) -> None:
    refused(daemon.ctl("token", *args, check=False), *texts)
    assert stored_tokens(daemon) == []


def test_a_name_is_refused_again_live_or_revoked(daemon: Daemon) -> None:
    d = daemon
    first = d.ctl_json("token", "add", "ci", "--role", "viewer")
    refused(d.ctl("token", "add", "ci", "--role", "admin", check=False),
                   "token ci exists: choose another name")
    d.ctl("token", "revoke", "ci")
    refused(d.ctl("token", "add", "ci", "--role", "viewer", check=False),
                   "token ci was revoked", "choose another name")
    refused(d.ctl("token", "revoke", "ci", check=False),
                   "token ci was revoked already")
    [row] = stored_tokens(d)
    assert row["role"] == "viewer" and tokens.verify(first["secret"], row["hash"])


def direct(d: Daemon, *args: str) -> subprocess.CompletedProcess[str]:
    """perfectschedctl -c (the daemon's config: its database, no daemon), as root."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PERFECTSCHED_")}
    return subprocess.run([*d.ctl_command, "-c", str(d.config_path), *args],
                          capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root")
def test_root_manages_tokens_in_direct_mode(tmp_path: Path) -> None:
    d = Daemon(tmp_path)  # its config only: no daemon runs
    res = direct(d, "--json", "token", "add", "local", "--role", "admin", "--expires", "12h")
    assert res.returncode == 0, res.stderr
    added = json.loads(res.stdout)
    assert SECRET.fullmatch(added["secret"]) and added["created_by"] == "root"
    listed = direct(d, "token", "list")
    assert listed.returncode == 0 and "local" in listed.stdout and "admin" in listed.stdout
    assert added["secret"] not in listed.stdout and "scrypt$" not in listed.stdout
    assert direct(d, "token", "revoke", "local").stdout == "revoked token local\n"
    [row] = stored_tokens(d)
    assert row["revoked_at"] is not None and tokens.verify(added["secret"], row["hash"])
    refused(direct(d, "token", "add", "x", "--role", "boss"), "role: must be")
    assert len(stored_tokens(d)) == 1


def test_commands_refuse_token_to_anyone_but_root(tmp_path: Path) -> None:
    """The rule, in process: whatever the way in, a caller that is not uid 0 is refused
    before anything is read, with the caller named."""
    from perfectschedd.control.auth import Caller

    with perfectschedd.open({"type": "rdb_compat",
                             "url": f"sqlite:///{tmp_path / 'db.sqlite'}"}) as sc:
        for where in (registry.DAEMON, registry.DIRECT):
            with pytest.raises(PermissionDeniedError) as exc:
                commands.execute(sc, "token", {"action": "add", "name": "x", "role": "admin"},
                                 where=where, caller=Caller.of(65534, [65534]), now=T0)
            assert str(exc.value) == "token: only root manages API tokens, not nobody"
        assert sc.store.tokens() == []
        added = commands.execute(sc, "token", {"action": "add", "name": "x", "role": "admin"},
                                 caller=Caller.of(0, [0]), now=T0)
        assert added["created_by"] == "root" and added["created_at"] == T0


def test_list_says_when_a_token_has_expired(tmp_path: Path) -> None:
    with perfectschedd.open({"type": "rdb_compat",
                             "url": f"sqlite:///{tmp_path / 'db.sqlite'}"}) as sc:
        added = commands.execute(sc, "token", {"action": "add", "name": "brief",
                                               "role": "viewer", "expires": "60s"}, now=T0)
        assert added["expires_at"] == T0 + 60

        def states(now: float) -> list[str]:
            return [t["state"] for t in commands.execute(sc, "token", {"action": "list"},
                                                         now=now)]
        assert states(T0 + 59) == ["live"] and states(T0 + 60) == ["expired"]
        commands.execute(sc, "token", {"action": "revoke", "name": "brief"}, now=T0 + 61)
        assert states(T0 + 62) == ["revoked"]


# -- as another user ------------------------------------------------------------------------

@pytest.fixture
def shared_daemon(open_dir: Path) -> Iterator[Daemon]:
    """A daemon that admits members of nogroup (nobody, as AS_NOBODY runs it)."""
    d = Daemon(open_dir, {"control_group": "nogroup"})
    try:
        d.start()
        os.chmod(d.dir, 0o755)
        yield d
    finally:
        d.kill()


@needs_root
def test_an_admitted_caller_who_is_not_root_is_refused_in_one_line(
        shared_daemon: Daemon) -> None:
    d = shared_daemon
    d.ctl("token", "add", "kept", "--role", "viewer")
    before = stored_tokens(d)
    assert ctl_as(d, AS_NOBODY, "status").returncode == 0  # admitted to the daemon
    for args in (["add", "mine", "--role", "admin"], ["list"], ["revoke", "kept"],
                 ["add", "bad name", "--role", "nope"]):
        line = refused(ctl_as(d, AS_NOBODY, "token", *args))
        assert line == "token: only root manages API tokens, not nobody", args
    assert stored_tokens(d) == before
    assert "mine" not in d.log() and "kept revoked" not in d.log()


@needs_root
def test_direct_mode_is_root_s_only_too(shared_daemon: Daemon) -> None:
    """Refused before the config is read: perfectschedctl -c as nobody."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PERFECTSCHED_")}
    res = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
                          *foreign_ctl(), "-c", str(shared_daemon.config_path), "token",
                          "add", "mine", "--role", "admin"],
                         capture_output=True, text=True, timeout=60, env=env, cwd="/")
    assert refused(res) == "token: only root manages API tokens, not nobody"
    assert stored_tokens(shared_daemon) == []


@needs_root
@needs_dbus
def test_dbus_refuses_token_to_anyone_but_root(open_dir: Path) -> None:
    bus = Bus(open_dir)
    d = Daemon(open_dir, {"control_group": "nogroup", "dbus": True,
                          "dbus_address": bus.address})
    try:
        d.start()
        name, message = bus.call(AS_NOBODY, "call", "token",
                                 json.dumps({"action": "add", "name": "x", "role": "admin"}))
        assert name == "org.perfectsched1.Error.PermissionDeniedError"
        assert message == "token: only root manages API tokens, not nobody"
        assert stored_tokens(d) == []
    finally:
        d.kill()
        bus.stop()


def test_the_cli_sends_what_the_registry_says() -> None:
    ns = cli.build_parser().parse_args(["token", "add", "ci", "--role", "viewer",
                                        "--expires", "90d"])
    assert cli.request_of(ns) == ("token", {"action": "add", "name": "ci", "role": "viewer",
                                            "expires": "90d"})
    assert cli.request_of(cli.build_parser().parse_args(["token", "list"])) == (
        "token", {"action": "list"})
