"""Logging: journald priority prefixes under systemd, plain lines otherwise, reopen on USR2.

The first tests configure logging in this process (restored afterwards); the last ones run
a real daemon whose stderr is (or is not) the stream systemd named in JOURNAL_STREAM.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import wait_until

from perfectschedd import logsetup

YEARLY = "0 0 1 1 *"


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        root.removeHandler(h)
        h.close()
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)


def test_log_file_is_reopened_after_rotation(tmp_path: Path, restore_logging: None) -> None:
    path = tmp_path / "d.log"
    logsetup.setup(str(path))
    log = logging.getLogger("perfectschedd.test")
    log.info("before rotation")
    os.rename(path, tmp_path / "d.log.1")
    log.info("still the old file")
    logsetup.reopen()
    log.warning("after rotation")
    logsetup.flush()  # records are written by a writer thread
    old = (tmp_path / "d.log.1").read_text()
    new = path.read_text()
    assert "before rotation" in old and "still the old file" in old
    assert "after rotation" in new and "before rotation" not in new
    assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} WARNING \S+\[\d+\]: after rotation",
                    new), new


def test_lines_name_the_process_and_keep_their_order(tmp_path: Path,
                                                     restore_logging: None) -> None:
    """Many records at once (written in batches) arrive complete and in order, with the
    process name and pid; a forked child logs its own pid."""
    path = tmp_path / "d.log"
    logsetup.setup(str(path))
    logsetup.set_process_name("worker-7")
    log = logging.getLogger("perfectschedd.test")
    for i in range(5000):
        log.info("line %d of %s", i, "many")
    pid = os.fork()
    if pid == 0:  # the child: a new writer thread, its own pid in the lines
        try:
            logsetup.after_fork()
            logsetup.set_process_name("worker-8")
            log.warning("from the child")
            logsetup.shutdown()
        finally:
            os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    logsetup.flush()
    lines = path.read_text().splitlines()
    mine = [line for line in lines if "worker-7[" in line]
    assert len(mine) == 5000
    assert all(line.endswith(f"INFO worker-7[{os.getpid()}]: line {i} of many")
               for i, line in enumerate(mine)), mine[:3]
    assert any(line.endswith(f"WARNING worker-8[{pid}]: from the child") for line in lines)


def test_info_lines_are_the_usual_lines_and_reach_added_handlers(
        tmp_path: Path, restore_logging: None) -> None:
    """logsetup.info (a task's start and end lines) writes what log.info writes, in
    order with the other lines; a handler or filter someone added (a test's capture, an
    application's) still sees its records, and a level above INFO drops them."""
    path = tmp_path / "d.log"
    logsetup.setup(str(path))
    logsetup.set_process_name("worker-3")
    log = logging.getLogger("perfectschedd.test")
    log.info("usual %d", 1)
    logsetup.info(log, "short 1")
    log.info("usual %d", 2)
    seen: list[logging.LogRecord] = []
    extra = logging.Handler()
    extra.emit = seen.append  # type: ignore[method-assign]
    logging.getLogger("perfectschedd").addHandler(extra)
    try:
        logsetup.info(log, "short 2")
    finally:
        logging.getLogger("perfectschedd").removeHandler(extra)
    log.setLevel(logging.WARNING)
    try:
        logsetup.info(log, "dropped")
    finally:
        log.setLevel(logging.NOTSET)
    logsetup.info(log, "short 3")
    logsetup.flush()
    lines = path.read_text().splitlines()
    pid = os.getpid()
    assert [line.split(" ", 2)[2] for line in lines] == [
        f"INFO worker-3[{pid}]: {m}" for m in ("usual 1", "short 1", "usual 2", "short 2",
                                                "short 3")], lines
    assert all(re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} ", line)
               for line in lines), lines
    assert [r.getMessage() for r in seen] == ["short 2"]
    assert seen[0].name == "perfectschedd.test" and seen[0].levelno == logging.INFO


class _RecordingStream:
    """The log file's stream, with the time and text of each write the writer makes."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.writes: list[tuple[float, str]] = []

    def write(self, text: str) -> int:
        self.writes.append((time.monotonic(), text))
        return int(self.stream.write(text))

    def flush(self) -> None:
        self.stream.flush()


def test_a_line_after_a_quiet_moment_goes_out_at_once_and_the_next_ones_together(
        tmp_path: Path, restore_logging: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The writer rests WRITE_PAUSE after a small batch: lines logged meanwhile go out in
    one write, not one each (a thread switch per line in a burst of exec runs); a line
    logged when none was does not wait for the rest."""
    monkeypatch.setattr(logsetup, "WRITE_PAUSE", 3.0)  # far above a loaded machine's stall
    logsetup.setup(str(tmp_path / "d.log"))
    assert isinstance(logsetup._output, logging.StreamHandler)
    stream = _RecordingStream(logsetup._output.stream)
    logsetup._output.stream = stream
    log = logging.getLogger("perfectschedd.test")
    logged = time.monotonic()
    log.info("first")
    wait_until(lambda: len(stream.writes) == 1, 10, what="the first line written")
    assert stream.writes[0][0] - logged < 2.0, "a line after a quiet moment waited"
    log.info("second")
    logsetup.info(log, "third")
    wait_until(lambda: len(stream.writes) == 2, 10, what="the next lines written")
    (first_at, first), (next_at, both) = stream.writes
    assert first.endswith(": first\n") and first.count("\n") == 1, first
    assert both.count("\n") == 2 and ": second\n" in both and both.endswith(": third\n"), both
    assert next_at - first_at >= 3.0 * 0.99  # they waited out the rest, together
    logsetup.flush()
    assert [line.rsplit(": ", 1)[1] for line in (tmp_path / "d.log").read_text().splitlines()] \
        == ["first", "second", "third"]


def test_journal_formatter_prefixes_every_line() -> None:
    fmt = logsetup.JournalFormatter("%(message)s")
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", None,
                                   sys.exc_info())
    text = fmt.format(record)
    lines = text.splitlines()
    assert len(lines) > 2  # message and traceback
    assert all(line.startswith("<3>") for line in lines), text
    for level, prio in ((logging.INFO, 6), (logging.WARNING, 4), (logging.DEBUG, 7),
                        (logging.CRITICAL, 2)):
        rec = logging.LogRecord("x", level, __file__, 1, "m", None, None)
        assert fmt.format(rec) == f"<{prio}>m"


