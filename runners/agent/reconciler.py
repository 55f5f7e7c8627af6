"""The reconciler: rounds of due rows, one per host, at most `max_hosts` in flight, each
driven on a thread of its pool; paused while the store itself fails."""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from apscheduler.schedulers.background import BackgroundScheduler

from models.errors import BrokenInvariant
from models.store import utcnow
from runners.agent.trust import StoreTrust, guarded
from workflows.base.context import Context, Result
from workflows.engine.claim import claim
from workflows.engine.obligations import (
    KINDS,
    Due,
    backoff,
    drain_batches,
    due,
    next_due,
    run_group,
    run_one,
)
from workflows.generations.listeners import collect as collect_listeners
from workflows.lifecycle.wake_group import GROUP

log = logging.getLogger("vigil.agent")


def _drives(rows: list[Due]) -> list[list[Due]]:
    """The drives of claimed rows: one row each, but rows of a grouped kind (worker
    wakes: nothing slow between their intent and their current) go GROUP to a drive."""
    single = [[d] for d in rows if not d.grouped]
    grouped = [d for d in rows if d.grouped]
    return single + [grouped[i:i + GROUP] for i in range(0, len(grouped), GROUP)]


def _outside(d: Due) -> bool:
    return KINDS[d.kind].outside


class Kick:
    """A round wanted (a new intent, a drive's end, an exit, a row due): made before the
    reconciler and the parts that ring it, so each is built with it (runners/agent/daemon.py).
    `fresh`: the round reads the store afresh (anything but a drive's end)."""

    def __init__(self, shutting_down: threading.Event) -> None:
        self.shutting_down, self.rung, self._lock = shutting_down, threading.Event(), threading.Lock()
        self._fresh = False

    def __call__(self, fresh: bool = True) -> None:
        if not self.shutting_down.is_set():
            self.note(fresh)
            self.rung.set()

    def note(self, fresh: bool) -> None:
        with self._lock:
            self._fresh = self._fresh or fresh

    def take(self) -> bool:
        """Whether a round must read afresh, reset."""
        with self._lock:
            fresh, self._fresh = self._fresh, False
        return fresh


