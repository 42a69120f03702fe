"""The job guard: what kills a daemon's exec runs when the whole daemon dies at once.

The master kills a dead worker's runs, and a worker whose master died stops its own.
When master and workers die together (kill -9 of all of them, the OOM killer, a
container or `make run` without systemd's KillMode), nobody is left to do either: a job
would run on past its lease, beside the copy another host starts (SPEC "Execution
guarantees": when the daemon dies its jobs die within seconds).

So the master starts, before anything else, this small process: forked, then a new
interpreter (exec) that imports nothing but the standard library, runmarks.py and the
log setup.  Only forked, it held the master's heap as it was at the fork, and every
page the master wrote afterwards became the guard's own: 24 MiB of a daemon's summed PSS
(docs/performance.md); exec'd, about 7.  It holds the read end of
a pipe whose write end the master and every worker hold (workers by inheritance; a job
does not: the pipe is close-on-exec).  Nothing is ever written: when the last holder is
gone the read ends, and the guard kills every process whose run id names this daemon's
instance (reaper.set_instance), then exits.  It ignores the signals a terminal, `kill
-TERM` of the group or a reload sends to every process, so that it goes last; only KILL
stops it early, and then the next start of the daemon kills what is left
(reaper.left_by_earlier_incarnations).
"""

from __future__ import annotations

import logging
import os
import select
import signal
import sys
from dataclasses import dataclass

from perfectschedd import logsetup
from perfectschedd.executors import runmarks

_PR_SET_NAME = 15
# Its name in ps and /proc/PID/comm: `pkill perfectschedd` does not match it, so what
# kills a daemon that way leaves the guard to clean up after it.
NAME = b"psched-guard"
READY_WAIT = 10.0
_IGNORED = (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT, signal.SIGHUP, signal.SIGUSR1,
            signal.SIGUSR2, signal.SIGPIPE)


@dataclass(frozen=True)
class Guard:
    pid: int
    lifeline: int  # the write end: held, never written


def start(instance: str, log_path: str | None) -> Guard:
    """Start the guard of the daemon instance `instance` (in the master, before anything
    else that its children should not inherit: listening sockets, threads), logging to
    `log_path` (None: where the daemon's lines go without `log:`)."""
    read_end, write_end = os.pipe()
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(write_end)
            os.close(ready_r)
            os.set_inheritable(read_end, True)
            os.set_inheritable(ready_w, True)
            # -P: nothing of the master's working directory on the module path.
            os.execv(sys.executable, [sys.executable, "-P", "-m", __name__, instance,
                                      str(read_end), str(ready_w), log_path or ""])
        finally:
            os._exit(127)
    os.close(read_end)
    os.close(ready_w)
    # Until it says it is ready it is a python3 like the workers (ps, /proc/PID/comm):
    # the master goes on once it has its name and guards, READY_WAIT at most.
    try:
        select.select([ready_r], [], [], READY_WAIT)
    finally:
        os.close(ready_r)
    return Guard(pid, write_end)


def main(argv: list[str]) -> int:
    instance, lifeline, ready, log_path = argv[0], int(argv[1]), int(argv[2]), argv[3] or None
    for sig in _IGNORED:
        signal.signal(sig, signal.SIG_IGN)
    try:
        import ctypes  # here only: the name in ps is worth its import, nothing more

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, NAME, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    try:
        logsetup.setup(log_path)
    except Exception:  # noqa: BLE001 - its one line goes to stderr: the guard still guards
        logsetup.setup(None)
    logsetup.set_process_name("guard")
    os.write(ready, b"1")
    os.close(ready)
    log = logging.getLogger("perfectschedd")
    while True:
        try:
            if not os.read(lifeline, 4096):
                break
        except InterruptedError:
            continue
    killed = runmarks.kill_marked(lambda run: runmarks.instance_of(run) == instance,
                                  me=os.getpid())
    if killed:
        log.warning("the daemon's master and workers died together; the job guard killed "
                    "%d process(es) of their runs", killed)
    logsetup.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
