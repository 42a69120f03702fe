"""What status, /metrics and `list` say of the schedules as a whole: counts, states
(vocabulary/states.py) with each row's latest run, the overdue and the unclaimed, the
rows with series of their own.  Each is one query, or a few, at any size."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import sqlalchemy as sa

from perfectschedd.store.base import StoreBase, retried
from perfectschedd.store.keys import starts_with
from perfectschedd.store.rows import row_of
from perfectschedd.store.schema import Row
from perfectschedd.vocabulary import states
from perfectschedd.vocabulary.fields import RUN_NOW_MARK
from perfectschedd.vocabulary.outcomes import FAILURES, Outcome


class Summaries(StoreBase):
    """The schedules as a whole: counts, states, what is late or unclaimed."""

    @retried
    def counts(self, now: int) -> dict[str, int]:
        """Totals for status and metrics; `overdue` counts through the due index only."""
        t = self.t
        with self._tx(readonly=True) as conn:
            total = conn.execute(sa.select(sa.func.count()).select_from(t)).scalar() or 0
            paused = conn.execute(sa.select(sa.func.count()).select_from(t)
                                  .where(t.c.paused == 1)).scalar() or 0
            due = conn.execute(sa.select(sa.func.count()).select_from(t).where(
                t.c.paused == 0, t.c.next_run_time <= now, t.c.owner.is_(None))).scalar() or 0
            running = conn.execute(sa.select(sa.func.count()).select_from(t).where(
                t.c.owner.isnot(None), t.c.next_run_time > now)).scalar() or 0
        return {"schedules": total, "paused": paused, "due": due, "running": running}

    def next_due(self, limit: int) -> list[tuple[str, str, int]]:
        """(key, type, run time) of the `limit` unpaused schedules that run next, not
        taken: read in the claim's own index order, so as cheap at a million schedules as
        at ten (a second sort key would sort every unpaused row on each reading)."""
        t = self.t
        with self._tx(readonly=True) as conn:
            rows = conn.execute(sa.select(t.c.key, t.c.type, t.c.next_run_time)
                                .where(t.c.paused == 0, t.c.owner.is_(None))
                                .order_by(t.c.next_run_time).limit(limit)).all()
        return [(str(k), str(ty), int(n)) for k, ty, n in rows]

    def _last_run(self) -> tuple[sa.sql.FromClause, list[Any]]:
        """The schedules table outer-joined to each row's latest history row (its
        outcome, attempt, end and, where the history has one, error text; NULLs when the
        key has none), and those columns: one probe of the (key, id) index per schedule,
        one query for any number of them."""
        t, h = self.t, self.h
        h2 = h.alias("h_latest")
        last_id = (sa.select(sa.func.max(h2.c.id)).where(h2.c.key == t.c.key)
                   .correlate(t).scalar_subquery())
        columns = [h.c.outcome.label("last_outcome"), h.c.attempt.label("last_attempt"),
                   h.c.finished_at.label("last_finished_at")]
        # The history's error text, once a version that records it made the column.
        error = h.c.get("error")  # type: ignore[no-untyped-call]
        columns.append((error if error is not None else sa.null()).label("last_error"))
        return t.outerjoin(h, h.c.id == last_id), columns

    @staticmethod
    def _last_of(m: Any) -> dict[str, Any] | None:
        if m["last_outcome"] is None:
            return None
        return {"outcome": m["last_outcome"], "attempt": m["last_attempt"],
                "finished_at": m["last_finished_at"], "error": m["last_error"]}

    @retried
    def rows_with_last_run(self, *, prefix: str | None = None, limit: int | None = None,
                           after_key: str | None = None
                           ) -> list[tuple[Row, dict[str, Any] | None]]:
        """rows(), each with its latest run (outcome, attempt, finished_at, error; None:
        no run recorded), in one query."""
        t = self.t
        joined, last = self._last_run()
        q = sa.select(t, *last).select_from(joined).order_by(t.c.key)
        if prefix:
            q = q.where(starts_with(t.c.key, prefix))
        if after_key is not None:
            q = q.where(t.c.key > after_key)
        if limit is not None:
            q = q.limit(limit)
        with self._tx(readonly=True) as conn:
            return [(row_of(r), self._last_of(r._mapping)) for r in conn.execute(q)]

    @retried
    def state_summary(self, now: int, problems: int = 1000, overdue: int = 500
                      ) -> dict[str, Any]:
        """What status and /metrics say of the schedules' states (vocabulary/states.py):
        `counts` by state; `problems`: up to `problems` rows retrying or whose latest run
        failed, by key, each with its latest run; `overdue`: up to `overdue` rows due and
        not held, oldest due first (the due index)."""
        t = self.t
        joined, last = self._last_run()
        outcome = last[0]
        retrying = sa.and_(t.c.attempt > 0, sa.or_(outcome.is_(None),
                                                     outcome != Outcome.LATER.value))
        failed = outcome.in_(FAILURES)
        unheld = sa.and_(t.c.paused == 0, t.c.owner.is_(None))
        cases = {
            states.PAUSED: t.c.paused != 0,
            states.RUNNING: sa.and_(t.c.paused == 0, t.c.owner.isnot(None)),
            states.RETRYING: sa.and_(unheld, retrying),
            states.FAILED: sa.and_(unheld, sa.not_(retrying), failed),
        }
        sums = [sa.func.sum(sa.case((cond, 1), else_=0)).label(name)
                for name, cond in cases.items()]
        total = sa.func.count().label("total")
        with self._tx(readonly=True) as conn:
            r = conn.execute(sa.select(total, *sums).select_from(joined)).first()
            counts = {name: int(getattr(r, name) or 0) for name in cases}
            counts[states.OK] = int(r.total or 0) - sum(counts.values())
            bad = conn.execute(
                sa.select(t, *last).select_from(joined)
                .where(unheld, sa.or_(retrying, failed)).order_by(t.c.key)
                .limit(problems)).all()
        return {"counts": counts,
                "problems": [(row_of(r), self._last_of(r._mapping)) for r in bad],
                "overdue": self.overdue_rows(now, overdue) if overdue else []}

    @retried
    def overdue_rows(self, now: int, limit: int = 500) -> list[Row]:
        """Up to `limit` rows due and not held, oldest due first (the due index: cheap at
        any size, unlike state_summary's states)."""
        t = self.t
        with self._tx(readonly=True) as conn:
            late = conn.execute(
                sa.select(t).where(t.c.paused == 0, t.c.owner.is_(None),
                                   t.c.next_run_time <= now)
                .order_by(t.c.next_run_time).limit(limit)).all()
        return [row_of(r) for r in late]

    @retried
    def unclaimed(self, due_before: int, limit: int = 100) -> dict[str, int]:
        """Occurrences due before `due_before` that nobody holds, by type (the `limit`
        types with most of them): work no live worker takes."""
        t = self.t
        n = sa.func.count().label("n")
        q = (sa.select(t.c.type, n).where(t.c.paused == 0, t.c.next_run_time < due_before,
                                          t.c.owner.is_(None))
             .group_by(t.c.type).order_by(n.desc()).limit(limit))
        with self._tx(readonly=True) as conn:
            return {r[0]: int(r[1]) for r in conn.execute(q)}

    @retried
    def series_rows(self, route_types: Collection[str], limit: int) -> tuple[list[Row], int]:
        """The schedules with series of their own on /metrics (docs/metrics.md): those
        whose policy says `metrics: true`, and those of `route_types` (their route's
        default) that do not say false.  Up to `limit` of them: files' first, then root's,
        then by key (a member's thousand cannot push root's out), and how many there are
        in all.  Extra runs' rows (KEY@run-...) are their schedule's, not listed."""
        t = self.t
        chosen = t.c.policy.like('%"metrics":true%')
        if route_types:
            chosen = sa.or_(chosen, sa.and_(
                t.c.type.in_(sorted(route_types)),
                sa.or_(t.c.policy.is_(None), sa.not_(t.c.policy.like('%"metrics":false%')))))
        chosen = sa.and_(chosen, sa.not_(t.c.key.contains(RUN_NOW_MARK, autoescape=True)))
        first = sa.case((t.c.source.isnot(None), 0), (t.c.creator == 0, 1), else_=2)
        with self._tx(readonly=True) as conn:
            total = int(conn.execute(sa.select(sa.func.count()).select_from(t)
                                     .where(chosen)).scalar() or 0)
            rows = conn.execute(sa.select(t).where(chosen).order_by(first, t.c.key)
                                .limit(limit)).all() if limit and total else []
        return [row_of(r) for r in rows], total

    @retried
    def type_counts(self, task_type: str | None = None) -> dict[str, int]:
        """Schedules by task type (one type's, or every type's), the extra runs of `run
        KEY` left out: one grouped count, in the database, at any size."""
        t = self.t
        query = sa.select(t.c.type, sa.func.count()).where(
            ~t.c.key.contains(RUN_NOW_MARK, autoescape=True)).group_by(t.c.type)
        if task_type is not None:
            query = query.where(t.c.type == task_type)
        with self._tx(readonly=True) as conn:
            return {str(ty): int(n) for ty, n in conn.execute(query)}
