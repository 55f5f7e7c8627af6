"""The agent daemon: one per state directory. Recovers, then runs the reconciler under
APScheduler: a round on every new intent (doorbell), when the next row falls due, and on
a slow safety interval; a liveness sweep of current generations on a short one."""

from __future__ import annotations

import concurrent.futures
import fcntl
import logging
import os
import select
import signal
import socket
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import IO, cast

import psutil
from apscheduler.schedulers.background import BackgroundScheduler
from sqlalchemy import update

from models.errors import BrokenInvariant, Refused, StoreNotReady, StoreTrouble
from models.schema import require_head
from models.store import emit, utcnow
from models.tables import Agent as AgentRow
from runners.agent import schedules
from runners.agent.exits import ExitWatcher, pidfds_supported
from runners.agent.fencing import FencedProcess, FenceGuard, Timing
from runners.agent.helpers import Helper, HelperWatch
from runners.agent.sd_notify import notify
from runners.agent.storelock import hold_sqlite_store
from runners.backend.sockets import settle_state_dir
from runners.base import wakeup
from runners.base.doorbell import DOORBELL, LOCK
from runners.base.doorbell import ring as ring_doorbell
from runners.base.storewatch import FileGuard, StoreWatch, write_back
from runners.quick.control import ControlServer, raise_open_file_limit
from runners.quick.control import version as control_version
from workflows.base.context import Context, Result
from workflows.engine.claim import claim
from workflows.engine.history import Keep, prune
from workflows.engine.obligations import Due, backoff, drain_batches, due, next_due, run_one
from workflows.engine.recovery import recover
from workflows.generations.listeners import collect as collect_listeners
from workflows.leases.lease import renew_in
from workflows.lifecycle.members import current_leaders, retire_dead_currents
from workflows.lifecycle.probe import Prober
from workflows.lifecycle.takeover import take_over
from workflows.lifecycle.workers import any_to_sweep
from workflows.lifecycle.workers import sweep as sweep_workers

log = logging.getLogger("vigil.agent")

BACKSTOP = 30.0  # seconds between full liveness checks when exits arrive by pidfd
SCHEMA_EVERY = 2.0  # seconds between checks that the schema is still the one it knows
PRUNE_FIRST, PRUNE_EVERY = 5.0, 600.0  # seconds: the history prune after start, then between
PRUNE_BATCHES = 20  # batches per table per prune run (workflows/engine/history.py BATCH rows each)

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



