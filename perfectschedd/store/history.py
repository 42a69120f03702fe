"""Run history: append rows (vocabulary/history.py), read a schedule's runs and its
latest outcomes, and bound the table (per key, and by age).  A schedule's runs include
those of its KEY@run-... rows (keys.runs_of)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from perfectschedd.store.base import StoreBase, retried
from perfectschedd.store.keys import chunks, runs_of, starts_with
from perfectschedd.vocabulary.fields import RUN_NOW_MARK, history_from_name, schedule_key
from perfectschedd.vocabulary.history import HISTORY_COLUMNS
from perfectschedd.vocabulary.outcomes import FAILURES, Outcome

_HISTORY_ORDER = tuple(HISTORY_COLUMNS)
# A worker's rows carry exactly these keys unless a schedule names its notifier: those
# pass as they are (one set comparison per run on the finish path, no copy).
_HISTORY_KEYS = frozenset(HISTORY_COLUMNS)


class RunHistory(StoreBase):
    """The history table: runs appended, read, pruned."""

    @retried
    def record_runs(self, runs: Iterable[dict[str, Any]]) -> None:
        """Append history rows (vocabulary/history.py) in one transaction.  A row may
        leave out the optional columns (HISTORY_OPTIONAL: a skipped occurrence has no
        exit code); the backends' statements bind every column, so they become None.  Keys
        that are not columns (what observers of the runs read) are left out."""
        payload = [r if r.keys() == _HISTORY_KEYS else {k: r.get(k) for k in _HISTORY_ORDER}
                   for r in runs]
        if not payload:
            return
        self.backend.record_runs(payload)

    @retried
    def history(self, key: str, limit: int, attempt: int | None = None,
                after_id: int | None = None) -> list[dict[str, Any]]:
        """Newest runs of `key`, including its extra runs (`run`: keys KEY@run-...);
        with `attempt`, only the runs that were that attempt of their occurrence; with
        `after_id`, only those recorded after that row (history_start)."""
        h = self.h
        q = (sa.select(h).where(sa.or_(h.c.key == key,
                                       starts_with(h.c.key, f"{key}{RUN_NOW_MARK}")))
             .order_by(h.c.id.desc()).limit(limit))
        if attempt is not None:
            q = q.where(h.c.attempt == attempt)
        if after_id is not None:
            q = q.where(h.c.id > after_id)
        with self._tx(readonly=True) as conn:
            return [dict(r._mapping) for r in conn.execute(q)]

    @retried
    def history_start(self, key: str) -> int | None:
        """The newest history id of the schedules `key` named before it was last added
        (mark_history_start), or None."""
        m = self.backend.meta
        with self._tx(readonly=True) as conn:
            found = conn.execute(sa.select(m.c.value).where(
                m.c.name == history_from_name(key))).scalar()
        try:
            return None if found is None else int(found)
        except ValueError:
            return None

    @retried
    def last_outcome(self, key: str, before: float, outcomes: Iterable[str]) -> str | None:
        """The outcome of `key`'s latest run among `outcomes` that ended before `before`
        (Unix seconds), or None (notifications: was the run before this one a failure?).
        For a KEY@run-... key (an extra run, an occurrence on a row of its own), the
        latest run of its schedule: KEY's and those of every KEY@run-... row."""
        h = self.h
        runs = runs_of(h.c.key, schedule_key(key)) if RUN_NOW_MARK in key else h.c.key == key
        q = (sa.select(h.c.outcome)
             .where(runs, h.c.finished_at < before, h.c.outcome.in_(list(outcomes)))
             .order_by(h.c.id.desc()).limit(1))
        with self._tx(readonly=True) as conn:
            found = conn.execute(q).scalar()
        return None if found is None else str(found)

    @retried
    def last_outcomes(self, runs: Sequence[tuple[str, float]], outcomes: Iterable[str]
                      ) -> dict[str, str | None]:
        """last_outcome of many keys in one query: for each (key, before), the outcome of
        the key's latest run among `outcomes` that ended before `before`.  The three
        newest such rows of each key are read (the newest is usually the run itself);
        a key with none of them before `before` gets None."""
        keys = sorted({key for key, _ in runs})
        if not keys:
            return {}
        h = self.h
        rank = sa.func.row_number().over(partition_by=h.c.key,
                                         order_by=h.c.id.desc()).label("rank")
        newest = (sa.select(h.c.key, h.c.outcome, h.c.finished_at, rank)
                  .where(h.c.key.in_(keys), h.c.outcome.in_(list(outcomes))).subquery())
        q = (sa.select(newest.c.key, newest.c.outcome, newest.c.finished_at)
             .where(newest.c.rank <= 3).order_by(newest.c.key, newest.c.rank))
        by_key: dict[str, list[tuple[str, float]]] = {}
        with self._tx(readonly=True) as conn:
            for key, outcome, finished in conn.execute(q):
                by_key.setdefault(key, []).append((str(outcome), float(finished)))
        return {key: next((o for o, finished in by_key.get(key, ()) if finished < before),
                          None)
                for key, before in runs}

    @retried
    def last_success_and_failure(self, keys: Sequence[str], chunk: int = 100
                                 ) -> dict[str, tuple[float | None, float | None]]:
        """For each schedule key: when its latest successful run and its latest failed
        one (FAILURES) ended, its KEY@run-... runs included (None: none kept)."""
        h = self.h
        found: dict[str, list[float | None]] = {k: [None, None] for k in keys}
        wanted = (Outcome.SUCCESS.value, *FAILURES)
        with self._tx(readonly=True) as conn:
            for i in range(0, len(keys), chunk):
                part = keys[i:i + chunk]
                q = (sa.select(h.c.key, h.c.outcome, sa.func.max(h.c.finished_at))
                     .where(sa.or_(*(runs_of(h.c.key, k) for k in part)),
                            h.c.outcome.in_(wanted))
                     .group_by(h.c.key, h.c.outcome))
                for key, outcome, ended in conn.execute(q):
                    times = found.get(schedule_key(key))
                    if times is None or ended is None:
                        continue
                    slot = 0 if outcome == Outcome.SUCCESS else 1
                    if times[slot] is None or float(ended) > times[slot]:  # type: ignore[operator]
                        times[slot] = float(ended)
        return {k: (v[0], v[1]) for k, v in found.items()}

    @retried
    def prune_history(self, keep_per_key: int) -> int:
        """Keep only the newest `keep_per_key` runs of each key (bounded history), and of
        each schedule whose runs have keys of their own (KEY@run-...: its extra runs, an
        allow or replace schedule's occurrences, one run per key) the newest
        `keep_per_key` of them all once they alone are more (`history KEY` lists them
        together; at most twice `keep_per_key` are kept until then)."""
        h = self.h
        removed = 0
        # One scan: the keys over the bound, and every KEY@run-... key with its count.
        over = (sa.select(h.c.key, sa.func.count()).group_by(h.c.key)
                .having(sa.or_(sa.func.count() > keep_per_key,
                               h.c.key.contains(RUN_NOW_MARK, autoescape=True))))
        with self._tx(readonly=True) as conn:
            found = [(str(k), int(n)) for k, n in conn.execute(over)]
        marked: dict[str, int] = {}  # schedule -> its KEY@run-... runs, once pruned per key
        for key, n in found:
            if RUN_NOW_MARK in key:
                base = schedule_key(key)
                marked[base] = marked.get(base, 0) + min(n, keep_per_key)
        bounded = [h.c.key == k for k, n in found if n > keep_per_key]
        bounded += [runs_of(h.c.key, b) for b, n in marked.items() if n > keep_per_key]
        for runs in bounded:
            with self._tx() as conn:
                oldest_kept = conn.execute(
                    sa.select(h.c.id).where(runs).order_by(h.c.id.desc())
                    .limit(1).offset(max(keep_per_key - 1, 0))).scalar()
                if oldest_kept is None:
                    continue
                if keep_per_key == 0:
                    oldest_kept += 1
                removed += conn.execute(
                    h.delete().where(runs, h.c.id < oldest_kept)).rowcount
        return removed

    @retried
    def prune_old_history(self, before: float, after_id: int, limit: int
                          ) -> tuple[int, int]:
        """Remove history rows that ended before `before` (Unix time), of every key,
        deleted schedules' too, except the newest run of each schedule that exists (its
        state in `list` and `status`).  Reads at most `limit` rows in id order (the order
        they were written in, so oldest first) from after id `after_id`: one bounded
        step.  Returns (rows removed, the id to go on from: the last old row read; it
        stays where it is once the rows read are recent)."""
        h, t = self.h, self.t
        with self._tx(readonly=True) as conn:
            read = conn.execute(sa.select(h.c.id, h.c.key, h.c.finished_at)
                                .where(h.c.id > after_id).order_by(h.c.id)
                                .limit(limit)).all()
        old = []
        for row in read:
            if row.finished_at is None or row.finished_at >= before:
                break  # the rest are as recent, but for a straggler (next time round)
            old.append(row)
        if not old:
            return 0, after_id
        keys = sorted({str(r.key) for r in old})
        kept: set[int] = set()
        with self._tx(readonly=True) as conn:
            for chunk in chunks(keys, 500):
                live = [str(k) for (k,) in conn.execute(
                    sa.select(t.c.key).where(t.c.key.in_(chunk)))]
                if live:
                    kept.update(int(i) for (i,) in conn.execute(
                        sa.select(sa.func.max(h.c.id)).where(h.c.key.in_(live))
                        .group_by(h.c.key)))
        doomed = [int(r.id) for r in old if int(r.id) not in kept]
        removed = 0
        for chunk in chunks(doomed, 500):
            with self._tx() as conn:
                removed += conn.execute(h.delete().where(h.c.id.in_(chunk))).rowcount
        return removed, int(old[-1].id)


