"""Deciding which recorded runs are told, and telling them from a thread of their own.

The lease pipeline calls `Dispatcher.on_recorded` after each history batch is written.
That call is on the worker's hot path, so it does almost nothing: a success of a key whose
last known outcome was a success is dropped there (a dict read), and everything else is
queued for the notification thread.  That thread resolves the notifier (the schedule's
own `notify` name > its schedules file entry's > its route's > the configuration's
default), decides by the notifier's `when`:

- change (default): the first failure (failed, timeout or lost) after a success or
  after nothing, and the recovery (the first success after a failure);
- every-failure: every failure, and the recovery;
- output: every run that printed something (cron's MAILTO rule),

and sends, with a few tries.  A state is a schedule's: the outcomes of its extra runs and
of its occurrences on rows of their own (KEY@run-...) are KEY's.  The previous outcome of a
schedule comes from this thread's memory, or once per schedule from the history table (the
latest row recorded before this run) when the thread has not seen it yet.  Nothing here
ever waits on the pipeline, and the pipeline never waits on this: a full queue drops
notifications (counted by reason, logged).

Fair under a flood (one user's thousands of failing schedules): root's runs (creator 0)
go to a lane of their own, with its own thread, so they never wait behind another's
send, retries or timeouts.  Everyone else's share the other lane, in turn by creator
(one run of each creator with something pending, round and round).  In both, a key has
at most one pending run: a newer run of a key still waiting takes the place of the one
before it (its latest state is what is told, once; `coalesced` says how many runs it
stands for).  The bounds are per creator and per lane, so one user's backlog drops
(counted, reason `user_backlog`) only that user's notifications.

A first success (attempt 1) of a key the pipeline has not seen is a recovery only if the
history says the run before it failed: a burst of thousands of new keys must neither
fill the queue nor cost a query each.  Those wait apart, one per key, and the thread
asks the history about up to VERIFY_BATCH of them in one query when it has nothing
else to do.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from perfectschedd.config import Config, notify_runner
from perfectschedd.metrics import counters
from perfectschedd.notify import senders
from perfectschedd.settings.notify_spec import SILENT, Notifier
from perfectschedd.vocabulary.fields import RUN_NOW_MARK, schedule_key
from perfectschedd.vocabulary.outcomes import FAILURES, Outcome

log = logging.getLogger("perfectschedd.notify")

# A key's state for notifications: its latest run that counts succeeded, or failed (any
# of FAILURES: it failed, timed out, or was lost with its worker or host).
SUCCESS, FAILED = Outcome.SUCCESS.value, Outcome.FAILED.value
# The outcomes that make a key's state; the rest (later, skipped, preempted, released,
# stopped, ...) change nothing.
STATE_OUTCOMES = (SUCCESS, *sorted(FAILURES))
# Root's runs: a lane (and a thread) of their own.
ROOT = 0
# Keys pending at once, per creator and per lane; beyond, a new key's run is dropped.
PENDING_PER_CREATOR = 5000
PENDING_MAX = 20_000
# Past this many pending runs in a lane, a run waits with only the tail of its output
# (the history keeps it whole): bounded memory under a flood.
PENDING_FULL_OUTPUT = 1000
OUTPUT_WHILE_CROWDED = 1024
# Tries of one notification, and the waits between them (seconds).
TRIES = 3
RETRY_WAITS = (1.0, 4.0)
# The thread forgets keys beyond this (and asks the history again when it meets them).
STATE_MAX = 100_000

Run = dict[str, Any]


def schedule_of(key: Any) -> Any:
    """The schedule whose state a run with this key makes: KEY for KEY@run-... (`run KEY`,
    an allow or replace schedule's occurrence), whose keys are each run's own."""
    return schedule_key(key) if isinstance(key, str) else key
PreviousOutcome = Callable[[str, float], "str | None"]
# Many at once: [(key, before)] -> {key: the latest state outcome before, or None}.
PreviousOutcomes = Callable[[list[tuple[str, float]]], dict[str, "str | None"]]
# First successes of unseen keys asked about in one query; at most STATE_MAX wait.
VERIFY_BATCH = 500
# The state of a key whose history holds no earlier run.
UNKNOWN = "unknown"
# First successes are checked once the pipeline has recorded nothing for this long: the
# check shares the GIL with the pipeline, and a recovery told a second late harms
# nobody, while a burst slowed down does.
QUIET = 0.5


class Lane:
    """One sending thread's work: the runs pending, at most one per key, kept per creator
    and taken in turn; the first successes waiting to be checked; and what the thread
    knows of each key's state.  Touched under the dispatcher's condition, except `state`
    (its thread's only)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.pending: dict[Any, collections.OrderedDict[str, Run]] = {}
        self.turns: collections.deque[Any] = collections.deque()  # creators, in turn
        self.size = 0
        # First successes of keys the pipeline had not seen, by key (see the module doc).
        self.unverified: collections.OrderedDict[str, Run] = collections.OrderedDict()
        # Each key's last state outcome.
        self.state: collections.OrderedDict[str, str] = collections.OrderedDict()
        # Keys whose run was dropped: the history holds a state nobody was told, so
        # their next run is told as if nothing came before it.
        self.untold: set[str] = set()
        self.busy = False
        self.thread: threading.Thread | None = None

    def put(self, run: Run) -> str | None:
        """Queue a run, or merge it into its key's pending one; why it was dropped, or
        None."""
        key = schedule_of(run.get("key"))
        creator = run.get("creator")
        bucket = self.pending.get(creator)
        if bucket is not None and key in bucket:
            before = bucket[key]
            run["coalesced"] = int(before.get("coalesced") or 0) + 1
            # The state before the first of them is what this one changes (decide()).
            run["state_since"] = before.get("state_since", before.get("started_at"))
            bucket[key] = run  # in its predecessor's place in the line
            counters.notification_coalesced()
            return None
        if bucket is not None and len(bucket) >= PENDING_PER_CREATOR:
            return "user_backlog"
        if self.size >= PENDING_MAX:
            return "backlog"
        if bucket is None:
            bucket = self.pending[creator] = collections.OrderedDict()
            self.turns.append(creator)
        if self.size >= PENDING_FULL_OUTPUT:
            out = run.get("output")
            if out and len(out) > OUTPUT_WHILE_CROWDED:
                run["output"] = out[-OUTPUT_WHILE_CROWDED:]
        bucket[key] = run
        self.size += 1
        return None

    def take(self) -> Run:
        """The next run: the oldest pending key of the creator whose turn it is."""
        creator = self.turns[0]
        bucket = self.pending[creator]
        _, run = bucket.popitem(last=False)
        self.size -= 1
        if bucket:
            self.turns.rotate(-1)
        else:
            self.turns.popleft()
            del self.pending[creator]
        return run

    def idle(self) -> bool:
        return not self.size and not self.unverified and not self.busy


class Dispatcher:
    def __init__(self, config: Config, previous: PreviousOutcome, *,
                 previous_many: PreviousOutcomes | None = None,
                 send: Callable[[Notifier, senders.Message], None] | None = None) -> None:
        self.config = config
        self.previous = previous  # (key, before) -> the latest state outcome before
        self.previous_many = previous_many
        self.last_recorded = 0.0  # monotonic time of the pipeline's last on_recorded
        self.host = config.node
        user, refused = config.notify_as, config.notify_refused
        if user is None and refused is None:  # not the host's checked config (the master's)
            user, refused = notify_runner(config, grant=False)
        self._send = send or (lambda n, m: senders.send(
            n, m, sendmail=config.sendmail, user=user, refused=refused))
        self.watch_output = any(n.when == "output" for n in config.all_notifiers())
        self.entry_notify = dict(config.entry_notify)
        # The pipeline's thread only: what it last queued or dropped per key.
        self.seen: dict[str, str] = {}
        self.cond = threading.Condition()
        self.stopping = threading.Event()
        self.unknown_names: set[str] = set()
        # Root's runs, and everyone else's (see the module doc).
        self.root = Lane("notify-root")
        self.others = Lane("notify")
        self.lanes = (self.root, self.others)
        for lane in self.lanes:
            lane.thread = threading.Thread(target=self._loop, args=(lane,), name=lane.name,
                                           daemon=True)
            lane.thread.start()

    def lane_of(self, run: Run) -> Lane:
        return self.root if run.get("creator") == ROOT else self.others

    def pending(self) -> int:
        """Runs waiting to be told (both lanes; first successes not counted)."""
        with self.cond:
            return sum(lane.size for lane in self.lanes)

    def unverified(self) -> int:
        with self.cond:
            return sum(len(lane.unverified) for lane in self.lanes)

    # -- the pipeline's side ------------------------------------------------------------

    def on_recorded(self, records: list[Run]) -> None:
        """Runs just written to the history (the pipeline's thread): queue those that may
        be told.  Never blocks, never raises."""
        keep = []
        later = []
        seen = self.seen
        for r in records:
            outcome = r.get("outcome")
            key = schedule_of(r.get("key"))
            if outcome == SUCCESS:
                told_output = self.watch_output and r.get("output")
                known = seen.get(key)
                if known == SUCCESS and not told_output:
                    continue  # the hot path: success after success, nothing to tell
                seen[key] = SUCCESS
                if known is None and not told_output and (r.get("attempt") or 1) <= 1 \
                        and self.previous_many is not None:
                    later.append(r)  # a recovery only if the history says so: asked apart
                    continue
            elif outcome in FAILURES:
                seen[key] = FAILED
            else:
                continue
            keep.append(r)
        if len(seen) > STATE_MAX:  # forgetting costs at most one query per key again
            seen.clear()
        self.last_recorded = time.monotonic()
        if later:
            with self.cond:
                for r in later:
                    waiting = self.lane_of(r).unverified
                    waiting[schedule_of(r["key"])] = r
                    waiting.move_to_end(schedule_of(r["key"]))
                    while len(waiting) > STATE_MAX:
                        waiting.popitem(last=False)
                        self._dropped("unverified")
                self.cond.notify_all()
        if not keep:
            return
        dropped: dict[str, int] = {}
        with self.cond:
            for r in keep:
                lane = self.lane_of(r)
                why = lane.put(r)
                if why is not None:
                    # A dropped run may be a failure: the next one must not be taken for
                    # a success after a success, nor for a failure already told.
                    seen.pop(schedule_of(r.get("key")), None)
                    if len(lane.untold) < STATE_MAX:
                        lane.untold.add(schedule_of(r.get("key")))
                    self._dropped(why)
                    dropped[why] = dropped.get(why, 0) + 1
            self.cond.notify_all()
        for why, n in dropped.items():
            log.warning("notification queue full (%s): %d run(s) not told", why, n)

    @staticmethod
    def _dropped(why: str) -> None:
        counters.notification("?", "dropped")
        counters.notification_dropped(why)

    # -- the threads --------------------------------------------------------------------

    def _rest(self, lane: Lane) -> None:
        """The lane has nothing to do (self.cond held): tell drain(), once.  Only on the
        change: the lanes share the condition, and a lane that notified each time it went
        to wait would wake the other, which would wake it again, for ever (two threads
        spinning on a futex in every daemon with a notifier, as 0.3.0's first build did)."""
        if lane.busy:
            lane.busy = False
            self.cond.notify_all()

    def _loop(self, lane: Lane) -> None:
        unverified = False
        while True:
            batch: list[Run] = []
            with self.cond:
                while not lane.size and not lane.unverified and not self.stopping.is_set():
                    self._rest(lane)
                    self.cond.wait()
                if not lane.size and not lane.unverified:
                    self._rest(lane)
                    return
                if not lane.size and not self.stopping.is_set():
                    quiet_in = self.last_recorded + QUIET - time.monotonic()
                    if quiet_in > 0 and len(lane.unverified) < STATE_MAX // 2:
                        self._rest(lane)
                        self.cond.wait(quiet_in)
                        continue
                lane.busy = True
                if lane.size:
                    batch = [lane.take()]
                    if lane.untold:
                        untold = schedule_of(batch[0].get("key"))
                        if untold in lane.untold:
                            lane.untold.discard(untold)
                            batch[0]["untold_before"] = True
                else:  # nothing else to do: first successes, many per query
                    while lane.unverified and len(batch) < VERIFY_BATCH:
                        batch.append(lane.unverified.popitem(last=False)[1])
                    unverified = True
            if unverified:
                # Outside the lock: on_recorded never waits on a query.  Only a success
                # after a failure has anything to tell; the rest cost a dict write each
                # (a burst of new keys shares the GIL with the pipeline).
                batch = self._learn(batch, lane.state)
                unverified = False
            for run in batch:
                try:
                    self.handle(run, lane.state)
                except Exception:  # noqa: BLE001 - this thread must outlive any one run
                    log.exception("key=%s: notification not sent (internal error)",
                                  run.get("key"))

    def _learn(self, runs: list[Run], state: collections.OrderedDict[str, str]
               ) -> list[Run]:
        """Of these first successes, those that may be recoveries: the history (one
        query, see the module doc) or this thread's memory says the run before failed.
        The others only mark their key a success."""
        assert self.previous_many is not None
        ask = [(str(r["key"]), float(r.get("started_at") or time.time()))
               for r in runs if schedule_of(r.get("key")) not in state]
        try:
            # A run of a KEY@run-... row is asked about alone: the batch query reads
            # exact keys, and such a run's state is its schedule's (few: once each).
            plain = [(k, b) for k, b in ask if RUN_NOW_MARK not in k]
            found = self.previous_many(plain) if plain else {}
            found.update({k: self.previous(k, b) for k, b in ask if RUN_NOW_MARK in k})
        except Exception:  # noqa: BLE001 - decide() asks one by one instead
            log.exception("reading the previous outcomes of %d key(s)", len(ask))
            return runs
        for key, _ in ask:
            prior = found.get(key)
            state[schedule_of(key)] = (UNKNOWN if prior is None
                                       else FAILED if prior in FAILURES else SUCCESS)
        told = []
        for r in runs:
            key = schedule_of(r["key"])
            if state.get(key) == FAILED:
                told.append(r)
            else:
                state[key] = SUCCESS
                state.move_to_end(key)
        while len(state) > STATE_MAX:
            state.popitem(last=False)
        return told

    def handle(self, run: Run, state: collections.OrderedDict[str, str]) -> None:
        notifier = self.resolve(run)
        event = self.decide(run, notifier, state)
        if notifier is None or event is None:
            return
        self.deliver(notifier, senders.Message(event, self.host, run))

    def resolve(self, run: Run) -> Notifier | None:
        """The notifier of a run's schedule (see the module's doc); None: nobody."""
        name = run.get("notify")
        if name:
            found = self.config.notifier(name)
            if found is not None:
                return None if found is SILENT else found
            if name not in self.unknown_names:
                self.unknown_names.add(name)
                log.error("key=%s: notifier %r is not in this host's notifiers:; using "
                          "the route's or the default", run.get("key"), name)
        key = run.get("key")
        # An extra run or an occurrence on a row of its own (KEY@run-...) is its
        # schedule's: the entry's notifier is that of the schedule's key.
        chosen = self.entry_notify.get(schedule_key(key)) if isinstance(key, str) else None
        if chosen is None:
            task_type = run.get("type")
            for route in self.config.routes:
                if isinstance(task_type, str) and route.matches(task_type):
                    chosen = route.notify
                    break
        if chosen is None:
            chosen = self.config.notify
        return None if chosen is None or chosen is SILENT else chosen

    def decide(self, run: Run, notifier: Notifier | None,
               state: collections.OrderedDict[str, str]) -> str | None:
        """The event to tell (failure, recovery, output) or None; keeps the key's state
        (`state`: the lane's)."""
        run_key = str(run.get("key"))
        key = schedule_of(run_key)
        failed = run.get("outcome") in FAILURES
        now_state = FAILED if failed else SUCCESS
        before = None if run.get("untold_before") else state.get(key)
        if before is None and notifier is not None and notifier.when != "output" \
                and not run.get("untold_before"):
            # Once per schedule this thread has not seen: its last run before this one
            # (before the first of the runs it stands for, when coalesced).
            started = run.get("state_since", run.get("started_at"))
            prior = self.previous(run_key,
                                  float(started if started is not None else time.time()))
            before = None if prior is None else (FAILED if prior in FAILURES else SUCCESS)
        state[key] = now_state
        state.move_to_end(key)
        if len(state) > STATE_MAX:
            state.popitem(last=False)
        if notifier is None:
            return None
        if notifier.when == "output":
            return "output" if run.get("output") else None
        if failed:
            if notifier.when == "every-failure" or before != FAILED:
                return "failure"
            return None
        return "recovery" if before == FAILED else None

    def deliver(self, notifier: Notifier, message: senders.Message) -> bool:
        why = "?"
        for attempt in range(TRIES):
            try:
                self._send(notifier, message)
            except senders.SendError as exc:
                why = str(exc)
            except Exception as exc:  # noqa: BLE001 - a notifier's bug is its failure
                why = f"{type(exc).__name__}: {exc}"
            else:
                counters.notification(notifier.kind, "sent")
                log.info("key=%s: %s notification sent (%s %s)", message.run.get("key"),
                         message.event, notifier.kind, notifier.name)
                return True
            if attempt < len(RETRY_WAITS) and self.stopping.wait(RETRY_WAITS[attempt]):
                break  # stopping: no more waiting between tries
        counters.notification(notifier.kind, "failed")
        log.error("key=%s: %s notification not sent (%s %s): %s", message.run.get("key"),
                  message.event, notifier.kind, notifier.name, why)
        return False

    # -- stop ---------------------------------------------------------------------------

    def drain(self, timeout: float) -> int:
        """Wait up to `timeout` for what is queued to be sent; then the thread ends.  The
        number of runs left untold (logged)."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while not all(lane.idle() for lane in self.lanes) and \
                    time.monotonic() < deadline:
                self.cond.wait(max(0.0, min(0.1, deadline - time.monotonic())))
            left = sum(lane.size + len(lane.unverified) + (1 if lane.busy else 0)
                       for lane in self.lanes)
            self.stopping.set()
            self.cond.notify_all()
        if left:
            log.warning("stopping: %d notification(s) may not be sent", left)
        return left
