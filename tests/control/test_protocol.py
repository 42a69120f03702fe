"""control/protocol.py: newline-delimited JSON frames, their limits, and the clear
ProtocolError every bad frame gets.  Also over a real socket pair, as the daemon reads."""

from __future__ import annotations

import json
import socket
from typing import Any

import pytest

from perfectschedd.control import protocol
from perfectschedd.control.protocol import (
    MAX_DEPTH,
    MAX_FRAME,
    ProtocolError,
    RemoteError,
    encode,
    error,
    error_type,
    loads_bounded,
    ok,
    ok_page,
    parse_request,
    parse_request_from,
    parse_response,
    parse_response_full,
    request,
)
from perfectschedd.errors import InvalidInputError, NotFoundError


def test_a_frame_is_one_line_of_compact_json() -> None:
    frame = request("add", {"key": "a\nb", "data": {"x": [1, 2]}}, client="0.2.0")
    assert frame.endswith(b"\n") and frame.count(b"\n") == 1  # newlines in values escaped
    assert b" " not in frame
    assert json.loads(frame) == {"cmd": "add", "args": {"key": "a\nb", "data": {"x": [1, 2]}},
                                 "client": "0.2.0"}
    assert parse_request_from(frame) == ("add", {"key": "a\nb", "data": {"x": [1, 2]}},
                                         "0.2.0")
    # Without a client version (a 0.1.0 daemon refuses the field).
    bare = request("list")
    assert json.loads(bare) == {"cmd": "list", "args": {}}
    assert parse_request_from(bare) == ("list", {}, None)
    assert parse_request(bare) == ("list", {})


def test_encode_refuses_nan_and_infinity() -> None:
    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(ValueError):
            encode({"x": bad})
    with pytest.raises(TypeError):
        encode({"x": object()})


def test_responses_round_trip() -> None:
    assert parse_response(ok([1, {"a": None}])) == [1, {"a": None}]
    assert parse_response_full(ok("x")) == {"result": "x", "more": None}
    page = ok_page([protocol.encode_item({"key": "a"}), protocol.encode_item({"key": "b"})],
                   "b")
    assert page.endswith(b"}\n") and page.count(b"\n") == 1
    assert parse_response_full(page) == {"result": [{"key": "a"}, {"key": "b"}],
                                         "more": {"after": "b"}}
    assert parse_response_full(ok_page([], None)) == {"result": [], "more": None}


def test_errors_come_back_as_remote_errors_with_type_and_version() -> None:
    with pytest.raises(RemoteError) as info:
        parse_response(error("NotFoundError", "no schedule 'x'", daemon="0.2.0"))
    assert info.value.type == "NotFoundError"
    assert str(info.value) == "no schedule 'x'"
    assert info.value.daemon == "0.2.0"
    with pytest.raises(RemoteError) as old:
        parse_response(b'{"ok":false,"error":{"type":"Busy","message":"later"}}\n')
    assert old.value.daemon is None and old.value.type == "Busy"


def test_error_frames_are_one_bounded_line_of_a_known_type() -> None:
    msg = json.loads(error("NoSuchType", "first line\nsecond line\n" + "x" * 10))
    assert msg["error"] == {"type": "InternalError", "message": "first line"}
    long = json.loads(error("InvalidInputError", "y" * 5000))
    assert long["error"]["message"] == "y" * 2000
    assert json.loads(error("Busy", "   "))["error"]["message"] == "error"
    assert "daemon" not in json.loads(error("Busy", "x"))


def test_error_type_names_the_nearest_known_base() -> None:
    assert error_type(NotFoundError("x")) == "NotFoundError"
    assert error_type(InvalidInputError("key", "bad")) == "InvalidInputError"

    class Sub(NotFoundError):
        pass

    assert error_type(Sub("x")) == "NotFoundError"
    assert error_type(KeyError("x")) == "InternalError"
    assert error_type(ProtocolError("x")) == "ProtocolError"
    assert protocol.refusal("NotFoundError").dbus_name == \
        "org.perfectsched1.Error.NotFoundError"
    assert protocol.refusal("Nonsense") == protocol.REFUSALS["InternalError"]


BAD_REQUESTS: list[tuple[bytes, str]] = [
    (b"", "invalid JSON"),
    (b"not json", "invalid JSON"),
    (b'{"cmd": "list"', "invalid JSON"),
    (b"\xff\xfe{}", "invalid JSON"),
    (b'{"cmd": "add", "args": {"grace": NaN}}', "invalid JSON"),
    (b'{"cmd": "add", "args": {"grace": Infinity}}', "invalid JSON"),
    (b'{"cmd": "add", "args": {"grace": -Infinity}}', "invalid JSON"),
    (b"[]", "must be a JSON object"),
    (b'"list"', "must be a JSON object"),
    (b"null", "must be a JSON object"),
    (b'{"cmd": "list", "extra": 1}', "unknown field(s) extra"),
    (b'{"args": {}}', "'cmd' must be a non-empty string"),
    (b'{"cmd": ""}', "'cmd' must be a non-empty string"),
    (b'{"cmd": 5}', "'cmd' must be a non-empty string"),
    (b'{"cmd": "list", "args": []}', "'args' must be an object"),
    (b'{"cmd": "list", "args": "x"}', "'args' must be an object"),
    (b'{"cmd": "list", "client": 2}', "'client' must be a version string"),
    (b'{"cmd": "list", "client": ""}', "'client' must be a version string"),
    (b'{"cmd": "list", "client": "' + b"9" * 41 + b'"}', "'client' must be a version string"),
]


