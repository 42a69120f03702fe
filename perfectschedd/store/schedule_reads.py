"""Reads of schedules' rows as they are: by key, by source, by prefix in pages, the
held ones, the types present."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import sqlalchemy as sa

from perfectschedd.store.base import StoreBase, retried
from perfectschedd.store.keys import starts_with
from perfectschedd.store.rows import row_of
from perfectschedd.store.schema import Row
from perfectschedd.vocabulary.fields import SOURCE_FILE


class ScheduleReads(StoreBase):
    """Schedules' rows as stored (schema.Row)."""

    @retried
    def rows_of(self, keys: Sequence[str] = (), sources: Sequence[str] = ()) -> list[Row]:
        """The rows with these keys or from these sources (schedules files), read in
        slices of IN lists."""
        t = self.t
        found: dict[str, Row] = {}
        with self._tx(readonly=True) as conn:
            for column, values in ((t.c.key, list(keys)), (t.c.source, list(sources))):
                for i in range(0, len(values), 500):
                    q = sa.select(t).where(column.in_(values[i:i + 500]))
                    for r in conn.execute(q):
                        found.setdefault(r._mapping["key"], row_of(r))
        return list(found.values())

    @retried
    def file_sources(self) -> list[str]:
        """The sources of schedules that came from schedules files (file:NAME)."""
        t = self.t
        q = sa.select(t.c.source).where(t.c.source.startswith(SOURCE_FILE)).distinct()
        with self._tx(readonly=True) as conn:
            return [r[0] for r in conn.execute(q)]

    @retried
    def get(self, key: str) -> Row | None:
        with self._tx(readonly=True) as conn:
            r = conn.execute(sa.select(self.t).where(self.t.c.key == key)).first()
        return row_of(r) if r is not None else None

    @retried
    def exists(self, key: str) -> bool:
        with self._tx(readonly=True) as conn:
            return conn.execute(
                sa.select(self.t.c.key).where(self.t.c.key == key)).first() is not None

    @retried
    def rows(self, *, prefix: str | None = None, limit: int | None = None,
             after_key: str | None = None) -> list[Row]:
        q = sa.select(self.t).order_by(self.t.c.key)
        if prefix:
            q = q.where(starts_with(self.t.c.key, prefix))
        if after_key is not None:
            q = q.where(self.t.c.key > after_key)
        if limit is not None:
            q = q.limit(limit)
        with self._tx(readonly=True) as conn:
            return [row_of(r) for r in conn.execute(q)]

    @retried
    def running(self) -> list[Row]:
        with self._tx(readonly=True) as conn:
            res = conn.execute(sa.select(self.t).where(self.t.c.owner.isnot(None))
                               .order_by(self.t.c.claimed_at))
            return [row_of(r) for r in res]

    @retried
    def types_present(self, limit: int = 10_000) -> list[str]:
        """The task types schedules have (for routes whose type is a pattern)."""
        t = self.t
        with self._tx(readonly=True) as conn:
            return [r[0] for r in conn.execute(
                sa.select(t.c.type).distinct().order_by(t.c.type).limit(limit))]

    @retried
    def keys_matching(self, bad: Callable[[str], bool], limit: int = 100,
                      slice_rows: int = 1000) -> list[str]:
        """Up to `limit` schedule keys for which `bad(key)` is true, the table read in
        key order in slices of `slice_rows` (never all of it in memory).  Small slices:
        the objects of one slice are freed, but the allocator keeps the memory they took
        (slices of 10,000 left the master 2 MiB larger at 100,000 schedules)."""
        t = self.t
        found: list[str] = []
        after = ""
        while len(found) < limit:
            q = (sa.select(t.c.key).where(t.c.key > after).order_by(t.c.key)
                 .limit(slice_rows))
            with self._tx(readonly=True) as conn:
                keys = [r[0] for r in conn.execute(q)]
            if not keys:
                break
            found.extend(k for k in keys if bad(k))
            after = keys[-1]
        return found[:limit]