def mark_history_start(conn: Connection, history: sa.Table, meta: sa.Table,
                       keys: Sequence[str]) -> None:
    """Keys added again: the runs of the schedules they named before are not the new
    schedules' (its creator may be another user, who may not read them).  Where such
    runs exist, the newest history id is recorded (history_from_name): history's
    `after_id` shows a reader what follows it.  One key: its runs and its extra
    runs'; a batch: runs under the keys themselves, one query per 500 keys."""
    h, m = history, meta
    keys = [k for k in keys if RUN_NOW_MARK not in k]
    if len(keys) == 1:
        found = [keys[0]] if conn.execute(
            sa.select(h.c.id).where(runs_of(h.c.key, keys[0])).limit(1)).first() \
            else []
    else:
        found = [k for i in range(0, len(keys), 500) for (k,) in conn.execute(
            sa.select(h.c.key).where(h.c.key.in_(keys[i:i + 500])).distinct())]
    if not found:
        return
    newest = str(conn.execute(sa.select(sa.func.max(h.c.id))).scalar())
    names = [history_from_name(k) for k in found]
    for i in range(0, len(names), 500):
        conn.execute(m.delete().where(m.c.name.in_(names[i:i + 500])))
    conn.execute(m.insert(), [{"name": n, "value": newest} for n in names])
