"""The master's database: every query the master makes runs here, never on its loop.

Invariants:
- The master's main loop never waits on the database.  The store is opened, status
  figures are read and history is pruned by one housekeeping thread, which publishes a
  snapshot (what a reading holds is snapshot.py's); commands run on a small pool with a
  deadline, so a database that hangs answers "database unreachable" instead of hanging
  the caller.
- The loop forks workers only while no master thread is inside a database call
  (`fork_gate`): a worker never inherits a lock held mid-call (SQLite's mutexes, the
  connection pool's).  If a call is in flight, the fork waits for the next turn of the
  loop rather than for the call.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, TypeVar

from sqlalchemy.exc import DBAPIError

from perfectschedd import __version__
from perfectschedd.config import Config
from perfectschedd.errors import DatabaseUnavailableError, SchemaError, first_line
from perfectschedd.master import heap
from perfectschedd.master.snapshot import (
    Series,
    Snapshot,
    States,
    read_figures,
    read_states,
    show_on_metrics,
    snapshot_of,
)
from perfectschedd.metrics import exposition
from perfectschedd.notify.dispatch import STATE_OUTCOMES, Dispatcher
from perfectschedd.schedules import policy
from perfectschedd.schedules.collection import ScheduleCollection
from perfectschedd.schedules.validate import key_problem
from perfectschedd.store import deadline
from perfectschedd.store.sql import Store
from perfectschedd.vocabulary.fields import schedule_key

log = logging.getLogger("perfectschedd")

T = TypeVar("T")

COMMAND_TIMEOUT = 10.0  # a command that needs the database answers within this
COMMAND_THREADS = 4     # calls in flight at once; more wait for a thread (and a deadline)
PROBE_EVERY = 2.0       # a cheap query: is the database answering?
COUNTS_EVERY = 15.0     # totals: a count over the table
# Which schedules are retrying or failed takes a probe of the history per schedule (0.7 s
# of CPU at a million rows on SQLite): unasked, it runs at most this share of the time, so
# an idle daemon stays idle at any size (every COUNTS_EVERY up to about 15,000 schedules,
# about every 12 minutes at a million).  A status request always reads it afresh.
STATES_SHARE = 0.001
PRUNE_EVERY = 60.0
# history_keep_days: rows read per step, steps per prune (each its own transaction, the
# fork gate taken anew: 10,000 rows a minute at most), and how often the walk starts
# again from the oldest row (the newest runs it kept may be old news by then).
PRUNE_OLD_BATCH = 1000
PRUNE_OLD_STEPS = 10
PRUNE_OLD_RESTART = 3600.0
OPEN_RETRY_MAX = 2.0  # cheap queries: the master may look again soon
RENAME_CHECK_EVERY = 3600.0  # a read of every key: rare, and off the master's loop
# SQLite's page cache per connection of the master (the default is 2 MiB).  Its reads
# scan whole tables (counts, states, keys), so the default cache fills and stays full: at
# 100,000 schedules that was 3.9 MiB of the master's RSS.  A status read at 100,000 took
# the same CPU with 512 KiB as with 2 MiB (80 ms), twice as much with 256 KiB.
PAGE_CACHE_KIB = 512
# Workers are forked once the first attempt to open the store has ended, if it ends within
# this long: the objects opening builds (engine, tables, statements) are then shared with
# the workers, which use that store (store_for_worker) instead of building their own.
# Building them in each worker wrote 4 MiB of its pages (CPython writes the reference
# counts of everything the code touches); so did the master, when it opened the store
# after the fork, in pages the workers still shared.
OPEN_BEFORE_FORK = 5.0
# On PostgreSQL and MySQL a call in flight that long is waiting on its socket, where no
# lock of ours is held: a fork may go ahead.  SQLite calls run inside the library (its
# mutexes), so there a fork always waits for them to end (busy_timeout bounds them).
FORK_AFTER_NETWORK_WAIT = 2.0
# While a fork waits for calls in flight to end, new calls hold back this long, so that a
# steady stream of requests cannot starve worker starts.
FORK_PRIORITY = 1.0
# A status call in flight this long means the database does not answer.
UNANSWERED_AFTER = 3.0
# This host's row in the hosts table is refreshed this often (status reads "last seen").
HOST_EVERY = 10.0


class MasterDatabase:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.sc: ScheduleCollection | None = None
        # The collection's store (set and cleared with `sc`): the queries the collection
        # does not offer (status figures, hosts, leases given back) go to it directly.
        self.store: Store | None = None
        self.snapshot = Snapshot()
        self._pool = ThreadPoolExecutor(COMMAND_THREADS, thread_name_prefix="master-db")
        self._cond = threading.Condition()
        self._in_flight = 0
        self._started: dict[int, float] = {}  # calls in flight: token -> monotonic start
        self._tokens = itertools.count()
        self._busy_since = 0.0  # monotonic time _in_flight last went from 0 to 1
        self._network = not config.url.startswith("sqlite")
        self._forking = False
        self._fork_wanted: float | None = None  # monotonic time a fork was first postponed
        self._stop = threading.Event()
        self._refresh = threading.Event()
        # A status request waits for the states too: set with _refresh, and taken with its
        # clearing, both under _refreshed (a request between reading the event and
        # clearing it must not be answered by a reading that skips the states).
        self._states_asked = False
        self._refreshed = threading.Condition()
        # The latest reading of the schedules' states (Store.state_summary without its
        # overdue rows), and when the next one is due unasked (monotonic).
        self._states: States | None = None
        self._series: Series = ([], 0)
        self._next_states = 0.0
        self._thread = threading.Thread(target=self._housekeeping, name="housekeeping",
                                        daemon=True)
        self.started_at = time.time()
        # history_keep_days's walk: the id it goes on from, and when it started (monotonic).
        self._prune_after = 0
        self._prune_walk_started = time.monotonic()
        # Runs the master records itself (a dead worker's, as `lost`) are notified from
        # here; only where some notifier is configured.
        self.notices = self._dispatcher(config)
        # Set once the first attempt to open the store has ended, whatever its outcome.
        self.first_open = threading.Event()
        self._started_mono: float | None = None
        # Why the database can never be used by this version (SchemaError): the daemon
        # stops.  None while it can, or may once it answers.
        self.fatal: str | None = None

    def _dispatcher(self, config: Config) -> Dispatcher | None:
        if not config.all_notifiers():
            return None
        return Dispatcher(config, self._previous_outcome, previous_many=self._previous_outcomes)

    def reconfigure(self, config: Config) -> None:
        """A reload that keeps the database (url and table): what the master does with
        it follows the new configuration at once (the zone and notifiers of `add`, the
        schedules_dir that refusals name, history_limit, the lost runs' notifiers), as
        after a restart.  The open store stays: its statement deadline is the old
        alive_time's until the next restart (the workers open theirs anew)."""
        old, self.config = self.config, config
        sc = self.sc
        if sc is not None:
            sc.config = config
        if _notifying(old) != _notifying(config):
            notices, self.notices = self.notices, self._dispatcher(config)
            if notices is not None:  # what it holds is still told, off the loop
                threading.Thread(target=notices.drain, args=(5.0,), daemon=True,
                                 name="old-notices").start()

    def start(self) -> None:
        self._started_mono = time.monotonic()
        exposition.watch_database(lambda: self.health()[1])  # the metrics are set up by now
        self._thread.start()

    def opening(self) -> bool:
        """True while the first attempt to open the store goes on (at most
        OPEN_BEFORE_FORK after start): forks wait for it."""
        return (self._started_mono is not None and not self.first_open.is_set()
                and time.monotonic() - self._started_mono < OPEN_BEFORE_FORK)

    def stop(self, timeout: float = 5.0) -> None:
        """Let calls in flight end (at most `timeout`), then close the store."""
        end = time.monotonic() + timeout
        if self.notices is not None:  # what a dead worker's lost runs still have to tell
            self.notices.drain(min(2.0, timeout / 2))
        self._stop.set()
        self._refresh.set()
        self._pool.shutdown(wait=False)
        with self._cond:
            self._cond.wait_for(lambda: self._in_flight == 0,
                                max(0.0, end - time.monotonic()))
        if self._thread.ident is not None:  # started
            self._thread.join(max(0.0, end - time.monotonic()))
        sc, self.sc = self.sc, None
        store, self.store = self.store, None
        if sc is not None:
            # Say this host left, if the database answers in time: a stop never waits
            # on it longer (the row ages out otherwise).
            leave = threading.Thread(target=self._forget_host, args=(store,), daemon=True,
                                     name="leave")
            leave.start()
            leave.join(max(0.5, end - time.monotonic()))
            sc.close()

    def _forget_host(self, store: Store) -> None:
        try:
            store.forget_host(self.config.node, os.getpid())
        except Exception as exc:  # noqa: BLE001 - stopping goes on
            log.info("could not remove this host from the hosts table: %s", first_line(exc))

    def after_fork(self) -> None:
        """In a worker just forked from the master: the master's pooled connections must
        not be used or closed by the child."""
        if self.store is not None:
            self.store.after_fork()

    def store_for_worker(self, config: Config) -> Store | None:
        """In a worker just forked (after after_fork): the master's open store, if it is
        the one `config` would open, for the worker to use as its own; None: the worker
        opens one.  Its objects stay shared with the master's copy-on-write.  It was
        initialized by the master (schema checked and brought up to date); a worker
        opening its own store did that again moments after."""
        store, mine = self.store, self.config
        if store is None or (mine.url, mine.table, mine.alive_time) != (
                config.url, config.table, config.alive_time):
            return None
        # The worker's connections are new (after_fork emptied the pool): its claims read
        # a few index pages, so SQLite's default cache, as when it opened its own.
        store.backend.page_cache_kib = None
        return store

    def _previous_outcome(self, key: str, before: float) -> str | None:
        """For the notification thread: `key`'s last state outcome before a run."""
        store = self.store
        if store is None:
            return None
        with self._gate():
            return store.last_outcome(key, before, STATE_OUTCOMES)

    def _previous_outcomes(self, runs: list[tuple[str, float]]) -> dict[str, str | None]:
        store = self.store
        if store is None:
            return {}
        with self._gate():
            return store.last_outcomes(runs, STATE_OUTCOMES)

    def give_back_leases(self, owner: str, why: str | None = None) -> None:
        """Give the leases of `owner` (a dead worker whose runs were killed) back now,
        recording those attempts as `lost` (with `why`), off the caller's thread: the
        database may be slow, and the occurrences need not wait for alive_time.  If the
        database does not answer, the leases expire by themselves."""
        store = self.store

        def work(sc: ScheduleCollection) -> None:
            assert store is not None
            runs = store.reclaim_owner(owner, time.time(), why)
            if runs:
                log.info("gave back %d lease(s) of %s; recorded as lost", len(runs), owner)
            if runs and self.notices is not None:
                # These runs were recorded here, not by a worker: the master tells.
                for run in runs:
                    notify = policy.from_text(run.pop("policy")).notify
                    if notify:
                        run["notify"] = notify
                self.notices.on_recorded(runs)

        self.in_background(f"giving back the leases of {owner}", work)

    def stop_in_background(self) -> None:
        """For a reload that moved the database: the old one may be the one that hangs."""
        threading.Thread(target=self.stop, name="old-database", daemon=True).start()

    # -- the fork gate ----------------------------------------------------------------------

    @contextmanager
    def _gate(self) -> Iterator[None]:
        with self._cond:
            while self._forking or (
                    self._fork_wanted is not None
                    and time.monotonic() - self._fork_wanted < FORK_PRIORITY):
                self._cond.wait(0.05)
            if not self._in_flight:
                self._busy_since = time.monotonic()
            self._in_flight += 1
            token = next(self._tokens)
            self._started[token] = time.monotonic()
        try:
            yield
        finally:
            with self._cond:
                self._in_flight -= 1
                del self._started[token]
                self._cond.notify_all()

    @contextmanager
    def fork_gate(self) -> Iterator[bool]:
        """Yields True when no database call is in flight (and none starts until the block
        ends); False when one is, so the caller tries again later instead of waiting."""
        with self._cond:
            now = time.monotonic()
            clear = not self._in_flight or (
                self._network and now - self._busy_since > FORK_AFTER_NETWORK_WAIT)
            self._forking = clear
            self._fork_wanted = None if clear else (self._fork_wanted or now)
        if not clear:
            yield False
            return
        try:
            yield True
        finally:
            with self._cond:
                self._forking = False
                self._cond.notify_all()

    # -- commands ---------------------------------------------------------------------------

    def call(self, fn: Callable[[ScheduleCollection], T],
             timeout: float = COMMAND_TIMEOUT) -> T:
        """Run fn(sc) off the caller's thread; DatabaseUnavailableError if the store is not
        open, every call slot is taken by calls that do not return, or fn does not return
        within `timeout`."""
        sc = self.sc
        if sc is None:
            raise DatabaseUnavailableError(self._why("the database is not open yet"))
        stuck = self._stuck_for()
        if stuck > timeout:
            # Known to hang: answer now rather than hold the caller for another timeout.
            raise DatabaseUnavailableError(self._why(
                f"a query has been waiting for {stuck:.0f}s"))

        def run() -> T:
            with self._gate():
                return fn(sc)

        asked_at = time.time()
        future: Future[T] = self._pool.submit(run)
        try:
            result = future.result(timeout)
            if self.snapshot.ok is False:
                self._mark(True)  # it answered: say so before the next probe does
            return result
        except TimeoutError:  # concurrent.futures.TimeoutError since 3.11
            future.cancel()  # not started yet: it never will (a stale write, later)
            self._mark(False, f"no answer within {timeout:g}s")
            raise DatabaseUnavailableError(self._why(f"no answer within {timeout:g}s")
                                           ) from None
        except DBAPIError as exc:
            if deadline.unavailable(exc):
                # Hung (cut at the statement deadline), unreachable, not the primary:
                # the caller is told the database is unreachable, as after a timeout.
                why = deadline.describe(exc)
                self._mark(False, why, asked_at)
                raise DatabaseUnavailableError(self._why(why)) from None
            raise

    def health(self) -> tuple[bool | None, float | None, str | None]:
        """(reachable, unreachable since (Unix time), why): the snapshot's word, unless a
        call has been waiting so long that the database is not answering right now."""
        snap = self.snapshot
        stuck = self._stuck_for()
        if stuck > UNANSWERED_AFTER and snap.ok is not False:
            return False, time.time() - stuck, f"no answer for {stuck:.0f}s"
        return snap.ok, snap.unreachable_since, snap.error

    def _stuck_for(self) -> float:
        """How long the oldest call in flight has been waiting (0 when none is)."""
        with self._cond:
            started = min(self._started.values(), default=None)
        return 0.0 if started is None else time.monotonic() - started

    def in_background(self, what: str, fn: Callable[[ScheduleCollection], Any]) -> None:
        """Run fn(sc) when the store is open, without waiting for it; failures are logged."""
        sc = self.sc
        if sc is None:
            return

        def run() -> None:
            try:
                with self._gate():
                    fn(sc)
            except Exception as exc:  # noqa: BLE001 - logged; the caller does not wait
                log.warning("%s failed: %s", what, first_line(exc))

        try:
            self._pool.submit(run)
        except RuntimeError:  # stopping
            pass

    def _why(self, detail: str) -> str:
        since = self.health()[1]
        if since is not None:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since))
            return f"database unreachable since {stamp} ({detail})"
        return f"database unreachable ({detail})"

    # -- status -----------------------------------------------------------------------------

    def fresh_snapshot(self, wait: float) -> Snapshot:
        """Ask for a refresh and wait at most `wait` seconds for it; the snapshot either
        way (its `read_at` says how old it is)."""
        before, asked = self.snapshot, time.time()

        def answered() -> bool:
            # A reading begun after the request (one begun before may have been published
            # meanwhile), or word that the database cannot be read.
            snap = self.snapshot
            return snap is not before and (snap.ok is False or (snap.read_at or 0) >= asked)

        # A database known not to answer gives no figures: the request is left for the
        # housekeeping thread, and status answers at once with what is known.
        unanswered = self.health()[0] is False
        with self._refreshed:
            self._states_asked = True
            self._refresh.set()
            if not unanswered:
                self._refreshed.wait_for(answered, timeout=wait)
        return self.snapshot

    def _mark(self, ok: bool, error: str | None = None, asked_at: float | None = None
              ) -> None:
        """`asked_at`: when the call that failed was sent (Unix time): a server that hung
        has been unreachable since then, not since its deadline cut the call."""
        old = self.snapshot
        if ok == old.ok and (ok or error == old.error):
            return
        since = None if ok else (old.unreachable_since or asked_at or time.time())
        if not ok and old.ok is not False:
            log.error("database unreachable: %s", error)
        elif ok and old.ok is False:
            log.info("database reachable again")
        self._publish(replace(old, ok=ok, unreachable_since=since,
                              error=None if ok else error))

    def _publish(self, snap: Snapshot) -> None:
        with self._refreshed:
            self.snapshot = snap
            self._refreshed.notify_all()

    # -- housekeeping thread ----------------------------------------------------------------

    def _housekeeping(self) -> None:
        backoff = 0.5
        next_probe = next_counts = next_host = 0.0
        next_prune = time.monotonic() + PRUNE_EVERY
        next_rename_check = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            asked_at = time.time()
            try:
                if self.sc is None:
                    self._open()
                    self.first_open.set()
                    backoff = 0.5
                if now >= next_host:
                    next_host = now + HOST_EVERY
                    self._record_host()
                if self._refresh.is_set() or now >= next_counts:
                    with self._refreshed:
                        asked, self._states_asked = self._states_asked, False
                        self._refresh.clear()
                        # The reading's read_at: a request after this waits for the next.
                        began = time.time()
                    self._read_status(states=asked or now >= self._next_states, now=began)
                    next_counts = now + COUNTS_EVERY
                    next_probe = now + PROBE_EVERY
                elif now >= next_probe:
                    with self._gate():
                        assert self.store is not None
                        self.store.earliest_due()
                    self._mark(True)
                    next_probe = now + PROBE_EVERY
                if now >= next_rename_check:
                    next_rename_check = now + RENAME_CHECK_EVERY
                    self._check_keys()
                if now >= next_prune:
                    next_prune = now + PRUNE_EVERY
                    with self._gate():
                        assert self.store is not None
                        self.store.prune_history(self.config.history_limit)
                    self._prune_old_history()
            except SchemaError as exc:
                # Waiting will not fix it: the supervisor stops the daemon (and says why).
                self.fatal = first_line(exc)
                self.first_open.set()  # after the outcome is published: waiters read it
                return
            except Exception as exc:  # noqa: BLE001 - this thread must not die
                # Hung (cut at its deadline), read-only, shutting down, or the driver's word.
                self._mark(False, deadline.describe(exc), asked_at)
                self.first_open.set()
                # A status request (or stop) arriving meanwhile cuts the wait short.
                self._refresh.clear()
                if self._stop.is_set():
                    break
                self._refresh.wait(backoff)
                backoff = min(backoff * 2, OPEN_RETRY_MAX)
                continue
            wake = min(next_probe, next_counts) - time.monotonic()
            self._refresh.wait(max(0.05, wake))

    def _prune_old_history(self) -> None:
        """history_keep_days: a bounded walk through the oldest history rows, every key's
        (a deleted schedule's history goes too), on this thread, never the loop's."""
        days = self.config.history_keep_days
        if not days:
            return
        now = time.monotonic()
        if now - self._prune_walk_started >= PRUNE_OLD_RESTART:
            self._prune_walk_started, self._prune_after = now, 0
        before = time.time() - days * 86400
        removed = 0
        for _ in range(PRUNE_OLD_STEPS):
            with self._gate():
                assert self.store is not None
                gone, after = self.store.prune_old_history(before, self._prune_after,
                                                           PRUNE_OLD_BATCH)
            removed += gone
            if after == self._prune_after:
                break  # recent rows from here on
            self._prune_after = after
        if removed:
            log.info("history: removed %d run(s) older than %g day(s)", removed, days)

    def _open(self) -> None:
        with self._gate():
            sc = ScheduleCollection(self.config, PAGE_CACHE_KIB)
        sc.config = self.config  # a reload while it opened (reconfigure) is not lost
        self.store = sc.store
        self.sc = sc
        log.info("database open")

    def _record_host(self) -> None:
        with self._gate():
            assert self.store is not None
            self.store.record_host(self.config.node, __version__, os.getpid(),
                                   self.started_at, time.time())

    def _check_keys(self) -> None:
        store = self.store
        assert store is not None

        def bad(key: str) -> bool:
            # Extra runs (KEY@run-...) are named by the daemon; their base key is checked.
            return key_problem(schedule_key(key)) is not None

        with self._gate():
            keys = store.keys_matching(bad)
        rename = {k: key_problem(schedule_key(k)) or "" for k in keys}
        self._publish(replace(self.snapshot, rename=rename))
        heap.trim()  # it read every key

    def _read_status(self, states: bool = True, now: float | None = None) -> None:
        """Read what status and /metrics show (snapshot.py); `states`: the schedules'
        states too (else the latest reading of them is shown again, see STATES_SHARE).
        `now`: when the reading began (its read_at)."""
        store, sc = self.store, self.sc
        assert store is not None and sc is not None
        now = time.time() if now is None else now
        with self._gate():
            if states or self._states is None:
                began = time.monotonic()
                # Read with the states, and counted in their share of the time: the
                # choice of the schedules with series of their own reads every row too.
                self._states, self._series = read_states(store, self.config, now)
                took = time.monotonic() - began
                self._next_states = began + max(COUNTS_EVERY, took / STATES_SHARE)
            figures = read_figures(store, sc, self.config, now)
        snap = snapshot_of(self.snapshot, figures, self._states, now)
        show_on_metrics(snap, self._series)
        self._publish(snap)


def _notifying(config: Config) -> tuple[Any, ...]:
    """What the master's notification thread reads of a configuration."""
    return (config.notifiers, config.notify, config.sendmail, config.node,
            config.entry_notify, tuple(r.notify for r in config.routes),
            tuple(r.pattern for r in config.routes))
