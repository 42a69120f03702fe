"""Jobs as systemd units, the parts that need no systemd (perfectschedd/unit_props.py and
where routes and schedules files take `executor:`/`unit:`): unit names as systemd-escape
makes them, the `unit:` whitelist and its D-Bus types, and the one-line refusals at load,
including `executor: systemd` on a host that systemd does not run (this suite's hosts)."""

from __future__ import annotations

import os
import random
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from daemon_harness import Daemon, wait_until

from perfectschedd import ConfigError
from perfectschedd.config import Config, from_mapping, refuse_routes
from perfectschedd.schedules import files
from perfectschedd.settings import unit_props

BASE = {"type": "rdb_compat", "url": "sqlite:////tmp/x.db"}
ROUTE = {"type": "backup", "exec": ["/usr/local/bin/backup"], "executor": "systemd"}
ENTRY = {"key": "nightly", "cron": "@daily", "exec": ["/bin/true"], "executor": "systemd"}


@pytest.fixture
def with_systemd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A host that systemd runs, as far as the check at load can tell."""
    marker = tmp_path / "run-systemd-system"
    marker.mkdir()
    monkeypatch.setattr(unit_props, "SYSTEMD_MARKER", str(marker))


@pytest.fixture
def without_systemd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(unit_props, "SYSTEMD_MARKER", str(tmp_path / "no-such-dir"))


# -- unit names ---------------------------------------------------------------------------

KEYS = ["nightly", "a/b/c", "db backup", "-dash-", ".hidden", "über:ü", "x\\y", "tab\there",
        "a.b_c:d", "100%", "日本語のキー"]


@pytest.mark.skipif(shutil.which("systemd-escape") is None, reason="no systemd-escape")
@pytest.mark.parametrize("key", KEYS)
def test_keys_are_escaped_as_systemd_escape_does(key: str) -> None:
    want = subprocess.run(["systemd-escape", "--", key], capture_output=True, text=True,
                          check=True).stdout.strip()
    assert unit_props.escape(key) == want


@pytest.mark.parametrize("key", KEYS)
def test_every_key_gives_a_valid_unit_name(key: str) -> None:
    name = unit_props.unit_name(key, 1357000000)
    assert name.startswith("perfectsched-") and name.endswith("-1357000000.service")
    assert len(name) <= 255
    assert all(c.isascii() and (c.isalnum() or c in ":-_.\\@") for c in name), name
    if shutil.which("systemd-escape") is not None:  # systemd itself agrees it is a unit
        res = subprocess.run(["systemd-escape", "--unescape", "--", name[:-8]],
                             capture_output=True, text=True)
        assert res.returncode == 0, res.stderr


def test_a_retry_is_a_unit_of_its_own() -> None:
    assert unit_props.unit_name("k", 60) == "perfectsched-k-60.service"
    assert unit_props.unit_name("k", 60, attempt=2) == "perfectsched-k-60-2.service"


def test_long_keys_are_cut_and_told_apart_by_a_hash() -> None:
    a, b = "é" * 256, "é" * 255 + "è"
    na, nb = unit_props.unit_name(a, 1357000000, 3), unit_props.unit_name(b, 1357000000, 3)
    assert len(na) <= 255 and len(nb) <= 255 and na != nb
    assert na.endswith("-1357000000-3.service")
    # Whole escapes only (never \\x4 of \\x41), then _ and the hash.
    assert re.fullmatch(r"perfectsched-(\\x[0-9a-f]{2})+_[0-9a-f]{16}-1357000000-3\.service",
                        na), na


@pytest.mark.skipif(shutil.which("systemd-escape") is None, reason="no systemd-escape")
@pytest.mark.parametrize("key", ["rootjob/1795585905", "a/b/0", "x_0123456789abcdef",
                                 "/7", "a/5/_0123456789abcdef"])
def test_systemd_reads_an_escaped_tail_back_as_the_key(key: str) -> None:
    name = unit_props.unit_name(key, 60)
    res = subprocess.run(["systemd-escape", "--unescape", "--",
                          name.removeprefix("perfectsched-").removesuffix("-60.service")],
                         capture_output=True, text=True, check=True)
    assert res.stdout.strip() == key


def test_a_key_ending_in_slash_digits_is_not_another_occurrence() -> None:
    """The reported pair: the '/' of a trailing "/<digits>" escaped as '-' made key
    rootjob/1795585905 at time 2 the second attempt of rootjob at 1795585905."""
    a = unit_props.unit_name("rootjob", 1795585905, 2)
    b = unit_props.unit_name("rootjob/1795585905", 2, 1)
    assert a == "perfectsched-rootjob-1795585905-2.service"
    assert b == "perfectsched-rootjob\\x2f1795585905-2.service" and a != b


def unescape(escaped: str) -> str | None:
    """`systemd-escape --unescape`: '-' is '/', \\xNN a byte; None: not UTF-8 text (a
    long key's cut may end inside a character)."""
    out, i = bytearray(), 0
    while i < len(escaped):
        if escaped[i] == "-":
            out += b"/"
            i += 1
        elif escaped.startswith("\\x", i):
            out.append(int(escaped[i + 2:i + 4], 16))
            i += 4
        else:
            out += escaped[i].encode()
            i += 1
    try:
        return out.decode("utf-8")
    except UnicodeDecodeError:
        return None


def readings(name: str) -> list[tuple[str | None, int, int]]:
    """Every (key, scheduled_time, attempt) that a unit name could be read as: its middle
    cut at each "-<digits>" (or two) at its end."""
    middle = name.removeprefix(unit_props.UNIT_PREFIX).removesuffix(unit_props.UNIT_SUFFIX)
    out = []
    parts = middle.split("-")
    for tail in (1, 2):
        if len(parts) > tail and all(p.isdigit() for p in parts[-tail:]):
            numbers = [int(p) for p in parts[-tail:]] + [1]
            out.append((unescape("-".join(parts[:-tail])), numbers[0], numbers[1]))
    return out


def generated_keys(rng: random.Random, n: int) -> list[str]:
    """Keys made of what unit names are made of: '/', '-', digits, '_', hex, '\\', 'x',
    and some too long for a unit name (cut and hashed)."""
    alphabet = "/-_0123456789abcdefx\\.é@ "
    keys = []
    for _ in range(n):
        size = rng.choice([1, 2, 3, 5, 8, 13, 21, 200, 230, 250, 300])
        key = "".join(rng.choice(alphabet) for _ in range(size))
        if rng.random() < 0.3:  # a trailing "/<digits>", or "_<16 hex>" as a hash reads
            key += rng.choice([f"/{rng.randrange(10**6)}",
                               "_" + "".join(rng.choice("0123456789abcdef") for _ in
                                             range(16))])
        keys.append(key)
    return keys


def test_unit_names_are_unique_per_key_time_and_attempt() -> None:
    """No two (key, scheduled_time, attempt) give one name: over generated triples, and
    over every other way to read each name back (a key cut at a "-<digits>", a long key's
    cut-and-hash read as a key of its own)."""
    rng = random.Random(25)
    triples = {(k, rng.choice([0, 2, 60, 1357000000, 1795585905, rng.randrange(2**33)]),
                rng.choice([1, 1, 2, 3, 11])) for k in generated_keys(rng, 6000)}
    triples |= {("rootjob", 1795585905, 2), ("rootjob/1795585905", 2, 1)}
    named: dict[str, tuple[str, int, int]] = {}
    for key, when, attempt in sorted(triples):
        name = unit_props.unit_name(key, when, attempt)
        assert named.setdefault(name, (key, when, attempt)) == (key, when, attempt), name
        assert len(name) <= unit_props.UNIT_NAME_MAX
        for other_key, other_when, other_attempt in readings(name):
            if other_key and (other_key, other_when, other_attempt) != (key, when, attempt):
                assert unit_props.unit_name(other_key, other_when, other_attempt) != name, \
                    (name, other_key, key)
    assert len(named) == len(triples)


def test_bus_path_is_systemd_s_bus_label() -> None:
    assert unit_props.bus_path("perfectsched-a\\x2fb-1.service") == (
        "/org/freedesktop/systemd1/unit/perfectsched_2da_5cx2fb_2d1_2eservice")


# -- the unit: whitelist and D-Bus types ----------------------------------------------------


def test_properties_become_dbus_values() -> None:
    got = unit_props.convert({
        "MemoryMax": "1G", "CPUQuota": "50%", "CPUWeight": 200, "IOWeight": 50, "Nice": -5,
        "TasksMax": 64, "PrivateTmp": True, "ProtectSystem": "strict",
        "ReadWritePaths": ["/var/lib/backup", "/srv"], "WorkingDirectory": "/srv"})
    assert got == (
        ("MemoryMax", "t", 1 << 30), ("CPUQuotaPerSecUSec", "t", 500_000),
        ("CPUWeight", "t", 200), ("IOWeight", "t", 50), ("Nice", "i", -5),
        ("TasksMax", "t", 64), ("PrivateTmp", "b", True), ("ProtectSystem", "s", "strict"),
        ("ReadWritePaths", "as", ["/var/lib/backup", "/srv"]),
        ("WorkingDirectory", "s", "/srv"))


@pytest.mark.parametrize("raw,want", [
    ({"MemoryMax": "50M"}, ("MemoryMax", "t", 50 << 20)),
    ({"MemoryMax": "512K"}, ("MemoryMax", "t", 512 << 10)),
    ({"MemoryMax": 1000000}, ("MemoryMax", "t", 1000000)),
    ({"MemoryMax": "1.5G"}, ("MemoryMax", "t", 3 << 29)),
    ({"MemoryMax": "infinity"}, ("MemoryMax", "t", 2**64 - 1)),
    ({"CPUQuota": "200%"}, ("CPUQuotaPerSecUSec", "t", 2_000_000)),
    ({"TasksMax": "infinity"}, ("TasksMax", "t", 2**64 - 1)),
    ({"ProtectSystem": True}, ("ProtectSystem", "s", "yes")),
    ({"ProtectSystem": "full"}, ("ProtectSystem", "s", "full")),
    ({"ReadWritePaths": "/srv"}, ("ReadWritePaths", "as", ["/srv"])),
    ({"WorkingDirectory": "~"}, ("WorkingDirectory", "s", "~")),
    # The edges of systemd's uint64 (D-Bus signature t), in exact arithmetic.
    ({"MemoryMax": 2**64 - 1}, ("MemoryMax", "t", 2**64 - 1)),
    ({"MemoryMax": "15.9999999999999999999E"}, ("MemoryMax", "t", 2**64 - 1)),
    ({"MemoryMax": "0.5K"}, ("MemoryMax", "t", 512)),
    ({"TasksMax": 2**64 - 1}, ("TasksMax", "t", 2**64 - 1)),
    ({"CPUQuota": "0.0001%"}, ("CPUQuotaPerSecUSec", "t", 1)),
    ({"CPUQuota": "1844674407370955.1615%"}, ("CPUQuotaPerSecUSec", "t", 2**64 - 1)),
])
def test_each_property_s_type(raw: dict[str, Any], want: unit_props.Property) -> None:
    assert unit_props.convert(raw) == (want,)


@pytest.mark.parametrize("raw,error", [
    ({"ExecStartPre": "/bin/rm -rf /"}, "'ExecStartPre': not an allowed property (allowed: "
                                        "MemoryMax, CPUQuota"),
    ({"User": "root"}, "'User': not an allowed property"),
    ({"MemoryMax": "lots"}, "MemoryMax: expected bytes such as 512M or 1G, or infinity, "
                            "got 'lots'"),
    ({"MemoryMax": -1}, "MemoryMax: expected bytes"),
    ({"MemoryMax": True}, "MemoryMax: expected bytes"),
    ({"CPUQuota": 50}, "CPUQuota: expected a percentage of one CPU such as 50%"),
    ({"CPUQuota": "0%"}, "CPUQuota: expected a percentage"),
    ({"CPUWeight": 0}, "CPUWeight: expected a whole number from 1 to 10000, got 0"),
    ({"IOWeight": "high"}, "IOWeight: expected a whole number from 1 to 10000"),
    ({"Nice": 20}, "Nice: expected a whole number from -20 to 19, got 20"),
    ({"TasksMax": 0}, "TasksMax: expected a number of tasks"),
    ({"PrivateTmp": "yes"}, "PrivateTmp: expected true or false, got 'yes'"),
    ({"ProtectSystem": "mostly"}, "ProtectSystem: expected true, false, full or strict"),
    ({"ReadWritePaths": ["relative/path"]}, "ReadWritePaths: expected an absolute path"),
    ({"ReadWritePaths": []}, "ReadWritePaths: expected an absolute path or a list"),
    ({"WorkingDirectory": "tmp"}, "WorkingDirectory: expected an absolute path"),
    ("MemoryMax=1G", "expected a mapping of systemd properties"),
    # Past systemd's uint64 (D-Bus signature t), or 0 after rounding: refused at load.
    ({"MemoryMax": 2**64}, "MemoryMax: out of range: a whole number too large (1 to "
                           "18446744073709551615 bytes, or infinity)"),
    ({"MemoryMax": "999999999999999999999G"}, "MemoryMax: out of range: "),
    ({"MemoryMax": "9" * 400 + "G"}, "MemoryMax: out of range: "),
    ({"MemoryMax": "16E"}, "MemoryMax: out of range: '16E'"),
    ({"MemoryMax": "0.1"}, "MemoryMax: out of range: '0.1'"),
    ({"TasksMax": 2**64}, "TasksMax: out of range: a whole number too large (1 to "
                          "18446744073709551615 tasks, or infinity)"),
    ({"CPUQuota": "9" * 400 + "%"}, "CPUQuota: out of range: "),
    ({"CPUQuota": "1844674407370955.1616%"}, "CPUQuota: out of range: "),
    ({"CPUQuota": "0.00001%"}, "CPUQuota: out of range: '0.00001%' (0.0001% to "
                               "1844674407370955.1615%)"),
])
def test_bad_properties_are_refused_by_name(raw: Any, error: str) -> None:
    with pytest.raises(unit_props.UnitPropertyError) as caught:
        unit_props.convert(raw)
    assert str(caught.value).startswith(error) and "\n" not in str(caught.value)


# -- routes and schedules files -------------------------------------------------------------


def test_a_route_with_executor_systemd(with_systemd: None) -> None:
    c = from_mapping({**BASE, "routes": [{**ROUTE, "timeout": 60,
                                          "unit": {"MemoryMax": "1G", "Nice": 5}}]})
    route = c.routes[0]
    assert route.executor == "systemd" and route.timeout == 60
    assert route.unit == (("MemoryMax", "t", 1 << 30), ("Nice", "i", 5))
    assert from_mapping({**BASE, "routes": [{**ROUTE, "executor": "exec"}]}).routes[0] \
        .executor == "exec"


@pytest.mark.parametrize("route,error", [
    ({**ROUTE, "unit": {"Restart": "always"}},
     "routes[0].unit: 'Restart': not an allowed property"),
    ({**ROUTE, "unit": {"CPUQuota": "half"}}, "routes[0].unit: CPUQuota: expected a "
                                              "percentage"),
    ({**ROUTE, "executor": "docker"}, "routes[0].executor: expected exec or systemd, got "
                                      "'docker'"),
    ({"type": "t", "python": "m:C", "executor": "systemd"},
     "routes[0].executor: systemd runs exec routes only"),
    ({"type": "t", "exec": ["/bin/true"], "unit": {"Nice": 1}},
     "routes[0].unit: only with executor: systemd"),
])
def test_bad_routes_are_refused_naming_the_field(with_systemd: None, route: dict[str, Any],
                                                 error: str) -> None:
    with pytest.raises(ConfigError) as caught:
        from_mapping({**BASE, "routes": [route]})
    assert str(caught.value).startswith(error) and "\n" not in str(caught.value)


def check_host(config: Config) -> None:
    """Raise the first refusal, as ConfigError (what these tests look at)."""
    marked, refused = refuse_routes(config)
    if refused:
        assert [r.refused for r in marked.routes if r.refused] == refused
        raise ConfigError(refused[0])


def test_executor_systemd_is_refused_where_systemd_does_not_run(without_systemd: None
                                                                 ) -> None:
    """The daemon checks the host (config.refuse_routes, at start and on reload); a client
    reading the same file (perfectschedctl -c) runs no job and takes it.  The route is
    refused alone: the others keep their place and run."""
    config = from_mapping({**BASE, "routes": [
        {"type": "t", "exec": ["/bin/true"], "user": "root"}, {**ROUTE, "user": "root"}]},
        source="/etc/perfectsched/perfectsched.yml")
    marked, refused = refuse_routes(config)
    assert refused == [
        "/etc/perfectsched/perfectsched.yml: routes[1].executor: systemd is not running on "
        f"this host ({unit_props.SYSTEMD_MARKER} is missing); use executor exec"]
    assert marked.routes[0] == config.routes[0] and marked.routes[1].refused == refused[0]
    check_host(from_mapping({**BASE, "routes": [{**ROUTE, "executor": "exec",
                                                 "user": "root"}]}))


def test_a_host_with_systemd_passes_the_check(with_systemd: None) -> None:
    check_host(from_mapping({**BASE, "routes": [{**ROUTE, "user": "nobody"}]}))


def test_a_unit_never_runs_as_root_unless_named(with_systemd: None) -> None:
    """Without user: a unit runs as the daemon's user: refused under a root daemon."""
    with pytest.raises(ConfigError) as caught:
        check_host(from_mapping({**BASE, "routes": [ROUTE]}))
    assert str(caught.value).startswith("routes[0].user: missing; a unit without user: runs "
                                        "as the daemon's user, and this daemon runs as root")
    check_host(from_mapping({**BASE, "routes": [{**ROUTE, "user": "root"}]}))


def test_no_job_runs_under_the_uid_that_holds_the_grant(
        with_systemd: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon that is not root: executor systemd needs the grant; with it, neither an
    exec job nor a unit may run as the daemon's user (it could start units as root)."""
    monkeypatch.setattr(os, "geteuid", lambda: 65534)  # nobody: a daemon user, not root
    unit_as = {**ROUTE, "user": "daemon"}
    plain = {"type": "p", "exec": ["/bin/true"]}
    config = from_mapping({**BASE, "routes": [unit_as, plain]}, source="/etc/p.yml")
    _, refused = refuse_routes(config, grant=False)
    assert refused == ["/etc/p.yml: routes[0].executor: systemd needs the polkit grant, which "
                       "is off on this host: enable it with `perfectsched-grant enable`, "
                       "then reload"]
    marked, refused = refuse_routes(config, grant=True)
    assert refused == ["/etc/p.yml: routes[1].executor: an exec job runs as nobody, the "
                       "daemon's user, which holds the polkit grant to start units (it could "
                       "become root): use executor: systemd with a user:, or turn the grant "
                       "off (perfectsched-grant disable)"]
    assert marked.routes[0].refused is None
    for user in (None, "nobody"):
        _, refused = refuse_routes(from_mapping({**BASE, "routes": [
            {**ROUTE, "user": user}]}), grant=True)
        assert refused == ["routes[0].user: the unit would run as nobody, the daemon's user, "
                           "which holds the polkit grant to start units (it could become "
                           "root): name another user"], user


def test_a_route_s_user_and_env(with_systemd: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Routes take `user` and `env` as entries do.  Whether the user exists, and whether
    the daemon may switch to it, is the daemon's check: systemd sets a unit's User=, an
    exec route's user needs a root daemon."""
    unit_route = {**ROUTE, "user": "nobody", "env": {"PGHOST": "db1", "RETRIES": 3}}
    plain = {"type": "t", "exec": ["/bin/true"], "user": "nobody"}
    config = from_mapping({**BASE, "routes": [unit_route]})
    assert config.routes[0].user == "nobody"
    assert config.routes[0].env == (("PGHOST", "db1"), ("RETRIES", "3"))
    check_host(config)
    # `user: ~` (null), as in an entry, is no user.
    assert from_mapping({**BASE, "routes": [{**ROUTE, "user": None}]}).routes[0].user is None
    monkeypatch.setattr(os, "geteuid", lambda: 4242)  # a daemon user, not root nor nobody
    assert refuse_routes(config, grant=True)[1] == []
    refused = from_mapping({**BASE, "routes": [plain]}, source="/etc/p.yml")  # a client may
    with pytest.raises(ConfigError) as caught:
        check_host(refused)
    assert str(caught.value) == ("/etc/p.yml: routes[0].user: running as 'nobody' needs the "
                                 "daemon to run as root (this one does not)")
    with pytest.raises(ConfigError) as caught:
        check_host(from_mapping({**BASE, "routes": [{**ROUTE, "user": "no-such-user-x"}]}))
    assert str(caught.value) == "routes[0].user: no such user 'no-such-user-x' on this host"


@pytest.mark.parametrize("route,error", [
    ({"type": "t", "python": "m:C", "env": {"A": "1"}}, "routes[0].env: only for exec routes "
     "(a python handler runs inside the daemon, in its environment)"),
    ({**ROUTE, "user": ""}, "routes[0].user: must be a user name"),
    ({**ROUTE, "user": 0}, "routes[0].user: must be a user name"),
    ({**ROUTE, "env": ["A=1"]}, "routes[0].env: must be a mapping of NAME: value"),
    ({**ROUTE, "env": {"1A": "x"}}, "routes[0].env: bad variable name '1A'"),
    ({**ROUTE, "env": {"A": ["x"]}}, "routes[0].env: A: must be text, got a list"),
    ({**ROUTE, "env": {"A": "x\0y"}}, "routes[0].env: A: contains a NUL character"),
])
def test_bad_route_users_and_envs_are_refused(with_systemd: None, route: dict[str, Any],
                                              error: str) -> None:
    with pytest.raises(ConfigError) as caught:
        from_mapping({**BASE, "routes": [route]})
    assert str(caught.value) == error


def load_one(tmp_path: Path, entries: Any, **kw: Any) -> files.Loaded:
    f = tmp_path / "one.yml"
    f.write_text(yaml.safe_dump(entries))
    return files.load([f], **kw)


def test_an_entry_with_executor_systemd(with_systemd: None, tmp_path: Path) -> None:
    loaded = load_one(tmp_path, [{**ENTRY, "user": "nobody", "timeout": 2,
                                  "unit": {"MemoryMax": "50M", "PrivateTmp": True}}])
    assert loaded.errors == []
    route = loaded.entries["nightly"].route()
    assert route is not None and route.executor == "systemd" and route.user == "nobody"
    assert route.unit == (("MemoryMax", "t", 50 << 20), ("PrivateTmp", "b", True))
    assert route.timeout == 2


@pytest.mark.parametrize("entry,error", [
    ({**ENTRY, "unit": {"KillMode": "none"}}, "unit: 'KillMode': not an allowed property"),
    ({**ENTRY, "unit": {"MemoryMax": "1Q"}}, "unit: MemoryMax: expected bytes"),
    ({**ENTRY, "unit": {"MemoryMax": 2**70}}, "unit: MemoryMax: out of range"),
    ({**ENTRY, "unit": {"CPUQuota": "9" * 400 + "%"}}, "unit: CPUQuota: out of range"),
    ({**ENTRY, "executor": "chroot"}, "executor: expected exec or systemd, got 'chroot'"),
    ({"key": "k", "cron": "@daily", "type": "t", "executor": "systemd"},
     "executor: only for exec entries"),
    ({"key": "k", "cron": "@daily", "exec": "true", "unit": {"Nice": 1}},
     "unit: only with executor: systemd"),
])
def test_bad_entries_are_refused_naming_the_field(with_systemd: None, tmp_path: Path,
                                                  entry: dict[str, Any], error: str) -> None:
    loaded = load_one(tmp_path, [entry])
    assert loaded.entries == {} and len(loaded.errors) == 1
    assert loaded.errors[0].split(": ", 2)[2].startswith(error), loaded.errors


def test_a_unit_s_user_needs_no_root(with_systemd: None, tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """systemd sets User=: a daemon that is not root may run a unit as another user (an
    exec entry's user needs a root daemon)."""
    monkeypatch.setattr(os, "geteuid", lambda: 4242)  # a daemon user, not root nor nobody
    assert load_one(tmp_path, [{**ENTRY, "user": "nobody"}]).errors == []
    exec_entry = load_one(tmp_path, [{**ENTRY, "executor": "exec", "user": "nobody"}])
    assert "needs the daemon to run as root" in exec_entry.errors[0]


def test_an_entry_with_executor_systemd_is_refused_without_systemd(
        without_systemd: None, tmp_path: Path) -> None:
    loaded = load_one(tmp_path, [ENTRY])
    assert loaded.errors == [f"{tmp_path / 'one.yml'}: entry 1 (nightly): executor: systemd "
                             f"is not running on this host ({unit_props.SYSTEMD_MARKER} is "
                             "missing); use executor exec"]
    # `apply` from a workstation only stores what the file holds: it does not ask.
    assert load_one(tmp_path, [ENTRY], need_user_support=False).errors == []


@pytest.mark.skipif(unit_props.systemd_booted(), reason="this host runs systemd")
def test_the_daemon_refuses_the_file_and_runs_the_rest(daemon_factory: Any, tmp_path: Path
                                                       ) -> None:
    """Without systemd (this suite's hosts): a schedules file with an `executor: systemd`
    entry is rejected whole at load with one line naming it; every other file runs as
    before.  A configuration route with it is refused alone: the daemon starts, says so
    in one line in its log and in status, runs the other routes, and leaves the refused
    route's occurrences waiting; a reload that keeps it exits non-zero naming it."""
    sched_dir = tmp_path / "schedules.d"
    sched_dir.mkdir()
    out = tmp_path / "ran"
    (sched_dir / "units.yml").write_text(yaml.safe_dump([ENTRY]))
    (sched_dir / "plain.yml").write_text(yaml.safe_dump([
        {"key": "plain", "cron": "* * * * *", "exec": f"echo ok >> {out}",
         "user": "root"}]))
    d: Daemon = daemon_factory({"schedules_dir": str(sched_dir)})
    d.start()
    d.wait_log("units.yml")
    line = next(x for x in d.log().splitlines() if "units.yml" in x)
    assert "entry 1 (nightly): executor: systemd is not running on this host" in line
    keys = {s["key"] for s in d.ctl_json("list")}
    assert "plain" in keys and "nightly" not in keys
    d.ctl("run", "plain")
    wait_until(lambda: out.exists() and "ok" in out.read_text(), 20, what="the exec entry")
    assert d.stop() == 0
    mixed = daemon_factory({"routes": [ROUTE, {"type": "plain-t", "exec": [
        "/bin/sh", "-c", f"echo route >> {out}"], "user": "root"}]}).start()
    mixed.wait_log("this route is refused")
    errors = [x for x in mixed.log().splitlines() if "executor" in x]
    assert len(errors) == 1 and "routes[0].executor: systemd is not running on this " \
        "host" in errors[0] and "this route is refused, the other routes run" in errors[0]
    status = mixed.status()
    assert len(status["refused_routes"]) == 1 and "routes[0].executor" in \
        status["refused_routes"][0]
    line = next(x for x in mixed.ctl("status").stdout.splitlines() if "refused route" in x)
    assert line.startswith("refused route (the others run): ") and "routes[0].executor" in line
    mixed.ctl("add", "via-unit", ROUTE["type"], "* * * * *", "--at", "0")
    mixed.ctl("add", "via-exec", "plain-t", "* * * * *", "--at", "0")
    wait_until(lambda: "route" in out.read_text(), 20, what="the exec route's job")
    time.sleep(1.5)  # a poll or two: the refused route's occurrence is not taken
    assert mixed.ctl_json("history", "via-unit") == []
    assert mixed.ctl_json("show", "via-unit")["next_run_time"] == 0
    res = mixed.ctl("reload", check=False)
    assert res.returncode == 1 and res.stderr.startswith("perfectschedctl: refused: ") and \
        "routes[0].executor: systemd is not running" in res.stderr, res
    assert mixed.stop() == 0


def test_a_reload_with_a_number_past_uint64_is_refused_in_one_line(daemon_factory: Any
                                                                    ) -> None:
    """It was an OverflowError, named as such, in the reload's answer and the log."""
    d: Daemon = daemon_factory().start()
    d.write_config({**d.config, "routes": [{**ROUTE, "unit": {"MemoryMax": "9" * 400 + "G"}}]})
    res = d.ctl("reload", check=False)
    assert res.returncode == 1 and len(res.stderr.strip().splitlines()) == 1, res
    assert "routes[0].unit: MemoryMax: out of range: " in res.stderr, res.stderr
    assert "Overflow" not in d.log() and "Traceback" not in d.log()
    assert d.alive() and d.stop() == 0


def test_a_python_route_runs_only_as_the_daemon_s_user(monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    """A python handler runs inside the worker: its `user:` can only name the daemon's
    user, and under a root daemon must (root runs one only where root wrote user: root)."""
    py = {"type": "p", "python": "m:C"}

    def refused(route: dict[str, Any], grant: bool = False) -> list[str]:
        return refuse_routes(from_mapping({**BASE, "routes": [route]}), grant=grant)[1]

    if os.geteuid() == 0:
        assert refused(py) == ["routes[0].user: missing; a python handler runs inside the "
                               "daemon, and this one runs as root: write user: root to run "
                               "it as root"]
        assert refused({**py, "user": "root"}) == []
        assert refused({**py, "user": "nobody"}) == [
            "routes[0].user: a python handler runs inside the daemon, as root: user: may only "
            "name root, not 'nobody' (use an exec route to run as another user)"]
    monkeypatch.setattr(os, "geteuid", lambda: 65534)  # nobody: a daemon user, not root
    assert refused(py) == refused({**py, "user": "nobody"}) == []
    assert refused(py, grant=True) == [
        "routes[0].python: a python handler runs inside the daemon, as nobody, which holds "
        "the polkit grant to start units (it could become root): use executor: systemd with "
        "a user:, or turn the grant off (perfectsched-grant disable)"]
