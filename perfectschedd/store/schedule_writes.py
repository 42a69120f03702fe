"""The user-side writes of schedules' rows: add, change, delete (and the markers of a
schedules file's forced deletes, written with the delete).  Each commits durably: a
user is told it is done once it returns."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError

from perfectschedd.store.base import StoreBase, retried
from perfectschedd.store.history import mark_history_start
from perfectschedd.store.rows import new_row_values, row_of
from perfectschedd.store.schema import Row
from perfectschedd.vocabulary.fields import DELETED_META, RUN_NOW_MARK, deleted_marker_name


class ScheduleWrites(StoreBase):
    """A user's writes of schedules' rows, and the markers of forced deletes."""

    @retried
    def insert(self, row: Row) -> bool:
        """Insert a schedule; False if the key exists."""
        values = new_row_values(row)
        try:
            with self._tx(durable=True) as conn:
                conn.execute(self.t.insert().values(**values))
                drop_deleted(conn, self.backend.meta, [row.key])
                mark_history_start(conn, self.h, self.backend.meta, [row.key])
        except IntegrityError:
            return False
        return True

    @retried
    def insert_many(self, rows: Sequence[Row]) -> None:
        """Bulk insert; raises IntegrityError (nothing stored) if any key exists."""
        payload = [new_row_values(r) for r in rows]
        with self._tx(durable=True) as conn:
            conn.execute(self.t.insert(), payload)
            drop_deleted(conn, self.backend.meta, [r.key for r in rows])
            mark_history_start(conn, self.h, self.backend.meta, [r.key for r in rows])

    @retried
    def delete(self, key: str, marker: Callable[[Row], str | None] | None = None) -> int:
        """Delete a schedule and its extra runs (`run`: KEY@run-..., queued or running:
        a running one loses its lease and is stopped); the rows deleted, 0 if none.
        `marker`: gives, from the row as it is deleted, the value of the meta row that
        records the delete as forced (a schedules file's schedule: deleted_markers), or
        None; written with it, in its transaction.  From the row read here, not before:
        an entry a convergence changed in between would otherwise be marked as it was,
        and come back."""
        t, m = self.t, self.backend.meta
        with self._tx(durable=True) as conn:
            if marker is None:
                row = conn.execute(sa.select(t.c.has_extra).where(t.c.key == key)).first()
            else:
                # Locked (PostgreSQL, MySQL; SQLite's write transaction holds the file):
                # no change commits between this read and the delete.
                row = conn.execute(
                    sa.select(t).where(t.c.key == key).with_for_update()).first()
            if row is None:
                return 0
            value = None if marker is None else marker(row_of(row))
            if value is not None:
                name = deleted_marker_name(key)
                conn.execute(m.delete().where(m.c.name == name))
                conn.execute(m.insert().values(name=name, value=value))
            keys = [key]
            if row.has_extra:
                prefix = f"{key}{RUN_NOW_MARK}"
                # LIKE ignores case on SQLite and MySQL: the exact prefix is checked here.
                keys += [k for (k,) in conn.execute(sa.select(t.c.key).where(
                    t.c.key.startswith(prefix, autoescape=True))) if k.startswith(prefix)]
            deleted = 0
            for i in range(0, len(keys), 500):
                deleted += conn.execute(t.delete().where(t.c.key.in_(keys[i:i + 500]))).rowcount
            return deleted

    @retried
    def update(self, key: str, values: dict[str, Any], *, take_lease: bool) -> bool:
        """Change a schedule's fields; `take_lease` preempts a current holder."""
        if take_lease:
            values = {**values, "fence": self.t.c.fence + 1, "owner": None, "claimed_at": None}
        with self._tx(durable=True) as conn:
            res = conn.execute(self.t.update().where(self.t.c.key == key).values(**values))
            return res.rowcount > 0

    @retried
    def deleted_markers(self) -> dict[str, str]:
        """The markers of forced deletes (delete's `marker`): meta row name -> value."""
        m = self.backend.meta
        with self._tx(readonly=True) as conn:
            # LIKE ignores case on SQLite and MySQL: the exact prefix is checked here.
            return {str(name): str(value) for name, value in conn.execute(
                sa.select(m.c.name, m.c.value).where(m.c.name.startswith(DELETED_META)))
                if str(name).startswith(DELETED_META)}

    @retried
    def drop_deleted_markers(self, names: Sequence[str]) -> None:
        """Forget these markers of forced deletes (their entries may be added again)."""
        m = self.backend.meta
        with self._tx(durable=True) as conn:
            for i in range(0, len(names), 500):
                conn.execute(m.delete().where(m.c.name.in_(list(names[i:i + 500]))))


def drop_deleted(conn: Connection, meta: sa.Table, keys: Sequence[str]) -> None:
    """A key added again, by whatever way, ends its forced delete's marker (delete)."""
    m = meta
    names = [deleted_marker_name(k) for k in keys if RUN_NOW_MARK not in k]
    if len(names) > 1:
        # A batch: the few markers that exist are read in one query, and only theirs
        # deleted, instead of one DELETE per 500 keys that finds none.
        wanted = set(names)
        names = [n for (n,) in conn.execute(sa.select(m.c.name).where(
            m.c.name.startswith(DELETED_META))) if n in wanted]
    for i in range(0, len(names), 500):
        conn.execute(m.delete().where(m.c.name.in_(names[i:i + 500])))