def test_journald_detected_only_when_stderr_is_the_named_stream(
        tmp_path: Path, restore_logging: None) -> None:
    st = os.fstat(sys.stderr.fileno())
    saved = os.environ.get("JOURNAL_STREAM")
    try:
        os.environ["JOURNAL_STREAM"] = f"{st.st_dev}:{st.st_ino}"
        assert logsetup.under_journald()
        os.environ["JOURNAL_STREAM"] = f"{st.st_dev}:{st.st_ino + 1}"  # a child's stderr
        assert not logsetup.under_journald()
        del os.environ["JOURNAL_STREAM"]
        assert not logsetup.under_journald()
    finally:
        if saved is None:
            os.environ.pop("JOURNAL_STREAM", None)
        else:
            os.environ["JOURNAL_STREAM"] = saved


def _start_with_stream(daemon_factory: Any, tmp_path: Path, match: bool) -> Any:
    d = daemon_factory({"routes": [{"type": "broken", "exec": ["/nonexistent/job"],
                                    "user": "root"}]})
    d.log_path.touch()  # the harness appends to it: same inode as the daemon's stderr
    st = d.log_path.stat()
    stream = f"{st.st_dev}:{st.st_ino}" if match else f"{st.st_dev}:{st.st_ino + 12345}"
    d.extra_env = {"JOURNAL_STREAM": stream}
    return d.start()


