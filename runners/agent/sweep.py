"""The agent's checks on a clock: the short sweep (liveness, workers, leases, takeover,
heartbeat) on a thread of its own, the liveness backstop when exits arrive by pidfd, the
ongoing health probes, the history prune."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import update

from models.store import utcnow
from models.tables import Agent as AgentRow
from runners.agent.chore_holder import Chores
from runners.agent.exit_watch import ExitWatcher
from runners.agent.fencing import FenceGuard
from runners.agent.reconciler import Reconciler
from runners.agent.trust import StoreTrust
from runners.base.wakeup import Rings
from workflows.base.context import Context
from workflows.base.crash import crashpoint
from workflows.engine.history import Keep, prune, prune_rings
from workflows.engine.recovery import release_leftovers
from workflows.generations.known import note
from workflows.leases import box
from workflows.lifecycle.members import count_current_leaders, leaders_after, retire_dead_currents
from workflows.lifecycle.probe import Prober
from workflows.lifecycle.takeover import take_over
from workflows.lifecycle.workers import any_to_sweep
from workflows.lifecycle.workers import sweep as sweep_workers

log = logging.getLogger("vigil.agent")

BACKSTOP = 30.0  # seconds between liveness backstops when exits arrive by pidfd
WALK_SLICE = 200  # leaders whose descendants one backstop walks (docs/internals/idle.md)
HEARTBEAT_EVERY = 3.0  # seconds between heartbeats written (a command looks 10 s back)
PRUNE_FIRST, PRUNE_EVERY = 5.0, 600.0  # seconds: the history prune after start, then between
PRUNE_BATCHES = 20  # batches per table per prune run (workflows/engine/history.py BATCH rows each)


def liveness(ctx: Context, trust: StoreTrust, kick: Callable[[], None],
             only: set[int] | None = None, skip: set[int] | None = None) -> bool:
    """Reap our children and retire every dead current (or those of `only`; none of
    `skip`); True when some were retired (the reconciler is rung)."""
    reap = getattr(ctx.proc, "reap", None)
    if reap is not None:
        reap()
    if not trust.may_act() or not retire_dead_currents(ctx, only, skip or ()):
        return False
    kick()
    return True


class Heartbeat:
    """This box's lease renewed and the agents row's heartbeat written (without LISTEN, the
    intents' rings read in the same transaction); the chores renewed when due."""

    def __init__(self, ctx: Context, chores: Chores, rings: Rings | None,
                 kick: Callable[[], None] | None) -> None:
        self.ctx, self.chores, self.rings, self.kick = ctx, chores, rings, kick
        self.last_beat = 0.0  # monotonic time of the last beat
        self.heartbeat_at = -HEARTBEAT_EVERY  # of the last heartbeat written: the first writes one

    def beat(self) -> None:
        # The agents row's heartbeat (read only by a command asking whether some agent acts,
        # runners/quick/ops.py: within 10 s) every HEARTBEAT_EVERY, not every sweep: an idle
        # box then writes a row a few seconds, not one a second (1,000 boxes: 330/s, not 1,000).
        now = time.monotonic()
        heartbeat = now - self.heartbeat_at >= HEARTBEAT_EVERY
        rings = self.rings  # without LISTEN (--listen off): the intents' rings, read here

        def beat(s):  # type: ignore[no-untyped-def]
            fresh = box.hold(s, self.ctx, due_only=True)[1]  # one row: this box's lease
            if heartbeat:
                s.execute(update(AgentRow).where(AgentRow.id == self.ctx.agent_id)
                          .values(heartbeat_at=utcnow()))
            return fresh, rings.read(s) if rings is not None else set()

        fresh, rung = self.ctx.store.write(beat)
        if fresh:
            crashpoint(box.TAKEN)
        self.last_beat = time.monotonic()
        if heartbeat:
            self.heartbeat_at = now
        if rings is not None and rings.new(rung) and self.kick is not None:
            self.kick()  # an intent written for this box (or the shared channel): a round
        self.chores.tick()  # every TTL/6 at most: one row the whole fleet shares


def forks_since_boot() -> int | None:
    """The kernel's count of forks (and clones) since boot, /proc/stat `processes`: no
    process has a new descendant while it does not move. None: not readable."""
    try:
        with open("/proc/stat", "rb") as f:
            for line in f:
                if line.startswith(b"processes "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


class Walks:
    """The backstop's walk of the leaders' descendants (workflows/generations/known.py), a
    slice of WALK_SLICE leaders a turn, by generation id, so an idle backstop's cost does
    not grow with the hosts; a cycle over all of them is skipped when nothing on the box
    forked since the last whole cycle began (docs/internals/idle.md: why nothing is missed)."""

    def __init__(self, ctx: Context, size: int = WALK_SLICE) -> None:
        self.ctx, self.size = ctx, size
        self.after = 0  # the last generation id walked in this cycle (0: a new cycle)
        self.cycle_forks: int | None = None  # the fork count when this cycle began
        self.done_forks: int | None = None  # ... when the last whole cycle began
        self.walked = 0  # leaders walked, all turns (for tests and the bench)

    def turn(self) -> None:
        if self.after == 0:
            forks = forks_since_boot()
            if forks is not None and forks == self.done_forks:
                return  # nothing forked since a whole cycle began: no new descendant anywhere
            self.cycle_forks = forks
        refs = leaders_after(self.ctx, self.after, self.size)
        if len(refs) < self.size:
            self.after, self.done_forks = 0, self.cycle_forks  # the cycle is whole
        else:
            self.after = max(refs)
        self.walked += len(refs)
        note(self.ctx, refs)


@dataclass
class Sweeper:
    """The agent's part that runs on a clock (runners/agent/daemon.py builds it)."""

    ctx: Context
    trust: StoreTrust
    reconciler: Reconciler
    heartbeat: Heartbeat
    watcher: ExitWatcher | None  # exits as events (pidfds); None: the sweep finds them
    fence: FenceGuard | None  # on PostgreSQL (runners/agent/fencing.py)
    stop: threading.Event
    keep: Keep  # what history the store keeps (workflows/engine/history.py)
    logs: Any  # the log keeper's client (runners/keepers/logkeeper.py), if any
    interval: float  # the short sweep's: --sweep-interval
    converge_budget: int  # worker converges per sweep, box-wide
    walks: Walks | None = None  # the backstop's slices (made at the first backstop)
    sweeps: int = 0
    _rounds_seen: int = -1
    _workers_to_sweep: bool = True

    def sweep(self) -> None:
        """The short sweep: worker drift and max-run, lease renewal, takeover, heartbeat.
        Dead currents too, unless exits arrive as events (then the scan is their backstop)."""
        self.trust.check_schema()
        reconciler = self.reconciler
        if not self.trust.may_act():
            self.trust.watch.remind()
            if self.ctx.store.dialect == "postgresql":
                try:  # other boxes must not take over apps that still run here
                    self.heartbeat.beat()
                except Exception:
                    pass  # the halt line says why; the lease fence does the rest
            return
        if self.watcher is None:
            liveness(self.ctx, self.trust, reconciler.kick)
        self.sweeps += 1
        if self._rounds_seen != reconciler.rounds:  # rows moved since the last look
            self._rounds_seen = reconciler.rounds
            self._workers_to_sweep = any_to_sweep(self.ctx)
        if self._workers_to_sweep and sweep_workers(self.ctx, self.converge_budget, self.sweeps):
            reconciler.kick()
        # Takeover, leases and the heartbeat: every sweep where other boxes share the store
        # (PostgreSQL); on one box every third of the lease's length (an fsync a second was
        # most of an idle agent's cost). A renewal pushes leases past half their length.
        every = 0.0 if self.ctx.store.dialect == "postgresql" else self.ctx.lease_ttl / 3
        if time.monotonic() - self.heartbeat.last_beat < every:
            return
        # Hosts placed here whose owner's lease expired; `keep` hosts once this box has
        # reached the store for a lease's length (their owner renews first after an outage).
        # The reconciler is rung as soon as the takeover commits: the wakes start at once.
        take_over(self.ctx, keep_too=self.fence is not None
                  and self.fence.steady_for() >= self.ctx.lease_ttl, on_taken=reconciler.kick)
        self.heartbeat.beat()

    def loop(self) -> None:
        """The short sweep on its own thread: APScheduler re-reads its job store on every
        wake-up, which a once-a-second job would pay for every second."""
        while not self.stop.wait(self.interval):
            with self.trust.guarded(log, "sweep failed; the next one retries"):
                self.sweep()

    def backstop(self) -> None:
        """With exits as events, now and then, for what no pidfd reports: the leaders the
        watcher could not open one for are checked; the watcher re-reads what to watch
        only when the store's count of current leaders is not its own; a slice of the
        leaders' descendants is walked. Nothing here reads every leader while nothing
        happens (docs/internals/idle.md says why nothing is missed)."""
        # A scheduler job: a failure is said here, not as APScheduler's traceback.
        with self.trust.guarded(log, "the liveness backstop failed; the next one retries"):
            watcher = self.watcher
            reap = getattr(self.ctx.proc, "reap", None)
            if reap is not None:
                reap()  # children that exited and were not reported (their zombies)
            if watcher is None or not watcher.alive():  # no events: the whole check
                liveness(self.ctx, self.trust, self.reconciler.kick)
            elif self.trust.may_act():
                unwatched = watcher.unwatched()
                if unwatched:
                    liveness(self.ctx, self.trust, self.reconciler.kick, only=unwatched)
                if count_current_leaders(self.ctx) != watcher.count():
                    watcher.refresh()
                self.walks = self.walks or Walks(self.ctx)
                self.walks.turn()
            if self.logs is not None:
                try:
                    self.logs.peer.revive()  # a keeper that died meanwhile: started again
                except OSError as exc:
                    log.warning("log keeper: %s; the next backstop tries again", exc)

    def probe_loop(self, prober: Prober) -> None:
        """The ongoing health probes that are due (workflows/lifecycle/probe.py), every tick while a
        host is probed (else a read every few seconds); nothing while the agent is halted."""
        while not self.stop.is_set():
            prober.wake.wait(prober.pause())
            prober.wake.clear()
            if self.stop.is_set() or not self.trust.may_act() or self.ctx.shutting_down.is_set():
                continue
            with self.trust.guarded(log, "the health probe failed; the next tick retries"):
                prober.round()
        prober.close()

    def release_leftovers(self) -> None:
        """A job once after start: the cgroup dirs a death between a proof and its release
        left (workflows/engine/recovery.py). Not on the way to ready: it lists every dir
        under the box's cgroup base, every store's (0.45 s of each start with 79,000 there)."""
        with self.trust.guarded(log, "releasing leftover cgroups failed; the next start retries"):
            released = release_leftovers(self.ctx)
            if released:
                log.info("released %d leftovers (cgroup dirs, exec claims) of proven "
                         "generations", released)

    def prune_history(self) -> None:
        """A scheduled job: delete history nothing needs, a batch at a time (at most
        PRUNE_BATCHES per table per run: a backlog goes over several runs)."""
        if not self.trust.may_act() or not self.heartbeat.chores.held:
            return  # the whole store's: the agent holding the chores prunes it
        if self.ctx.store.dialect == "postgresql":  # only PostgreSQL's trigger writes rings
            with self.trust.guarded(log, "pruning rings failed; the next run retries"):
                prune_rings(self.ctx.store)
        if self.keep.older_than is None:
            return
        with self.trust.guarded(log, "pruning history failed; the next run retries"):
            done = prune(self.ctx.store, self.keep, max_batches=PRUNE_BATCHES,
                         go_on=lambda: not self.ctx.shutting_down.is_set() and self.trust.may_act())
            if any(done.values()):
                log.info("history pruned %s", " ".join(f"{k}={v}" for k, v in done.items() if v))
