"""The jobs' timer: a thread of the agent's that writes the runs of scheduled jobs
(workflows/lifecycle/jobs.py tick) at each next instant any job has, and moves the open
runs; never later than BACKSTOP after the last turn while a job is enabled here (IDLE_BACKSTOP
while none is: an idle agent need not wake every 2 s), and at once when a drive moved a row
or a round ran (`poke`: a job just enabled rings the doorbell, so its round pokes the timer;
a run ended by a stop is a drive's progress). A poke during a turn makes one more turn
right after it, never two at once.

It was an APScheduler date job, re-added at each poke: APScheduler counts a job's instances
from its submission to its return, so a poke at a turn's start or end could find two
counted and the turn was skipped with a warning in the agent's log (the clean-clone
.ci/run at 4ae1c0a: a deploy retried against a full disk poked it at every drive).

The instants are derived from the store each turn, not kept here: an agent killed at any
point finds the same instants due, and the store's unique (host, instant) keeps each one
to a single run."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import UTC, datetime

from models.store import utcnow
from runners.agent.trust import StoreTrust
from workflows.base.context import Context
from workflows.lifecycle.jobs import tick

log = logging.getLogger("vigil.jobs")
BACKSTOP = 2.0  # seconds at most between two turns while a job is enabled here
IDLE_BACKSTOP = 30.0  # ... while none is (a wake of one rings a round, which pokes the timer)


class JobTimer:
    def __init__(self, ctx: Context, trust: StoreTrust, stop: threading.Event,
                 kick: Callable[[], None] = lambda: None) -> None:
        self.ctx, self.trust, self.stop = ctx, trust, stop
        self.kick = kick  # the reconciler's round: a run's wake written is started at once
        self.bell = threading.Event()  # a poke: one turn now (or right after this one)
        # When this agent began writing runs: the instants before it passed with no agent
        # (their catch-up policy decides them: workflows/lifecycle/catchup.py).
        self.up_since = utcnow()

    def start(self) -> None:
        self.up_since = utcnow()
        threading.Thread(target=self.loop, name="jobs", daemon=True).start()

    def poke(self) -> None:
        """A turn now (a drive moved a row: a run may have started or ended; a round ran: a
        job may have been enabled)."""
        self.bell.set()

    def loop(self) -> None:
        pause = 0.0
        while True:
            self.bell.wait(pause)
            self.bell.clear()  # a poke from here on is after this turn's reads: one more turn
            if self.stop.is_set() or self.ctx.shutting_down.is_set():
                return
            nxt = self._turn()
            now = datetime.now(UTC)
            pause = IDLE_BACKSTOP if nxt is None else max(0.0, min(
                BACKSTOP, (nxt.replace(tzinfo=UTC) - now).total_seconds()))

    def _turn(self) -> datetime | None:
        if not self.trust.may_act():
            return None
        with self.trust.guarded(log, "jobs tick failed"):
            return tick(self.ctx, self.up_since, self.kick)
        return None
