"""Start an exec run's command: in a session of its own, with the given environment and
standard descriptors, every other descriptor closed (``close_fds``), signals as Popen
restores them; the caller reaps it (:func:`wait`).

Popen costs an exec run's worker about 120 us of CPU, half of it Python work around the
fork that a run does not need: its handles and file objects, its bookkeeping, the
environment encoded key by key.  Where the private ``_posixsubprocess.fork_exec`` has
the signature of Python 3.11 to 3.13 (checked by version: a C function cannot be
inspected), :func:`spawn` calls it as Popen would, with the same arguments, and reads
the child's exec error the way Popen does; elsewhere, and for a change of user (which
Popen turns into ids and groups, and forks without vfork), it uses Popen itself.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from typing import Any

__all__ = ["Child", "spawn"]

try:
    from _posixsubprocess import fork_exec as _fork_exec
except ImportError:  # pragma: no cover - not CPython on POSIX
    _fork_exec = None

# The versions whose fork_exec takes the 23 arguments passed below (Popen._execute_child
# of 3.11.2 to 3.13 passes exactly these).
_DIRECT = _fork_exec is not None and (3, 11) <= sys.version_info[:2] <= (3, 13)
# Popen's own choice: vfork where the platform allows it (subprocess._USE_VFORK).
_USE_VFORK: bool = getattr(subprocess, "_USE_VFORK", True)
_ERR_MAX = 50_000  # as Popen: the most of the child's error message read


class Child:
    """A started command: its pid, and how to reap it once it exited."""

    __slots__ = ("pid", "_popen")

    def __init__(self, pid: int, popen: subprocess.Popen[bytes] | None = None) -> None:
        self.pid = pid
        self._popen = popen

    def wait(self) -> int:
        """Reap it (blocks until it exits); its exit status, or -N if signal N killed
        it (Popen's returncode)."""
        if self._popen is not None:
            # Popen reaps its own children: a pid reaped behind its back could be reused
            # by another run's command, which Popen's clean-up would then reap.
            return self._popen.wait()
        return os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])


def spawn(argv: list[str], env: dict[bytes, bytes], stdin: int, stdout: int, stderr: int,
          as_user: dict[str, Any]) -> Child:
    """Start `argv` in a new session with `env` and the descriptors `stdin`, `stdout`
    and `stderr` (which stay open here); `as_user`: Popen's user, group, extra_groups
    and cwd arguments.  Raises OSError when the command cannot be started."""
    if not _DIRECT or as_user:
        proc = subprocess.Popen(argv, stdin=stdin, stdout=stdout, stderr=stderr, env=env,
                                start_new_session=True, close_fds=True, **as_user)
        return Child(proc.pid, proc)
    env_list = [k + b"=" + v for k, v in env.items()]
    if any(b"=" in k for k in env):
        raise ValueError("illegal environment variable name")
    executable = os.fsencode(argv[0])
    if os.path.dirname(executable):
        executable_list: tuple[bytes, ...] = (executable,)
    else:  # as Popen, and os._execvpe: the PATH of the command's environment
        executable_list = tuple(os.path.join(os.fsencode(d), executable)
                                for d in os.get_exec_path(env))  # type: ignore[arg-type]
    sys.audit("subprocess.Popen", argv[0], argv, None, env)
    err_r, err_w = os.pipe()
    low = []
    while err_w < 3:  # as Popen: not where the child's standard descriptors go
        low.append(err_w)
        err_w = os.dup(err_w)
    for fd in low:
        os.close(fd)
    try:
        try:
            pid = _fork_exec(  # type: ignore[misc]
                argv, executable_list, True, (err_w,), None, env_list,
                stdin, -1, -1, stdout, -1, stderr, err_r, err_w,
                True, True,           # restore_signals, start_new_session
                -1, None, None, None, -1,  # process_group, gid, gids, uid, umask
                None, _USE_VFORK)     # preexec_fn
        finally:
            os.close(err_w)
        # Until the exec: empty at EOF when it succeeded, else why it failed.
        data = bytearray()
        while len(data) <= _ERR_MAX:
            part = os.read(err_r, _ERR_MAX)
            if not part:
                break
            data += part
    finally:
        os.close(err_r)
    if data:
        try:
            os.waitpid(pid, 0)  # it exited after writing (status 255)
        except ChildProcessError:
            pass
        raise _child_error(bytes(data), argv[0])
    return Child(pid)


def _child_error(data: bytes, command: str) -> OSError:
    """The exception the child's error report (`name:hex errno:message`) stands for, as
    Popen raises it: OSError with the errno (the file name when exec failed)."""
    try:
        name, hex_errno, message = data.split(b":", 2)
        text = message.decode()
        code = int(hex_errno, 16)
    except ValueError:
        return OSError(errno.EIO, f"bad exception data from child: {data!r}")
    if name != b"OSError" or not code:
        return OSError(errno.EIO, text or name.decode(errors="replace"))
    if text == "noexec:chdir":
        return OSError(code, os.strerror(code), None)
    if text == "noexec":
        return OSError(code, os.strerror(code))
    return OSError(code, os.strerror(code), command)