@pytest.mark.parametrize(("frame", "reason"), BAD_REQUESTS,
                         ids=[f[:30].decode("latin-1") for f, _ in BAD_REQUESTS])
def test_bad_requests_get_a_clear_protocol_error(frame: bytes, reason: str) -> None:
    with pytest.raises(ProtocolError) as info:
        parse_request_from(frame)
    assert reason in str(info.value)
    assert "\n" not in str(info.value)


def test_args_null_means_no_arguments() -> None:
    assert parse_request(b'{"cmd": "list", "args": null}') == ("list", {})


def test_frame_size_limit() -> None:
    filler = b'{"cmd":"add","args":{"data":"'
    tail = b'"}}'
    exact = filler + b"x" * (MAX_FRAME - len(filler) - len(tail)) + tail
    assert len(exact) == MAX_FRAME
    cmd, args = parse_request(exact)
    assert cmd == "add" and len(args["data"]) == MAX_FRAME - len(filler) - len(tail)
    with pytest.raises(ProtocolError, match=f"larger than {MAX_FRAME} bytes"):
        parse_request(exact[:-3] + b'x"}}')


def nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


def test_nesting_limit() -> None:
    # args is level 2 of the request; nested(n) adds n levels.  The request may hold
    # data of MAX_DEPTH levels inside add_many's list (REQUEST_ENVELOPE), so that deeper
    # data is refused by the schedule's check, naming `data`.
    limit = MAX_DEPTH + protocol.REQUEST_ENVELOPE
    ok_frame = encode({"cmd": "add", "args": {"data": nested(limit - 2)}})
    assert parse_request(ok_frame)[0] == "add"
    deep = encode({"cmd": "add", "args": {"data": nested(limit - 1)}})
    with pytest.raises(ProtocolError, match=f"nested deeper than {limit} levels"):
        parse_request(deep)
    # Far deeper than the interpreter's recursion limit: still a ProtocolError.
    very = b'{"cmd":"x","args":{"a":' + b"[" * 200_000 + b"]" * 200_000 + b"}}"
    with pytest.raises(ProtocolError, match="nested deeper than"):
        parse_request(very)


def test_json_depth_counts_iteratively_and_stops_past_the_limit() -> None:
    assert protocol.json_depth(1) == 0
    assert protocol.json_depth({}) == 1
    assert protocol.json_depth({"a": [1, {"b": []}]}) == 4
    assert protocol.json_depth(nested(10_000), limit=5) == 6


def test_loads_bounded_names_what_it_read() -> None:
    with pytest.raises(ProtocolError, match="^answer: invalid JSON"):
        loads_bounded(b"{", what="answer")
    assert loads_bounded('{"a": 1}') == {"a": 1}


BAD_RESPONSES = [b"", b"garbage", b"[]", b'{"result": 1}', b"\xff"]


@pytest.mark.parametrize("frame", BAD_RESPONSES)
def test_bad_responses_are_protocol_errors(frame: bytes) -> None:
    with pytest.raises(ProtocolError, match="invalid response from the daemon"):
        parse_response(frame)


def test_malformed_error_responses_still_raise_remote_error() -> None:
    with pytest.raises(RemoteError) as a:
        parse_response(b'{"ok": false, "error": "plain text", "daemon": 3}')
    assert (a.value.type, str(a.value), a.value.daemon) == ("InternalError", "plain text",
                                                             None)
    with pytest.raises(RemoteError) as b:
        parse_response(b'{"ok": false}')
    assert (b.value.type, str(b.value)) == ("InternalError", "error")


def test_versions_note() -> None:
    assert protocol.versions_note("0.2.0", "0.2.0") == ""
    note = protocol.versions_note("0.3.0", None)
    assert "perfectschedctl 0.3.0" in note and "perfectschedd older than 0.2.0" in note


def test_many_frames_over_a_real_socket_are_split_on_newlines() -> None:
    a, b = socket.socketpair()
    with a, b:
        frames = [request("list"), request("show", {"key": "k"}, client="0.2.0"),
                  request("add", {"key": "x", "data": {"s": "line\nbreak"}})]
        a.sendall(b"".join(frames))
        a.shutdown(socket.SHUT_WR)
        received = b""
        while chunk := b.recv(7):  # small reads: frames arrive in pieces
            received += chunk
    lines = received.split(b"\n")
    assert lines[-1] == b""
    assert [parse_request(line) for line in lines[:-1]] == [
        ("list", {}), ("show", {"key": "k"}),
        ("add", {"key": "x", "data": {"s": "line\nbreak"}})]
