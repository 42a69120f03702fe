"""The hosts that use the database: each records itself (what it runs, when it was last
seen), and which nodes are at work, those too old to record themselves included."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError

from perfectschedd.store.base import StoreBase, retried
from perfectschedd.store.version import SCHEMA_VERSION


class Hosts(StoreBase):
    """The hosts table, and the nodes at work."""

    @retried
    def record_host(self, name: str, version: str, pid: int, started_at: float,
                    now: float) -> None:
        """This host uses the database now, running `version` (insert or update)."""
        hs = self.backend.hosts
        values = {"version": version, "schema_version": SCHEMA_VERSION,
                  "pid": pid, "started_at": started_at, "last_seen": now}
        with self._tx() as conn:
            if conn.execute(hs.update().where(hs.c.name == name).values(**values)).rowcount:
                return
        try:
            with self._tx() as conn:
                conn.execute(hs.insert().values(name=name, **values))
        except IntegrityError:  # a twin (same node_name) inserted it meanwhile
            with self._tx() as conn:
                conn.execute(hs.update().where(hs.c.name == name).values(**values))

    @retried
    def forget_host(self, name: str, pid: int) -> None:
        """A clean stop: the host's row goes, unless another daemon of that name took it."""
        hs = self.backend.hosts
        with self._tx() as conn:
            conn.execute(hs.delete().where(hs.c.name == name, hs.c.pid == pid))

    @retried
    def hosts(self, forget_before: float | None = None) -> list[dict[str, Any]]:
        """Every host recorded, by name; rows last seen before `forget_before` are
        deleted first (hosts gone for good)."""
        hs = self.backend.hosts
        if forget_before is not None:
            with self._tx() as conn:
                conn.execute(hs.delete().where(hs.c.last_seen < forget_before))
        with self._tx(readonly=True) as conn:
            return [dict(r._mapping) for r in conn.execute(sa.select(hs).order_by(hs.c.name))]

    @retried
    def nodes_at_work(self, since: float, recent_runs: int = 2000) -> set[str]:
        """Names of the nodes that hold a lease now or recorded a run since `since` (among
        the newest `recent_runs`): hosts of every version, those that record themselves
        in the hosts table and those too old to (0.1.0)."""
        t, h = self.t, self.h
        with self._tx(readonly=True) as conn:
            owners = [r[0] for r in conn.execute(
                sa.select(t.c.owner).where(t.c.owner.isnot(None)).distinct())]
            recent = (sa.select(h.c.worker, h.c.finished_at).order_by(h.c.id.desc())
                      .limit(recent_runs).subquery())
            workers = [r[0] for r in conn.execute(
                sa.select(recent.c.worker).where(recent.c.finished_at >= since).distinct())]
        return {w.rsplit(":", 1)[0] for w in (*owners, *workers) if w}
