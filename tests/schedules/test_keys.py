"""What a key may be (SPEC "Schedule semantics"): one rule for the socket, D-Bus, the CLI
in direct mode and the library; keys stored before the rule keep working and `status`
lists them for a rename."""

from __future__ import annotations

import sqlite3
import subprocess
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import CTL, YEARLY, Daemon

import perfectschedd
from perfectschedd import InvalidInputError

HOSTILE = [
    ("--use-compress-program=sh -c 'id > /tmp/x; cat'", "must not start with '-'"),
    ("-v", "must not start with '-'"),
    ("line\u2028break", "line-separator"),
    ("bidi\u202eevil", "format"),
    ("esc\x1b[31m", "control"),
    ("del\x7f", "control"),
    ("other@run-1-abc", "'@run-'"),
    ("with space", "spaces"),
    ("nbsp\u00a0key", "spaces"),
]


@pytest.mark.parametrize(("key", "why"), HOSTILE)
def test_the_library_refuses_hostile_keys(tmp_path: Path, key: str, why: str) -> None:
    with perfectschedd.open({"type": "rdb_compat",
                             "url": f"sqlite:///{tmp_path / 'db'}"}) as sc:
        with pytest.raises(InvalidInputError, match=r"^key: .*" + why.replace("'", ".")):
            sc.add(key, "t", cron=YEARLY)
        with pytest.raises(InvalidInputError, match="^key: "):
            sc.add_many([{"key": "fine", "type": "t", "cron": YEARLY},
                         {"key": key, "type": "t", "cron": YEARLY}])
        assert sc.list() == []  # nothing stored, not even the good one of the batch


def test_socket_and_direct_mode_refuse_with_one_line(daemon_factory: Any) -> None:
    d: Daemon = daemon_factory().start()
    for key, _ in HOSTILE:
        for via in (["--socket", d.socket_path], ["-c", str(d.config_path)]):
            res = subprocess.run([*CTL, *via, "add", "--", key, "t", YEARLY],
                                 capture_output=True, text=True, timeout=30)
            assert res.returncode == 1, (key, res)
            lines = res.stderr.strip().splitlines()
            assert len(lines) == 1 and "key:" in lines[0], (key, res.stderr)
    assert d.ctl_json("list") == []
    assert d.alive()
    assert d.stop() == 0


def test_keys_stored_before_the_rule_keep_working_and_are_listed(daemon_factory: Any) -> None:
    d: Daemon = daemon_factory().start()
    d.ctl("add", "ok", "t", YEARLY)
    db = d.config["url"].removeprefix("sqlite:///")
    with sqlite3.connect(db) as con:  # as an older version would have stored them
        for key in ("-old", "tab\tkey", "a space"):
            con.execute("INSERT INTO perfectsched (key, type, cron, delay, timezone, data,"
                        " next_time, next_run_time, paused, fence, attempt)"
                        " SELECT ?, type, cron, delay, timezone, data, next_time,"
                        " next_run_time, paused, fence, attempt FROM perfectsched"
                        " WHERE key = 'ok'", (key,))
    d.stop()
    d.start()
    st = d.status()
    assert {k["key"] for k in st["keys_to_rename"]} == {"-old", "tab\tkey", "a space"}
    assert "key to rename: '-old': key: must not start with '-'" in d.ctl("status").stdout
    assert d.ctl_json("show", "--", "-old")["key"] == "-old"  # still works
    d.ctl("delete", "--", "-old")
    assert d.stop() == 0


def test_every_ascii_control_character_is_refused_and_the_rest_accepted() -> None:
    """An ASCII key is checked without Unicode categories: the same verdict for each of
    the 128 characters as the categories give."""
    import unicodedata

    from perfectschedd.schedules.validate import check_key

    for code in range(128):
        key = f"k{chr(code)}k"
        if unicodedata.category(chr(code)) == "Cc":
            with pytest.raises(InvalidInputError, match="^key: .*control"):
                check_key(key)
        elif chr(code) == " ":
            with pytest.raises(InvalidInputError, match="^key: must not contain spaces"):
                check_key(key)
        else:
            assert check_key(key) == key
