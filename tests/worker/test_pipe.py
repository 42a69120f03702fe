"""The worker-to-master pipe (worker/pipe.py): every message survives its line, and a line
that is no message is refused: not a ping, said once per worker."""

from __future__ import annotations

import logging

import pytest

from perfectschedd.master.workertable import WorkerProc
from perfectschedd.worker import pipe

MESSAGES = [
    pipe.Ping(3, True, 0.5, False),
    pipe.Ping(0, False, 61.2, True),
    pipe.Ping(2, True),  # without the loop's state
    pipe.Spawning("4242.123456789.1"),
    pipe.Spawned("4242.123456789.1", 4243),
    pipe.UnitStarting("4242.123456789.2", "perfectsched-k-1.service"),
    pipe.Ended("4242.123456789.1"),
    pipe.GaveBack(),
    pipe.GrantDone(),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(msg: pipe.Message) -> None:
    data = pipe.encode(msg.line())
    assert data.endswith(b"\n") and data.count(b"\n") == 1
    assert pipe.parse(data[:-1]) == msg


def test_lines_are_split_where_they_end() -> None:
    buf = bytearray(b"".join(pipe.encode(m.line()) for m in MESSAGES[:2]) + b"s 1.")
    lines, rest = pipe.split_lines(buf)
    assert [pipe.parse(line) for line in lines] == MESSAGES[:2]
    assert rest == b"s 1."


@pytest.mark.parametrize("line", [
    b"", b"x 1.2.3", b"hello", b"g 1.2", b"g 1.2.3 pid", b"s", b"s 1 2", b"e",
    b"3", b"3 2", b"3 1 0.5", b"3 1 fast 0", b"-1 1", b"\xff\xfe 1", b"s \xff",
    b"b 1", b"bb",
])
def test_a_line_that_is_no_message_is_refused(line: bytes) -> None:
    with pytest.raises(pipe.PipeError):
        pipe.parse(line)


def test_an_unknown_line_is_no_ping_and_is_logged_once_per_worker(
        caplog: pytest.LogCaptureFixture) -> None:
    first = WorkerProc(101, 0, 0, -1, -1, started=0.0, last_seen=0.0)
    second = WorkerProc(102, 1, 0, -1, -1, started=0.0, last_seen=0.0)
    with caplog.at_level(logging.ERROR, logger="perfectschedd"):
        first.report(b"hello master", now=5)
        first.report(b"x 1.2.3", now=6)
        second.report(b"hello master", now=7)
    assert (first.pinged, first.last_seen) == (False, 0.0)  # not a sign of life
    said = [r.getMessage() for r in caplog.records if "not a worker message" in r.getMessage()]
    assert said == [
        "worker 0 (pid 101): not a worker message: b'hello master'; ignored (said once per "
        "worker)",
        "worker 1 (pid 102): not a worker message: b'hello master'; ignored (said once per "
        "worker)",
    ]
    first.report(pipe.Ping(1, True, 0.2, False).line().encode(), now=8)
    assert (first.pinged, first.last_seen, first.running) == (True, 8, 1)


def test_the_master_to_worker_bytes_cannot_be_taken_for_each_other() -> None:
    """The wake pipe carries single bytes: a drain is its own byte, never a wake-up, and
    so is the polkit grant's."""
    assert len(pipe.WAKE) == len(pipe.DRAIN) == len(pipe.GRANT) == 1
    assert len({pipe.WAKE, pipe.DRAIN, pipe.GRANT}) == 3
    assert pipe.DRAIN not in pipe.WAKE * 4096
    assert pipe.GRANT not in (pipe.WAKE + pipe.DRAIN) * 4096


def test_a_grant_done_line_ends_the_worker_s_grant_stop() -> None:
    p = WorkerProc(101, 0, 0, -1, -1, started=0.0, last_seen=0.0, grant_pending=True)
    p.report(pipe.GrantDone().line().encode(), now=3)
    assert not p.grant_pending and p.last_seen == 3


def test_a_gave_back_line_asks_the_master_to_wake_the_others() -> None:
    p = WorkerProc(101, 0, 0, -1, -1, started=0.0, last_seen=0.0)
    p.report(pipe.GaveBack().line().encode(), now=3)
    assert p.wake_others and p.last_seen == 3
