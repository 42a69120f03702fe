"""The master's self-pipe: how a signal handler or another thread (control requests,
unit clean-ups, the grant watch) wakes the main loop, which sleeps in select() on the
read end (Supervisor._loop_once).  Writes never block: a full pipe already wakes it."""

from __future__ import annotations

import os


class SelfPipe:
    def __init__(self) -> None:
        self.r, self.w = os.pipe()
        for fd in (self.r, self.w):
            os.set_blocking(fd, False)

    def wake(self, why: bytes) -> None:
        """Safe in a signal handler and from any thread."""
        try:
            os.write(self.w, why)
        except OSError:
            pass

    def empty(self) -> None:
        """Read what woke the loop (it acts on its own state, not on the bytes)."""
        try:
            os.read(self.r, 4096)
        except BlockingIOError:
            pass

    def fds(self) -> list[int]:
        return [self.r, self.w]
