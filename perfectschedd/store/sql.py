"""The Store: schedules and run history in SQL, through SQLAlchemy Core, what every
database does alike.  What differs (engine options, the worker's claim and finish,
history appends, which errors mean "try again") is a backend's (backends/); the tables
and their rules are schema.py's.

Store is one class made of one mixin per job, each in its module: its methods are what
callers use (`store.claim(...)`, `store.history(...)`), and a mixin keeps that one flat
surface while the code of each job reads on its own.  Composition (store.leases.claim)
would have renamed every call in the daemon, or needed a delegating method per method.
Every mixin is a StoreBase (base.py: the backend, its tables, transactions, retries).
"""

from __future__ import annotations

from perfectschedd.store.groups import Groups
from perfectschedd.store.history import RunHistory
from perfectschedd.store.hosts import Hosts
from perfectschedd.store.leases import Leases
from perfectschedd.store.pauses import Pauses
from perfectschedd.store.schedule_reads import ScheduleReads
from perfectschedd.store.schedule_writes import ScheduleWrites
from perfectschedd.store.summaries import Summaries
from perfectschedd.store.tokens import ApiTokens
from perfectschedd.store.upgrade import SchemaUpgrade


class Store(SchemaUpgrade, ScheduleWrites, ScheduleReads, Summaries, Pauses, Leases, Groups,
            RunHistory, Hosts, ApiTokens):
    """Schedules and run history in one database; safe for many threads of one process.

    Create one per process, after fork (connections must not cross a fork), or call
    after_fork() in the child before using one the parent made.

    Opening (upgrade.py: init, refusal; refused.py: rows refused), a user's writes
    (schedule_writes.py), reads (schedule_reads.py, summaries.py), pausing (pauses.py),
    the holder side (leases.py, groups.py), history (history.py), hosts (hosts.py) and
    API tokens (tokens.py).
    """