class Reconciler:
    """One due row per host per round, rotating which host goes first, at most
    `max_hosts` drives in flight: a drive is one row, or up to GROUP worker wakes started
    together (workflows/lifecycle/wake_group.py: their intents and their pids each one
    commit), which is what lets a wake of a thousand workers share its fsyncs.

    A round reads its rows in one query, up to `snapshot` hosts (one row each), and hands
    them out as slots free up: a drive that ends takes the next host of the same round
    instead of paying for a new query over every open row. Anything else that starts a
    round (a new intent, a row falling due, the safety scan) reads afresh.

    Rows of an outside kind (notifications: a try waits on a receiver vigil does not run)
    go to `max_sends` slots of their own, on a pool of their own: receivers that hang or
    trickle hold those, never a slot a host's restart or wake needs."""

    def __init__(self, ctx: Context, scheduler: BackgroundScheduler, max_hosts: int = 8,
                 snapshot: int = 256, max_sends: int = 4, *, bell: Kick | None = None,
                 trust: StoreTrust | None = None, on_progress: Callable[[], None] = lambda: None,
                 on_round: Callable[[float], None] = lambda _seconds: None) -> None:
        self.ctx = ctx
        self.scheduler = scheduler
        self.max_hosts = max_hosts
        self.snapshot = max(snapshot, max_hosts)
        self.pool = concurrent.futures.ThreadPoolExecutor(max_hosts, thread_name_prefix="drive")
        self.inflight: set[str] = set()  # hosts of the drives in flight
        self.drives = 0  # drives in flight (a group of wakes is one)
        self.max_sends = max_sends
        self.send_pool = concurrent.futures.ThreadPoolExecutor(max_sends, thread_name_prefix="send")
        self.sends = 0  # sends (rows of an outside kind) in flight
        self.cursor = ""
        self.backlog: list[Due] = []  # the current round's rows not handed out yet
        self._lock = threading.Lock()
        self._running = False
        self._dirty = False
        self.rounds = 0
        self.last_round_at: datetime | None = None  # wall clock, for `vigil agent status`
        self.on_progress = on_progress  # a drive moved a row
        self.on_round = on_round  # a round's duration: the metrics, when served
        self._thread: threading.Thread | None = None
        self.bell = bell or Kick(ctx.shutting_down)
        # The store as a whole (runners/agent/trust.py): while it fails, rounds pause with
        # the rows' own backoff (0.1 s doubling to 5 s), since no row's pacing can be
        # written; a halted watch (store replaced, schema changed, damaged) ends them.
        self.trust = trust
        self._paused_until = 0.0

    def start(self) -> None:
        """Rounds on a thread of their own, woken by kick(): a drive that ends, a new intent
        or an exit costs an Event, not an APScheduler job (whose SQL job store is read on
        every wake-up of its loop). Without start(), kick() hands rounds to the scheduler."""
        self._thread = threading.Thread(target=self._loop, name="reconciler", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            self.bell.rung.wait()
            if self.ctx.shutting_down.is_set():
                return
            self.bell.rung.clear()
            with guarded(self._store_failed, log, "a round failed; the next kick or the scan retries"):
                self.round(fresh=False)  # the bell notes whether the round must read afresh

    def _store_failed(self, exc: BaseException) -> bool:
        """The store itself failed (said once by the watch, not as a traceback): pause the
        rounds for the ordinary backoff, then try again."""
        if self.trust is None or not self.trust.trouble(exc):
            return False
        wait = backoff(self.trust.watch.failures)
        self._paused_until = time.monotonic() + wait
        if not self.ctx.shutting_down.is_set() and self.trust.watch.acting:
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
        self.bell(fresh)

    def round(self, fresh: bool = True) -> None:
        self.bell.note(fresh)
        with self._lock:
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
        if self.ctx.shutting_down.is_set() or (self.trust is not None and not self.trust.may_act()):
            return
        if time.monotonic() < self._paused_until:
            return  # the store failed: the store-retry job kicks once the pause is over
        self.rounds += 1
        self.last_round_at = datetime.now(UTC)
        fresh, backlog = self._backlog()
        left = self._hand_out(backlog)
        if fresh:  # after the per-host drives are on their way: a deploy does not wait on it
            self._drain()
            try:
                collect_listeners(self.ctx)  # a removed host's sockets are closed
            except Exception:
                log.exception("closing listeners no host names failed; the next round retries")
        self._next_round(left)

    def _backlog(self) -> tuple[bool, list[Due]]:
        """Whether this round reads afresh, and its rows: what is left of the last read (no
        host in flight), topped up from the store when it cannot fill the free slots."""
        with self._lock:
            busy = set(self.inflight)
            free = self.max_hosts - self.drives
            room = free > 0 or self.sends < self.max_sends  # a send slot takes only a send
            fresh = self.bell.take()
            if fresh:
                self.backlog = []
            backlog = [d for d in self.backlog if d.host not in busy]
        if room and len(backlog) < max(free, 1) * GROUP:  # a slot may take a group of rows
            # Rotate: hosts after the cursor go first, so no host is always last.
            skip = busy | {d.host for d in backlog}
            backlog += due(self.ctx, utcnow(), skip=skip, after=self.cursor,
                           limit=self.snapshot - len(backlog))
        return fresh, backlog

    def _hand_out(self, backlog: list[Due]) -> list[Due]:
        """Drive the backlog's rows while slots are free; the rows left for later. A slot
        drives one row, or up to GROUP rows of a grouped kind (worker wakes); a send slot
        one row of an outside kind."""
        rest = backlog
        while True:
            admitted, left = self._admit(rest)
            won = self._claim(admitted) if admitted else []
            for work in _drives(won or []):
                outside = _outside(work[0])  # a group is of one kind
                with self._lock:
                    if outside:
                        self.sends += 1
                    else:
                        self.drives += 1
                pool = self.send_pool if outside else self.pool
                pool.submit(self._drive, work)
            for d in admitted:
                if won is None or d not in won:
                    with self._lock:
                        self.inflight.discard(d.host)
            # Rows another agent claimed first free their slot for the next host of the round.
            if won is None or len(won) == len(admitted) or not left:
                return left
            rest = left

    def _admit(self, rows: list[Due]) -> tuple[list[Due], list[Due]]:
        """The rows that fit the free slots (marked in flight), and those left, in order.
        Once the drive slots are full the host rows wait; sends go on to their own slots."""
        admitted: list[Due] = []
        left: list[Due] = []
        sends, full = 0, False
        with self._lock:
            for d in rows:
                if d.host in self.inflight:
                    continue  # its drive in flight comes back for it
                if _outside(d):
                    if self.sends + sends >= self.max_sends:
                        left.append(d)  # a send in flight comes back for it
                        continue
                    sends += 1
                else:
                    drives = [x for x in admitted if not _outside(x)]
                    if full or self.drives + len(_drives([*drives, d])) > self.max_hosts:
                        full = True
                        left.append(d)
                        continue
                    # Past the last host admitted: a full window moves on by its whole width,
                    # so a late host never waits behind the same slow hosts round after round.
                    self.cursor = d.host
                self.inflight.add(d.host)
                admitted.append(d)
        return admitted, left

    def _next_round(self, left: list[Due]) -> None:
        """Keep the rows not handed out for the drives to come back for; when none are left,
        a round when the next row falls due."""
        with self._lock:
            self.backlog = left
            if self.backlog:
                return  # the drives in flight come back for the rest of this round
            busy = set(self.inflight)
        when = next_due(self.ctx, busy)
        if when is not None:
            # A row that fell due while this round ran (a short backoff on a loaded box) is
            # due at once: a wake-up in the past would never come.
            at = max(when.replace(tzinfo=UTC), datetime.now(UTC) + timedelta(seconds=0.02))
            self.scheduler.add_job(self.kick, "date", run_date=at, id="due",
                                   replace_existing=True, misfire_grace_time=None)

    def _drain(self) -> None:
        """Store-only rows go in groups, one transaction per batch (workflows/engine/obligations.py)."""
        with guarded(self._store_failed, log,
                     "a batch of store-only obligations failed; the next round retries it"):
            n, more = drain_batches(self.ctx)
            if n:
                log.info("batch rows=%d", n)
            if more:  # the cap let this round's per-host rows go first; the rest next round
                self.kick()

    def _claim(self, admitted: list[Due]) -> list[Due] | None:
        """On PostgreSQL, only the rows this agent claimed (workflows/engine/claim.py); rows another
        agent claimed first free their slot for the next due host. None: the claim failed."""
        with guarded(self._store_failed, log, "claiming %d row(s) failed; the next round tries "
                     "again", len(admitted)):
            return claim(self.ctx, admitted)
        return None

    def _drive(self, work: list[Due]) -> None:
        try:
            if len(work) == 1:
                results = [run_one(self.ctx, work[0])]
            else:
                group = KINDS[work[0].kind].drive_group
                if group is None:  # _drives groups only kinds that have a group drive
                    raise BrokenInvariant(f"{work[0].kind} rows grouped, but the kind has no group drive")
                results = run_group(self.ctx, work, group)
            moved = [self._said(d, result, error) for d, (result, error)
                     in zip(work, results, strict=True)]
            if any(moved):  # once a drive: a group of 16 wakes is one re-read of the watched
                self.on_progress()  # (and one turn of the jobs' timer), not 16
        except Exception as exc:
            for d in work:
                if self._store_failed(exc):  # the spell is said once; which drives it cut short here
                    log.info("drive kind=%s id=%s host=%s result=cut_short: the store failed",
                             d.kind, d.id, d.host)
                else:
                    log.exception("drive kind=%s id=%s host=%s crashed", d.kind, d.id, d.host)
        finally:
            with self._lock:
                if _outside(work[0]):
                    self.sends -= 1
                else:
                    self.drives -= 1
                for d in work:
                    self.inflight.discard(d.host)
            self.kick(fresh=False)

    def _said(self, d: Due, result: Result, error: str | None) -> bool:
        """The drive's result logged; whether it moved a row."""
        level = logging.WARNING if result is Result.poked else logging.INFO  # held: ordinary
        log.log(level, "drive kind=%s id=%s host=%s result=%s%s", d.kind, d.id, d.host,
                result.value, f" error={error!r}" if error else "")
        return result is Result.progress

    def shutdown(self) -> None:
        self.bell.rung.set()  # shutting_down is set: the loop ends
        if self._thread is not None:
            self._thread.join(30)
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.send_pool.shutdown(wait=True, cancel_futures=True)
