"""The tables and the records that travel between the store and its backends.

One row per schedule.  `next_run_time` is both "when it may run" and, while a worker
holds the row, the lease expiry; `fence` grows on every claim and every write that takes
the row away from its holder, and every holder-side write names the fence it was given,
so a worker that lost its lease changes nothing (PreemptedError upstream).
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any, NamedTuple

import sqlalchemy as sa

from perfectschedd.vocabulary.fields import (
    CLAIMED_FIELDS,
    CLAIMED_OPTIONAL,
    CRON_MAX,
    ERROR_MAX,
    KEY_MAX,
    PAUSED_REASON_MAX,
    POLICY_MAX,
    ROW_FIELDS,
    ROW_OPTIONAL,
    SCHEDULE_FIELDS,
    SOURCE_MAX,
    TYPE_MAX,
    TZ_MAX,
    UNIT_MAX,
)
from perfectschedd.vocabulary.tokens import HASH_MAX, NAME_MAX

# How long an operation is tried again while the database says "try again" (a SQLite
# writer waiting for the lock: busy_timeout and our retries; a deadlock victim).
TRY_AGAIN_FOR = 60.0


def lease_until(now: float, seconds: int) -> int:
    """The stored end of a lease taken or renewed at `now` for `seconds`.  Rounded up:
    next_run_time holds whole seconds, and rounding down took up to a second off every
    lease, so a short one (alive_time 2) could be fenced before its first heartbeat and
    its occurrence run twice."""
    return math.ceil(now) + seconds


# Row and Claimed are made from the one list of a schedule's fields (vocabulary/fields.py),
# which says what each holds.

Row = dataclasses.make_dataclass(
    "Row", [(n, SCHEDULE_FIELDS[n]) if n not in ROW_OPTIONAL
            else (n, SCHEDULE_FIELDS[n], dataclasses.field(default=None)) for n in ROW_FIELDS],
    frozen=True, namespace={"__doc__": "One schedule as stored (fields.ROW_FIELDS)."})
Row.__module__ = __name__

# A named tuple, as Advance: one is made per fire, and a frozen dataclass costs several
# times as much to build.
Claimed = collections.namedtuple(
    "Claimed", CLAIMED_FIELDS, defaults=(None,) * len(CLAIMED_OPTIONAL), module=__name__)
Claimed.__doc__ = ("A row just leased to the caller, as it is after the claim "
                   "(fields.CLAIMED_FIELDS).")
Claimed.__annotations__ = {n: SCHEDULE_FIELDS[n] for n in CLAIMED_FIELDS}


class Advance(NamedTuple):
    """A holder-side write: the new times of a schedule whose occurrence finished."""

    key: str
    fence: int
    next_time: int | None  # None: a one-off row, delete it
    next_run_time: int | None
    # Set when the schedule has no next occurrence (its cron runs past year 9999): the
    # row is paused with this reason instead of moved on.
    pause_reason: str | None = None


# Unix seconds with a fraction: double precision everywhere (MySQL's plain FLOAT is 4 bytes
# and would round today's times to ~2 minutes).
SECONDS = sa.Float(precision=53)


def schedules_table(metadata: sa.MetaData, name: str, data_type: sa.types.TypeEngine[Any],
                    partial_index_dialect: str | None) -> sa.Table:
    """The schedules table.  `data_type` holds JSON text up to DATA_MAX bytes;
    `partial_index_dialect` names the dialect whose partial index keeps the leased rows
    apart (None: it has none)."""
    t = sa.Table(
        name, metadata,
        sa.Column("key", sa.String(KEY_MAX), primary_key=True),
        sa.Column("type", sa.String(TYPE_MAX), nullable=False),
        sa.Column("cron", sa.String(CRON_MAX), nullable=True),  # NULL: a one-off run
        sa.Column("delay", sa.Integer, nullable=False, default=0),
        sa.Column("timezone", sa.String(TZ_MAX), nullable=False),
        sa.Column("data", data_type, nullable=False),
        sa.Column("next_time", sa.BigInteger, nullable=False),
        sa.Column("next_run_time", sa.BigInteger, nullable=False),
        sa.Column("paused", sa.SmallInteger, nullable=False, default=0),
        sa.Column("fence", sa.BigInteger, nullable=False, default=0),
        sa.Column("attempt", sa.Integer, nullable=False, default=0),
        sa.Column("owner", sa.String(128), nullable=True),
        sa.Column("claimed_at", SECONDS, nullable=True),
        # next_run_time as it was when the current holder claimed the row.
        sa.Column("due_time", sa.BigInteger, nullable=True),
        # Set by `run KEY`: the schedule has had extra runs, which must not overlap it.
        sa.Column("has_extra", sa.SmallInteger, nullable=True),
        # Why the daemon paused the schedule (no next occurrence); NULL when a user did.
        sa.Column("paused_reason", sa.String(PAUSED_REASON_MAX), nullable=True),
        # Policies other than the defaults, as JSON (schedules/policy.py); NULL: all defaults.
        sa.Column("policy", sa.String(POLICY_MAX), nullable=True),
        # The member of this schedule's group (itself, or an extra run KEY@run-...) that
        # runs now, or ran last: the others wait while it holds a live lease.
        sa.Column("group_holder", sa.String(KEY_MAX), nullable=True),
        # Where the schedule comes from: file:NAME (a schedules file); NULL: `add`.
        sa.Column("source", sa.String(SOURCE_MAX), nullable=True),
        # The uid that made the schedule (the caller of add, apply, import; a schedules
        # file's owner).  NULL: unknown, made by a version that did not record it.
        # (A uid takes 32 bits unsigned: BigInteger on every database.)
        sa.Column("creator", sa.BigInteger, nullable=True),
    )
    # The claim reads "unpaused rows, smallest next_run_time first": O(log n) on this index.
    sa.Index(f"{name}_due", t.c.paused, t.c.next_run_time)
    if partial_index_dialect is not None:
        # Leased rows only (status, release_owner): tiny, so claims and finishes barely
        # pay for it.  Without partial indexes (MySQL) those reads scan the table.
        # Only this dialect's keyword: naming another one makes SQLAlchemy import it.
        sa.Index(f"{name}_held", t.c.owner,
                 **{f"{partial_index_dialect}_where": t.c.owner.isnot(None)})
    return t


def history_table(metadata: sa.MetaData, name: str,
                  output_type: sa.types.TypeEngine[Any] | None = None) -> sa.Table:
    """One row per run (and per occurrence skipped or lost).  `output_type` holds the
    output tail, up to the config's output_limit (at most OUTPUT_LIMIT_MAX bytes):
    the backend's long text (schedules' `data` type: MySQL's TEXT stops at 64 KiB)."""
    t = sa.Table(
        f"{name}_history", metadata,
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"),
                  primary_key=True, autoincrement=True),
        sa.Column("key", sa.String(KEY_MAX), nullable=False),
        sa.Column("type", sa.String(TYPE_MAX), nullable=False),
        sa.Column("scheduled_time", sa.BigInteger, nullable=False),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("started_at", SECONDS, nullable=False),
        sa.Column("finished_at", SECONDS, nullable=False),
        sa.Column("outcome", sa.String(32), nullable=False),
        sa.Column("worker", sa.String(128), nullable=False),
        # executor systemd: the run's transient unit (journalctl -u UNIT); NULL otherwise.
        # Nullable: init() adds it to a history table an older version made.
        sa.Column("unit", sa.String(UNIT_MAX), nullable=True),
        # What happened (schema 3).  Nullable, as unit: init() adds them to an older
        # table, and hosts of 0.1.0 and 0.2.0, which name the columns they insert, leave
        # them NULL.  The exit status of a command that exited (NULL: none, e.g. a python
        # run or a command killed by a signal) ...
        sa.Column("exit_code", sa.Integer, nullable=True),
        # ... the signal that killed it (NULL: none) ...
        sa.Column("signal", sa.Integer, nullable=True),
        # ... how long it ran, seconds ...
        sa.Column("duration", SECONDS, nullable=True),
        # ... the tail of its output (exec: stdout+stderr; python: the traceback) ...
        sa.Column("output", output_type if output_type is not None else sa.Text(),
                  nullable=True),
        # ... and one line saying what went wrong (NULL: nothing did).
        sa.Column("error", sa.String(ERROR_MAX), nullable=True),
    )
    sa.Index(f"{name}_history_key", t.c.key, t.c.id)
    return t


