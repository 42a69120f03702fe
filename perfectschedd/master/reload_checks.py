"""Whether a reload's configuration may replace the running one: read, with the checks
the daemon's start runs (notify, schedules_dir), and, when it moves to another database,
one this version can make and use.  A refusal is one bounded line; the running
configuration stays.

What a reload then swaps (listeners, database, a new generation of workers) is the
supervisor's (Supervisor.reload).
"""

from __future__ import annotations

import threading

from perfectschedd.config import Config, load, notify_refusal, schedules_dir_refusal
from perfectschedd.errors import ConfigError, NotSupportedError
from perfectschedd.master.database import PAGE_CACHE_KIB
from perfectschedd.store.sql import Store
from perfectschedd.store.urls import check_url

# How long a reload that moves to another database waits to learn whether this version
# may use it (the master's loop waits meanwhile).
RELOAD_CHECK_WAIT = 3.0


def read_new_config(source: str, environment: str | None, running: Config) -> Config:
    """The configuration at `source` as read, or ConfigError (NotSupportedError, OSError:
    whatever reading it raised) saying why it cannot replace `running`."""
    new = load(source, environment)
    refusal = notify_refusal(new) or schedules_dir_refusal(new)
    if refusal is not None:
        raise ConfigError(refusal)
    if (new.url, new.table) != (running.url, running.table):
        check_url(new.url)  # the old store stays unless the new one can be made
        # ... and unless this version may use it: a database it refuses would stop
        # the daemon once its store opened (one that does not answer yet is waited
        # for, as at a start).
        refusal = refusal_of(new)
        if refusal is not None:
            raise ConfigError(f"url: {refusal}")
    return new


def rejection(exc: Exception) -> str:
    """Why a reload was rejected, in one bounded line, never a repr() of what the file
    holds."""
    why = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:500]
    if not isinstance(exc, ConfigError | NotSupportedError | OSError):
        why = f"{type(exc).__name__}: {why}"
    return why


def refusal_of(config: Config, wait: float = RELOAD_CHECK_WAIT) -> str | None:
    """Why this version can never use `config`'s database (Store.refusal), asked on a
    thread of its own for at most `wait` seconds; None when it can, or when the database
    does not answer in time or at all: then nobody can tell yet, and the daemon waits for
    it as at a start."""
    found: list[str | None] = []

    def ask() -> None:
        store = None
        try:
            store = Store(config.url, config.table, config.alive_time, PAGE_CACHE_KIB)
            found.append(store.refusal())
        except Exception:  # noqa: BLE001 - unreachable, or the driver's word: cannot tell
            found.append(None)
        finally:
            if store is not None:
                store.close()

    thread = threading.Thread(target=ask, name="reload-database-check", daemon=True)
    thread.start()
    thread.join(wait)
    return found[0] if found else None
