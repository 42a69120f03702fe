"""One class per database behind one small interface (base.Backend)."""

from __future__ import annotations

from sqlalchemy.engine.url import URL

from perfectschedd.errors import ConfigError
from perfectschedd.store.backends.base import Backend


def open_backend(url: URL, table: str) -> Backend:
    """The backend for `url` (already mapped by store.engine_url).  Each module is
    imported only when used: the other databases' drivers are never loaded."""
    name = url.get_backend_name()
    if name == "sqlite":
        from perfectschedd.store.backends.sqlite import SQLiteBackend

        return SQLiteBackend(url, table)
    if name == "postgresql":
        from perfectschedd.store.backends.postgresql import PostgreSQLBackend

        return PostgreSQLBackend(url, table)
    if name == "mysql":
        from perfectschedd.store.backends.mysql import MySQLBackend

        return MySQLBackend(url, table)
    raise ConfigError(f"url: unsupported database {name!r}")
