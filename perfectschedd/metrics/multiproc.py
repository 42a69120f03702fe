"""prometheus_client's multiprocess directory: where the workers' metric files go, held by
one daemon (a second one given the same directory is refused) and cleared at its start.

Workers count tasks with prometheus_client in multiprocess mode: every worker process
writes its own files here, and the master's /metrics sums them (exposition.py), so a
worker that dies or is replaced keeps its counts in the totals (archive.py folds its
files).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import glob
import os
import shutil
import tempfile
from typing import Any

from perfectschedd.errors import ConfigError
from perfectschedd.metrics.type_labels import TYPES_FILE

_dir: str | None = None      # the multiprocess directory, once prepare ran
_dir_lock: int | None = None  # the master's lock on it


def choose(config: Any) -> str:
    """Where the workers' metric files go (created if needed; not yet cleared)."""
    runtime = os.environ.get("RUNTIME_DIRECTORY", "").split(":")[0]
    candidates = []
    if runtime:
        candidates.append(os.path.join(runtime, "metrics"))
    sock = getattr(config, "control_socket", None)
    if sock:
        stem = os.path.splitext(os.path.basename(sock))[0] or "perfectschedd"
        candidates.append(os.path.join(os.path.dirname(os.path.abspath(sock)),
                                       f"{stem}-metrics"))
    for path in candidates:
        try:
            os.makedirs(path, mode=0o700, exist_ok=True)
        except OSError:
            continue
        if os.access(path, os.W_OK | os.X_OK):
            return path
    path = tempfile.mkdtemp(prefix="perfectschedd-metrics-")
    atexit.register(shutil.rmtree, path, True)
    return path


def _lock_dir(path: str) -> int:
    """Hold the directory for this daemon: a second daemon given the same one (the same
    RUNTIME_DIRECTORY, another socket) is refused before it clears the files of the
    running one's workers.  The lock goes with the master's last descriptor of it."""
    fd = os.open(os.path.join(path, ".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(f"metrics directory {path} is in use by another perfectschedd; "
                          "give each daemon its own control_socket and runtime directory"
                          ) from None
    return fd


def master_fds() -> list[int]:
    """Descriptors only the master keeps (a forked worker closes them)."""
    return [] if _dir_lock is None else [_dir_lock]


def prepare(config: Any) -> str:
    """The directory chosen, held for this daemon and cleared of an earlier run's files,
    and named in the environment that every process forked from here on inherits."""
    global _dir, _dir_lock
    path = choose(config)
    _dir_lock = _lock_dir(path)
    for f in [*glob.glob(os.path.join(path, "*.db")), os.path.join(path, TYPES_FILE)]:
        with contextlib.suppress(FileNotFoundError):
            os.remove(f)
    # Read by prometheus_client's value classes in every process forked from here on.
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    _dir = path
    return path


def directory() -> str | None:
    """The directory, once prepare ran in the master (a worker inherits it); None in
    library use and perfectschedctl -c, where every metric is a no-op."""
    return _dir
