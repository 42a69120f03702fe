"""Fixtures of the fault-injection suite (tests/faults/): clusters of real daemons."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from faultlib import Cluster  # noqa: E402


@pytest.fixture
def cluster_factory(tmp_path: Path) -> Iterator[Callable[..., Cluster]]:
    """cluster_factory(url, n, overrides=None, watchdog_usec=None) -> Cluster (not started).
    Every daemon of every cluster made is killed with its process tree at teardown."""
    made: list[Cluster] = []

    def make(url: str, n: int, overrides: dict[str, Any] | None = None,
             **kwargs: Any) -> Cluster:
        base = tmp_path / f"cluster{len(made)}"
        base.mkdir()
        c = Cluster(base, url, n, overrides, **kwargs)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()
