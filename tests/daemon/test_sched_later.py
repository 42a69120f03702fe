"""SCHED_LATER is not a failed attempt (issue 39 item 3): runs that asked to run later do
not count toward max_attempts, and the config's later_limit bounds how long one
occurrence may be put off: past it the occurrence is given up, saying why."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from daemon_harness import YEARLY, Daemon, sh, wait_until

# Three runs say SCHED_LATER 1, then every run fails: a counter in a file.
LATER_THEN_FAIL = ('n=$(cat {c} 2>/dev/null || echo 0); n=$((n+1)); echo $n > {c}; '
                   'echo "run $n attempt $PERFECTSCHED_ATTEMPT" >> {o}; '
                   '[ $n -le 3 ] && echo "SCHED_LATER 1"; exit 1')

# One worker, and leases and a worker timeout long enough that a loaded machine's slow
# runs are not taken for lost ones (which would count attempts of their own).
SLOW_OK = {"workers": 1, "alive_time": 60, "worker_timeout": 60}


def history(d: Daemon, key: str) -> list[dict[str, Any]]:
    return list(reversed(d.ctl_json("history", key, "-n", "100")))


def test_runs_that_asked_to_run_later_are_not_failed_attempts(daemon_factory: Any,
                                                             tmp_path: Path) -> None:
    out = tmp_path / "out"
    d: Daemon = daemon_factory({**SLOW_OK, "routes": [
        sh("t", LATER_THEN_FAIL.format(c=tmp_path / "count", o=out))]}).start()
    d.ctl("add", "k", "t", YEARLY, "-a", "0", "--max-attempts", "3", "--retry-wait", "0")
    d.wait_log("gave up the occurrence", timeout=60)
    wait_until(lambda: len(history(d, "k")) == 6, what="six runs recorded")
    runs = [(r["outcome"], r["attempt"]) for r in history(d, "k")]
    assert runs == [("later", 1)] * 3 + [("failed", 1), ("failed", 2), ("failed", 3)], runs
    assert out.read_text().splitlines() == [
        "run 1 attempt 1", "run 2 attempt 1", "run 3 attempt 1", "run 4 attempt 1",
        "run 5 attempt 2", "run 6 attempt 3"]
    assert "after 3 failed attempt(s) (max_attempts)" in d.log()
    assert d.stop() == 0


def test_later_limit_gives_an_endlessly_postponed_occurrence_up(daemon_factory: Any,
                                                                tmp_path: Path) -> None:
    out = tmp_path / "out"
    d: Daemon = daemon_factory({**SLOW_OK, "later_limit": 6, "routes": [
        sh("t", f'echo x >> {out}; echo "SCHED_LATER 1"')]}).start()
    d.ctl("add", "k", "t", YEARLY, "--max-attempts", "2")
    d.ctl("run", "k")  # an occurrence due now
    d.wait_log("later_limit", timeout=30)
    wait_until(lambda: history(d, "k")[-1:] and history(d, "k")[-1]["outcome"] == "failed",
               what="the given-up run recorded")
    runs = history(d, "k")
    assert [r["outcome"] for r in runs] == ["later"] * (len(runs) - 1) + ["failed"]
    # About one a second until the run asked for would be past later_limit.
    assert len(runs) >= 2 and all(r["attempt"] == 1 for r in runs), runs
    assert runs[-1]["error"].startswith("SCHED_LATER 1 refused: the occurrence of ")
    assert "more than later_limit (6 s); given up, the schedule moves on" in runs[-1]["error"]
    count = len(out.read_text().splitlines())
    wait_until(lambda: d.ctl_json("list") and all(
        "@run-" not in s["key"] for s in d.ctl_json("list")), what="the extra run gone")
    assert len(out.read_text().splitlines()) == count  # nothing ran since
    assert d.stop() == 0
