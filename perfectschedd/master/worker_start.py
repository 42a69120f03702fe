"""A worker's start, in the child just forked from the master (Supervisor._fork_worker):
it lets go of what is the master's (its signal handlers, log writer, selector, pipes and
listening sockets, pooled database connections, metric files), then runs the worker
(worker/process.py) on the master's open store when that fits
(MasterDatabase.store_for_worker).  It never returns into the master's code: it returns
the worker's exit code.

Imported by the master just before its first fork, so that what it loads is shared with
every worker copy-on-write.
"""

from __future__ import annotations

import logging
import os
import selectors
import signal
from collections.abc import Callable

from perfectschedd import logsetup
from perfectschedd.config import Config
from perfectschedd.errors import EXIT_UNUSABLE_DATABASE, SchemaError, first_line
from perfectschedd.master.database import MasterDatabase
from perfectschedd.metrics import counters
from perfectschedd.metrics.type_labels import exact_types
from perfectschedd.worker import process

log = logging.getLogger("perfectschedd")


def run_worker(config: Config, index: int, wake_r: int, alive_w: int, master_pid: int,
               db: MasterDatabase, sel: selectors.BaseSelector,
               master_fds: Callable[[], list[int]]) -> int:
    """Worker `index`, reading its wake pipe `wake_r` and writing reports to `alive_w`;
    `master_fds`: the master's descriptors the worker closes (its self-pipe, listeners,
    the other workers' pipes)."""
    try:
        _let_go(config, db, sel, master_fds())
        return process.run(config, index, wake_r, alive_w, master_pid,
                           db.store_for_worker(config))
    except SchemaError as exc:
        # The master says it as an error, once: it finds the same on its own.
        log.info("worker %d cannot use the database: %s", index, first_line(exc))
        return EXIT_UNUSABLE_DATABASE
    except BaseException:  # noqa: BLE001 - never return into the master's code
        log.exception("worker %d crashed", index)
        return 1
    finally:
        logsetup.shutdown()
        logging.shutdown()


def _let_go(config: Config, db: MasterDatabase, sel: selectors.BaseSelector,
            fds: list[int]) -> None:
    logsetup.after_fork()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    # Until the worker installs its handlers, a USR2 or reload sent to the whole
    # group must not kill it (their default action is to terminate).
    for sig in (signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)
    sel.close()
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    db.after_fork()
    counters.after_fork_in_worker(exact_types(config.routes))
