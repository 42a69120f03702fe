"""Several daemons (separate configs and node names, standing for hosts) on one database."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from faultlib import (
    JOB_TYPE,
    Cluster,
    add_catchup_schedules,
    analyse,
    expected_occurrences,
    wait_until,
)

from perfectschedd.schedules import cron

pytestmark = pytest.mark.faults


@pytest.fixture(params=["postgresql", "mysql"])
def shared_url(request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue("pg_url" if request.param == "postgresql"
                                       else "mysql_url"))


def test_two_nodes_share_one_database(shared_url: str,
                                      cluster_factory: Callable[..., Cluster]) -> None:
    c = cluster_factory(shared_url, 2)
    n0, n1 = c.start().nodes
    now = int(time.time())
    # Added through either node's control socket...
    for i in range(4):
        n0.ctl("add", f"via-n0-{i}", JOB_TYPE, "* * * * *", "--start", str(now - 120))
        n1.ctl("add", f"via-n1-{i}", JOB_TYPE, "* * * * *", "--start", str(now - 120))
    with c.open() as sc:
        first = add_catchup_schedules(sc, 300, 120)
    start = cron.first_at_or_after("* * * * *", "UTC", now - 120)
    first.update({f"via-{n}-{i}": start for n in ("n0", "n1") for i in range(4)})
    # ...every node's perfectschedctl sees the whole cluster's schedules.
    for d in (n0, n1):
        keys = {s["key"] for s in d.ctl_json("list")}
        assert set(first) <= keys
    # `status` on one node shows what every node runs, with the node in the owner.
    seen: set[str] = set()

    def both_nodes_running() -> bool:
        for r in n0.status()["running"]:
            seen.add(r["owner"].split(":")[0])
        return seen >= {"n0", "n1"}
    wait_until(both_nodes_running, 30, interval=0.1, what="tasks of n0 and n1 in status")
    text = n1.ctl("status").stdout
    assert "n0:" in text or "n1:" in text, text
    assert n0.status()["host"] == "n0" and n1.status()["host"] == "n1"

    cutoff = int(time.time())
    c.wait_settled(cutoff, timeout=90)
    c.assert_all_alive()
    rep = analyse(c.read_log(), expected_occurrences(first, cutoff), c.faults, keys=first)
    print(f"\n{rep.summary()}")
    rep.assert_ok()
    assert not rep.duplicates  # no faults here: exactly once
    # Whichever node was free ran them: both took a real share.
    assert min(rep.nodes.values()) > rep.runs / 5, rep.nodes
