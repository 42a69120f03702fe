"""One class per database behind one small interface (base.Backend)."""

from __future__ import annotations

from sqlalchemy.engine.url import URL

from perfectschedd.errors import ConfigError
from perfectschedd.store.backends.base import Backend


def open_backend(url: URL, table: str, deadline: float = 10.0) -> Backend:
    """The backend for `url` (already mapped by urls.engine_url).  Each module is
    imported only when used: the other databases' drivers are never loaded.  `deadline`:
    seconds a statement to a server may go unanswered (store/deadline.py)."""
    name = url.get_backend_name()
    if name == "sqlite":
        from perfectschedd.store.backends.sqlite import SQLiteBackend

        return SQLiteBackend(url, table)
    if name == "postgresql":
        from perfectschedd.store.backends.postgresql import PostgreSQLBackend

        return PostgreSQLBackend(url, table, deadline)
    if name == "mysql":
        from perfectschedd.store.backends.mysql import MySQLBackend

        return MySQLBackend(url, table, deadline)
    raise ConfigError(f"url: unsupported database {name!r}")