class Reconciler:
    """One due row per host per round, rotating which host goes first, at most
    `max_hosts` hosts in flight.

    A round reads its rows in one query, up to `snapshot` hosts (one row each), and hands
    them out as slots free up: a drive that ends takes the next host of the same round
    instead of paying for a new query over every open row. Anything else that starts a
    round (a new intent, a row falling due, the safety scan) reads afresh."""

    def __init__(self, ctx: Context, scheduler: BackgroundScheduler, max_hosts: int = 8,
                 snapshot: int = 256) -> None:
        self.ctx = ctx
        self.scheduler = scheduler
        self.max_hosts = max_hosts
        self.snapshot = max(snapshot, max_hosts)
        self.pool = concurrent.futures.ThreadPoolExecutor(max_hosts, thread_name_prefix="drive")
        self.inflight: set[str] = set()
        self.cursor = ""
        self.backlog: list[Due] = []  # the current round's rows not handed out yet
        self._lock = threading.Lock()
        self._running = False
        self._dirty = False
        self._fresh = False
        self.rounds = 0
        self.last_round_at: datetime | None = None  # wall clock, for `vigil agent status`
        self.on_progress: Callable[[], None] = lambda: None  # a drive moved a row
        self.on_round: Callable[[float], None] = lambda _seconds: None  # metrics, when served
        self._thread: threading.Thread | None = None
        self._kicked = threading.Event()
        # The store as a whole (runners/base/storewatch.py): while it fails, rounds pause with
        # the rows' own backoff (0.1 s doubling to 5 s), since no row's pacing can be
        # written; a halted watch (store replaced, schema changed, damaged) ends them.
        self.watch: StoreWatch | None = None
        self.may_act: Callable[[], bool] = lambda: True
        self._paused_until = 0.0

    def start(self) -> None:
        """Rounds on a thread of their own, woken by kick(): a drive that ends, a new intent
        or an exit costs an Event, not an APScheduler job (whose SQL job store is read on
        every wake-up of its loop). Without start(), kick() hands rounds to the scheduler."""
        self._thread = threading.Thread(target=self._loop, name="reconciler", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            self._kicked.wait()
            if self.ctx.shutting_down.is_set():
                return
            self._kicked.clear()
            try:
                self.round(fresh=False)  # kick() has set _fresh if the round must read afresh
            except Exception as exc:
                if not self._store_failed(exc):
                    log.exception("a round failed; the next kick or the scan retries")

    def _store_failed(self, exc: BaseException) -> bool:
        """The store itself failed (said once by the watch, not as a traceback): pause the
        rounds for the ordinary backoff, then try again."""
        if self.watch is None or not self.watch.trouble(exc):
            return False
        wait = backoff(self.watch.failures)
        self._paused_until = time.monotonic() + wait
        if not self.ctx.shutting_down.is_set() and self.watch.acting:
            at = datetime.now(UTC) + timedelta(seconds=wait)
            try:
                self.scheduler.add_job(self.kick, "date", run_date=at, id="store-retry",
                                       replace_existing=True, misfire_grace_time=None)
            except Exception:  # the scheduler has shut down: the agent is stopping
                pass
        return True

    def kick(self, fresh: bool = True) -> None:
        if self.ctx.shutting_down.is_set():
            return
        if self._thread is None:
            self.scheduler.add_job(self.round, kwargs={"fresh": fresh}, misfire_grace_time=None)
            return
        with self._lock:
            self._fresh = self._fresh or fresh
        self._kicked.set()

    def round(self, fresh: bool = True) -> None:
        with self._lock:
            self._fresh = self._fresh or fresh
            if self._running:
                self._dirty = True
                return
            self._running = True
        try:
            while True:
                self._dirty = False
                started = time.monotonic()
                self._dispatch()
                self.on_round(time.monotonic() - started)
                with self._lock:
                    if not self._dirty:
                        self._running = False
                        return
        except BaseException:
            with self._lock:
                self._running = False
            raise

    def _dispatch(self) -> None:
        if self.ctx.shutting_down.is_set() or not self.may_act():
            return
        if time.monotonic() < self._paused_until:
            return  # the store failed: the store-retry job kicks once the pause is over
        self.rounds += 1
        self.last_round_at = datetime.now(UTC)
        with self._lock:
            busy = set(self.inflight)
            fresh, self._fresh = self._fresh, False
            if fresh:
                self.backlog = []
            backlog = [d for d in self.backlog if d.host not in busy]
        free = self.max_hosts - len(busy)
        if free > 0 and len(backlog) < free:
            # Rotate: hosts after the cursor go first, so no host is always last.
            skip = busy | {d.host for d in backlog}
            backlog += due(self.ctx, utcnow(), skip=skip, after=self.cursor,
                           limit=self.snapshot - len(backlog))
        taken = 0
        while True:
            admitted = []
            for d in backlog[taken:]:
                with self._lock:
                    if d.host in self.inflight:
                        taken += 1
                        continue
                    if len(self.inflight) >= self.max_hosts:
                        break
                    self.inflight.add(d.host)
                taken += 1
                # Past the last host admitted: a full window moves on by its whole width, so
                # a late host never waits behind the same slow hosts round after round.
                self.cursor = d.host
                admitted.append(d)
            won = self._claim(admitted) if admitted else []
            for d in admitted:
                if won is not None and d in won:
                    self.pool.submit(self._drive, d)
                else:
                    with self._lock:
                        self.inflight.discard(d.host)
            # Rows another agent claimed first free their slot for the next host of the round.
            if won is None or len(won) == len(admitted) or taken >= len(backlog):
                break
        if fresh:  # after the per-host drives are on their way: a deploy does not wait on it
            self._drain()
            try:
                collect_listeners(self.ctx)  # a removed host's sockets are closed
            except Exception:
                log.exception("closing listeners no host names failed; the next round retries")
        with self._lock:
            self.backlog = backlog[taken:]
            if self.backlog:
                return  # the drives in flight come back for the rest of this round
            busy = set(self.inflight)
        when = next_due(self.ctx, busy)
        if when is not None:
            at = when.replace(tzinfo=UTC)
            if at > datetime.now(UTC):
                self.scheduler.add_job(self.kick, "date", run_date=at, id="due",
                                       replace_existing=True, misfire_grace_time=None)

    def _drain(self) -> None:
        """Store-only rows go in groups, one transaction per batch (workflows/obligations)."""
        try:
            n, more = drain_batches(self.ctx)
        except Exception as exc:
            if not self._store_failed(exc):
                log.exception("a batch of store-only obligations failed; the next round retries it")
            return
        if n:
            log.info("batch rows=%d", n)
        if more:  # the cap let this round's per-host rows go first; the rest next round
            self.kick()

    def _claim(self, admitted: list[Due]) -> list[Due] | None:
        """On PostgreSQL, only the rows this agent claimed (workflows/engine/claim.py); rows another
        agent claimed first free their slot for the next due host. None: the claim failed."""
        try:
            return claim(self.ctx, admitted)
        except Exception as exc:
            if not self._store_failed(exc):
                log.exception("claiming %d row(s) failed; the next round tries again", len(admitted))
            return None

    def _drive(self, d: Due) -> None:
        try:
            result, error = run_one(self.ctx, d)
            if result is Result.progress:
                self.on_progress()
            level = logging.INFO if result is not Result.poked else logging.WARNING
            log.log(level, "drive kind=%s id=%s host=%s result=%s%s", d.kind, d.id, d.host,
                    result.value, f" error={error!r}" if error else "")
        except Exception as exc:
            if not self._store_failed(exc):
                log.exception("drive kind=%s id=%s host=%s crashed", d.kind, d.id, d.host)
        finally:
            with self._lock:
                self.inflight.discard(d.host)
            self.kick(fresh=False)

    def shutdown(self) -> None:
        self._kicked.set()  # shutting_down is set: the loop ends
        if self._thread is not None:
            self._thread.join(30)
        self.pool.shutdown(wait=True, cancel_futures=True)


class AgentDaemon:
    def __init__(self, ctx: Context, *, safety_interval: float = 30.0,
                 monitor_interval: float = 1.0, max_hosts: int = 8, converge_budget: int = 1,
                 metrics_listen: str | None = None, keep: Keep | None = None,
                 db: str | None = None) -> None:
        self.ctx = ctx
        self.keep = keep or Keep()  # what history the store keeps (workflows/engine/history.py)
        self.db = db  # as given (--db / VIGIL_DB): a client naming another store goes direct
        self.started_at = datetime.now(UTC)
        self.logs = None  # the log keeper's client (runners/keepers/logkeeper.py), set on start
        self.reconciler: Reconciler | None = None
        self.metrics_listen = metrics_listen
        self.converge_budget = converge_budget  # worker converges per sweep, box-wide
        self.sweeps = 0
        self.safety_interval = safety_interval
        self.monitor_interval = monitor_interval
        self.max_hosts = max_hosts
        self.stop = threading.Event()
        self._signalled = False  # SIGTERM/SIGINT seen (set by the handler, read by run())
        self._lock_file: IO[str] | None = None
        self._store_lock: IO[bytes] | None = None  # the SQLite file, flocked while this agent runs
        self.recovered = threading.Event()
        self.watcher: ExitWatcher | None = None
        self._last_beat = 0.0
        self._rounds_seen = -1
        self._workers_to_sweep = True
        self.watch: StoreWatch | None = None
        self.files: FileGuard | None = None
        self._schema_checked = 0.0
        self._scheduler: BackgroundScheduler | None = None
        self._version = control_version()

    def live(self) -> dict[str, object]:
        """What the agent says of itself on its control socket (`vigil agent status`)."""
        r = self.reconciler
        last = r.last_round_at if r is not None else None
        return {"running": True, "pid": os.getpid(), "box": self.ctx.agent_id,
                "version": self._version, "up_since": self.started_at.isoformat(),
                "ready": self.recovered.is_set(), "rounds": r.rounds if r is not None else 0,
                "last_round": last.isoformat() if last is not None else None}

    def _take_lock(self) -> None:
        path = self.ctx.state_dir / LOCK
        f = open(path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            other = f.read().strip() or "unknown"
            f.close()
            raise Refused(f"another agent (pid {other}) is already running on {self.ctx.state_dir}",
                          f"stop it first (kill {other}) or pass another --state-dir") from None
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        self._lock_file = f  # held until the process ends, even by SIGKILL
        self._store_lock = hold_sqlite_store(self.ctx.store.url, self.ctx.state_dir)

    def _register(self) -> None:
        me = psutil.Process()

        def step(s):  # type: ignore[no-untyped-def]
            row = s.get(AgentRow, self.ctx.agent_id)
            values = dict(box=socket.gethostname(), pid=me.pid, create_time=me.create_time(),
                          state_dir=str(self.ctx.state_dir), started_at=utcnow(),
                          heartbeat_at=utcnow(), stopped_at=None)
            if row is None:
                s.add(AgentRow(id=self.ctx.agent_id, **values))
            else:
                s.execute(update(AgentRow).where(AgentRow.id == self.ctx.agent_id).values(**values))
            emit(s, "agent_started", None, agent=self.ctx.agent_id, pid=me.pid)

        self.ctx.store.write(step)

    def _doorbell(self, reconciler: Reconciler) -> threading.Thread:
        path = self.ctx.state_dir / DOORBELL
        try:
            path.unlink()
        except FileNotFoundError:
            pass
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(str(path))
        os.chmod(path, 0o600)

        def loop() -> None:
            while not self.stop.is_set():
                try:
                    sock.recv(64)  # blocks: the agent's stop rings it once more
                except OSError:
                    return
                if not self.stop.is_set():
                    reconciler.kick()
            sock.close()

        t = threading.Thread(target=loop, name="doorbell", daemon=True)
        t.start()
        return t

    def may_act(self) -> bool:
        """False once the store cannot be trusted: the files this agent opened are no longer
        the ones at their paths (checked at every round: two stat calls), or the watch
        halted (schema changed, store damaged)."""
        if self.watch is None:
            return True
        if self.watch.acting and self.files is not None:
            changed = self.files.changed()
            if changed is not None:
                self._files_replaced(changed)
        return self.watch.acting

    def _files_replaced(self, which: str) -> None:
        if self.watch is None or self.files is None:
            raise BrokenInvariant("the store watch runs before the store's files are checked")
        db, pid = self.files.db, os.getpid()
        restart = f"restart the agent (`kill {pid}`, then start it again)"
        if which == "wal":
            saved = write_back(self.ctx.store)
            cause = (f"{db.name}-wal was deleted or replaced while the agent ran (its last "
                     "commits were only in the file it still held open)")
            fix = (f"they are written back to {db} now; {restart}" if saved else
                   f"stop the agent with SIGTERM (`kill {pid}`, never kill -9): as it closes "
                   f"the database it writes them back to {db}; then start it again")
        else:
            cause = f"{db} was deleted or replaced while the agent ran (it still has the old file open)"
            fix = f"{restart}: it then uses the file at that path"
        self.watch.halt("replaced", cause, fix)

    def _check_schema(self, now: bool = False) -> None:
        """The schema is still the one this agent knows (a downgrade or an upgrade by a newer
        vigil under it halts it). At most every SCHEMA_EVERY seconds (a small read), and at
        once (`now`) when a statement was refused."""
        if self.watch is None or not self.watch.acting:
            return
        if not now and time.monotonic() - self._schema_checked < SCHEMA_EVERY:
            return
        self._schema_checked = time.monotonic()
        try:
            require_head(self.ctx.store.engine)
        except StoreTrouble as exc:
            self.watch.trouble(exc)
        except StoreNotReady as exc:
            self.watch.halt("schema", f"the schema changed under the running agent: {exc.cause}",
                            "run `vigil db upgrade`, then restart the agent "
                            f"(`kill {os.getpid()}`, then start it again)")

    def _halted(self) -> None:
        """The agent stops acting: its timers stop (scan, backstop, schedules), the sweep
        only says so again now and then."""
        if self._scheduler is not None:
            try:
                self._scheduler.pause()
            except Exception:  # not started yet, or shut down
                pass

    def safety(self, reconciler: Reconciler) -> None:
        """The short sweep: worker drift and max-run, lease renewal, takeover, heartbeat.
        Dead currents too, unless exits arrive as events (then the scan is their backstop)."""
        self._check_schema()
        if not self.may_act():
            if self.watch is not None:  # may_act() is False only through the watch
                self.watch.remind()
            if self.ctx.store.dialect == "postgresql":
                try:  # other boxes must not take over apps that still run here
                    self._beat()
                except Exception:
                    pass  # the halt line says why; the lease fence does the rest
            return
        if self.watcher is None:
            self.liveness(reconciler)
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
        if time.monotonic() - self._last_beat < every:
            return
        if take_over(self.ctx):  # hosts placed here whose owner's lease expired
            reconciler.kick()
        self._beat()

    def _beat(self) -> None:
        def beat(s):  # type: ignore[no-untyped-def]
            renew_in(s, self.ctx)
            s.execute(update(AgentRow).where(AgentRow.id == self.ctx.agent_id)
                      .values(heartbeat_at=utcnow()))

        self.ctx.store.write(beat)
        self._last_beat = time.monotonic()

    def _sweep_loop(self, reconciler: Reconciler) -> None:
        """The short sweep on its own thread: APScheduler re-reads its job store on every
        wake-up, which a once-a-second job would pay for every second."""
        while not self.stop.wait(self.monitor_interval):
            try:
                self.safety(reconciler)
            except Exception as exc:
                if self.watch is None or not self.watch.trouble(exc):
                    log.exception("sweep failed; the next one retries")

    def liveness(self, reconciler: Reconciler, only: set[int] | None = None,
                 skip: set[int] | None = None) -> None:
        """Reap our children and retire every dead current (or those of `only`; none of
        `skip`)."""
        reap = getattr(self.ctx.proc, "reap", None)
        if reap is not None:
            reap()
        if not self.may_act():
            return
        if retire_dead_currents(self.ctx, only, skip or ()):
            reconciler.kick()
            if self.watcher is not None:
                self.watcher.refresh()

    def backstop(self, reconciler: Reconciler) -> None:
        """With exits as events: a full liveness check now and then, for what no pidfd
        reported (a leader this agent could not watch). A leader whose pidfd is open is not
        checked again: its exit is an event (1,000 pid reads every 30 s were most of an idle
        agent's cost)."""
        try:
            self.liveness(reconciler, skip=self.watcher.watched() if self.watcher else None)
        except Exception as exc:  # a scheduler job: said here, not as APScheduler's traceback
            if self.watch is None or not self.watch.trouble(exc):
                log.exception("the liveness backstop failed; the next one retries")
            return
        if self.watcher is not None:
            self.watcher.refresh()
        if self.logs is not None:
            try:
                self.logs.ensure()  # a keeper that died meanwhile: started again
            except OSError as exc:
                log.warning("log keeper: %s; the next backstop tries again", exc)

    def _probe_loop(self, prober: Prober) -> None:
        """The ongoing health probes that are due (workflows/lifecycle/probe.py), every tick while a
        host is probed (else a read every few seconds); nothing while the agent is halted."""
        while not self.stop.is_set():
            prober.wake.wait(prober.pause())
            prober.wake.clear()
            if self.stop.is_set() or not self.may_act() or self.ctx.shutting_down.is_set():
                continue
            try:
                prober.round()
            except Exception as exc:  # said once by the store watch, or here
                if self.watch is None or not self.watch.trouble(exc):
                    log.exception("the health probe failed; the next tick retries")
        prober.close()

    def prune_history(self) -> None:
        """A scheduled job: delete history nothing needs, a batch at a time (at most
        PRUNE_BATCHES per table per run: a backlog goes over several runs)."""
        if not self.may_act() or self.keep.older_than is None:
            return
        try:
            done = prune(self.ctx.store, self.keep, max_batches=PRUNE_BATCHES,
                         go_on=lambda: not self.ctx.shutting_down.is_set() and self.may_act())
        except Exception as exc:
            if self.watch is None or not self.watch.trouble(exc):
                log.exception("pruning history failed; the next run retries")
            return
        if any(done.values()):
            log.info("history pruned %s", " ".join(f"{k}={v}" for k, v in done.items() if v))

    def _wait_for_stop(self) -> None:
        """Sleep until SIGTERM/SIGINT (or stop is set), without waking every 200 ms."""
        wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        main = threading.current_thread() is threading.main_thread()
        if main:
            signal.set_wakeup_fd(wake_w)  # a signal makes select() return at once
        poller = select.poll()  # not select(): with 1,000 hosts the fd is above FD_SETSIZE
        poller.register(wake_r, select.POLLIN)
        try:
            while not self._signalled and not self.stop.is_set():
                poller.poll((5.0 if main else 0.2) * 1000)
                try:
                    os.read(wake_r, 512)
                except BlockingIOError:
                    pass
        finally:
            if main:
                signal.set_wakeup_fd(-1)
            os.close(wake_r)
            os.close(wake_w)

    def _on_signal(self, *_: object) -> None:
        # Only a flag: Event.set() here could deadlock on the lock a main thread interrupted
        # inside Event.wait() holds (it did, about once in 100 stops, right after `ready`).
        self._signalled = True

    def run(self) -> int:
        raise_open_file_limit()  # before anything opens: the control socket's cap follows it
        self._take_lock()
        self.watch = StoreWatch(self.ctx.store.url, self.ctx.state_dir, log,
                                on_halt=self._halted)
        self.watch.recheck = lambda: self._check_schema(now=True)
        self.ctx.store.on_events = log_failures
        require_head(self.ctx.store.engine)
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
        counts = recover(self.ctx)
        log.info("recovered agent=%s adopted=%d retired=%d", self.ctx.agent_id,
                 counts["adopted"], counts["retired"])
        self.ctx.store.on_success = self.watch.ok
        if guard is not None:
            guard.on_store_error = self.watch.trouble
        self.files = FileGuard.of(self.ctx.store)  # the files it has open now, at their paths
        scheduler = BackgroundScheduler(timezone=UTC,
                                        job_defaults={"coalesce": True, "max_instances": 1,
                                                      "misfire_grace_time": None})
        self._scheduler = scheduler
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
                        self.monitor_interval)
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
        scheduler.add_job(reconciler.kick, "interval", seconds=self.safety_interval, id="scan")
        if self.watcher is not None:
            scheduler.add_job(self.backstop, "interval", id="backstop", args=[reconciler],
                              seconds=max(BACKSTOP, self.safety_interval))
        scheduler.add_job(self.prune_history, "interval", id="history", seconds=PRUNE_EVERY,
                          next_run_time=datetime.now(UTC) + timedelta(seconds=PRUNE_FIRST))
        sweeper = threading.Thread(target=self._sweep_loop, args=[reconciler], name="sweep",
                                   daemon=True)
        schedules.attach(scheduler, self.ctx, reconciler.kick, self.watch.trouble, self.may_act)
        self._doorbell(reconciler)
        control = ControlServer(self.ctx, self.db, reconciler.kick, self.live, self.may_act)
        control.start()
        wakeup.start(self.ctx.store, reconciler.kick, self.stop, self.watch.trouble)
        scheduler.start()
        sweeper.start()
        reconciler.round()  # finish what was in flight before the first interval
        self.recovered.set()
        log.info("ready agent=%s state_dir=%s", self.ctx.agent_id, self.ctx.state_dir)
        notify("READY=1", f"STATUS=ready: adopted {counts['adopted']}, retired {counts['retired']}")
        self._wait_for_stop()
        self.stop.set()
        prober.wake.set()  # its thread ends
        control.close()  # from here the CLI works on the store itself
        ring_doorbell(self.ctx.state_dir)  # its thread blocks in recv until a ring
        log.info("stopping agent=%s", self.ctx.agent_id)
        notify("STOPPING=1", "STATUS=stopping (apps keep running)")
        self.ctx.shutting_down.set()
        if guard is not None:
            guard.close()
        schedules.detach(scheduler)
        scheduler.shutdown(wait=False)
        if self.watcher is not None:
            self.watcher.close()
        reconciler.shutdown()
        helpers.close()  # after the drives: one may still have handed a helper something
        if not self.may_act():
            return 1  # nothing more is written to a store it no longer trusts
        try:
            self.ctx.store.write(lambda s: s.execute(update(AgentRow).where(
                AgentRow.id == self.ctx.agent_id).values(stopped_at=utcnow())))
        except Exception as exc:
            if not self.watch.trouble(exc):
                raise
        return 0
