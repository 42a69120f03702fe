"""The process layer of the worker pool: fork with pipes, signal, reap, read pipes.

The supervisor decides (workertable.py) and acts through an object of this shape, which
tests replace with one that records instead of forking (tests/master/test_supervisor.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from perfectschedd.worker import pipe


class Processes:
    def fork(self, child: Callable[[int, int], int]) -> tuple[int, int, int]:
        """Fork a worker running child(wake_r, alive_w) -> exit code; returns (pid,
        wake_w, alive_r), both non-blocking.  The child never returns into our code."""
        wake_r, wake_w = os.pipe()
        try:
            alive_r, alive_w = os.pipe()
        except OSError:
            self.close(wake_r, wake_w)
            raise
        try:
            pid = os.fork()
        except OSError:
            self.close(wake_r, wake_w, alive_r, alive_w)
            raise
        if pid == 0:
            code = 1
            try:
                os.close(wake_w)
                os.close(alive_r)
                code = child(wake_r, alive_w)
            finally:
                os._exit(code)
        os.close(wake_r)
        os.close(alive_w)
        os.set_blocking(wake_w, False)
        os.set_blocking(alive_r, False)
        return pid, wake_w, alive_r

    @staticmethod
    def kill(pid: int, sig: int) -> None:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass

    @staticmethod
    def reap() -> list[tuple[int, int]]:
        """Every child that exited (workers and orphans): (pid, exit code, -signal if
        killed)."""
        done = []
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            done.append((pid, os.waitstatus_to_exitcode(status)))
        return done

    @staticmethod
    def read(fd: int) -> bytes | None:
        """What a worker wrote; b"" if nothing yet, None at EOF (it exited)."""
        try:
            return os.read(fd, 65536) or None
        except BlockingIOError:
            return b""
        except OSError:
            return None

    @staticmethod
    def poke(fd: int) -> None:
        try:
            os.write(fd, pipe.WAKE)
        except OSError:
            pass  # full (it will look anyway) or gone (reaped soon)

    @staticmethod
    def drain(pid: int, fd: int) -> bool:
        """Tell worker `pid` to drain (pipe.DRAIN); False when its pipe is full (try
        again: it reads the pipe within a second)."""
        return _tell(fd, pipe.DRAIN)

    @staticmethod
    def grant(pid: int, fd: int) -> bool:
        """Tell worker `pid` that the polkit grant came on (pipe.GRANT); False when its
        pipe is full (try again)."""
        return _tell(fd, pipe.GRANT)

    @staticmethod
    def close(*fds: int) -> None:
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass


def _tell(fd: int, byte: bytes) -> bool:
    """Write one command byte to a worker's wake pipe; False when the pipe is full."""
    try:
        os.write(fd, byte)
    except BlockingIOError:
        return False
    except OSError:
        pass  # gone: reaped soon
    return True
