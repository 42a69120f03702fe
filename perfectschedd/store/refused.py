"""Rows refused: a row whose type names a schedules file's exec entry (exec:K) but that
is not that entry's own row is paused with the reason, never run (SPEC "Privilege
model"; the rule is vocabulary/fields.py's foreign_exec_row)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import sqlalchemy as sa

from perfectschedd.store.base import StoreBase, retried
from perfectschedd.store.keys import starts_with
from perfectschedd.vocabulary.fields import (
    EXEC_TYPE,
    REFUSED_ROW_REASON,
    exec_entry_key,
    foreign_exec_row,
    refused_line,
    refused_reason,
    schedule_key,
)


class RefusedRow(NamedTuple):
    """A row whose type names a schedules file's exec entry whose own row it is not
    (fields.foreign_exec_row): paused with `reason`, never run."""

    key: str
    type: str
    creator: int | None
    reason: str

    def line(self) -> str:
        return refused_line(self.key, self.type, self.creator, self.reason)


class RefusedRows(StoreBase):
    """Refusing the rows that are not their exec entry's own."""

    @retried
    def refuse_foreign_exec_rows(self, entry_sources: Mapping[str, str] | None = None
                                 ) -> list[RefusedRow]:
        """Pause, with the reason, every row whose type names a schedules file's exec
        entry (exec:K) and that is not that entry's own (fields.foreign_exec_row;
        `entry_sources`: K -> the file holding entry K on this host, where known).
        Returns the rows it refused now; those refused before stay so, unreported."""
        t = self.t
        q = sa.select(t.c.key, t.c.type, t.c.source, t.c.paused, t.c.paused_reason,
                      t.c.creator).where(starts_with(t.c.type, EXEC_TYPE))
        with self._tx(readonly=True) as conn:
            rows = conn.execute(q).all()
        origin = {r.key: (r.type, r.source) for r in rows}
        sources = entry_sources or {}
        refused: list[RefusedRow] = []
        for r in rows:
            why = foreign_exec_row(r.key, r.type, origin.get(schedule_key(r.key)),
                                   sources.get(exec_entry_key(r.type) or ""))
            if why is None or (r.paused and (r.paused_reason or "").startswith(
                    REFUSED_ROW_REASON)):
                continue
            refused.append(RefusedRow(r.key, r.type, r.creator, refused_reason(why)))
        if not refused:
            return []
        done = []
        with self._tx(durable=True) as conn:
            for item in refused:
                if conn.execute(t.update().where(t.c.key == item.key, t.c.type == item.type)
                                .values(paused=1, paused_reason=item.reason)).rowcount:
                    done.append(item)
        return done

    @retried
    def refused_rows(self, limit: int = 100) -> list[RefusedRow]:
        """Up to `limit` rows paused as refused (refuse_foreign_exec_rows, or a worker's
        refusal), by key."""
        t = self.t
        q = (sa.select(t.c.key, t.c.type, t.c.creator, t.c.paused_reason)
             .where(t.c.paused == 1, starts_with(t.c.paused_reason, REFUSED_ROW_REASON))
             .order_by(t.c.key).limit(limit))
        with self._tx(readonly=True) as conn:
            return [RefusedRow(r.key, r.type, r.creator, r.paused_reason)
                    for r in conn.execute(q)]
