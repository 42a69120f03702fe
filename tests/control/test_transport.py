"""control/transport.py: what the socket, D-Bus and HTTP share, without a server: the
pool a request runs on, the refusal ladder, and how `list` answers are paged.  The
transports' own tests (test_control_server.py, test_dbus_server.py, tests/web/) meet
the same rules through a daemon."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
from sqlalchemy.exc import OperationalError

from perfectschedd import __version__
from perfectschedd.control import protocol, registry
from perfectschedd.control.transport import (
    RequestPools,
    is_quick,
    list_page,
    one_page,
    peek_command,
    refusal_of,
)
from perfectschedd.errors import ConfigError, InvalidInputError, NotFoundError

log = logging.getLogger("test-transport")


def test_quick_commands_are_the_registrys() -> None:
    quick = {name for name, command in registry.COMMANDS.items() if command.quick}
    assert quick == {"status"}
    assert all(is_quick(name) == (name in quick) for name in registry.COMMANDS)
    assert not is_quick("no-such-command") and not is_quick(None)


@pytest.mark.parametrize(("frame", "cmd"), [
    (protocol.request("status"), "status"),
    (protocol.request("list", {"prefix": "a"}), "list"),
    (b"not json", None),
    (b'["status"]', None),
    (b'{"cmd": 1}', None),
    # A large frame is not read twice: it goes to the pool that may wait.
    (protocol.request("status", {"pad": "x" * 600}), None),
])
def test_peek_command_reads_small_frames_only(frame: bytes, cmd: str | None) -> None:
    assert peek_command(frame.rstrip(b"\n")) == cmd


def test_the_pools_send_quick_commands_to_their_own() -> None:
    pools = RequestPools("test", 2, 1)
    try:
        assert pools.of("status") is pools.quick
        assert pools.of("list") is pools.slow and pools.of(None) is pools.slow
        assert pools.quick.submit(lambda: 1).result(5) == 1
    finally:
        pools.shutdown()
    with pytest.raises(RuntimeError):
        pools.slow.submit(lambda: 1)


def test_the_refusal_ladder() -> None:
    assert refusal_of(protocol.ProtocolError("bad frame"), None, log) == \
        ("ProtocolError", "bad frame")
    assert refusal_of(NotFoundError("k: no such schedule"), None, log) == \
        ("NotFoundError", "k: no such schedule")
    assert refusal_of(ConfigError("x: bad"), None, log) == ("ConfigError", "x: bad")
    db = OperationalError("SELECT 1", {}, Exception("\nserver gone\nmore"))
    assert refusal_of(db, None, log) == ("DatabaseError", "database error: server gone")


def test_a_bug_is_logged_with_its_traceback(caplog: pytest.LogCaptureFixture) -> None:
    try:
        raise KeyError("oops")
    except KeyError as exc:
        with caplog.at_level(logging.ERROR, logger=log.name):
            assert refusal_of(exc, None, log, what="D-Bus request add") == \
                ("InternalError", "internal error: 'oops'")
    [record] = caplog.records
    assert record.getMessage() == "D-Bus request add failed" and record.exc_info


def test_an_unknown_command_names_both_versions_unless_told_not_to() -> None:
    unknown = InvalidInputError("cmd", "unknown command 'frob'")
    type_, message = refusal_of(unknown, "0.1.9", log)
    assert type_ == "InvalidInputError" and "perfectschedctl 0.1.9" in message \
        and f"perfectschedd {__version__}" in message
    assert refusal_of(unknown, __version__, log)[1] == str(unknown)
    assert refusal_of(unknown, None, log, note_versions=False)[1] == str(unknown)


def test_one_page_caps_a_list_at_a_page() -> None:
    assert one_page({}) == {"limit": protocol.LIST_PAGE}
    assert one_page({"limit": protocol.LIST_PAGE + 1}) == {"limit": protocol.LIST_PAGE}
    assert one_page({"prefix": "a", "limit": 5}) == {"prefix": "a", "limit": 5}
    # Not a whole number: left for the command to refuse, naming it.
    assert one_page({"limit": "many"}) == {"limit": "many"}


class Rows:
    """A fake `list` over `count` schedules k00000, k00001, ..., each `size` bytes of
    data, recording the limits it was asked for."""

    def __init__(self, count: int, size: int = 10) -> None:
        self.keys = [f"k{i:05d}" for i in range(count)]
        self.data = "x" * size
        self.asked: list[int] = []

    def __call__(self, cmd: str, args: dict[str, Any]) -> list[dict[str, Any]]:
        assert cmd == "list"
        self.asked.append(args["limit"])
        after = args.get("after")
        keys = [k for k in self.keys if after is None or k > after]
        return [{"key": k, "data": self.data} for k in keys[:args["limit"]]]


def page_of(answer: bytes) -> tuple[list[str], Any]:
    msg = protocol.parse_response_full(answer.rstrip(b"\n"))
    return [row["key"] for row in msg["result"]], msg["more"]


def test_a_short_list_is_one_page_without_more() -> None:
    assert page_of(list_page(Rows(3), {})) == (["k00000", "k00001", "k00002"], None)
    assert page_of(list_page(Rows(3), {"limit": 2})) == (["k00000", "k00001"], None)


def test_a_long_list_says_where_to_go_on() -> None:
    rows = Rows(protocol.LIST_PAGE + 5)
    keys, more = page_of(list_page(rows, {}))
    assert len(keys) == protocol.LIST_PAGE and more == {"after": keys[-1]}
    rest, more = page_of(list_page(rows, {"after": keys[-1]}))
    assert rest == rows.keys[protocol.LIST_PAGE:] and more is None


def test_a_page_of_large_schedules_stops_at_the_byte_budget() -> None:
    rows = Rows(200, size=64 * 1024)
    answer = list_page(rows, {})
    keys, more = page_of(answer)
    assert len(answer) <= protocol.LIST_PAGE_BYTES + 64 * 1024 + 1024
    assert 0 < len(keys) < 200 and more == {"after": keys[-1]}
    # Read in batches, never the whole page's rows at once.
    assert max(rows.asked) <= 17


def test_a_list_limit_is_checked() -> None:
    with pytest.raises(InvalidInputError):
        list_page(Rows(1), {"limit": -1})
    json.loads(list_page(Rows(0), {}))  # an empty list is a whole answer
