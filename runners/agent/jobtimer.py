"""The jobs' timer: the agent's one APScheduler job that writes the runs of scheduled jobs
(workflows/lifecycle/jobs.py tick) at each next instant any job has, and moves the open
runs; never later than BACKSTOP after the last turn while a job is enabled here (IDLE_BACKSTOP
while none is: an idle agent's scheduler need not wake every 2 s), and at once when a drive
moved a row or a round ran (`poke`: a job just enabled rings the doorbell, so its round pokes
the timer; a run ended by a stop is a drive's progress).

The instants are derived from the store each turn, not kept here: an agent killed at any
point finds the same instants due, and the store's unique (host, instant) keeps each one
to a single run."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from apscheduler.schedulers import SchedulerNotRunningError
from apscheduler.schedulers.base import BaseScheduler

from models.store import utcnow
from runners.agent.trust import StoreTrust
from workflows.base.context import Context
from workflows.lifecycle.jobs import tick

log = logging.getLogger("vigil.jobs")
JOB_ID = "jobs"
BACKSTOP = 2.0  # seconds at most between two turns while a job is enabled here
IDLE_BACKSTOP = 30.0  # ... while none is (a wake of one rings a round, which pokes the timer)


class JobTimer:
    def __init__(self, ctx: Context, scheduler: BaseScheduler, trust: StoreTrust,
                 kick: Callable[[], None] = lambda: None) -> None:
        self.ctx, self.scheduler, self.trust = ctx, scheduler, trust
        self.kick = kick  # the reconciler's round: a run's wake written is started at once
        self.lock = threading.Lock()  # one turn at a time, whoever asks for it
        # A poke while a turn runs asks that turn to go again at its end, rather than
        # replacing the turn's own job (APScheduler would skip the new one with a warning:
        # "maximum number of running instances reached").
        self.state = threading.Lock()
        self.turning = False
        self.again = False
        # When this agent began writing runs: the instants before it passed with no agent
        # (their catch-up policy decides them: workflows/lifecycle/catchup.py).
        self.up_since = utcnow()

    def start(self) -> None:
        self.up_since = utcnow()
        self._at(datetime.now(UTC))

    def poke(self) -> None:
        """A turn now (a drive moved a row: a run may have started or ended; a round ran: a
        job may have been enabled)."""
        with self.state:
            if self.turning:
                self.again = True
                return
            self._at(datetime.now(UTC))

    def fire(self) -> None:
        with self.state:
            self.turning, self.again = True, False
        try:
            nxt = self._turn()
        finally:
            with self.state:
                self.turning = False
                now = datetime.now(UTC)
                if self.again:  # poked meanwhile: what it saw may be after this turn's reads
                    self._at(now)
                elif nxt is None:
                    self._at(now + timedelta(seconds=IDLE_BACKSTOP))
                else:
                    self._at(min(now + timedelta(seconds=BACKSTOP), nxt.replace(tzinfo=UTC)))

    def _turn(self) -> datetime | None:
        with self.lock:
            if self.ctx.shutting_down.is_set() or not self.trust.may_act():
                return None
            with self.trust.guarded(log, "jobs tick failed"):
                return tick(self.ctx, self.up_since, self.kick)
        return None

    def _at(self, when: datetime) -> None:
        if self.ctx.shutting_down.is_set():
            return
        try:
            self.scheduler.add_job(self.fire, "date", run_date=when, id=JOB_ID,
                                   replace_existing=True, misfire_grace_time=None,
                                   max_instances=2)  # a rare poke at a turn's start: it waits
        except SchedulerNotRunningError:  # shut down in between: no turn is owed any more
            pass
