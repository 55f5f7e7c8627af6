"""The agent daemon: one per state directory. Recovers, then runs the reconciler
(runners/agent/reconciler.py) under APScheduler: a round on every new intent (doorbell),
when the next row falls due, and on a slow scan interval; a liveness sweep of current
generations on a short one (runners/agent/sweep.py). Its start and stop are in
runners/agent/startup.py, whether it may still act on the store in runners/agent/trust.py."""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import cast

from apscheduler.schedulers.background import BackgroundScheduler
from sqlalchemy import update

from models.errors import BrokenInvariant
from models.notices import word_of
from models.schema import require_head
from models.store import utcnow
from models.tables import Agent as AgentRow
from runners.agent import schedules
from runners.agent.chores import Chores
from runners.agent.exits import ExitWatcher, pidfds_supported
from runners.agent.fencing import FencedProcess, FenceGuard, Timing
from runners.agent.helpers import Helper, HelperWatch
from runners.agent.openfiles import raise_open_file_limit, say_open_file_limit
from runners.agent.reconciler import Reconciler
from runners.agent.startup import StartStop
from runners.agent.sweep import BACKSTOP, HEARTBEAT_EVERY, PRUNE_EVERY, PRUNE_FIRST, Sweeps
from runners.backend.sockets import settle_state_dir
from runners.base import wakeup
from runners.base.doorbell import ring as ring_doorbell
from runners.base.sd_notify import notify
from runners.base.storewatch import FileGuard, StoreWatch
from runners.quick.control import ControlServer
from runners.quick.control import version as control_version
from workflows.base.context import Context
from workflows.engine.history import Keep
from workflows.engine.recovery import recover
from workflows.lifecycle.members import current_leaders
from workflows.lifecycle.probe import Prober

log = logging.getLogger("vigil.agent")
Observer = Callable[[float], None]  # a round's duration, to the metrics when served

# Events the agent also logs at WARNING, with their reason: a failed or abandoned attempt
# (its drive alone says result=progress), a failed wake, a host refused, a host down.
WARN_EVENTS = frozenset({"deploy_failed", "deploy_abandoned", "deploy_down", "down",
                         "wake_failed", "refused", "self_fenced"})


def log_failures(events: list[tuple[str, str | None, int | None, dict[str, object]]]) -> None:
    """After a commit: one WARNING line per failure event it wrote."""
    for kind, host, gen, detail in events:
        if kind in WARN_EVENTS:
            pairs = " ".join(f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}"
                             for k, v in detail.items())
            log.warning("%s host=%s%s %s", kind, host,
                        f" generation=g{gen}" if gen is not None else "", pairs)


def _after_events(events: list[tuple[str, str | None, int | None, dict[str, object]]],
                  kick: Callable[[], None]) -> None:
    """After a commit: its failures logged; a round at once if it owed a notification."""
    log_failures(events)
    if any(word_of(kind, detail) is not None for kind, _, _, detail in events):
        kick()


@dataclass
class Running:
    """What a started agent runs, stopped in turn by its shutdown."""

    guard: FenceGuard | None
    scheduler: BackgroundScheduler
    reconciler: Reconciler
    helpers: HelperWatch
    prober: Prober
    control: ControlServer


