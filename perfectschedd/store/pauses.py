"""Pausing: schedules one by one (a user's pause and resume) and everything at once
(pause --all, recorded as a meta row so that schedules added meanwhile join it)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError

from perfectschedd.store.base import StoreBase, retried
from perfectschedd.store.rows import row_of
from perfectschedd.store.schema import Row
from perfectschedd.vocabulary.fields import PAUSED_ALL_META, PAUSED_ALL_REASON


class Pauses(StoreBase):
    """Pause and resume: schedules, and everything (pause --all)."""

    @retried
    def set_paused(self, keys: Sequence[str], paused: bool,
                   moved: Mapping[str, tuple[int, dict[str, Any]]] | None = None, *,
                   sources: Mapping[str, str] | None = None) -> set[str]:
        """Pause or resume these schedules as a user does (paused_reason NULL: a schedule
        paused on its own), in one transaction.  `moved`: key -> (next_time read,
        new times) of schedules resumed without catching up, written only where the row
        is still paused, unheld and at that next_time; `sources`: key -> its new source.
        Returns the keys moved."""
        t = self.t
        with self._tx(durable=True) as conn:
            done = self._move(conn, moved or {}, t.c.paused == 1)
            for i in range(0, len(keys), 500):
                conn.execute(t.update().where(t.c.key.in_(list(keys[i:i + 500])))
                             .values(paused=int(paused), paused_reason=None))
            for key, source in (sources or {}).items():
                conn.execute(t.update().where(t.c.key == key).values(source=source))
        return done

    def _move(self, conn: Connection, moved: Mapping[str, tuple[int, dict[str, Any]]],
              still: Any) -> set[str]:
        t = self.t
        done = set()
        for key, (next_time, values) in moved.items():
            res = conn.execute(t.update().where(t.c.key == key, still, t.c.owner.is_(None),
                                                t.c.next_time == next_time).values(**values))
            if res.rowcount:
                done.add(key)
        return done

    @retried
    def paused_all(self) -> str | None:
        """The meta row that says everything is paused (its text), None if nothing is."""
        m = self.backend.meta
        with self._tx(readonly=True) as conn:
            found = conn.execute(sa.select(m.c.value).where(m.c.name == PAUSED_ALL_META)
                                 ).scalar()
        return None if found is None else str(found)

    @retried
    def pause_all(self, state: str) -> int:
        """Record that everything is paused (`state`: the meta row's text; an existing one
        is kept) and pause every schedule not paused yet, with PAUSED_ALL_REASON, in one
        transaction.  Returns how many it paused."""
        m, t = self.backend.meta, self.t
        for _ in range(3):
            try:
                with self._tx(durable=True) as conn:
                    paused = conn.execute(t.update().where(t.c.paused == 0).values(
                        paused=1, paused_reason=PAUSED_ALL_REASON)).rowcount
                    if conn.execute(sa.select(m.c.name).where(m.c.name == PAUSED_ALL_META)
                                    ).first() is None:
                        conn.execute(m.insert().values(name=PAUSED_ALL_META, value=state))
                return int(paused)
            except IntegrityError:
                continue  # another host's pause --all recorded it meanwhile: ours is done
        raise RuntimeError("pause --all: the meta row kept changing")  # pragma: no cover

    @retried
    def join_pause_all(self, keys: Sequence[str]) -> int:
        """Pause these schedules, just added, with PAUSED_ALL_REASON if everything is
        paused (a pause --all recorded while they were being added)."""
        m, t = self.backend.meta, self.t
        everything = sa.select(m.c.name).where(m.c.name == PAUSED_ALL_META).exists()
        with self._tx(durable=True) as conn:
            return int(sum(conn.execute(t.update().where(
                t.c.key.in_(list(keys[i:i + 500])), t.c.paused == 0, everything).values(
                paused=1, paused_reason=PAUSED_ALL_REASON)).rowcount
                for i in range(0, len(keys), 500)))

    @retried
    def paused_with_all(self) -> list[Row]:
        """The schedules pause --all paused (not those paused on their own)."""
        t = self.t
        with self._tx(readonly=True) as conn:
            return [row_of(r) for r in conn.execute(sa.select(t).where(
                t.c.paused == 1, t.c.paused_reason == PAUSED_ALL_REASON))]

    @retried
    def resume_all(self, moved: Mapping[str, tuple[int, dict[str, Any]]] | None = None
                   ) -> tuple[int, set[str]]:
        """End the cluster-wide pause: delete its meta row and resume what pause --all
        paused, leaving schedules paused on their own paused, in one transaction.
        `moved`: as set_paused's.  Returns (how many it resumed, the keys moved)."""
        m, t = self.backend.meta, self.t
        marked = sa.and_(t.c.paused == 1, t.c.paused_reason == PAUSED_ALL_REASON)
        with self._tx(durable=True) as conn:
            conn.execute(m.delete().where(m.c.name == PAUSED_ALL_META))
            done = self._move(conn, moved or {}, marked)
            resumed = conn.execute(t.update().where(marked).values(
                paused=0, paused_reason=None)).rowcount
        return int(resumed), done

    @retried
    def count_paused(self, with_all: bool) -> int:
        """How many schedules pause --all paused (`with_all`), or are paused on their own."""
        t = self.t
        reason = t.c.paused_reason
        which = reason == PAUSED_ALL_REASON if with_all else sa.or_(
            reason.is_(None), reason != PAUSED_ALL_REASON)
        with self._tx(readonly=True) as conn:
            return int(conn.execute(sa.select(sa.func.count()).select_from(t).where(
                t.c.paused == 1, which)).scalar() or 0)
