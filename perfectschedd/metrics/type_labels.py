"""Which `type` label a task type is counted under on /metrics: a bound on the series that
task types users choose (a /regexp/ route's) add to every scrape, the same in the master
and every worker (the list of admitted types is shared through the multiprocess
directory, multiproc.py)."""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable, Iterable
from typing import Any

# Distinct task types with a `type` label of their own, besides the exact types of this
# host's routes: a /regexp/ route takes types that users choose, and each one adds series
# to every scrape.  The rest are counted under OTHER_TYPE.
TYPE_LABELS_MAX = 100
OTHER_TYPE = "_other"
# The types admitted so far, one JSON string a line, shared by the master and every
# worker through the multiprocess directory: the bound holds across workers and their
# replacements (their counts stay in the totals).
TYPES_FILE = "type-labels"
# Folded types a worker remembers (each is counted once per worker).
FOLDED_REMEMBERED = 10_000


class TypeLabels:
    """Which `type` label a task type is counted under: its own (an exact route's type,
    or one of the first TYPE_LABELS_MAX others admitted in `path`), else OTHER_TYPE."""

    def __init__(self, path: str | None, exact: Iterable[str] = ()) -> None:
        self.path = path
        self.exact = frozenset(exact)
        self.admitted: set[str] = set()
        self.full = False  # the file holds TYPE_LABELS_MAX types: it never changes again
        self.folded: set[str] = set()
        self.on_folded: Callable[[], None] = lambda: None

    def label(self, task_type: str) -> str:
        if task_type in self.exact or task_type in self.admitted:
            return task_type
        if task_type in self.folded:
            return OTHER_TYPE
        if not self.full and self._admit(task_type):
            return task_type
        if len(self.folded) < FOLDED_REMEMBERED:
            self.folded.add(task_type)
            self.on_folded()
        return OTHER_TYPE

    def _admit(self, task_type: str) -> bool:
        """Read the shared list (and add `task_type` while there is room), under its
        lock: a new type costs this once per process."""
        if self.path is None:
            return False
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC,
                         0o600)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            with os.fdopen(os.dup(fd), "rb") as f:
                self.admitted = self.read(f.read())
            if task_type not in self.admitted and len(self.admitted) < TYPE_LABELS_MAX:
                os.write(fd, json.dumps(task_type).encode() + b"\n")
                self.admitted.add(task_type)
            self.full = len(self.admitted) >= TYPE_LABELS_MAX
        except OSError:
            return False
        finally:
            os.close(fd)  # and its lock
        return task_type in self.admitted

    @staticmethod
    def read(data: bytes) -> set[str]:
        found = set()
        for line in data.splitlines():
            try:
                found.add(str(json.loads(line)))
            except ValueError:
                continue  # a line cut by a crash: that type is simply not admitted
        return found


# This process' labels: none shared until the metrics are set up (share).
_types = TypeLabels(None)


def share(directory: str, exact: Iterable[str] = ()) -> TypeLabels:
    """This process' labels from now on: the list shared in `directory` (the master's at
    setup, each worker's after its fork), with `exact`, the exact types of its routes."""
    global _types
    _types = TypeLabels(os.path.join(directory, TYPES_FILE), exact)
    return _types


def exact_types(routes: Iterable[Any]) -> list[str]:
    """The exact (not /regexp/) types of a configuration's routes."""
    return [r.pattern for r in routes if r.regexp is None]


def set_route_types(exact: Iterable[str]) -> None:
    """This process' exact route types, which always have a label of their own."""
    exact = frozenset(exact)
    if exact != _types.exact:
        _types.exact = exact


def type_label(task_type: str) -> str:
    return _types.label(task_type)


def fold_types(counts: dict[str, int]) -> dict[str, int]:
    """The master's counts by type under the workers' rule (their list is shared, and
    the master adds to it: a type no host routes is never run, and still worth its own
    label while there is room)."""
    out: dict[str, int] = {}
    for task_type, n in counts.items():
        label = _types.label(task_type)
        out[label] = out.get(label, 0) + n
    return out
