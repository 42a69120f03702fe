"""What a run leaves for its history row (issue #27): the exit status or signal, the tail
of its output (at most output_limit bytes, cut at a character, marked), and one error
line; for exec, python and systemd-unit runs (base.py, command.py, application.py,
systemd/unit.py).  The daemon's side (history --json, logs) is tests/daemon/
test_run_record.py's."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest
from executor_harness import FakeTask, py, run, sh

from perfectschedd.executors import base
from perfectschedd.executors.application import Application
from perfectschedd.executors.base import OutputTail, RunControl, StopReason
from perfectschedd.executors.systemd import unit
from perfectschedd.vocabulary.outcomes import Outcome

LOG = logging.getLogger("test.run_output")
NAME = "perfectsched-k-1357000000.service"


# -- the output tail -------------------------------------------------------------------------

def test_a_short_output_is_kept_whole() -> None:
    assert base.output_tail(b"one\ntwo\n", 8, 64) == "one\ntwo\n"
    assert base.output_tail(b"anything", 8, 0) is None  # output_limit 0: none kept


def test_a_long_output_keeps_its_tail_within_the_limit_marked() -> None:
    data = b"".join(b"line %d\n" % i for i in range(1000))
    got = base.output_tail(data, len(data), 100)
    assert got is not None and len(got.encode()) <= 100
    mark, rest = got.split("\n", 1)
    cut = int(mark.removeprefix("[... ").removesuffix(" bytes cut]"))
    assert cut + len(rest.encode()) == len(data)  # the mark counts what is gone
    assert data.decode().endswith(rest) and rest.endswith("line 999\n")


def test_the_tail_is_cut_at_a_character_and_bad_bytes_are_replaced() -> None:
    data = "é€😀".encode() * 50 + b"\xff\x00end"
    got = base.output_tail(data, len(data), 64)
    assert got is not None and len(got.encode()) <= 64
    text = got.split("\n", 1)[1]
    # Whole characters only (no replacement char for a split one), the invalid byte and
    # the NUL (which PostgreSQL cannot store) replaced.
    assert text.endswith("\ufffd\ufffdend")
    assert set(text[:-5]) <= set("é€😀")


def test_output_of_invalid_bytes_only_stays_within_the_limit() -> None:
    """Each invalid byte becomes a 3-byte replacement character: still at most limit."""
    for size in (10, 30, 64, 500):
        got = base.output_tail(b"\xff" * size, size, 64)
        assert got is not None and len(got.encode()) <= 64 and "\ufffd" in got


def test_the_ring_holds_at_most_twice_the_limit_whatever_the_output() -> None:
    tail = OutputTail(100)
    for i in range(10_000):
        tail.add(b"x" * 37 + b"%d\n" % i)
        assert len(tail.buf) <= 200
    text = tail.text()
    assert text is not None and text.endswith("9999\n") and len(text.encode()) <= 100
    assert OutputTail(100).text() is None  # no output: nothing to show


def test_the_error_is_one_bounded_line() -> None:
    line = base.error_line("exit status 3", "first\nsecond\x00\x1b[31m" + "x" * 1000)
    assert "\n" not in line and "\x00" not in line and "\x1b" not in line
    assert len(line) == base.ERROR_MAX and line.startswith("exit status 3: first second")
    assert base.error_line(None, "", "  ") == ""
    assert base.status_text(-15) == "killed by SIGTERM" and base.status_text(2) == \
        "exit status 2"


# -- exec ---------------------------------------------------------------------------------

def test_exec_success_keeps_stdout_and_stderr_in_order() -> None:
    # Two pipes: their chunks are kept in the order they are read, so each pause must
    # outlast the reader's longest wait for a core (0.1 s did not, once, on a machine
    # running make check beside it).
    result = run(FakeTask(), sh("echo out1; sleep 0.5; echo err1 >&2; sleep 0.5; echo out2"))
    assert result.outcome == Outcome.SUCCESS
    assert (result.status, result.signal, result.error) == (0, None, None)
    assert result.output == "out1\nerr1\nout2\n"


def test_exec_failure_says_the_status_and_the_last_line() -> None:
    # The pauses: two pipes, read in the order their chunks come.
    result = run(FakeTask(), sh("echo connecting; sleep 0.5; echo 'cannot reach db' >&2; "
                                "sleep 0.5; echo; exit 3"))
    assert result.outcome == Outcome.FAILED
    assert (result.status, result.signal) == (3, None)
    assert result.error == "exit status 3: cannot reach db"
    assert result.output == "connecting\ncannot reach db\n\n"


def test_exec_output_is_truncated_at_output_limit() -> None:
    result = run(FakeTask(), sh("seq 1 20000; echo last words >&2; exit 1"), output_limit=256)
    assert result.output is not None and len(result.output.encode()) <= 256
    assert result.output.startswith("[... ") and result.output.endswith("20000\nlast words\n")
    assert result.error == "exit status 1: last words"
    nothing = run(FakeTask(), sh("echo hi; exit 1"), output_limit=0)
    assert nothing.output is None and nothing.error == "exit status 1: hi"


class _Captured(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_exec_output_is_logged_up_to_log_output_limit_then_counted() -> None:
    """Issue 38: the log gets the output's first log_output_limit bytes (stdout and stderr
    together, whole lines), then one line says how much was not logged; what the run
    decides by (its last line, SCHED_LATER) and its tail are read past the cap as before."""
    log = logging.getLogger("test.run_output.cap")
    captured = _Captured()
    log.addHandler(captured)
    log.setLevel(logging.INFO)
    try:
        # 30,000 lines of 6 bytes, a line on stderr, then the protocol's last word.
        result = run(FakeTask(), sh("seq 100001 130000; echo 'last words' >&2; sleep 0.1; "
                                    "echo 'SCHED_LATER 7'"),
                     output_limit=64, log_output_limit=600, log=log)
        nothing = run(FakeTask(), sh("seq 1 1000; exit 2"), log_output_limit=0, log=log)
    finally:
        log.removeHandler(captured)
    assert result.outcome == Outcome.LATER  # the last stdout line, past the cap
    assert result.output is not None and result.output.endswith("last words\nSCHED_LATER 7\n")
    logged = [line for line in captured.lines if line.startswith("job-1: 1")]
    shown = 600 // 7  # whole lines of 7 bytes
    assert logged == [f"job-1: {n}" for n in range(100001, 100001 + shown)]
    total = 30_000 * 7 + len("last words\n") + len("SCHED_LATER 7\n")
    cut = f"job-1: {total - 7 * shown} bytes ({30_000 - shown + 2} lines) of output not " \
        "logged (log_output_limit 600); history keeps its tail"
    assert captured.lines.count(cut) == 1, captured.lines[-5:]
    assert captured.lines.index(cut) > captured.lines.index(logged[-1])
    # log_output_limit 0: nothing of the output, and no line about it; the error still
    # names the last line.
    assert nothing.error == "exit status 2: 1000"
    assert not [line for line in captured.lines if line.startswith("job-1: ") and
                line[7:].isdigit() and int(line[7:]) <= 1000]
    assert len([line for line in captured.lines if "not logged" in line]) == 1


def test_exec_killed_by_a_signal_records_the_signal() -> None:
    result = run(FakeTask(), sh("echo about to die; kill -KILL $$"))
    assert result.outcome == Outcome.FAILED
    assert (result.status, result.signal) == (None, 9)
    assert result.error == "killed by SIGKILL: about to die"


def test_exec_sched_fail_says_so() -> None:
    result = run(FakeTask(), sh("echo quota exceeded; echo SCHED_FAIL"))
    assert result.outcome == Outcome.FAILED
    assert result.error == "SCHED_FAIL (exit status 0): quota exceeded"


def test_exec_timeout_says_after_how_long() -> None:
    result = run(FakeTask(), sh("echo started; sleep 30", timeout=0.3))
    assert result.outcome == Outcome.TIMEOUT
    assert result.signal == 15  # SIGTERM, as the timeout sent
    assert result.error == "timed out after 0.3 s: started"
    assert result.output == "started\n"


def test_exec_stopped_by_a_lost_lease_says_why() -> None:
    control = RunControl()
    threading.Timer(0.3, control.stop, (StopReason.PREEMPTED,)).start()
    result = run(FakeTask(), sh("echo working; sleep 30"), stop_event=control)
    assert result.outcome == Outcome.PREEMPTED
    assert result.error is not None and result.error.startswith("stopped: lease lost")
    assert result.output == "working\n"


def test_exec_that_cannot_start_says_why() -> None:
    handler = sh("true")
    handler = type(handler)(handler.route, ("/nonexistent/prog",), None)
    result = run(FakeTask(), handler)
    assert result.outcome == Outcome.FAILED
    assert result.error == "cannot run /nonexistent/prog: No such file or directory"


# -- python -------------------------------------------------------------------------------

class FailsDeep(Application):
    def run(self) -> None:
        self.connect("db.example")

    def connect(self, host: str) -> None:
        raise ConnectionError(f"cannot reach {host}\nsecond line")


class SleepsForever(Application):
    def run(self) -> None:
        while True:
            time.sleep(0.01)


class Finishes(Application):
    def run(self) -> None:
        self.task.finish()


def test_python_exception_and_traceback_tail_are_recorded() -> None:
    result = run(FakeTask(), py(FailsDeep))
    assert result.outcome == Outcome.FAILED
    assert result.error == "ConnectionError: cannot reach db.example"
    assert (result.status, result.signal) == (None, None)
    assert result.output is not None
    assert "in connect" in result.output and result.output.startswith("Traceback")
    assert result.output.endswith("ConnectionError: cannot reach db.example\nsecond line\n")
    short = run(FakeTask(), py(FailsDeep), output_limit=80)
    assert short.output is not None and len(short.output.encode()) <= 80
    assert short.output.startswith("[... ") and short.output.endswith("second line\n")


def test_python_timeout_records_where_it_was_interrupted() -> None:
    result = run(FakeTask(), py(SleepsForever, timeout=0.2))
    assert result.outcome == Outcome.TIMEOUT
    assert result.error == "timed out after 0.2 s"
    assert result.output is not None and "HandlerTimeout" in result.output


def test_python_success_records_nothing_to_see() -> None:
    result = run(FakeTask(), py(Finishes))
    assert result.outcome == Outcome.SUCCESS
    assert (result.output, result.error) == (None, None)


# -- systemd units --------------------------------------------------------------------------

EXITED, KILLED = 1, 2


@pytest.mark.parametrize("state,last,why,want", [
    ({"Result": "success", "ExecMainCode": EXITED, "ExecMainStatus": 0}, "", None, None),
    ({"Result": "exit-code", "ExecMainCode": EXITED, "ExecMainStatus": 4}, "disk full",
     None, "exit status 4: disk full"),
    ({"Result": "signal", "ExecMainCode": KILLED, "ExecMainStatus": 11}, "", None,
     "killed by SIGSEGV"),
    ({"Result": "exit-code", "ExecMainCode": EXITED, "ExecMainStatus": 1}, "SCHED_FAIL",
     None, "SCHED_FAIL (exit status 1)"),
    ({"Result": "timeout", "ExecMainCode": KILLED, "ExecMainStatus": 15}, "", None,
     "timed out after 2 s"),
    ({"Result": "oom-kill", "ExecMainCode": KILLED, "ExecMainStatus": 9}, "", None,
     f"unit {NAME} was killed: out of memory (OOM, its MemoryMax)"),
    ({"Result": "start-limit-hit"}, "", None, f"unit {NAME} failed: result start-limit-hit"),
    ({"Result": "success", "ExecMainCode": KILLED, "ExecMainStatus": 15}, "", "stop",
     "stopped: daemon stopping"),
])
def test_a_unit_run_records_its_status_and_error(state: dict[str, Any], last: str,
                                                 why: str | None, want: str | None) -> None:
    assert unit.unit_result("k", NAME, state, last, why, None, 2, LOG).error == want
