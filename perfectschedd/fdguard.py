"""Accepting connections when the process runs out of file descriptors.

accept() failing with EMFILE leaves the client in the listen backlog, so the listening
socket stays readable and a selector loop spins on it (a local user with enough
connections made ours log 90,000 lines in 5 s).  The usual remedy: keep one descriptor
in reserve; when accept() fails, give the reserve up, accept the waiting client and close
it at once (it sees a closed connection, not a hang), take the reserve back, pause a
little, and log once a second at most.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import time

EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
PAUSE = 0.05  # after shedding: let descriptors free up rather than spin
LOG_EVERY = 1.0


class AcceptGuard:
    def __init__(self, what: str, log: logging.Logger) -> None:
        self.what = what
        self.log = log
        self.reserve: int | None = self._take()
        self.last_log = 0.0
        self.shed = 0  # clients closed unserved since the last log line

    @staticmethod
    def _take() -> int | None:
        try:
            return os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None

    def exhausted(self, listener: socket.socket, exc: OSError) -> bool:
        """Call when accept() raised `exc`; True if it was descriptor exhaustion (handled:
        one waiting client closed, a short pause taken), False for any other error.
        It accepts on `listener` itself: call it only after select() saw a client, or
        with a non-blocking listener, or it waits for the next client."""
        if exc.errno not in EXHAUSTED:
            return False
        if self.reserve is not None:
            os.close(self.reserve)
            self.reserve = None
        try:
            client, _ = listener.accept()
            client.close()
            self.shed += 1
        except OSError:
            pass
        self.reserve = self._take()
        now = time.monotonic()
        if now - self.last_log >= LOG_EVERY:
            self.last_log = now
            self.log.error("%s: out of file descriptors (%s); closed %d waiting "
                           "connection(s) unserved", self.what, exc.strerror, self.shed)
            self.shed = 0
        time.sleep(PAUSE)
        return True

    def close(self) -> None:
        if self.reserve is not None:
            os.close(self.reserve)
            self.reserve = None
