"""This agent's part in the store-wide chores (workflows/leases/chores.py): while it holds
them it runs the history prune and its scheduler carries the scheduled restarts' job store;
while another agent holds them, neither. Renewed every TTL/6 (at the sweep's heartbeat);
given up, job store detached, once TTL*2/3 passed on this box's monotonic clock since the
last renewal that committed (as the fence keeper's deadline: before another agent can take
them); let go at a clean stop so another takes them at once."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from runners.agent.trust import Trouble, guarded
from workflows.base.context import Context
from workflows.leases.chores import let_go, take_or_renew

log = logging.getLogger("vigil.agent")


class Chores:
    def __init__(self, ctx: Context, attach: Callable[[], None], detach: Callable[[], None],
                 trouble: Trouble) -> None:
        self.ctx, self.attach, self.detach, self.trouble = ctx, attach, detach, trouble
        self.held = False
        self.epoch: int | None = None
        self._renewed = 0.0  # monotonic time of the last renewal that committed
        self._next = 0.0

    def tick(self) -> None:
        """Take or renew the chores when due; attach or detach the job store to match."""
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.ctx.lease_ttl / 6
        got, failed = None, True
        with guarded(self.trouble, log, "chores: renewing failed; the next heartbeat retries"):
            got, failed = take_or_renew(self.ctx), False
        if failed:  # the store watch has said why; the deadline decides
            if self.held and now - self._renewed > self.ctx.lease_ttl * 2 / 3:
                self._lose("this box could not renew them in time: another agent may take them")
            return
        if got is None:
            if self.held:
                self._lose("another agent holds them")
            return
        self._renewed, self.epoch = now, got[0]
        if not self.held:
            self.held = True
            self.attach()
            log.info("chores: this agent runs the store-wide chores (history prune, scheduled "
                     "restarts) epoch=%d", got[0])

    def _lose(self, why: str) -> None:
        self.held = False
        self.detach()
        log.warning("chores: this agent no longer runs the store-wide chores: %s", why)

    def close(self, may_write: bool) -> None:
        """A stop: the job store detached (its due runs are not consumed by a scheduler
        without executors), the chores let go when the store is still trusted."""
        if not self.held:
            return
        self.held = False
        self.detach()
        if may_write:  # else they expire by themselves
            with guarded(self.trouble, log, "chores: letting go failed (they expire in %gs)",
                         self.ctx.lease_ttl):
                let_go(self.ctx)
