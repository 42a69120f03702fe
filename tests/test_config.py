"""config.py: YAML -> validated, immutable Config; bad values name their key."""

from __future__ import annotations

import dataclasses
import pathlib

import pytest

from perfectschedd import ConfigError, NotSupportedError
from perfectschedd.config import DEFAULT_METRICS_PORT, Config, from_mapping, load

BASE = {"type": "rdb_compat", "url": "sqlite:////tmp/x.db"}


def test_defaults_match_the_spec() -> None:
    c = from_mapping(BASE)
    assert (c.table, c.poll_interval, c.timezone, c.alive_time, c.retry_wait, c.workers) == (
        "perfectsched", 1.0, "UTC", 300, 300, 2)
    assert c.control_socket == "/run/perfectsched/perfectschedd.sock"
    assert c.log is None and c.routes == ()
    assert c.http_listen == ("127.0.0.1", DEFAULT_METRICS_PORT)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.url = "other"  # type: ignore[misc]


def test_yaml_file_and_environment_sections(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "p.yml"
    path.write_text(
        "production:\n  type: rdb_compat\n  url: postgresql://u:p@db/prod\n  workers: 8\n"
        "  timezone: Asia/Tokyo\n  metrics_listen: 'off'\n"
        "  routes:\n    - type: backup\n      exec: [/bin/true, --full]\n      timeout: 60\n"
        "    - type: /^report-.*$/\n      python: myapp.jobs:Report\n"
        "development:\n  type: rdb_compat\n  url: sqlite:///dev.db\n")
    prod = load(str(path), "production")
    assert prod.url == "postgresql://u:p@db/prod" and prod.workers == 8
    assert prod.timezone == "Asia/Tokyo" and prod.http_listen is None
    assert prod.source == str(path)
    backup, report = prod.routes
    assert backup.exec == ("/bin/true", "--full") and backup.timeout == 60.0
    assert backup.matches("backup") and not backup.matches("backup2")
    assert report.python == "myapp.jobs:Report"
    assert report.matches("report-daily") and not report.matches("daily-report")
    assert load(path, "development").url == "sqlite:///dev.db"
    with pytest.raises(ConfigError, match=r"environment 'staging' not found in .*p\.yml "
                                          r"\(it has: production, development\)"):
        load(str(path), "staging")
    # Without -e: the message says to choose one, and which there are.
    with pytest.raises(ConfigError, match=r"has sections for environments production, "
                                          r"development: choose one with -e ENV"):
        load(str(path))


def test_errors_are_runtime_errors_as_in_the_original() -> None:
    from perfectschedd import InvalidInputError, ProcessStopError, ScheduleError

    assert issubclass(ConfigError, RuntimeError) and issubclass(ProcessStopError, RuntimeError)
    assert issubclass(InvalidInputError, ScheduleError)


def test_config_env_var_names_the_default_file(tmp_path: pathlib.Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "c.yml"
    path.write_text("type: rdb_compat\nurl: sqlite:///a.db\ntable: jobs\n")
    monkeypatch.setenv("PERFECTSCHED_CONFIG", str(path))
    assert load().table == "jobs"


def test_a_config_object_passes_through() -> None:
    c = Config(url="sqlite:////tmp/a.db")
    assert load(c) is c


def test_rdb_backend_is_not_supported() -> None:
    with pytest.raises(NotSupportedError, match="^type: "):
        from_mapping({**BASE, "type": "rdb"})


@pytest.mark.parametrize(("change", "field"), [
    ({"type": "redis"}, "type"),
    ({"type": None}, "type"),
    ({"url": None}, "url"),
    ({"url": "oracle://x/y"}, "url"),
    ({"table": "x; DROP TABLE y"}, "table"),
    ({"table": "1abc"}, "table"),
    ({"timezone": "Mars/Olympus"}, "timezone"),
    ({"alive_time": 0}, "alive_time"),
    ({"alive_time": "long"}, "alive_time"),
    ({"workers": 1.5}, "workers"),
    ({"workers": True}, "workers"),
    ({"retry_wait": -1}, "retry_wait"),
    ({"poll_interval": 0}, "poll_interval"),
    ({"metrics_listen": "localhost"}, "metrics_listen"),
    ({"metrics_listen": "127.0.0.1:99999"}, "metrics_listen"),
    ({"routes": {"type": "x"}}, "routes"),
    ({"routes": [{"type": "x"}]}, "routes[0]"),
    ({"routes": [{"type": "x", "exec": "/bin/true"}]}, "routes[0].exec"),
    ({"routes": [{"type": "x", "exec": ["a"], "python": "m:C"}]}, "routes[0]"),
    ({"routes": [{"type": "x", "python": "nocolon"}]}, "routes[0].python"),
    ({"routes": [{"type": "/[/", "exec": ["a"]}]}, "routes[0].type"),
    ({"routes": [{"type": "x", "exec": ["a"], "timeout": 0}]}, "routes[0].timeout"),
    ({"wokers": 2}, "wokers"),
])
def test_bad_values_name_the_key(change: dict[str, object], field: str) -> None:
    raw = {**BASE, **change}
    raw = {k: v for k, v in raw.items() if v is not None}
    with pytest.raises(ConfigError) as info:
        from_mapping(raw)
    assert field in str(info.value)


def test_file_errors_name_the_file(tmp_path: pathlib.Path) -> None:
    missing = tmp_path / "missing.yml"
    with pytest.raises(ConfigError, match="cannot read .*missing.yml"):
        load(str(missing))
    bad = tmp_path / "bad.yml"
    bad.write_text("type: [unclosed\n")
    with pytest.raises(ConfigError, match="bad.yml: not valid YAML"):
        load(str(bad))
    empty = tmp_path / "empty.yml"
    empty.write_text("")
    with pytest.raises(ConfigError, match="empty"):
        load(str(empty))
    wrong = tmp_path / "wrong.yml"
    wrong.write_text("type: rdb_compat\nurl: sqlite:///a.db\ntimezone: Nowhere/City\n")
    with pytest.raises(ConfigError, match=r"wrong.yml: timezone: unknown time zone"):
        load(str(wrong))
    listy = tmp_path / "list.yml"
    listy.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load(str(listy))


@pytest.mark.parametrize("value,error", [
    ("2024-13-45", "p.yml: not valid YAML: month must be in 1..12"),
    ("9" * 5000, "p.yml: not valid YAML: Exceeds the limit (4300 digits)"),
])
def test_values_yaml_cannot_build_are_one_line(tmp_path: pathlib.Path, value: str,
                                               error: str) -> None:
    """They raised ValueError, a traceback at start, before."""
    path = tmp_path / "p.yml"
    path.write_text(f"type: rdb_compat\nurl: sqlite:///a.db\ntimezone: {value}\n")
    with pytest.raises(ConfigError) as info:
        load(str(path))
    assert str(info.value).startswith(f"{tmp_path}/{error}") and "\n" not in str(info.value)


def test_environments_may_share_a_section_by_alias(tmp_path: pathlib.Path) -> None:
    """Unlike schedules files, the configuration may use anchors (root's file, where
    environment sections share their common part; nothing in it is walked unbounded)."""
    path = tmp_path / "p.yml"
    path.write_text("base: &base {type: rdb_compat, url: 'sqlite:///a.db'}\n"
                    "production: {<<: *base, workers: 8}\n")
    assert load(str(path), "production").workers == 8


ROUTE_AS_NOBODY = {"type": "backup", "exec": ["/bin/true"], "user": "nobody"}


def test_a_route_s_allow_names_users_and_groups() -> None:
    c = from_mapping({**BASE, "routes": [{**ROUTE_AS_NOBODY, "allow": ["alice", "@ops"]},
                                         ROUTE_AS_NOBODY]})
    assert c.routes[0].allow == ("alice", "@ops")
    assert c.routes[1].allow == ()  # root only


@pytest.mark.parametrize(("allow", "error"), [
    ("alice", "routes[0].allow: must be a list of user names and @group names"),
    ([], None),
    (["alice", 7], "routes[0].allow: 7 is not a user name or @group name"),
    ([""], "routes[0].allow: '' is not a user name or @group name"),
    (["@"], "routes[0].allow: '@' is not a user name or @group name"),
    (["two words"], "routes[0].allow: 'two words' is not a user name or @group name"),
    (["-rf"], "routes[0].allow: '-rf' is not a user name or @group name"),
    (["al\nice"], "routes[0].allow: 'al\\nice' is not a user name or @group name"),
    (["alice", "alice"], "routes[0].allow: 'alice' appears twice"),
])
def test_bad_allow_lists_are_one_line(allow: object, error: str | None) -> None:
    raw = {**BASE, "routes": [{**ROUTE_AS_NOBODY, "allow": allow}]}
    if error is None:
        assert from_mapping(raw).routes[0].allow == ()
        return
    with pytest.raises(ConfigError) as info:
        from_mapping(raw)
    assert str(info.value) == error


def test_allow_is_for_routes_that_run_as_another_user() -> None:
    with pytest.raises(ConfigError) as info:
        from_mapping({**BASE, "routes": [{"type": "t", "exec": ["/bin/true"],
                                          "allow": ["alice"]}]})
    assert str(info.value) == ("routes[0].allow: only for a route with user: (a route "
                               "without one is open to control_group)")


def test_output_limit_defaults_to_4096_and_takes_0_or_a_bounded_size() -> None:
    assert load(dict(BASE)).output_limit == 4096
    assert load({**BASE, "output_limit": 0}).output_limit == 0
    assert load({**BASE, "output_limit": 65536}).output_limit == 65536
    for bad, why in ((10, "must be 0 (keep no output) or from 64 to 1048576 bytes, got 10"),
                     (2 << 20, "must be 0 (keep no output) or from 64"),
                     (-1, "must be at least 0"), ("4k", "must be a number"),
                     (100.5, "must be a whole number")):
        with pytest.raises(ConfigError, match=r"^output_limit: " + why.replace("(", r"\(")
                           .replace(")", r"\)")):
            load({**BASE, "output_limit": bad})
