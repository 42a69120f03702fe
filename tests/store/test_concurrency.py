"""Several processes claim from one table at once (each opens its own collection, after
fork): every occurrence is claimed exactly once; a holder whose lease expired gets
PreemptedError and changes nothing.  Times are passed in, nothing sleeps."""

from __future__ import annotations

import json
import multiprocessing
import pathlib
import random
from typing import Any

import pytest

import perfectschedd
from perfectschedd import PreemptedError

T0 = 1_700_002_800
MINUTE = 60
ALIVE = 300
PROCS = 4
SCHEDULES = 30
OCCURRENCES = 20  # per schedule: T0, T0+60, ... T0+19*60
NOW = T0 + (OCCURRENCES - 1) * MINUTE + 30


def _config(url: str) -> dict[str, Any]:
    return {"type": "rdb_compat", "url": url, "alive_time": ALIVE}


def _worker(url: str, out: str, seed: int, barrier: Any) -> None:
    """Drain everything due at NOW; write [(key, scheduled_time, fence), ...] claimed."""
    rng = random.Random(seed)
    claimed: list[tuple[str, int, int]] = []
    lost: list[str] = []
    with perfectschedd.open(_config(url)) as sc:
        sc.list(limit=1)  # connect before the start line
        barrier.wait()
        pending: list[perfectschedd.Task] = []
        first = True
        while True:
            limit = rng.randint(1, 5)
            if seed % 2:  # the worker's hot path: finish and claim in one transaction
                for t in pending:
                    t._end()
                gone, tasks = sc.finish_and_poll(pending, limit, now=NOW)
            else:
                gone = sc.finish_many(pending) if pending else set()
                tasks = sc.poll_many(limit, now=NOW)
            lost.extend(gone)
            claimed.extend((t.key, t.scheduled_time, t.fence) for t in tasks)
            if first:
                # Every process claims once before any claims twice: on a loaded machine
                # one process could otherwise drain the table alone.
                first = False
                barrier.wait()
            if not tasks:
                break
            pending = tasks
    pathlib.Path(out).write_text(json.dumps({"claimed": claimed, "lost": lost}))


def _run(procs: list[multiprocessing.process.BaseProcess]) -> None:
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0, f"{p.name} exited with {p.exitcode}"


def test_every_occurrence_is_claimed_exactly_once(db_url: str, tmp_path: pathlib.Path) -> None:
    with perfectschedd.open(_config(db_url)) as sc:
        sc.add_many([{"key": f"s{i:02d}", "type": "t", "cron": "* * * * *", "start": T0,
                      "now": T0} for i in range(SCHEDULES)])
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(PROCS)
    outs = [tmp_path / f"w{i}.json" for i in range(PROCS)]
    _run([ctx.Process(target=_worker, args=(db_url, str(o), i, barrier), name=f"w{i}")
          for i, o in enumerate(outs)])
    results = [json.loads(o.read_text()) for o in outs]
    claimed = [(k, t) for r in results for k, t, _ in r["claimed"]]
    expected = {(f"s{i:02d}", T0 + n * MINUTE)
                for i in range(SCHEDULES) for n in range(OCCURRENCES)}
    assert len(claimed) == len(set(claimed)), "an occurrence was claimed twice"
    assert set(claimed) == expected
    assert all(r["lost"] == [] for r in results)  # nobody's lease expired
    assert sum(1 for r in results if r["claimed"]) >= 2, "the work was not shared"
    # Per schedule, occurrences were claimed in order, with growing fences.
    for r in results:
        per_key: dict[str, list[tuple[int, int]]] = {}
        for k, t, f in r["claimed"]:
            per_key.setdefault(k, []).append((t, f))
        for seq in per_key.values():
            assert seq == sorted(seq)
    with perfectschedd.open(_config(db_url)) as sc:
        infos = sc.list()
        assert len(infos) == SCHEDULES
        assert all(i.next_time == T0 + OCCURRENCES * MINUTE and i.owner is None
                   and i.attempt == 0 for i in infos)


