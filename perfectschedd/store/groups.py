"""A schedule's group: the schedule and its rows KEY@run-... (extra runs, `run KEY`, and
the occurrences of an allow or replace schedule), of which one runs at a time
(group_turn decides which, under the base row's lock)."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from perfectschedd.store.base import StoreBase, retried
from perfectschedd.store.keys import runs_of, starts_with
from perfectschedd.store.rows import row_of
from perfectschedd.store.schema import Advance, Row
from perfectschedd.vocabulary.fields import ROW_FIELDS, RUN_NOW_MARK

# Store.group_turn's answers: the member starts (it is the group's holder now), waits, or
# no longer holds its row.
TURN_START, TURN_WAIT, TURN_LOST = "start", "wait", "lost"


class Groups(StoreBase):
    """One run at a time among a schedule and its KEY@run-... rows."""

    @retried
    def mark_extra(self, key: str) -> bool:
        """`run KEY` is about to add an extra run: from now on, claims of KEY check that
        none of its extra runs is running (and the extra runs check KEY).  No fence
        change: a running occurrence keeps its lease."""
        t = self.t
        with self._tx(durable=True) as conn:
            return conn.execute(t.update().where(t.c.key == key)
                                .values(has_extra=1)).rowcount > 0

    @retried
    def extra_runs(self, key: str) -> list[Row]:
        """The extra runs (`run KEY`) of `key` that have not ended."""
        t = self.t
        q = sa.select(t).where(starts_with(t.c.key, f"{key}{RUN_NOW_MARK}"))
        with self._tx(readonly=True) as conn:
            return [row_of(r) for r in conn.execute(q.order_by(t.c.next_run_time))]

    @retried
    def group_busy(self, key: str, base: str, now: int) -> bool:
        """Whether another member of `base`'s group (the schedule and its extra runs
        `base@run-...`) than `key` holds a live lease.  Read after the caller's own claim
        was committed, so of two members claimed at the same time at least one sees the
        other (and gives its occurrence back)."""
        t = self.t
        members = runs_of(t.c.key, base)
        q = (sa.select(t.c.key).where(members, t.c.key != key, t.c.owner.isnot(None),
                                      t.c.next_run_time > now).limit(1))
        with self._tx(readonly=True) as conn:
            return conn.execute(q).first() is not None

    def _group_members(self, conn: Connection, base: str, *conds: Any) -> list[str]:
        """The extra-run rows of `base` (base@run-...) matching `conds`.  LIKE ignores case
        on SQLite and MySQL: the exact prefix is checked here."""
        t = self.t
        prefix = f"{base}{RUN_NOW_MARK}"
        return [k for (k,) in conn.execute(sa.select(t.c.key).where(
            t.c.key.startswith(prefix, autoescape=True), *conds)) if k.startswith(prefix)]

    @retried
    def group_turn(self, key: str, base: str, now: int, *, fence: int | None = None,
                   replace: bool = False) -> str:
        """Whether `key`, a member of `base`'s group (the schedule and its rows
        `base@run-...`: extra runs, and occurrences of an allow or replace schedule),
        may start now: TURN_START (it becomes the group's holder), TURN_WAIT, or
        TURN_LOST (`fence` given: the caller's row no longer holds it).

        Decided under the base row's lock (one transaction), so of members claimed at the
        same time exactly one starts and the others wait: no overlap and no livelock.  A
        member waits while the holder's lease lives, and one of the extra runs waits
        while the base row is held (a base claimed before `run` marked it runs without
        asking).  The base's own occurrence also waits while an extra run is held or due:
        an extra run queued behind a running occurrence goes first.  `replace`: the held
        extra-run rows of the group are deleted first, so that their heartbeats find the
        leases gone and stop their runs (`preempted`)."""
        t = self.t
        with self._tx() as conn:
            row = conn.execute(
                sa.select(t.c.group_holder, t.c.owner, t.c.next_run_time)
                .where(t.c.key == base).with_for_update()).first()
            if fence is not None:
                own = conn.execute(sa.select(t.c.fence).where(t.c.key == key)).scalar()
                if own is None or int(own) != fence:
                    return TURN_LOST
            if row is None:
                return TURN_START  # the schedule is gone (delete took its extra runs)
            holder, base_owner, base_lease = row
            if replace:
                stopped = [k for k in self._group_members(conn, base, t.c.owner.isnot(None))
                           if k != key]
                for i in range(0, len(stopped), 500):
                    conn.execute(t.delete().where(t.c.key.in_(stopped[i:i + 500])))
            if key != base and base_owner is not None and base_lease > now:
                return TURN_WAIT
            if holder is not None and holder != key:
                live = conn.execute(sa.select(t.c.key).where(
                    t.c.key == holder, t.c.owner.isnot(None),
                    t.c.next_run_time > now)).first()
                if live is not None:
                    return TURN_WAIT
            if key == base and self._group_members(conn, base, t.c.paused == 0, sa.or_(
                    sa.and_(t.c.owner.isnot(None), t.c.next_run_time > now),
                    sa.and_(t.c.owner.is_(None), t.c.next_run_time <= now))):
                return TURN_WAIT
            if holder != key:
                conn.execute(t.update().where(t.c.key == base).values(group_holder=key))
            return TURN_START

    @retried
    def group_holder(self, base: str) -> str | None:
        """The member of `base`'s group that runs now, or ran last (group_turn)."""
        t = self.t
        with self._tx(readonly=True) as conn:
            return conn.execute(sa.select(t.c.group_holder).where(t.c.key == base)).scalar()

    @retried
    def group_holders(self, bases: Collection[str]) -> dict[str, str | None]:
        """group_holder of each of `bases` that exists, in one query."""
        if not bases:
            return {}
        t = self.t
        with self._tx(readonly=True) as conn:
            return dict(conn.execute(sa.select(t.c.key, t.c.group_holder)
                                     .where(t.c.key.in_(sorted(bases)))).all())

    @retried
    def split_occurrence(self, advance: Advance, run: Row, due_time: int) -> bool:
        """An occurrence of an allow or replace schedule moves to a row of its own: in
        one transaction, the schedule's row (fenced: `advance` names the claim's fence)
        moves on to its next occurrence, and `run`, a one-off row held by the caller,
        takes the occurrence over with its lease.  False, and nothing written, when the
        lease was lost."""
        t = self.t
        values = {n: getattr(run, n) for n in ROW_FIELDS}
        values.update(paused=int(run.paused), due_time=due_time)
        with self._tx() as conn:
            moved = conn.execute(t.update().where(
                t.c.key == advance.key, t.c.fence == advance.fence).values(
                next_time=advance.next_time, next_run_time=advance.next_run_time, attempt=0,
                owner=None, claimed_at=None, fence=t.c.fence + 1, has_extra=1))
            if moved.rowcount != 1:
                return False
            conn.execute(t.insert().values(**values))
        return True