def meta_table(metadata: sa.MetaData, name: str) -> sa.Table:
    """Facts about the database itself, as name/value rows: its schema version
    (version.py), a cluster-wide pause (PAUSED_ALL_META), the markers of forced
    deletes of schedules files' schedules (DELETED_META)."""
    return sa.Table(
        f"{name}_meta", metadata,
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("value", sa.String(255), nullable=False),
    )


def hosts_table(metadata: sa.MetaData, name: str) -> sa.Table:
    """One row per daemon host that uses the database: what it runs and when it was last
    heard of (status lists them; a feature an older live host cannot honour asks here)."""
    return sa.Table(
        f"{name}_hosts", metadata,
        sa.Column("name", sa.String(128), primary_key=True),
        sa.Column("version", sa.String(32), nullable=False),
        sa.Column("schema_version", sa.Integer, nullable=False),
        sa.Column("pid", sa.Integer, nullable=True),
        sa.Column("started_at", SECONDS, nullable=False),
        sa.Column("last_seen", SECONDS, nullable=False),
    )


def tokens_table(metadata: sa.MetaData, name: str) -> sa.Table:
    """API tokens (schema 4; vocabulary/tokens.py): one row per token ever made.  A revoked
    token keeps its row (a schedule's creator may name it) and its name: names are
    never reused, so a name in a record always means one token."""
    return sa.Table(
        f"{name}_tokens", metadata,
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer, "sqlite"),
                  primary_key=True, autoincrement=True),
        sa.Column("name", sa.String(NAME_MAX), nullable=False, unique=True),
        sa.Column("role", sa.String(16), nullable=False),
        # The salted slow hash of the secret's random part (never the secret); empty only
        # inside the transaction that makes the row (the secret holds the row's id).
        sa.Column("hash", sa.String(HASH_MAX), nullable=False),
        sa.Column("created_at", SECONDS, nullable=False),
        # The user name of who made it (root, through the daemon or -c).
        sa.Column("created_by", sa.String(128), nullable=False),
        sa.Column("expires_at", SECONDS, nullable=True),  # NULL: never
        sa.Column("revoked_at", SECONDS, nullable=True),  # NULL: not revoked
    )


