"""One SQLite writer at a time on this host, handed over without SQLite's busy sleeps.

SQLite lets one connection write at a time; the others wait in its busy handler, which
sleeps 1, 2, 5, 10, 15, 20, 25 ... ms between tries whatever the writer does.  In a
burst each transaction takes about a millisecond, so two workers taking turns spent a
third of their time asleep with the lock free.  Writers of this code therefore queue on
an flock(2) of a file next to the database first: it is polled with sleeps of 50 us
growing to 0.2 ms (so the next writer starts within about that of the last one's commit),
the kernel drops it when its holder dies, and the wait is bounded like SQLite's own.
Writers that do not take it (the sqlite3 shell, other programs) are still kept out by
SQLite's lock; they only miss the fast hand-over.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

FIRST_SLEEP = 0.00005
LONGEST_SLEEP = 0.0002


class HostWriteLock:
    """Serialises the write transactions of every process (and thread) on this host that
    uses the same database file.  Opened lazily per process: a descriptor must not be
    shared across a fork (flock belongs to the open file, not the process)."""

    def __init__(self, database_path: str, wait: float) -> None:
        self.database = database_path
        self.path = f"{database_path}-writer.lock"
        self.wait = wait
        self._threads = threading.Lock()
        self._fd: int | None = None
        self._pid = os.getpid()
        self._unusable = False
        # Called now and then while waiting: a worker proves it is alive (waiting on a
        # peer that froze with the lock is not being stuck; the peer gets killed).
        self.while_waiting: Callable[[], None] | None = None

    def _descriptor(self) -> int | None:
        if self._fd is None and not self._unusable:
            try:
                self._fd = self._open()
            except OSError:
                self._unusable = True  # e.g. a read-only directory: SQLite's lock alone
        return self._fd

    def _open(self) -> int:
        try:
            return os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            pass
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o660)
        except FileExistsError:  # another process made it just now
            return os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
        if os.geteuid() == 0:
            # As SQLite does for its -wal and -shm files: root (perfectschedctl -c run by
            # an admin) must not leave a file the daemon's own user cannot open.
            try:
                st = os.stat(self.database)
                os.fchown(fd, st.st_uid, st.st_gid)
            except OSError:
                pass
        return fd

    @contextmanager
    def held(self) -> Iterator[None]:
        """Hold the lock, or give up after `wait` seconds and let SQLite's own busy
        timeout decide (a holder stuck that long is the database's problem to report)."""
        if self._pid != os.getpid():  # used after a fork: nothing of the parent's
            self._threads = threading.Lock()
            self._fd, self._pid, self._unusable = None, os.getpid(), False
        if not self._threads.acquire(timeout=self.wait):
            yield
            return
        try:
            fd = self._descriptor()
            locked = fd is not None and self._acquire(fd)
            try:
                yield
            finally:
                if locked:
                    assert fd is not None
                    fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            self._threads.release()

    def _acquire(self, fd: int) -> bool:
        deadline = time.monotonic() + self.wait
        sleep = FIRST_SLEEP
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    return False
                if self.while_waiting is not None:
                    self.while_waiting()
                time.sleep(sleep)
                sleep = min(sleep * 2, LONGEST_SLEEP)
            except OSError:
                return False  # a file system without flock: SQLite's lock alone
