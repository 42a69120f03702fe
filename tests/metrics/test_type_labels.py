"""Distinct `type` labels in /metrics are bounded (issue 38: with a /regexp/ route, 300
task types took a scrape from 20 kB to 4.4 MB): the first TYPE_LABELS_MAX types besides
the routes' exact ones have a label of their own, across every worker; the rest are
counted under type="_other", and how many were folded is a metric."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from daemon_harness import Daemon, wait_until
from scrape import Samples, scrape, value

from perfectschedd import config
from perfectschedd.schedules.collection import ScheduleCollection

OTHER, LABELS_MAX = "_other", 100  # type_labels.OTHER_TYPE, type_labels.TYPE_LABELS_MAX
ONCE = "0 0 1 1 *"  # with at=0: runs now, then not again for months
JOB = """
import perfectschedd

class Ok(perfectschedd.Application):
    def run(self):
        pass
"""


def types_in(text: str, metric: str) -> set[str]:
    return set(re.findall(rf'^{metric}\{{[^}}]*type="([^"]*)"', text, re.M))


def test_300_types_of_a_regexp_route_make_at_most_100_labels(
        daemon_factory: Callable[..., Daemon], tmp_path: Path) -> None:
    (tmp_path / "typejobs.py").write_text(JOB)
    many = 300
    d = daemon_factory({
        "workers": 2, "poll_interval": 0.2,
        "routes": [{"type": "exact-job", "python": "typejobs:Ok", "user": "root"},
                   {"type": "/^t-/", "python": "typejobs:Ok", "user": "root"}],
    }, extra_args=["-I", str(tmp_path)]).start()
    sc = ScheduleCollection(config.load(str(d.config_path)))
    try:
        sc.add_many([{"key": f"k{i}", "type": f"t-{i}", "cron": ONCE, "at": 0}
                     for i in range(many)])

        def finished(n: int) -> Callable[[], Samples | None]:
            def check() -> Samples | None:
                _, s = scrape(d.metrics_port)
                return s if value(s, "perfectsched_tasks_finished_total") == n else None
            return check
        wait_until(finished(many), 60, what="every task counted")
        # An exact route's type has a label of its own however many came before.
        sc.add("exact", "exact-job", ONCE, at=0)
        wait_until(finished(many + 1), 20, what="the exact route's task counted")
    finally:
        sc.close()
    text, s = scrape(d.metrics_port)
    for metric in ("perfectsched_tasks_started_total", "perfectsched_tasks_finished_total",
                   "perfectsched_task_duration_seconds_count"):
        labels = types_in(text, metric)
        assert "exact-job" in labels and OTHER in labels, metric
        assert len(labels - {"exact-job", OTHER}) == LABELS_MAX
    assert value(s, "perfectsched_tasks_finished_total", type=OTHER,
                 outcome="success") == many - LABELS_MAX
    assert value(s, "perfectsched_type_labels_folded_total") == \
        many - LABELS_MAX
    assert len(text) < 500_000, len(text)  # 100 types: 380 kB; 0.2.0: over 1 MB


def test_the_constants_the_test_above_names() -> None:
    from perfectschedd.metrics.type_labels import OTHER_TYPE, TYPE_LABELS_MAX

    assert (OTHER_TYPE, TYPE_LABELS_MAX) == (OTHER, LABELS_MAX)


def test_the_list_is_shared_by_the_processes_and_exact_types_stay_apart(
        tmp_path: Path) -> None:
    """Two processes (a worker and its sibling, or the master) share one list in the
    metrics directory: the bound is theirs together, and survives either of them."""
    from perfectschedd.metrics.type_labels import TypeLabels

    path = str(tmp_path / "type-labels")
    folded: list[int] = []
    a, b = TypeLabels(path, ["exact"]), TypeLabels(path, ["exact"])
    b.on_folded = lambda: folded.append(1)
    assert [a.label(f"a{i}") for i in range(60)] == [f"a{i}" for i in range(60)]
    got = [b.label(f"b{i}") for i in range(60)]
    assert got == [f"b{i}" for i in range(LABELS_MAX - 60)] + [OTHER] * 20
    assert b.label("a7") == "a7" and b.label("exact") == "exact"
    assert a.label("b3") == "b3" and a.label("b59") == OTHER
    b.label("b59")  # already folded here: counted once
    assert len(folded) == 20
    assert TypeLabels(path).label("a0") == "a0"  # a replacement worker