def test_daemon_under_journald_writes_priority_prefixes(daemon_factory: Any,
                                                        tmp_path: Path) -> None:
    d = _start_with_stream(daemon_factory, tmp_path, match=True)
    victim = d.children()[0]
    os.kill(victim, signal.SIGKILL)  # an error line from the master
    d.wait_log(f"(pid {victim}) died")
    d.ctl("add", "k", "broken", YEARLY, "--at", "0")  # an error line from a worker
    d.wait_log("cannot run /nonexistent/job")
    assert d.stop() == 0
    lines = [line for line in d.log().splitlines() if line]
    assert lines and all(re.match(r"<[0-7]>", line) for line in lines), lines
    assert re.search(r"^<6>master\[\d+\]: ready$", d.log(), re.M)
    assert re.search(rf"^<3>master\[\d+\]: worker \d \(pid {victim}\) died", d.log(), re.M)
    assert re.search(r"^<3>worker-\d\[\d+\]: k: cannot run /nonexistent/job", d.log(), re.M)
    assert not re.search(r"\d{4}-\d\d-\d\d \d\d:", d.log())  # journald adds the time


def test_daemon_not_under_journald_writes_plain_lines(daemon_factory: Any,
                                                      tmp_path: Path) -> None:
    d = _start_with_stream(daemon_factory, tmp_path, match=False)
    assert d.stop() == 0
    log = d.log()
    assert "<6>" not in log
    assert re.search(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO master\[\d+\]: ready$", log,
                     re.M), log


def test_log_option_sends_everything_to_the_file(daemon_factory: Any, tmp_path: Path) -> None:
    logfile = tmp_path / "perfectschedd.log"
    d = daemon_factory({"log": str(logfile),
                        "routes": [{"type": "t", "exec": ["/bin/sh", "-c", "echo hi"],
                                    "user": "root"}]})
    d.start()
    d.ctl("add", "k", "t", YEARLY, "--at", "0")
    wait_until(lambda: logfile.exists() and "outcome=success" in logfile.read_text(),
               what="task lines in the log file")
    assert d.stop() == 0
    text = logfile.read_text()
    assert re.search(r"INFO worker-\d\[\d+\]: start key=k type=t scheduled=\d+ attempt=1 ", text)
    assert re.search(r"INFO worker-\d\[\d+\]: k: hi$", text, re.M)  # the command's output
    assert re.search(r"INFO master\[\d+\]: stopped$", text, re.M)
    assert "start key=k" not in d.log()  # nothing of it on stderr


def test_a_log_path_that_cannot_be_opened_is_one_line_naming_log(daemon_factory: Any,
                                                                  tmp_path: Path) -> None:
    """`log:` in a directory that does not exist: the start stops (exit 1) with one line
    that names the key, the path and why; a reload to it is refused with that line, and
    the daemon logs on where it did."""
    bad = tmp_path / "no" / "such" / "dir" / "x.log"
    why = f"log: {bad}: No such file or directory"
    d = daemon_factory({"log": str(bad)})
    d.start(wait_ready=False)
    assert d.proc is not None and d.proc.wait(20) == 1
    [line] = d.log().splitlines()
    assert " ERROR " in line and line.endswith(f"[{d.proc.pid}]: {why}"), line

    d = daemon_factory().start()
    d.write_config(dict(d.config, log=str(bad)))
    res = d.ctl("reload", check=False)
    assert res.returncode == 1 and res.stderr == (
        f"perfectschedctl: reload rejected, the running configuration stays: {why}\n"), res
    assert d.status()["last_error"] == f"reload: {why}"
    d.ctl("add", "k", "t", YEARLY)  # its log still goes where it went
    d.wait_log("reload failed, keeping the running configuration: " + why)
    assert d.stop() == 0


def test_the_log_file_is_the_daemon_s_user_s_alone(daemon_factory: Any, tmp_path: Path
                                                   ) -> None:
    """It holds jobs' output: not readable by the daemon's group, even when an older
    version (or logrotate's old `create 0640`) made it so."""
    logfile = tmp_path / "perfectschedd.log"
    logfile.write_text("")
    logfile.chmod(0o640)
    d = daemon_factory({"log": str(logfile)}).start()
    assert oct(logfile.stat().st_mode & 0o777) == oct(0o600)
    logfile.rename(tmp_path / "perfectschedd.log.1")
    d.send_signal(signal.SIGUSR2)  # after logrotate: a new file, narrow from the start
    wait_until(logfile.exists, what="the reopened log file")
    assert oct(logfile.stat().st_mode & 0o777) == oct(0o600)
    assert d.stop() == 0
    rotate = (Path(__file__).resolve().parents[1] / "etc" / "logrotate.d" /
              "perfectsched").read_text()
    assert "create 0600 perfectsched perfectsched" in rotate


