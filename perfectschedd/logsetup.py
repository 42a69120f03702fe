"""Logging for the daemon: journald priority prefixes on stderr, or a reopenable file."""

from __future__ import annotations

import logging
import logging.handlers
import os
import queue
import sys
import threading
import time

from perfectschedd.errors import ConfigError

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
        # The log holds jobs' output, which may be secrets of jobs that run as root or
        # another user: the daemon's user alone reads it, not its group (whose members
        # may only control the daemon).  A file we own is narrowed if it was wider.
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            st = os.fstat(fd)
            if st.st_uid == os.geteuid() and st.st_mode & 0o077:
                os.fchmod(fd, st.st_mode & 0o700)
        except OSError:
            pass
        return open(fd, "a", buffering=1, encoding="utf-8")  # noqa: SIM115

    def reopen(self) -> None:
        with self._reopen_lock:
            new = self._open()
            old, self.stream = self.stream, new
            old.close()


_PLAIN = "%(asctime)s %(levelname)s %(processName)s[%(process)d]: %(message)s"
_JOURNAL = "%(processName)s[%(process)d]: %(message)s"


def setup(log_path: str | None, level: int = logging.INFO) -> None:
    """(Re)configure the root logger; called by the master and again on reload.  A log
    file that cannot be opened is a ConfigError naming `log:` and the logging in place
    stays (its line goes where the lines went)."""
    handler: logging.Handler
    if log_path:
        try:
            handler = ReopenableFileHandler(log_path)
        except OSError as exc:
            raise ConfigError(f"log: {log_path}: {exc.strerror or exc}") from None
        handler.setFormatter(_CachedTimeFormatter(_PLAIN))
    elif under_journald():
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(JournalFormatter(_JOURNAL))
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_CachedTimeFormatter(_PLAIN))
    shutdown()
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
        h.close()
    # LogRecord fields no daemon format uses, each computed per record otherwise (a stack
    # walk for the caller, os.getpid() and friends; the process fields are filled from
    # cached values by _Enqueue): a fifth of the cost of a line.
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    global _output
    _output = handler
    _start_listener()
    root.setLevel(level)


# Records go through a queue to one writer thread: task threads logging their start and
# end lines would otherwise queue up on the output handler's lock (a convoy that cost a
# third of a worker's time in a burst).  The writer takes whatever has queued up and
# writes it with one flush: one system call per batch, not per line.
_output: logging.Handler | None = None
_listener: _Writer | None = None
_queue: queue.SimpleQueue[logging.LogRecord | None] | None = None
_process_name = "MainProcess"
_pid = os.getpid()
WRITE_BATCH = 512  # most records written with one flush
# The writer's rest after a batch smaller than WRITE_BATCH, in seconds: lines logged
# meanwhile wait at most this long, and go out together.
WRITE_PAUSE = 0.005
# The most records waiting for the writer.  Past it, records are dropped, not queued: a log
# that cannot keep up (a stalled journald, a terminal's stderr pipe nobody reads, a flood of
# lines) must cost neither memory without bound nor the time of the thread that logs (a
# job's output reader, the master's loop).  The drops are counted (dropped(): /metrics)
# and said in one line once the queue drained.  10,000 records are a few MB.
QUEUE_MAX = 10_000
# Records this process dropped since it started (a forked child counts its own from 0).
# Incremented without a lock: `+= 1` on a global is not interrupted by another thread or a
# signal handler (CPython switches threads at calls and jumps), and a lock here could be
# held by the very thread a signal handler that logs interrupts.
_dropped = 0
# How long a fork waits for a log write in progress (_before_fork): a stalled log output
# must not stall the master's loop, which forks workers.
FORK_WAIT = 1.0


def dropped() -> int:
    """Log records this process dropped (its queue was full) since it started or forked."""
    return _dropped


def _offer(q: queue.SimpleQueue[logging.LogRecord | None], record: logging.LogRecord) -> None:
    """Queue a record for the writer, or drop it (counted) when QUEUE_MAX wait already.
    qsize() is read without a lock: threads logging at the same instant may each add one
    past the bound, no more."""
    global _dropped
    if q.qsize() >= QUEUE_MAX:
        _dropped += 1
        return
    q.put(record)


