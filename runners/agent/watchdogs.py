"""The agent's watchdog loop (workflows/lifecycle/watchdog.py): a thread that sleeps until
the next watchdog is due, or a WATCHDOG=trigger rings, and then fires or pushes what is due.
Nothing while the agent is halted or shutting down."""

from __future__ import annotations

import logging
import threading

from runners.agent.trust import StoreTrust
from workflows.base.context import Context
from workflows.lifecycle.watchdog import Watchdogs

log = logging.getLogger("vigil.agent")
LOOK = 1.0  # at most this long between looks at whether the agent stops
AFTER_ERROR = 0.5  # a round that failed is tried again this much later, not in a spin


def start(ctx: Context, watchdogs: Watchdogs, stop: threading.Event, trust: StoreTrust) -> None:
    threading.Thread(target=_loop, args=[ctx, watchdogs, stop, trust], name="watchdog",
                     daemon=True).start()


def _loop(ctx: Context, watchdogs: Watchdogs, stop: threading.Event, trust: StoreTrust) -> None:
    while not stop.is_set():
        watchdogs.wake.wait(min(watchdogs.pause(), LOOK))
        watchdogs.wake.clear()
        if stop.is_set() or not trust.may_act() or ctx.shutting_down.is_set():
            continue
        done = False
        with trust.guarded(log, "the watchdog round failed; the next look retries"):
            watchdogs.round()
            done = True
        if not done:
            stop.wait(AFTER_ERROR)
