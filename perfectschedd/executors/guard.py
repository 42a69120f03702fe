"""The job guard: what kills a daemon's exec runs when the whole daemon dies at once.

The master kills a dead worker's runs, and a worker whose master died stops its own.
When master and workers die together (kill -9 of all of them, the OOM killer, a
container or `make run` without systemd's KillMode), nobody is left to do either: a job
would run on past its lease, beside the copy another host starts (SPEC "Execution
guarantees": when the daemon dies its jobs die within seconds).

So the master forks, before anything else, this small process.  It holds the read end of
a pipe whose write end the master and every worker hold (workers by inheritance; a job
does not: the pipe is close-on-exec).  Nothing is ever written: when the last holder is
gone the read ends, and the guard kills every process whose run id names this daemon's
instance (reaper.set_instance), then exits.  It ignores the signals a terminal, `kill
-TERM` of the group or a reload sends to every process, so that it goes last; only KILL
stops it early, and then the next start of the daemon kills what is left
(reaper.left_by_earlier_incarnations).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
from dataclasses import dataclass

from perfectschedd import logsetup
from perfectschedd.executors import reaper

log = logging.getLogger("perfectschedd")

_PR_SET_NAME = 15
# Its name in ps and /proc/PID/comm: `pkill perfectschedd` does not match it, so what
# kills a daemon that way leaves the guard to clean up after it.
NAME = b"psched-guard"
_IGNORED = (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT, signal.SIGHUP, signal.SIGUSR1,
            signal.SIGUSR2, signal.SIGPIPE)


@dataclass(frozen=True)
class Guard:
    pid: int
    lifeline: int  # the write end: held, never written


def start(instance: str) -> Guard:
    """Fork the guard of the daemon instance `instance` (in the master, before anything
    else that its children should not inherit: listening sockets, threads)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(write_end)
            code = _watch(read_end, instance)
        finally:
            os._exit(code)
    os.close(read_end)
    return Guard(pid, write_end)


def _watch(lifeline: int, instance: str) -> int:
    for sig in _IGNORED:
        signal.signal(sig, signal.SIG_IGN)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, NAME, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    logsetup.after_fork()
    logsetup.set_process_name("guard")
    while True:
        try:
            if not os.read(lifeline, 4096):
                break
        except InterruptedError:
            continue
    killed = reaper.kill_marked(lambda run: reaper.instance_of(run) == instance,
                                me=os.getpid())
    if killed:
        log.warning("the daemon's master and workers died together; the job guard killed "
                    "%d process(es) of their runs", killed)
    logsetup.shutdown()
    return 0


def kill_earlier_incarnations(me: int) -> int:
    """At start, before any worker: kill the runs a previous master of this daemon
    instance left behind when it died with its workers and its guard."""
    killed = reaper.kill_marked(reaper.left_by_earlier_incarnations, me=me)
    if killed:
        log.warning("killed %d process(es) left running by an earlier start of this daemon "
                    "(it died with its workers)", killed)
    return killed
