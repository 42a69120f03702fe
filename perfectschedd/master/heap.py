"""Give the master's free heap back to the kernel (glibc's malloc_trim).

glibc keeps the pages of freed heap chunks, and CPython has no call that returns them:
after a status read of 100,000 rows the master holds about 1.5 MiB of such pages, and
every worker forked later maps them too.  Trimming before each fork and after the big
reads returns them (measured in docs/performance.md, "Memory at 100,000 schedules").
Elsewhere (musl, no libc symbol) this does nothing.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

_trim: Callable[[int], int] | None = None
try:
    _trim = ctypes.CDLL(None).malloc_trim
except (OSError, AttributeError):
    pass


def trim() -> bool:
    """True when pages were returned."""
    return bool(_trim(0)) if _trim is not None else False