class _Enqueue(logging.handlers.QueueHandler):
    """The root logger's only handler: records are completed here and formatted by the
    writer thread."""

    def enqueue(self, record: logging.LogRecord) -> None:
        _offer(self.queue, record)  # type: ignore[arg-type]

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        if record.exc_info or record.exc_text or record.stack_info:
            record = super().prepare(record)  # the traceback, formatted now
        else:
            # Merge the arguments now (they may change once the call returns).  No copy
            # as QueueHandler makes: this is the record's only handler, and a copy per
            # record showed in the burst profile.
            record.msg = record.getMessage()
            record.args = None
        # Cached: os.getpid() per record is a system call.
        record.process = _pid
        record.processName = _process_name
        return record


class _CachedTimeFormatter(logging.Formatter):
    """formatTime once per second of wall time, not per record."""

    def __init__(self, fmt: str) -> None:
        super().__init__(fmt)
        self._second = -1
        self._prefix = ""

    def format(self, record: logging.LogRecord) -> str:
        # A plain line (no arguments left, no traceback) the short way: logging's own
        # format() asks the style whether it uses the time, and looks the fields up
        # twice, for each line.
        if record.args or record.exc_info or record.exc_text or record.stack_info \
                or not isinstance(record.msg, str):
            return super().format(record)
        record.message = record.msg
        record.asctime = self.formatTime(record)
        return self._fmt % record.__dict__  # type: ignore[operator]

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        second = int(record.created)
        if second != self._second:
            self._second = second
            self._prefix = time.strftime(self.default_time_format,
                                         self.converter(record.created))
        return f"{self._prefix},{int(record.msecs):03d}"


class _Writer:
    """The thread writing queued records in order.  It also reopens the file or signals
    a flush when it reaches the marker record for it, so neither overtakes records
    logged before."""

    def __init__(self, q: queue.SimpleQueue[logging.LogRecord | None],
                 output: logging.Handler) -> None:
        self.queue = q
        self.output = output
        self.reported = _dropped  # drops said in the log so far
        self.thread = threading.Thread(target=self._run, name="log-writer", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.queue.put(None)
        self.thread.join()

    def _run(self) -> None:
        while True:
            batch = [self.queue.get()]
            while len(batch) < WRITE_BATCH:
                try:
                    batch.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            if not self._write(batch):
                return
            if len(batch) < WRITE_BATCH:
                self._say_dropped()
                # Let the next lines gather: woken by each record, the writer cost a burst
                # of exec runs a thread switch (and a GIL hand-over) per line.  A line
                # logged when none was for WRITE_PAUSE is still written at once.
                time.sleep(WRITE_PAUSE)

    def _write(self, batch: list[logging.LogRecord | None]) -> bool:
        """Write a batch; False once the stop sentinel was reached."""
        lines: list[str] = []
        for record in batch:
            if record is None:
                self._emit(lines)
                return False
            action = getattr(record, "perfectsched_action", None)
            if action is None:
                if record.levelno >= self.output.level:
                    lines.append(self.output.format(record))
                continue
            self._emit(lines)
            lines = []
            if action == "reopen":
                if isinstance(self.output, ReopenableFileHandler):
                    self.output.reopen()
            else:
                action.set()  # a flush() waiting for everything before it
        self._emit(lines)
        return True

    def _say_dropped(self) -> None:
        """Once the queue drained: one line for the records dropped since the last one.
        (The queue may have filled during the write that emptied it: then later.)"""
        count = _dropped - self.reported
        if count <= 0 or self.queue.qsize():
            return
        self.reported += count
        record = logging.LogRecord(
            "perfectschedd", logging.WARNING, "", 0,
            f"log: {count} record(s) dropped: the log output did not keep up ({QUEUE_MAX} "
            "records waiting); /metrics counts them (perfectsched_log_records_dropped_total)",
            None, None)
        record.process = _pid
        record.processName = _process_name
        if record.levelno >= self.output.level:
            self._emit([self.output.format(record)])

    def _emit(self, lines: list[str]) -> None:
        if not lines:
            return
        out = self.output
        try:
            assert isinstance(out, logging.StreamHandler)
            with out.lock:  # type: ignore[union-attr]
                out.stream.write("\n".join(lines) + "\n")
                out.stream.flush()
        except Exception as exc:  # noqa: BLE001 - like logging's handleError: never kill the writer
            sys.stderr.write(f"perfectschedd: cannot write {len(lines)} log line(s): {exc}\n")


_held_at_fork: logging.Handler | None = None
_busy_at_fork = False  # a write was in progress at the fork: the child needs a new stream


def _before_fork() -> None:
    # A fork in the middle of the writer's write() would leave the child a stream whose
    # internal lock is held by a thread that does not exist there: every line the
    # child writes would fail.  So no fork happens while a batch is being written, unless
    # the write hangs (a stalled output): then the fork goes on, and the child writes
    # through a stream of its own (after_fork).
    global _held_at_fork, _busy_at_fork
    _held_at_fork = None
    _busy_at_fork = False
    if _output is not None:
        if _output.lock is not None and _output.lock.acquire(timeout=FORK_WAIT):
            _held_at_fork = _output
        else:
            _busy_at_fork = True


def _after_fork_in_parent() -> None:
    global _held_at_fork
    if _held_at_fork is not None and _held_at_fork.lock is not None:
        _held_at_fork.lock.release()
    _held_at_fork = None


# In the child, logging itself gives every handler a fresh lock (registered before ours).
os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent)


