"""pytest plugin used by debian/rules: keep the package build's test run quick.

Leaves out the tests that start a whole perfectschedd (the `daemon_factory`
fixture): each takes seconds of real process and timer waits, and they run in
`make test` (newest libraries and Debian's) and in the system test, which boots
the installed package under systemd.  What stays are the self-contained unit
tests (config, cron, store on SQLite, handlers, control protocol, ...).
"""

from __future__ import annotations

WHOLE_DAEMON_FIXTURES = frozenset({"daemon_factory"})


def pytest_collection_modifyitems(config, items):
    keep, drop = [], []
    for item in items:
        uses = WHOLE_DAEMON_FIXTURES.intersection(getattr(item, "fixturenames", ()))
        (drop if uses else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
