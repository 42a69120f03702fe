"""Dead workers' metric files folded into one archive per kind (prometheus_client's
multiprocess caveat: files of dead processes are never removed, so a worker that keeps
crashing grew the directory, and every scrape, without bound).

Counters and histograms of a dead pid are added into `<kind>_archive.db`; max gauges
(the last success time) are kept as their maximum in `gauge_max_archive.db`; live
gauges are removed by prometheus_client's own mark_process_dead.  The directory then
holds at most one file per live worker and kind, plus the archives.

Invariant: a scrape never sees a total go down nor a value counted twice.  The archive
is written beside and renamed into place, then the dead file removed, all under `LOCK`,
which render() holds while it reads the files.
"""

from __future__ import annotations

import inspect
import logging
import os
import threading
from collections.abc import Callable

from prometheus_client.mmap_dict import MmapedDict

log = logging.getLogger("perfectschedd")

LOCK = threading.Lock()
# kind (the file name's prefix) -> how two values of one key combine
_FOLD: dict[str, Callable[[float, float], float]] = {
    "counter": lambda a, b: a + b,
    "histogram": lambda a, b: a + b,
    "gauge_max": max,
}
# prometheus_client 0.17 added a timestamp to every value; Debian 12 ships 0.16.
_TIMESTAMPED = len(inspect.signature(MmapedDict.write_value).parameters) > 3


# A file's header (used bytes, padding): a shorter file was created by a process that
# died before it wrote any value (a worker stopped as it started), and holds none.
_HEADER = 8


def _values(path: str) -> dict[str, float]:
    try:
        if os.path.getsize(path) < _HEADER:
            return {}
        entries = MmapedDict.read_all_values_from_file(path)
    except FileNotFoundError:
        return {}
    return {entry[0]: float(entry[1]) for entry in entries}


def _write(path: str, values: dict[str, float]) -> None:
    tmp = f"{path}.new"  # not *.db: render()'s glob never reads a half-written archive
    archive = MmapedDict(tmp)
    try:
        for key, value in values.items():
            if _TIMESTAMPED:
                archive.write_value(key, value, 0.0)
            else:
                archive.write_value(key, value)  # type: ignore[call-arg]
    finally:
        archive.close()
    os.replace(tmp, path)


def fold_dead(directory: str, pid: int) -> None:
    """Fold the files of dead process `pid` into the archives; never raises (a file it
    cannot read is logged and left alone)."""
    with LOCK:
        for kind, fold in _FOLD.items():
            dead = os.path.join(directory, f"{kind}_{pid}.db")
            if not os.path.exists(dead):
                continue
            archive = os.path.join(directory, f"{kind}_archive.db")
            try:
                totals = _values(archive)
                for key, value in _values(dead).items():
                    totals[key] = fold(totals[key], value) if key in totals else value
                _write(archive, totals)
                os.remove(dead)
            except Exception as exc:  # noqa: BLE001 - metrics must never stop the master
                log.error("metrics: cannot fold %s into %s: %s", dead, archive, exc)