def _start_listener() -> None:
    global _listener, _queue, _handler
    assert _output is not None
    _queue = queue.SimpleQueue()
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    _handler = _Enqueue(_queue)  # type: ignore[arg-type]
    root.addHandler(_handler)
    _listener = _Writer(_queue, _output)


_handler: _Enqueue | None = None
_template: dict[str, object] | None = None  # the fields of an INFO record, as info() fills


def _only_our_handler(logger: logging.Logger) -> bool:
    """Whether a record of `logger` reaches our queue handler alone, unfiltered (no test
    capture, no handler or filter added by an application)."""
    c: logging.Logger | None = logger
    while c is not None:
        if c.filters or c.disabled:
            return False
        if c.handlers:
            return c.parent is None and c.handlers == [_handler] and not c.handlers[0].filters
        if not c.propagate:
            return False
        c = c.parent
    return False


def info(logger: logging.Logger, msg: str) -> None:
    """`logger.info(msg)` of a line formatted by the caller, for the lines every run logs
    (a task's start and end).  When nothing but our own handler would see the record, it
    is built from a template and queued for the writer directly: a third of the cost of
    the logging module's way (its record constructor, handler lock and filters), which a
    burst paid twice per task on the task threads."""
    q = _queue
    if q is None or not logger.isEnabledFor(logging.INFO) or not _only_our_handler(logger):
        logger.info("%s", msg)
        return
    global _template
    if _template is None:
        _template = dict(logging.LogRecord("", logging.INFO, "", 0, "", None, None).__dict__)
    record = logging.LogRecord.__new__(logging.LogRecord)
    fields = record.__dict__
    fields.update(_template)
    now = time.time()
    fields["name"] = logger.name
    fields["msg"] = msg
    fields["created"] = now
    fields["msecs"] = int((now - int(now)) * 1000) + 0.0
    fields["relativeCreated"] = (now - logging._startTime) * 1000
    fields["process"] = _pid
    fields["processName"] = _process_name
    _offer(q, record)


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
    global _listener, _pid, _dropped
    _pid = os.getpid()
    _dropped = 0  # the parent's drops are the parent's (/metrics sums the processes)
    if _output is None:
        return
    if _busy_at_fork:
        _new_stream(_output)
    _listener = None  # its thread and queue belong to the parent
    _start_listener()


def _new_stream(handler: logging.Handler) -> None:
    """The child of a fork made during a hung write: the stream's own lock stays held by
    the parent's writer, so the child writes through another file object, on another
    descriptor of the same file or pipe."""
    if isinstance(handler, ReopenableFileHandler):
        handler.stream = handler._open()
    elif isinstance(handler, logging.StreamHandler):
        fd = os.dup(handler.stream.fileno())
        handler.stream = open(fd, "w", buffering=1, encoding="utf-8",  # noqa: SIM115
                              errors="backslashreplace")


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
    """The name log lines carry (%(processName)s): master, worker-N."""
    global _process_name
    _process_name = name