def _stale_holder(url: str, out: str, claimed_evt: Any, taken_evt: Any) -> None:
    """Claim everything at T0, then wait until others took it over, then try to finish."""
    with perfectschedd.open(_config(url)) as sc:
        tasks = sc.poll_many(100, now=T0)
        claimed_evt.set()
        assert taken_evt.wait(60)
        outcome = []
        for i, t in enumerate(tasks):
            try:
                if i % 3 == 0:
                    t.finish()
                elif i % 3 == 1:
                    t.retry(now=T0 + 10)
                else:
                    t.heartbeat(now=T0 + 10)
                outcome.append("ok")
            except PreemptedError:
                outcome.append("preempted")
        lost = sc.finish_many([t for t in tasks if not t.done])
    pathlib.Path(out).write_text(json.dumps({"keys": [t.key for t in tasks],
                                             "outcome": outcome,
                                             "lost": sorted(lost)}))


def _taker(url: str, out: str, barrier: Any) -> None:
    with perfectschedd.open(_config(url)) as sc:
        barrier.wait()
        tasks = sc.poll_many(3, now=T0 + ALIVE)  # the stale leases end at T0 + ALIVE
        got = [(t.key, t.scheduled_time, t.attempt) for t in tasks]
        barrier.wait()  # everyone holds their share before anyone finishes
        assert not sc.finish_many(tasks)
    pathlib.Path(out).write_text(json.dumps(got))


def test_expired_holder_is_preempted_and_changes_nothing(db_url: str,
                                                         tmp_path: pathlib.Path) -> None:
    keys = [f"k{i}" for i in range(9)]
    with perfectschedd.open(_config(db_url)) as sc:
        for k in keys:
            sc.add(k, "t", cron="0 * * * *", start=T0, now=T0)
    ctx = multiprocessing.get_context("fork")
    claimed, taken = ctx.Event(), ctx.Event()
    stale_out = tmp_path / "stale.json"
    stale = ctx.Process(target=_stale_holder, args=(db_url, str(stale_out), claimed, taken))
    stale.start()
    assert claimed.wait(60)
    barrier = ctx.Barrier(3)
    outs = [tmp_path / f"t{i}.json" for i in range(3)]
    _run([ctx.Process(target=_taker, args=(db_url, str(o), barrier)) for o in outs])
    with perfectschedd.open(_config(db_url)) as sc:
        after_takeover = [i.as_dict() for i in sc.list()]
    taken.set()
    stale.join(60)
    assert stale.exitcode == 0
    got = [tuple(x) for o in outs for x in json.loads(o.read_text())]
    assert sorted(k for k, _, _ in got) == keys  # each taken over exactly once
    assert all(t == T0 and attempt == 2 for _, t, attempt in got)
    result = json.loads(stale_out.read_text())
    assert sorted(result["keys"]) == keys
    assert result["outcome"] == ["preempted"] * 9
    # The heartbeaten ones (still not done) were then finished in a batch: all lost too.
    assert result["lost"] == sorted(result["keys"][2::3])
    with perfectschedd.open(_config(db_url)) as sc:
        assert [i.as_dict() for i in sc.list()] == after_takeover
        assert all(i.next_time == T0 + 3600 for i in sc.list())


@pytest.mark.parametrize("processes", [3])
def test_concurrent_add_of_one_key_has_one_winner(db_url: str, tmp_path: pathlib.Path,
                                                  processes: int) -> None:
    with perfectschedd.open(_config(db_url)) as sc:
        sc.init()
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(processes)
    outs = [tmp_path / f"a{i}.json" for i in range(processes)]
    _run([ctx.Process(target=_adder, args=(db_url, str(o), i, barrier))
          for i, o in enumerate(outs)])
    results = [o.read_text() for o in outs]
    assert sorted(results) == ["added"] + ["exists"] * (processes - 1)
    with perfectschedd.open(_config(db_url)) as sc:
        (info,) = sc.list()
        assert results[int(info.type[1:])] == "added"


def _adder(url: str, out: str, i: int, barrier: Any) -> None:
    with perfectschedd.open(_config(url)) as sc:
        barrier.wait()
        try:
            sc.add("same", f"t{i}", cron="* * * * *", now=T0)
            result = "added"
        except perfectschedd.AlreadyExistsError:
            result = "exists"
    pathlib.Path(out).write_text(result)
