"""Database URLs: a user's URL mapped to the SQLAlchemy URL with the driver this
installation has, and refused (ConfigError) when no store could be made of it."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.engine.url import URL, make_url

from perfectschedd.errors import ConfigError
from perfectschedd.store.backends.sqlite import missing_directory

SA_MAJOR = int(sa.__version__.split(".")[0])


def engine_url(url: str) -> URL:
    """Map a user's URL to a SQLAlchemy URL with the driver this installation has."""
    try:
        u = make_url(url)
    except Exception as exc:  # noqa: BLE001 - any parse failure is a bad url
        # Not the URL itself: it may hold a password.
        raise ConfigError(f"url: cannot parse it: {str(exc)[:200]}") from None
    backend, _, driver = u.drivername.partition("+")
    if backend == "postgres":
        backend = "postgresql"
    if backend == "postgresql" and not driver:
        # SQLAlchemy 1.4 (Debian 12) has no psycopg 3 dialect; 2.x does.
        driver = "psycopg" if SA_MAJOR >= 2 else "psycopg2"
    if backend == "mysql" and not driver:
        driver = "pymysql"
    if backend not in ("sqlite", "postgresql", "mysql"):
        raise ConfigError(f"url: unsupported database {backend!r}")
    return u.set(drivername=f"{backend}+{driver}" if driver else backend)


def check_url(url: str) -> None:
    """Refuse, as ConfigError, a URL no Store could be made of: unparsable, an in-memory
    SQLite database (each process would have its own) or one in a directory that does
    not exist, a driver that is not installed.  Connects to nothing."""
    u = engine_url(url)
    if u.get_backend_name() == "sqlite" and (u.database or "") in ("", ":memory:"):
        raise ConfigError("url: the SQLite database must be a file (sqlite:///path)")
    if u.get_backend_name() == "sqlite" and (missing := missing_directory(u)):
        raise ConfigError(missing)
    try:
        dialect = u.get_dialect()
        load_dbapi = getattr(dialect, "import_dbapi", None) or dialect.dbapi
        load_dbapi()
    except Exception as exc:  # noqa: BLE001 - NoSuchModuleError, ImportError: one line
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise ConfigError(f"url: no driver for {u.drivername}: {first}") from None