class AgentDaemon(StartStop, Sweeps):
    def __init__(self, ctx: Context, *, scan_interval: float = 30.0,
                 sweep_interval: float = 1.0, max_hosts: int = 8, converge_budget: int = 1,
                 metrics_listen: str | None = None, keep: Keep | None = None,
                 db: str | None = None, listen: bool = True) -> None:
        self.ctx = ctx
        self.listen = listen  # LISTEN for intents (PostgreSQL); off: read their rings each sweep
        self.rings: wakeup.Rings | None = None
        self.kick: Callable[[], None] | None = None
        self.keep = keep or Keep()  # what history the store keeps (workflows/engine/history.py)
        self.db = db  # as given (--db / VIGIL_DB): a client naming another store goes direct
        self.started_at = datetime.now(UTC)
        self.logs = None  # the log keeper's client (runners/keepers/logkeeper.py), set on start
        self.reconciler: Reconciler | None = None
        self.metrics_listen = metrics_listen
        self.converge_budget = converge_budget  # worker converges per sweep, box-wide
        self.sweeps = 0
        self.scan_interval = scan_interval  # the full scan (job `scan`): --safety-interval
        self.sweep_interval = sweep_interval  # the short sweep: --sweep-interval
        self.max_hosts = max_hosts
        self.stop = threading.Event()
        self._signalled = False  # SIGTERM/SIGINT seen (set by the handler, read by run())
        self._lock_file = None
        self._store_lock = None  # the SQLite file, flocked while this agent runs
        self.recovered = threading.Event()
        self.watcher = None
        self._last_beat = 0.0
        self._heartbeat_at = -HEARTBEAT_EVERY  # the first sweep writes one
        self._rounds_seen = -1
        self._workers_to_sweep = True
        self.watch = None
        self.files = None
        self._schema_checked = 0.0
        self._scheduler = None
        self._version: str | None = None  # read on the first `agent status`, not at start

    def live(self) -> dict[str, object]:
        """What the agent says of itself on its control socket (`vigil agent status`)."""
        r = self.reconciler
        last = r.last_round_at if r is not None else None
        if self._version is None:
            self._version = control_version()
        return {"running": True, "pid": os.getpid(), "box": self.ctx.agent_id,
                "version": self._version, "up_since": self.started_at.isoformat(),
                "ready": self.recovered.is_set(), "rounds": r.rounds if r is not None else 0,
                "last_round": last.isoformat() if last is not None else None}

    def run(self) -> int:
        guard, counts, observe_round = self._recover()
        running = self._start(guard, observe_round)
        self.recovered.set()
        log.info("ready agent=%s state_dir=%s", self.ctx.agent_id, self.ctx.state_dir)
        notify("READY=1", f"STATUS=ready: adopted {counts['adopted']}, retired {counts['retired']}")
        self._wait_for_stop()
        return self._shut_down(running)

    def _recover(self) -> tuple[FenceGuard | None, dict[str, int], Observer | None]:
        """Lock, check and register, then recover: (the fence guard on PostgreSQL, what
        recovery adopted and retired, the metrics' round observer if served)."""
        limits = raise_open_file_limit()  # before anything opens: the control socket's cap follows it
        self._take_lock()
        self.watch = StoreWatch(self.ctx.store.url, self.ctx.state_dir, log,
                                on_halt=self._halted)
        self.watch.recheck = lambda: self._check_schema(now=True)
        self.ctx.store.on_events = log_failures
        require_head(self.ctx.store.engine)
        say_open_file_limit(self.ctx, limits)
        settle_state_dir(self.ctx)
        observe_round = None
        if self.metrics_listen:  # prometheus_client is imported only then (start-up time)
            from runners.agent import metrics

            metrics.serve(self.ctx, self.metrics_listen)
            observe_round = metrics.ROUND.observe
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        self._register()
        self.logs = getattr(self.ctx.proc, "logs", None)  # the log keeper's client
        if self.logs is not None:
            self.logs.adopt()  # copies of the pipes a running keeper writes for
        guard = None
        if self.ctx.store.dialect == "postgresql":  # several boxes: leases must fence
            guard = FenceGuard(self.ctx, Timing(self.ctx.lease_ttl))
            self.ctx.proc = FencedProcess(self.ctx.proc, guard)  # type: ignore[assignment]
            guard.start()
            self.fence_guard = guard
        counts = recover(self.ctx)
        log.info("recovered agent=%s adopted=%d retired=%d", self.ctx.agent_id,
                 counts["adopted"], counts["retired"])
        return guard, counts, observe_round

    def _start(self, guard: FenceGuard | None, observe_round: Observer | None) -> Running:
        """Everything that acts after recovery, started in turn; a first round at the end."""
        if self.watch is None:
            raise BrokenInvariant("the store watch starts before recovery")
        self.ctx.store.on_success = self.watch.ok
        if guard is not None:
            guard.on_store_error = self.watch.trouble
        self.files = FileGuard.of(self.ctx.store)  # the files it has open now, at their paths
        scheduler = BackgroundScheduler(timezone=UTC,
                                        job_defaults={"coalesce": True, "max_instances": 1,
                                                      "misfire_grace_time": None})
        self._scheduler = scheduler
        reconciler = self._reconciler(scheduler, observe_round)
        self.ctx.store.on_events = lambda events: _after_events(events, reconciler.kick)
        helpers = HelperWatch([cast(Helper, h) for h in (self.ctx.listeners, self.logs, guard)
                               if h is not None and hasattr(h, "revive")])
        helpers.start()  # each checked, restored and watched before the first round
        reconciler.start()
        prober = Prober(self.ctx, reconciler.kick)
        progressed = reconciler.on_progress  # the exit watcher's refresh, if any

        def on_progress() -> None:  # a drive moved a row: what is watched may have changed
            progressed()
            prober.refresh()

        reconciler.on_progress = on_progress
        threading.Thread(target=self._probe_loop, args=[prober], name="probe",
                         daemon=True).start()
        self._add_jobs(scheduler, reconciler)
        self._doorbell(reconciler)
        control = ControlServer(self.ctx, self.db, reconciler.kick, self.live, self.may_act)
        control.start()
        self.kick = reconciler.kick
        if self.listen:
            wakeup.start(self.ctx.store, self.ctx.agent_id, reconciler.kick, self.stop, self.watch.trouble)
        else:  # a fleet too large for a LISTEN session a box: the sweep reads the rings
            self.rings = wakeup.Rings(self.ctx.agent_id)
        scheduler.start()
        threading.Thread(target=self._sweep_loop, args=[reconciler], name="sweep",
                         daemon=True).start()
        reconciler.round()  # finish what was in flight before the first interval
        return Running(guard, scheduler, reconciler, helpers, prober, control)

    def _reconciler(self, scheduler: BackgroundScheduler, observe_round: Observer | None) -> Reconciler:
        """The reconciler, and the exit watcher that kicks it (where the kernel has pidfds)."""
        if self.watch is None:
            raise BrokenInvariant("the store watch starts before the reconciler")
        reconciler = Reconciler(self.ctx, scheduler, self.max_hosts)
        if observe_round is not None:
            reconciler.on_round = observe_round
        reconciler.watch = self.watch
        reconciler.may_act = self.may_act
        self.reconciler = reconciler
        if pidfds_supported():
            self.watcher = ExitWatcher(lambda: current_leaders(self.ctx),
                                       lambda ids: self.liveness(reconciler, ids),
                                       on_error=self.watch.trouble)
            reconciler.on_progress = self.watcher.refresh
            self.watcher.start()
        else:
            log.warning("this kernel has no pidfds: exits are found by the %gs sweep",
                        self.sweep_interval)
        return reconciler

    def _add_jobs(self, scheduler: BackgroundScheduler, reconciler: Reconciler) -> None:
        if self.watch is None:
            raise BrokenInvariant("the store watch starts before the jobs")
        scheduler.add_job(reconciler.kick, "interval", seconds=self.scan_interval, id="scan")
        if self.watcher is not None:
            scheduler.add_job(self.backstop, "interval", id="backstop", args=[reconciler],
                              seconds=max(BACKSTOP, self.scan_interval))
        scheduler.add_job(self.release_leftovers, "date", id="leftovers",
                          run_date=datetime.now(UTC))
        scheduler.add_job(self.prune_history, "interval", id="history", seconds=PRUNE_EVERY,
                          next_run_time=datetime.now(UTC) + timedelta(seconds=PRUNE_FIRST))
        watch = self.watch
        self.chores = Chores(self.ctx, lambda: schedules.attach(
            scheduler, self.ctx, reconciler.kick, watch.trouble, self.may_act),
            lambda: schedules.detach(scheduler), watch.trouble)
        self.chores.tick()  # the holder attaches the job store before its scheduler starts

    def _shut_down(self, running: Running) -> int:
        """In turn: no new request, no new round, the drives finished, the helpers let go;
        the agent's row says it stopped (unless it no longer trusts the store)."""
        if self.watch is None:
            raise BrokenInvariant("the store watch runs until the agent stops")
        guard, scheduler, reconciler = running.guard, running.scheduler, running.reconciler
        self.stop.set()
        running.prober.wake.set()  # its thread ends
        running.control.close()  # from here the CLI works on the store itself
        ring_doorbell(self.ctx.state_dir)  # its thread blocks in recv until a ring
        log.info("stopping agent=%s", self.ctx.agent_id)
        notify("STOPPING=1", "STATUS=stopping (apps keep running)")
        self.ctx.shutting_down.set()
        if guard is not None:
            guard.close()
        self.chores.close(self.may_act())
        scheduler.shutdown(wait=False)
        if self.watcher is not None:
            self.watcher.close()
        reconciler.shutdown()
        running.helpers.close()  # after the drives: one may still have handed a helper something
        if not self.may_act():
            return 1  # nothing more is written to a store it no longer trusts
        try:
            self.ctx.store.write(lambda s: s.execute(update(AgentRow).where(
                AgentRow.id == self.ctx.agent_id).values(stopped_at=utcnow())))
        except Exception as exc:
            if not self.watch.trouble(exc):
                raise
        return 0
