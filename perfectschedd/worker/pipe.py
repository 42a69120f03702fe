"""The lines a worker writes to its master (the `alive` pipe): the one place their format
lives.  The worker writes them (worker/process.py, worker/runs.py), the master parses
them (master/workertable.py).

One line per message, ASCII words separated by spaces, ended by a newline; each is
written with one os.write, shorter than PIPE_BUF, so lines of different threads never mix.

    RUNNING DB_OK LOOP_AGE IN_DB   a ping (RUNNING DB_OK alone: a ping without its loop's
                                   state, as tests and older workers write it)
    s RUN                          an exec run is about to spawn
    g RUN PGID                     it spawned as process group PGID
    u RUN UNIT                     it is about to start systemd unit UNIT
    e RUN                          it ended
    b                              it drains and gave back occurrences it had claimed
                                   but not started: the other workers should look now
    n                              after GRANT: none of its runs runs as the daemon's
                                   user any more

A line that is none of these is refused (PipeError): it is not a ping, and the master
says so once per worker.

The other way, the master writes single bytes to a worker's `wake` pipe:

    WAKE  (w)   look for due work now
    DRAIN (d)   a reload: claim nothing more, give back what waits, run the running
                jobs to their end, then exit
    GRANT (g)   the polkit grant came on: stop every run that runs as the daemon's user
                (they may not, docs/security.md), then drain

A byte, not a signal: INT, HUP and USR1 may reach the whole process group (a Ctrl-C, a
`kill -HUP -PGID`), so workers ignore them; a byte in its own pipe reaches one worker
and only from its master.
"""

from __future__ import annotations

from dataclasses import dataclass


class PipeError(ValueError):
    """A line that is not one of the worker's messages."""


@dataclass(frozen=True)
class Ping:
    running: int
    db_ok: bool
    loop_age: float | None = None  # seconds since the worker's main loop last turned
    in_db: bool | None = None      # its main loop is inside a database call

    def line(self) -> str:
        if self.loop_age is None or self.in_db is None:
            return f"{self.running} {int(self.db_ok)}"
        return f"{self.running} {int(self.db_ok)} {self.loop_age:.1f} {int(self.in_db)}"


@dataclass(frozen=True)
class Spawning:
    """Said before the spawn: the master knows the run before any of its processes can
    become the master's orphan."""

    run: str

    def line(self) -> str:
        return f"s {self.run}"


@dataclass(frozen=True)
class Spawned:
    run: str
    pgid: int

    def line(self) -> str:
        return f"g {self.run} {self.pgid}"


@dataclass(frozen=True)
class UnitStarting:
    run: str
    unit: str

    def line(self) -> str:
        return f"u {self.run} {self.unit}"


@dataclass(frozen=True)
class Ended:
    run: str

    def line(self) -> str:
        return f"e {self.run}"


@dataclass(frozen=True)
class GaveBack:
    def line(self) -> str:
        return "b"


@dataclass(frozen=True)
class GrantDone:
    """After GRANT: no run of this worker runs as the daemon's user any more."""

    def line(self) -> str:
        return "n"


Message = Ping | Spawning | Spawned | UnitStarting | Ended | GaveBack | GrantDone

WAKE = b"w"
DRAIN = b"d"
GRANT = b"g"


def encode(line: str) -> bytes:
    """A message's line (Message.line()) as written to the pipe."""
    return f"{line}\n".encode()


def split_lines(buf: bytearray) -> tuple[list[bytes], bytearray]:
    """The complete lines in what was read so far, and the rest (a line still coming)."""
    *lines, rest = buf.split(b"\n")
    return lines, bytearray(rest)


def _flag(word: bytes) -> bool:
    if word not in (b"0", b"1"):
        raise ValueError(f"not 0 or 1: {word!r}")
    return word == b"1"


def _word(word: bytes) -> str:
    return word.decode("ascii")


def parse(line: bytes) -> Message:
    """The message a line holds (without its newline); PipeError if it holds none."""
    words = line.split()
    try:
        kind, args = words[0], words[1:]
        if kind == b"s" and len(args) == 1:
            return Spawning(_word(args[0]))
        if kind == b"g" and len(args) == 2:
            return Spawned(_word(args[0]), int(args[1]))
        if kind == b"u" and len(args) == 2:
            return UnitStarting(_word(args[0]), _word(args[1]))
        if kind == b"e" and len(args) == 1:
            return Ended(_word(args[0]))
        if kind == b"b" and not args:
            return GaveBack()
        if kind == b"n" and not args:
            return GrantDone()
        if kind.isdigit() and len(args) == 1:
            return Ping(int(kind), _flag(args[0]))
        if kind.isdigit() and len(args) == 3:
            return Ping(int(kind), _flag(args[0]), float(args[1]), _flag(args[2]))
    except (ValueError, IndexError, UnicodeDecodeError):
        pass
    raise PipeError(f"not a worker message: {bytes(line[:80])!r}")
