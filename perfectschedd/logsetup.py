"""Logging for the daemon: journald priority prefixes on stderr, or a reopenable file."""

from __future__ import annotations

import logging
import logging.handlers
import os
import queue
import sys
import threading

# syslog priorities of sd-daemon(3), as journald reads them from a "<N>" line prefix.
_PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3,
             logging.CRITICAL: 2}


def under_journald() -> bool:
    """True when stderr is connected to the journal (systemd sets JOURNAL_STREAM)."""
    stream = os.environ.get("JOURNAL_STREAM", "")
    if not stream:
        return False
    try:
        st = os.fstat(sys.stderr.fileno())
    except (OSError, ValueError):
        return False
    return stream == f"{st.st_dev}:{st.st_ino}"


class JournalFormatter(logging.Formatter):
    """`<6>message`: journald adds time, host and unit itself."""

    def format(self, record: logging.LogRecord) -> str:
        prio = _PRIORITY.get(record.levelno, 6)
        text = super().format(record)
        return "\n".join(f"<{prio}>{line}" for line in text.splitlines() or [""])


class ReopenableFileHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A log file that `reopen()` (SIGUSR2, after logrotate) opens again by name."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._reopen_lock = threading.Lock()
        super().__init__(self._open())

    def _open(self):  # type: ignore[no-untyped-def]
        return open(self.path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115

    def reopen(self) -> None:
        with self._reopen_lock:
            new = self._open()
            old, self.stream = self.stream, new
            old.close()


_PLAIN = "%(asctime)s %(levelname)s %(processName)s[%(process)d]: %(message)s"
_JOURNAL = "%(processName)s[%(process)d]: %(message)s"


def setup(log_path: str | None, level: int = logging.INFO) -> None:
    """(Re)configure the root logger; called by the master and again on reload."""
    shutdown()
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
        h.close()
    handler: logging.Handler
    if log_path:
        handler = ReopenableFileHandler(log_path)
        handler.setFormatter(logging.Formatter(_PLAIN))
    elif under_journald():
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(JournalFormatter(_JOURNAL))
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(_PLAIN))
    global _output
    _output = handler
    _start_listener()
    root.setLevel(level)


# Records go through a queue to one writer thread: task threads logging their start and
# end lines would otherwise queue up on the output handler's lock (a convoy that cost a
# third of a worker's time in a burst).
_output: logging.Handler | None = None
_listener: logging.handlers.QueueListener | None = None
_queue: queue.SimpleQueue[logging.LogRecord] | None = None


class _Writer(logging.handlers.QueueListener):
    """Writes records in order; also reopens the file or signals a flush when the queue
    reaches the marker record for it, so neither overtakes records logged before."""

    def handle(self, record: logging.LogRecord) -> None:
        action = getattr(record, "perfectsched_action", None)
        if action is None:
            super().handle(record)
        elif action == "reopen":
            if isinstance(_output, ReopenableFileHandler):
                _output.reopen()
        else:
            action.set()  # a flush() waiting for everything before it


def _start_listener() -> None:
    global _listener, _queue
    assert _output is not None
    _queue = queue.SimpleQueue()
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(logging.handlers.QueueHandler(_queue))
    _listener = _Writer(_queue, _output)
    _listener.start()


def _mark(action: object) -> bool:
    if _queue is None or _listener is None:
        return False
    # SimpleQueue.put is reentrant: reopen() is called from a signal handler.
    _queue.put(logging.makeLogRecord({"perfectsched_action": action}))
    return True


def flush(timeout: float = 5.0) -> None:
    """Wait until every record logged so far is written."""
    done = threading.Event()
    if _mark(done):
        done.wait(timeout)


def after_fork() -> None:
    """In a forked child: the writer thread did not survive the fork; start a new one."""
    global _listener
    if _output is None:
        return
    _listener = None  # its thread and queue belong to the parent
    _start_listener()


def shutdown() -> None:
    """Write what is queued and stop the writer thread (before exit)."""
    global _listener
    if _listener is not None:
        listener, _listener = _listener, None
        listener.stop()


def reopen() -> None:
    """Reopen the log file (SIGUSR2), after the records logged before it are written."""
    if not _mark("reopen") and isinstance(_output, ReopenableFileHandler):
        _output.reopen()


def set_process_name(name: str) -> None:
    import multiprocessing

    multiprocessing.current_process().name = name
