"""The first process of a job run as a systemd unit: runs the job's command and tells the
worker its last stdout line (the exec protocol's SCHED_LATER/SCHED_DONE/SCHED_FAIL).

Why a wrapper: the command's output must stay in the journal under its unit
(`journalctl -u UNIT`), and the worker must learn the last line for certain.  Reading it
back from the journal would race journald (a stream's last lines may be stored after the
unit is already inactive, and nothing marks a stream's end) and would need journal access
for the daemon's user.  So the unit's stdout stays the journal, and its stderr is a pipe
whose other end the worker holds (StandardErrorFileDescriptor): this process copies the
command's stdout to the journal as it comes, sends the command's stderr to the journal
too, and writes only the last non-empty stdout line to the pipe when the command ends.
It exits as the command did (the same status, or the same signal), so the unit's
ExecMainCode/ExecMainStatus/Result are the command's.

Usage (unit.py builds it): python3 -I /path/to/executors/systemd/wrap.py -- ARGV...
It imports nothing but the standard library (it runs as the job's user, inside the job's
limits).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

_CHUNK = 65536
_LAST_MAX = 4096  # the protocol's lines are short; a huge last line is not one of them


def main(argv: list[str]) -> int:
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print("perfectschedd.unitwrap: no command", file=sys.stdout, flush=True)
        return 2
    # The worker may be gone (it died, the pipe is closed): the job must not die of it.
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    verdict = os.dup(2)
    os.dup2(1, 2)  # our own complaints and the command's stderr: the journal
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=2, close_fds=True,
                                pass_fds=(), restore_signals=True)
    except OSError as exc:
        print(f"cannot run {argv[0]}: {exc.strerror or exc}", flush=True)
        return 127 if isinstance(exc, FileNotFoundError) else 126
    # The stop signal (SIGTERM from systemd) reaches the whole cgroup: the command gets it
    # directly; this process only waits for it to end.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    last = b""
    partial = b""
    while True:
        chunk = os.read(fd, _CHUNK)
        if not chunk:
            break
        _write_all(1, chunk)
        partial += chunk
        *lines, partial = partial.split(b"\n")
        for line in lines:
            if line.strip():
                last = line[:_LAST_MAX]
        partial = partial[-_LAST_MAX:]
    if partial.strip():
        last = partial[:_LAST_MAX]
        _write_all(1, b"\n")
    code = proc.wait()
    try:
        _write_all(verdict, last.rstrip(b"\r") + b"\n")
    except OSError:
        pass
    if code < 0:  # die of the same signal, so that systemd sees what the command did
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code & 0xFF


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except BrokenPipeError:
            return


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
