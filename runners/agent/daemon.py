"""The agent daemon: one per state directory. Recovers, then runs the reconciler
(runners/agent/reconciler.py) under APScheduler: a round on every new intent (doorbell),
when the next row falls due, and on a slow scan interval; a liveness sweep of current
generations on a short one (runners/agent/sweep.py). Its parts are plain objects built
here in turn, each given what it needs (run: _build before recovery, _start after); its
lock, row, doorbell and signals are in runners/agent/startup.py, whether it may still act
on the store (and the one guard of its loops) in runners/agent/trust.py."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path
from typing import cast

from apscheduler.schedulers.background import BackgroundScheduler
from sqlalchemy import update

from models.notices import word_of
from models.schema import require_head
from models.store import Store, utcnow
from models.tables import Agent as AgentRow
from runners.agent import jobstore
from runners.agent import watchdogs as watchdog_loop
from runners.agent.chore_holder import Chores
from runners.agent.exit_watch import ExitWatcher, PipeBell, pidfds_supported
from runners.agent.fencing import FencedProcess, FenceGuard, Timing
from runners.agent.helpers import Keeper, KeeperWatch
from runners.agent.jobtimer import JobTimer
from runners.agent.openfiles import raise_open_file_limit, say_open_file_limit
from runners.agent.reconciler import Kick, Reconciler
from runners.agent.startup import Signals, doorbell, lock_state_dir, register, wait_for_stop
from runners.agent.sweep import BACKSTOP, PRUNE_EVERY, PRUNE_FIRST, Heartbeat, Sweeper, liveness
from runners.agent.trust import StoreTrust, guarded
from runners.backend.sockets import settle_state_dir
from runners.base import wakeup
from runners.base.doorbell import ring as ring_doorbell
from runners.base.sd_notify import notify
from runners.base.storewatch import StoreWatch
from runners.quick.control import Commits, ControlServer
from runners.quick.control import version as control_version
from workflows.base.context import Context
from workflows.engine.history import Keep
from workflows.engine.recovery import recover
from workflows.lifecycle.members import current_leaders
from workflows.lifecycle.probe import Prober
from workflows.lifecycle.watchdog import Watchdogs

log = logging.getLogger("vigil.agent")
Observer = Callable[[float], None]

# Events the agent also logs at WARNING, with their reason: a failed or abandoned attempt
# (its drive alone says result=progress), a failed wake, a host refused, a host down.
WARN_EVENTS = frozenset({"deploy_failed", "deploy_abandoned", "deploy_down", "down",
                         "wake_failed", "refused", "self_fenced"})


def _after_events(events: list[tuple[str, str | None, int | None, dict[str, object]]],
                  kick: Callable[[], None]) -> None:
    """After a commit: one WARNING line per failure event it wrote; a round at once if it
    owed a notification."""
    for kind, host, gen, detail in events:
        if kind in WARN_EVENTS:
            pairs = " ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}"
                             for k, v in detail.items())
            log.warning("%s host=%s%s %s", kind, host,
                        f" generation=g{gen}" if gen is not None else "", pairs)
    if any(word_of(kind, detail) is not None for kind, _, _, detail in events):
        kick()


def _pause(scheduler: BackgroundScheduler) -> None:
    """The agent stops acting (the store watch halted): its timers stop (scan, backstop,
    schedules); the sweep only says so again now and then."""
    try:
        scheduler.pause()
    except Exception:  # not started yet, or shut down
        pass


@dataclass
class Parts:
    """What the agent is built of once its state dir is locked: made in turn, each with
    what it needs, by AgentDaemon._build (before recovery) and _start (after)."""

    ctx: Context  # with its final process port (fenced on PostgreSQL)
    trust: StoreTrust
    guard: FenceGuard | None
    scheduler: BackgroundScheduler
    bell: Kick
    observe_round: Observer | None  # a round's duration: to the metrics when served
    signals: Signals
    locks: object  # the state dir's and the SQLite file's (startup.lock_state_dir), held
    commits: Commits  # the agent's write commits: for the control socket's polls, the wakeup


@dataclass
class Running:
    """What a started agent runs, stopped in turn by its shutdown."""

    parts: Parts
    reconciler: Reconciler
    watcher: ExitWatcher | None
    chores: Chores
    keepers: KeeperWatch
    prober: Prober
    control: ControlServer


# The agent's Context, made of its own store (the CLI's, with the agent's hooks) and its
# shutting_down event once the state dir is locked (runners/wiring.py make_context).
Wire = Callable[[Store, threading.Event], Context]


class AgentDaemon:
    """`started`: the keeper watch's bell, whose ring `wire` gave the keepers' clients."""

    def __init__(self, state_dir: Path, agent_id: str, store: Store, wire: Wire,
                 started: PipeBell, *, scan_interval: float = 30.0,
                 sweep_interval: float = 1.0, max_hosts: int = 8, converge_budget: int = 1,
                 metrics_listen: str | None = None, keep: Keep | None = None,
                 db: str | None = None, listen: bool = True) -> None:
        self.state_dir, self.agent_id, self.store = state_dir.absolute(), agent_id, store
        self.wire, self.started = wire, started
        self.listen = listen  # LISTEN for intents (PostgreSQL); off: read their rings each sweep
        self.keep = keep or Keep()  # what history the store keeps (workflows/engine/history.py)
        self.db = db  # as given (--db / VIGIL_DB): a client naming another store goes direct
        self.started_at = datetime.now(UTC)
        self.metrics_listen = metrics_listen
        self.converge_budget = converge_budget  # worker converges per sweep, box-wide
        self.scan_interval = scan_interval  # the full scan (job `scan`): --safety-interval
        self.sweep_interval = sweep_interval  # the short sweep: --sweep-interval
        self.max_hosts = max_hosts
        self.stop = threading.Event()
        self.recovered = threading.Event()
        self._version: str | None = None  # read on the first `agent status`, not at start

    def live(self, reconciler: Reconciler) -> dict[str, object]:
        """What the agent says of itself on its control socket (`vigil agent status`)."""
        last = reconciler.last_round_at
        if self._version is None:
            self._version = control_version()
        return {"running": True, "pid": os.getpid(), "box": self.agent_id,
                "version": self._version, "up_since": self.started_at.isoformat(),
                "ready": self.recovered.is_set(), "rounds": reconciler.rounds,
                "last_round": last.isoformat() if last is not None else None}

    def run(self) -> int:
        limits = raise_open_file_limit()  # before anything opens: the control socket's cap follows it
        parts = self._build(limits, lock_state_dir(self.state_dir, self.store.url))
        counts = recover(parts.ctx)
        log.info("recovered agent=%s adopted=%d retired=%d", parts.ctx.agent_id,
                 counts["adopted"], counts["retired"])
        running = self._start(parts)
        self.recovered.set()
        log.info("ready agent=%s state_dir=%s", self.agent_id, self.state_dir)
        notify("READY=1", f"STATUS=ready: adopted {counts['adopted']}, retired {counts['retired']}")
        wait_for_stop(self.stop, parts.signals)
        return self._shut_down(running)

    def _build(self, limits: tuple[int, int, int], locks: object) -> Parts:
        """The parts recovery needs, made in turn once the state dir is locked: the store
        watch and trust, the round's bell, the metrics if served, and on PostgreSQL the
        fence guard, whose spawn guard is in front of the agent's Context's process port."""
        scheduler = BackgroundScheduler(timezone=UTC,
                                        job_defaults={"coalesce": True, "max_instances": 1,
                                                      "misfire_grace_time": None})
        watch = StoreWatch(self.store.url, self.state_dir, log, on_halt=partial(_pause, scheduler))
        stopping = threading.Event()  # the Context's shutting_down
        bell, commits = Kick(stopping), Commits()

        def committed(readonly: bool) -> None:
            watch.ok(readonly)  # a store in trouble works again
            commits.committed(readonly)  # for a progress poll, and the SQLite file's watch

        ctx = self.wire(self.store.hooked(committed, partial(_after_events, kick=bell)), stopping)
        trust = StoreTrust(ctx.store, watch)
        require_head(ctx.store.engine)
        say_open_file_limit(ctx, limits)
        settle_state_dir(ctx)
        observe_round, proof_failed = None, ctx.on_proof_failed
        if self.metrics_listen:  # prometheus_client is imported only then (start-up time)
            from runners.agent import metrics

            metrics.serve(ctx.store, self.metrics_listen)
            observe_round, proof_failed = metrics.ROUND.observe, metrics.PROOFS_FAILED.inc
        signals = Signals()  # SIGTERM/SIGINT from here on stop the agent in turn
        register(ctx)
        logs = getattr(ctx.proc, "logs", None)  # the log keeper's client
        if logs is not None:
            logs.adopt()  # copies of the pipes a running keeper writes for
        guard, proc = None, ctx.proc
        if ctx.store.dialect == "postgresql":  # several boxes: leases must fence
            guard = FenceGuard(ctx, Timing(ctx.lease_ttl), trust.trouble, self.started.ring)
            proc = FencedProcess(ctx.proc, guard)  # type: ignore[assignment]
        ctx = replace(ctx, proc=proc, on_proof_failed=proof_failed)
        if guard is not None:
            guard.start()
        return Parts(ctx, trust, guard, scheduler, bell, observe_round, signals, locks, commits)

    def _start(self, parts: Parts) -> Running:
        """Everything that acts after recovery, started in turn; a first round at the end."""
        ctx, trust, guard, scheduler, bell = (parts.ctx, parts.trust, parts.guard,
                                              parts.scheduler, parts.bell)
        logs = getattr(ctx.proc, "logs", None)
        keepers = KeeperWatch([cast(Keeper, h) for h in (getattr(ctx.listeners, "peer", None),
                                                          getattr(logs, "peer", None), guard)
                               if h is not None], self.started)
        prober = Prober(ctx, bell)
        watcher = self._watcher(ctx, trust, bell)

        def progressed() -> None:  # a drive moved a row: what is watched may have changed
            if watcher is not None:
                watcher.refresh()
            prober.refresh()
            watchdogs.refresh()
            job_timer.poke()

        observe = parts.observe_round or (lambda _seconds: None)

        def rounded(seconds: float) -> None:  # a round ran: a job may have been enabled
            observe(seconds)
            job_timer.poke()

        reconciler = Reconciler(ctx, scheduler, self.max_hosts, bell=bell, trust=trust,
                                on_progress=progressed, on_round=rounded)
        watchdogs = Watchdogs(ctx, reconciler.kick)  # refreshed by progressed() from here on
        job_timer = JobTimer(ctx, trust, self.stop, reconciler.kick)  # poked by progressed() likewise
        if watcher is not None:
            watcher.start()
        keepers.start()  # each checked, restored and watched before the first round
        reconciler.start()
        chores = Chores(ctx, lambda: jobstore.attach(
            scheduler, ctx, reconciler.kick, trust.trouble, trust.may_act),
            lambda: jobstore.detach(scheduler), trust.trouble)
        rings = None if self.listen else wakeup.Rings(ctx.agent_id)  # read by the sweep
        sweeper = Sweeper(ctx, trust, reconciler, Heartbeat(ctx, chores, rings, reconciler.kick),
                          watcher, guard, self.stop, self.keep, logs, self.sweep_interval,
                          self.converge_budget)
        threading.Thread(target=sweeper.probe_loop, args=[prober], name="probe",
                         daemon=True).start()
        watchdog_loop.start(ctx, watchdogs, self.stop, trust)
        self._add_jobs(scheduler, reconciler, sweeper)
        job_timer.start()  # the jobs' runs (runners/agent/jobtimer.py)
        chores.tick()  # the holder attaches the job store before its scheduler starts
        doorbell(ctx, self.stop, reconciler.kick)
        control = ControlServer(ctx, self.db, reconciler.kick, partial(self.live, reconciler),
                                parts.commits, trust.may_act)
        control.start()
        if self.listen:
            wakeup.start(ctx.store, ctx.agent_id, reconciler.kick, self.stop, trust.trouble,
                         lambda: parts.commits.count)
        scheduler.start()
        threading.Thread(target=sweeper.loop, name="sweep", daemon=True).start()
        reconciler.round()  # finish what was in flight before the first interval
        return Running(parts, reconciler, watcher, chores, keepers, prober, control)

    def _watcher(self, ctx: Context, trust: StoreTrust, bell: Kick) -> ExitWatcher | None:
        """The exit watcher that rings the reconciler, where the kernel has pidfds."""
        if not pidfds_supported():
            log.warning("this kernel has no pidfds: exits are found by the %gs sweep",
                        self.sweep_interval)
            return None
        return ExitWatcher(lambda: current_leaders(ctx),
                           lambda ids: liveness(ctx, trust, bell, only=ids), trouble=trust.trouble)

    def _add_jobs(self, scheduler: BackgroundScheduler, reconciler: Reconciler,
                  sweeper: Sweeper) -> None:
        scheduler.add_job(reconciler.kick, "interval", seconds=self.scan_interval, id="scan")
        if sweeper.watcher is not None:
            scheduler.add_job(sweeper.backstop, "interval", id="backstop",
                              seconds=max(BACKSTOP, self.scan_interval))
        scheduler.add_job(sweeper.release_leftovers, "date", id="leftovers",
                          run_date=datetime.now(UTC))
        scheduler.add_job(sweeper.prune_history, "interval", id="history", seconds=PRUNE_EVERY,
                          next_run_time=datetime.now(UTC) + timedelta(seconds=PRUNE_FIRST))

    def _shut_down(self, running: Running) -> int:
        """In turn: no new request, no new round, the drives finished, the keepers let go;
        the agent's row says it stopped (unless it no longer trusts the store)."""
        ctx, trust, guard = running.parts.ctx, running.parts.trust, running.parts.guard
        self.stop.set()
        running.prober.wake.set()  # its thread ends
        running.control.close()  # from here the CLI works on the store itself
        ring_doorbell(ctx.state_dir)  # its thread blocks in recv until a ring
        log.info("stopping agent=%s", ctx.agent_id)
        notify("STOPPING=1", "STATUS=stopping (apps keep running)")
        ctx.shutting_down.set()
        if guard is not None:
            guard.close()
        running.chores.close(trust.may_act())
        running.parts.scheduler.shutdown(wait=False)
        if running.watcher is not None:
            running.watcher.close()
        running.reconciler.shutdown()
        running.keepers.close()  # after the drives: one may still have handed a keeper something
        if not trust.may_act():
            return 1  # nothing more is written to a store it no longer trusts
        with guarded(trust.trouble):
            ctx.store.write(lambda s: s.execute(update(AgentRow).where(
                AgentRow.id == ctx.agent_id).values(stopped_at=utcnow())))
        return 0
