"""The mark every process of an exec run carries, and killing by it (Linux /proc).

A module of the standard library's alone: the job guard (guard.py), a process of its own
that must stay small, needs just this.  The reaper (reaper.py) builds the master's and
the workers' sweeps on it.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

# In the environment of every process of an exec run: its run id,
# "<worker pid>.<stamp>.<digest of the control socket>:<master pid>.<n>".
RUN_ID_ENV = "PERFECTSCHED_RUN_ID"
_MARK = f"{RUN_ID_ENV}=".encode()
# Killing is done in rounds: each round's victims re-parent their children, who are found
# by the next round.  Bounded, so a fork bomb cannot hold the caller.
_ROUNDS = 20
_ROUND_PAUSE = 0.01


def run_id(pid: int) -> str | None:
    """The run a process belongs to, from its environment; None if it has none (or it
    is not ours to read: another user, a zombie)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read()
    except OSError:
        return None
    for item in env.split(b"\0"):
        if item.startswith(_MARK):
            return item[len(_MARK):].decode("ascii", "replace")
    return None


def instance_of(run: str) -> str | None:
    """The daemon instance in a run id; None in a run id of 0.2.0 or older."""
    fields = run.split(".")
    return fields[2] if len(fields) == 4 else None


def all_pids() -> list[int]:
    return [int(e) for e in os.listdir("/proc") if e.isdigit()]


def kill(pid: int) -> None:
    """SIGKILL `pid` and, if it leads one, its process group."""
    for send, target in ((os.killpg, pid), (os.kill, pid)):
        try:
            send(target, signal.SIGKILL)
        except OSError:
            pass


def kill_marked(belongs: Callable[[str], bool], *, me: int) -> int:
    """SIGKILL every process whose run id satisfies `belongs`, in rounds until none is
    left (or the bound is reached); returns how many were signalled."""
    count = 0
    for _ in range(_ROUNDS):
        victims = [p for p in all_pids() if p != me and (r := run_id(p)) is not None
                   and belongs(r)]
        if not victims:
            break
        for pid in victims:
            kill(pid)
        count += len(victims)
        time.sleep(_ROUND_PAUSE)
    return count
