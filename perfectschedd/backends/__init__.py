"""One class per database behind one small interface (base.Backend)."""

from __future__ import annotations

from sqlalchemy.engine.url import URL

from ..errors import ConfigError
from .base import Backend


def open_backend(url: URL, table: str) -> Backend:
    """The backend for `url` (already mapped by store.engine_url).  Each module is
    imported only when used: the other databases' drivers are never loaded."""
    name = url.get_backend_name()
    if name == "sqlite":
        from .sqlite import SQLiteBackend

        return SQLiteBackend(url, table)
    if name == "postgresql":
        from .postgresql import PostgreSQLBackend

        return PostgreSQLBackend(url, table)
    if name == "mysql":
        from .mysql import MySQLBackend

        return MySQLBackend(url, table)
    raise ConfigError(f"url: unsupported database {name!r}")
