"""heap.trim returns freed heap pages to the kernel (glibc), in a process of its own."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

PROBE = textwrap.dedent("""
    import os
    from perfectschedd.master import heap

    def rss_kib():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024

    # 40 MB in malloc'ed chunks (over pymalloc's 512 bytes, under mmap's threshold), the
    # last one kept: the freed ones lie below it, where free() alone never trims.
    chunks = [bytes(2000) + bytes([i % 256]) for i in range(20_000)]
    keep = chunks[-1]
    del chunks
    before = rss_kib()
    trimmed = heap.trim()
    print(trimmed, before - rss_kib())
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_trim_gives_freed_heap_pages_back() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         check=True, timeout=60).stdout.split()
    trimmed, freed_kib = out[0] == "True", int(out[1])
    assert trimmed and freed_kib > 20_000, out
