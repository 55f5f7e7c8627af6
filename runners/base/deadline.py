"""A timeout on an app that does not count time the agent itself did not run.

The monotonic clock goes on while the agent is SIGSTOPped (or its VM is frozen, or the box
is swapping it out), and the app, which kept running, may have answered meanwhile: the
agent must look once more before it blames the app. A jump is two readings of the clock
further apart than the longest wait the caller does between them plus JUMP; the first one
starts the timeout again, a later one does not (a stall that repeats cannot keep a bad app
from ever failing)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger("vigil.deadline")

JUMP = 2.0  # seconds of not running beyond the caller's own wait: no scheduling hiccup is this long


class Deadline:
    def __init__(self, timeout: float, step: float, what: str,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`step`: the longest the caller blocks between two calls of left()."""
        self.clock = clock
        self.timeout = timeout
        self.step = step
        self.what = what
        now = self.clock()
        self.end = now + timeout
        self._seen = now
        self.rearmed = False

    def left(self) -> float:
        """Seconds left (<= 0: the timeout has passed), after re-arming on the first jump."""
        now = self.clock()
        gap, self._seen = now - self._seen, now
        if not self.rearmed and gap > self.step + JUMP:
            self.rearmed = True
            self.end = now + self.timeout
            log.warning("timeout re-armed what=%s stalled=%.1fs (this process did not run: "
                        "the time is not counted against the app)", self.what, gap)
        return self.end - now
