"""The host-wide SQLite writer lock: real processes, real flock, real SIGKILL."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from perfectschedd.store.writelock import HostWriteLock


def _hold_and_log(lock: HostWriteLock, log: Path, rounds: int) -> None:
    for _ in range(rounds):
        with lock.held():
            fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            os.write(fd, f"in {os.getpid()} {threading.get_ident()}\n".encode())
            time.sleep(0.0005)  # long enough for another holder to barge in if it could
            os.write(fd, f"out {os.getpid()} {threading.get_ident()}\n".encode())
            os.close(fd)


def test_processes_and_threads_take_turns(tmp_path: Path) -> None:
    db = str(tmp_path / "s.db")
    log = tmp_path / "turns.log"
    children = []
    for _ in range(3):
        pid = os.fork()
        if pid == 0:
            try:
                lock = HostWriteLock(db, 30)  # one per process, as each Store is
                threads = [threading.Thread(target=_hold_and_log, args=(lock, log, 40))
                           for _ in range(2)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
            finally:
                os._exit(0)
        children.append(pid)
    for pid in children:
        assert os.waitpid(pid, 0)[1] == 0
    lines = log.read_text().splitlines()
    assert len(lines) == 3 * 2 * 40 * 2
    for enter, leave in zip(lines[::2], lines[1::2], strict=True):
        assert enter.startswith("in ") and leave == "out " + enter[3:], (enter, leave)


def test_a_killed_holder_releases_the_lock(tmp_path: Path) -> None:
    db = str(tmp_path / "s.db")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            with HostWriteLock(db, 30).held():
                os.write(w, b"x")
                time.sleep(60)
        finally:
            os._exit(0)
    assert os.read(r, 1) == b"x"
    lock = HostWriteLock(db, 30)
    got = threading.Event()

    def take() -> None:
        with lock.held():
            got.set()

    t = threading.Thread(target=take)
    t.start()
    assert not got.wait(0.3)  # the child holds it
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    assert got.wait(5)  # the kernel dropped the dead holder's lock
    t.join()


def test_the_wait_is_bounded(tmp_path: Path) -> None:
    """A holder that never lets go delays the others by `wait`, then SQLite's own busy
    timeout is in charge."""
    db = str(tmp_path / "s.db")
    holder = HostWriteLock(db, 30)
    waiter = HostWriteLock(db, 0.3)
    started = threading.Event()
    release = threading.Event()

    def hold() -> None:
        with holder.held():
            started.set()
            release.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    assert started.wait(5)
    began = time.monotonic()
    with waiter.held():
        waited = time.monotonic() - began
    release.set()
    t.join()
    assert 0.25 < waited < 3


def test_an_unwritable_directory_falls_back_to_sqlite_locking(tmp_path: Path) -> None:
    lock = HostWriteLock(str(tmp_path / "missing-dir" / "s.db"), 1)
    ran = False
    with lock.held():
        ran = True
    assert ran
    assert not (tmp_path / "missing-dir").exists()


def test_root_gives_the_lock_file_to_the_database_owner(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    db = tmp_path / "s.db"
    db.write_bytes(b"")
    os.chown(db, 65534, 65534)
    with HostWriteLock(str(db), 1).held():
        pass
    st = os.stat(f"{db}-writer.lock")
    assert (st.st_uid, st.st_gid) == (65534, 65534)


def test_a_lock_used_across_a_fork_starts_afresh_in_the_child(tmp_path: Path) -> None:
    """The parent holds it (a thread of its own) at the fork; the child still gets it once
    the parent lets go, and does not wait on the parent's thread lock."""
    lock = HostWriteLock(str(tmp_path / "s.db"), 30)
    r, w = os.pipe()
    with lock.held():
        pid = os.fork()
        if pid == 0:
            try:
                began = time.monotonic()
                with lock.held():
                    os.write(w, f"{time.monotonic() - began:.3f}".encode())
            finally:
                os._exit(0)
        time.sleep(0.3)
    waited = float(os.read(r, 32).decode())
    assert os.waitpid(pid, 0)[1] == 0
    assert 0.2 < waited < 5  # it waited for the parent's flock, then got it