class _StalledStream:
    """A log output that stops taking lines until released (a stalled journald, a
    terminal's pipe nobody reads); then it writes them to `stream`."""

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.go = threading.Event()
        self.entered = threading.Event()

    def write(self, text: str) -> int:
        self.entered.set()
        self.go.wait()
        return int(self.stream.write(text))

    def flush(self) -> None:
        self.stream.flush()

    def fileno(self) -> int:
        return int(self.stream.fileno())


def test_a_stalled_log_drops_records_past_the_bound_counts_and_says_so(
        tmp_path: Path, restore_logging: None) -> None:
    """Issue 38: records wait for the writer in a queue of at most QUEUE_MAX; past it
    they are dropped, not queued (the thread logging never waits for the log), counted
    (logsetup.dropped(): /metrics), and once the queue drained one line says how many."""
    path = tmp_path / "d.log"
    logsetup.setup(str(path))
    assert isinstance(logsetup._output, logging.StreamHandler)
    stalled = _StalledStream(logsetup._output.stream)
    logsetup._output.stream = stalled
    log = logging.getLogger("perfectschedd.test")
    try:
        log.info("first")
        assert stalled.entered.wait(10)  # the writer is stuck in its write
        before = logsetup.dropped()
        flood = 3 * logsetup.QUEUE_MAX

        def log_flood() -> None:
            for i in range(flood):
                if i % 2:
                    log.info("flood %d", i)
                else:
                    logsetup.info(log, f"flood {i}")

        logger = threading.Thread(target=log_flood)
        logger.start()
        logger.join(60)
        assert not logger.is_alive(), "logging waited for a stalled log"
        queued = logsetup._queue.qsize() if logsetup._queue is not None else 0
        dropped = logsetup.dropped() - before
        assert queued <= logsetup.QUEUE_MAX
        assert dropped == flood - queued >= flood - logsetup.QUEUE_MAX
    finally:
        stalled.go.set()  # the writer goes on, whatever happened
    logsetup.flush()
    wait_until(lambda: "dropped" in path.read_text(), 10, what="the drops' line")
    lines = path.read_text().splitlines()
    written = [line for line in lines if ": flood " in line]
    assert len(written) == queued and written[-1].endswith(f": flood {queued - 1}")
    said = [line for line in lines if "record(s) dropped" in line]
    assert len(said) == 1 and "WARNING " in said[0] and \
        f"[{os.getpid()}]: log: {dropped} record(s) dropped" in said[0], said
    assert lines.index(said[0]) > lines.index(written[-1])  # said once the queue drained


def test_a_fork_does_not_wait_for_a_stalled_log(tmp_path: Path,
                                                restore_logging: None) -> None:
    """The master forks workers: a log write that hangs delays a fork by FORK_WAIT at
    most, and the child writes its lines through a stream of its own."""
    path = tmp_path / "d.log"
    logsetup.setup(str(path))
    assert isinstance(logsetup._output, logging.StreamHandler)
    stalled = _StalledStream(logsetup._output.stream)
    logsetup._output.stream = stalled
    logging.getLogger("perfectschedd.test").info("stuck")
    assert stalled.entered.wait(10)
    children: list[int] = []

    def fork() -> None:  # on a thread: a fork that waits for the log fails, not hangs
        pid = os.fork()
        if pid == 0:
            try:
                logsetup.after_fork()
                logging.getLogger("perfectschedd.test").warning("from the child")
                logsetup.shutdown()
            finally:
                os._exit(0)
        children.append(pid)

    forking = threading.Thread(target=fork)
    forking.start()
    forking.join(getattr(logsetup, "FORK_WAIT", 1.0) + 5)
    try:
        assert children, "the fork waited for the stalled log"
        assert os.waitpid(children[0], 0)[1] == 0
        assert "from the child" in path.read_text()
    finally:
        stalled.go.set()
        forking.join()
    logsetup.flush()
    assert "stuck" in path.read_text()
