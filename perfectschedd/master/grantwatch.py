"""The polkit grant, watched: the master notices by itself when it comes on or goes off
(docs/security.md), not only at start and on reload.

Every CHECK_EVERY seconds the loop looks at what changes when the grant may have: the
mark `perfectsched-grant enable` leaves and the polkit rules directories (a rule linked
by hand changes its directory), a few stats (grant.signature).  On a change it asks again
(grant.grant_state: the mark, else systemd itself) on a thread of its own, since systemd
may take PROBE_TIMEOUT to answer, and keeps asking for SETTLE seconds (polkitd reads a
new rule a moment after it is linked).  An answer that was not sure (systemd did not
answer: taken as held) is asked again every RETRY seconds.  What changed is the
supervisor's to apply (Supervisor._grant_changed).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

CHECK_EVERY = 2.0
SETTLE = 10.0
RETRY = 30.0


class GrantWatch:
    def __init__(self, poke: Callable[[], None], ask: Callable[[], tuple[bool, bool]],
                 look: Callable[[], object]) -> None:
        """`ask`: (held, sure), may block (grant.grant_state); `look`: what changes with
        the grant (grant.signature); `poke`: wakes the master's loop."""
        self.poke = poke
        self.ask = ask
        self.look = look
        self.lock = threading.Lock()
        self.seen: object = None
        self.checked = -math.inf
        self.changed_at = -math.inf
        self.asked_at = -math.inf
        self.sure = True
        self.asking = False
        # An answer of an ask begun before the master last asked itself is stale.
        self.epoch = 0
        self.answer: bool | None = None

    def settled(self, sure: bool, now: float) -> None:
        """The master asked itself (start, reload, or a change it applied): that answer is
        the one to compare with from now on."""
        with self.lock:
            self.epoch += 1
            self.answer = None
            self.sure = sure
            self.asked_at = now
        self.seen = self.look()
        self.checked = now

    def poll(self, now: float) -> bool | None:
        """On the master's loop: the answer of the last ask, once it came (held or not;
        the caller compares it with what it runs under), else None.  Starts an ask when
        one is due."""
        with self.lock:
            answer, self.answer = self.answer, None
        if now - self.checked >= CHECK_EVERY:
            self.checked = now
            seen = self.look()
            if seen != self.seen:
                self.seen = seen
                self.changed_at = now
            if now - self.changed_at < SETTLE or (
                    not self.sure and now - self.asked_at >= RETRY):
                self._ask(now)
        return answer

    def _ask(self, now: float) -> None:
        with self.lock:
            if self.asking:
                return
            self.asking = True
            self.asked_at = now
            epoch = self.epoch

        def run() -> None:
            try:
                held, sure = self.ask()
            except Exception:  # noqa: BLE001 - no answer is taken as held (fail closed)
                held, sure = True, False
            with self.lock:
                self.asking = False
                if epoch == self.epoch:
                    self.sure = sure
                    self.answer = held
            self.poke()

        threading.Thread(target=run, name="grant-check", daemon=True).start()
