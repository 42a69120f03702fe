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
notifications (counted, logged).

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
from perfectschedd.metrics import counters as metrics
from perfectschedd.notify import senders
from perfectschedd.notify.spec import SILENT, Notifier
from perfectschedd.schedules.fields import RUN_NOW_MARK, schedule_key

log = logging.getLogger("perfectschedd.notify")

SUCCESS = "success"
# Outcomes that are a failure for notifications: the run failed, timed out, or was lost
# (its worker or host died under it).
FAILURES = frozenset({"failed", "timeout", "lost"})
# The outcomes that make a key's state; the rest (later, skipped, preempted, released,
# stopped, ...) change nothing.
STATE_OUTCOMES = (SUCCESS, *sorted(FAILURES))
QUEUE_MAX = 1000
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


class Dispatcher:
    def __init__(self, config: Config, previous: PreviousOutcome, *,
                 previous_many: PreviousOutcomes | None = None,
                 send: Callable[[Notifier, senders.Message], None] | None = None) -> None:
        self.config = config
        self.previous = previous  # (key, before) -> the latest state outcome before
        self.previous_many = previous_many
        # First successes of keys the pipeline had not seen, by key (see the module doc).
        self.unverified: collections.OrderedDict[str, Run] = collections.OrderedDict()
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
        # The notification thread only: each key's last state outcome.
        self.state: collections.OrderedDict[str, str] = collections.OrderedDict()
        self.queue: collections.deque[Run] = collections.deque()
        self.cond = threading.Condition()
        self.busy = False
        self.stopping = threading.Event()
        self.unknown_names: set[str] = set()
        self.thread = threading.Thread(target=self._loop, name="notify", daemon=True)
        self.thread.start()

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
                seen[key] = "failed"
            else:
                continue
            keep.append(r)
        if len(seen) > STATE_MAX:  # forgetting costs at most one query per key again
            seen.clear()
        self.last_recorded = time.monotonic()
        if later:
            with self.cond:
                for r in later:
                    self.unverified[schedule_of(r["key"])] = r
                    self.unverified.move_to_end(schedule_of(r["key"]))
                while len(self.unverified) > STATE_MAX:
                    self.unverified.popitem(last=False)
                    metrics.notification("?", "dropped")
                self.cond.notify()
        if not keep:
            return
        with self.cond:
            room = QUEUE_MAX - len(self.queue)
            if room < len(keep):
                for r in keep[max(0, room):]:
                    # A dropped run may be a failure: the next one must not be taken for
                    # a success after a success.
                    seen.pop(schedule_of(r.get("key")), None)
                    metrics.notification("?", "dropped")
                log.warning("notification queue full: %d run(s) not told",
                            len(keep) - max(0, room))
                keep = keep[:max(0, room)]
            self.queue.extend(keep)
            self.cond.notify()

    # -- the thread ---------------------------------------------------------------------

    def _loop(self) -> None:
        unverified = False
        while True:
            batch: list[Run] = []
            with self.cond:
                while not self.queue and not self.unverified and not self.stopping.is_set():
                    self.busy = False
                    self.cond.notify_all()
                    self.cond.wait()
                if not self.queue and not self.unverified:
                    self.busy = False
                    self.cond.notify_all()
                    return
                if not self.queue and not self.stopping.is_set():
                    quiet_in = self.last_recorded + QUIET - time.monotonic()
                    if quiet_in > 0 and len(self.unverified) < STATE_MAX // 2:
                        self.busy = False
                        self.cond.notify_all()
                        self.cond.wait(quiet_in)
                        continue
                self.busy = True
                if self.queue:
                    batch = [self.queue.popleft()]
                else:  # nothing else to do: first successes, many per query
                    while self.unverified and len(batch) < VERIFY_BATCH:
                        batch.append(self.unverified.popitem(last=False)[1])
                    unverified = True
            if unverified:
                # Outside the lock: on_recorded never waits on a query.  Only a success
                # after a failure has anything to tell; the rest cost a dict write each
                # (a burst of new keys shares the GIL with the pipeline).
                batch = self._learn(batch)
                unverified = False
            for run in batch:
                try:
                    self.handle(run)
                except Exception:  # noqa: BLE001 - this thread must outlive any one run
                    log.exception("key=%s: notification not sent (internal error)",
                                  run.get("key"))

    def _learn(self, runs: list[Run]) -> list[Run]:
        """Of these first successes, those that may be recoveries: the history (one
        query, see the module doc) or this thread's memory says the run before failed.
        The others only mark their key a success."""
        assert self.previous_many is not None
        state = self.state
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
                                       else "failed" if prior in FAILURES else SUCCESS)
        told = []
        for r in runs:
            key = schedule_of(r["key"])
            if state.get(key) == "failed":
                told.append(r)
            else:
                state[key] = SUCCESS
                state.move_to_end(key)
        while len(state) > STATE_MAX:
            state.popitem(last=False)
        return told

    def handle(self, run: Run) -> None:
        notifier = self.resolve(run)
        event = self.decide(run, notifier)
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

    def decide(self, run: Run, notifier: Notifier | None) -> str | None:
        """The event to tell (failure, recovery, output) or None; keeps the key's state."""
        run_key = str(run.get("key"))
        key = schedule_of(run_key)
        failed = run.get("outcome") in FAILURES
        now_state = "failed" if failed else SUCCESS
        before = self.state.get(key)
        if before is None and notifier is not None and notifier.when != "output":
            # Once per schedule this thread has not seen: its last run before this one.
            started = run.get("started_at")
            prior = self.previous(run_key,
                                  float(started if started is not None else time.time()))
            before = None if prior is None else ("failed" if prior in FAILURES else SUCCESS)
        self.state[key] = now_state
        self.state.move_to_end(key)
        if len(self.state) > STATE_MAX:
            self.state.popitem(last=False)
        if notifier is None:
            return None
        if notifier.when == "output":
            return "output" if run.get("output") else None
        if failed:
            if notifier.when == "every-failure" or before != "failed":
                return "failure"
            return None
        return "recovery" if before == "failed" else None

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
                metrics.notification(notifier.kind, "sent")
                log.info("key=%s: %s notification sent (%s %s)", message.run.get("key"),
                         message.event, notifier.kind, notifier.name)
                return True
            if attempt < len(RETRY_WAITS) and self.stopping.wait(RETRY_WAITS[attempt]):
                break  # stopping: no more waiting between tries
        metrics.notification(notifier.kind, "failed")
        log.error("key=%s: %s notification not sent (%s %s): %s", message.run.get("key"),
                  message.event, notifier.kind, notifier.name, why)
        return False

    # -- stop ---------------------------------------------------------------------------

    def drain(self, timeout: float) -> int:
        """Wait up to `timeout` for what is queued to be sent; then the thread ends.  The
        number of runs left untold (logged)."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while (self.queue or self.unverified or self.busy) and \
                    time.monotonic() < deadline:
                self.cond.wait(max(0.0, min(0.1, deadline - time.monotonic())))
            left = len(self.queue) + len(self.unverified) + (1 if self.busy else 0)
            self.stopping.set()
            self.cond.notify_all()
        if left:
            log.warning("stopping: %d notification(s) may not be sent", left)
        return left
