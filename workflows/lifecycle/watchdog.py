"""The watchdog (`vigil host add --watchdog SECONDS`; systemd's WatchdogSec=): a generation
spawned with one gets WATCHDOG_USEC and WATCHDOG_PID, and says WATCHDOG=1 on its
NOTIFY_SOCKET at least every SECONDS. A deadline passed with no ping, or WATCHDOG=trigger,
fires it: the fire and a `watchdog` event are written, SIGABRT is sent to its leader, then
the generation is retired as a dead one is (a retiring member: the stop path drains, kills
and proves it) and restarted by the one restart policy (workflows/lifecycle/restarts.py).

Each such generation has a `watchdogs` row, armed in the transaction that writes the
generation: its period, and the deadline by which a ping must come (NULL until it runs,
then `current_at + period`). Pings are kept in memory (runners/backend/readysignal.py); the
stored deadline is pushed to the last ping + period when it comes due, so the store is at
most one period behind and an app that pings costs one write a period. The notify socket
is the agent's and does not outlive it: on start every adopted generation's deadline is
re-armed a full period from then (`rearm`), so a watchdog never fires for time the agent
was down. A fire is finished on start if the agent died between its intent and the
retirement (the row says it fired)."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from models.durations import check_seconds
from models.errors import BadInput, LostRace
from models.states import GenState
from models.store import emit, utcnow
from models.tables import Generation, Lease, Watchdog
from models.transition import Unfenced, move, move_many
from workflows.base.context import Context
from workflows.base.crash import crashpoint, define
from workflows.base.ports import ProcRef
from workflows.lifecycle.members import retire

FIRING = define("watchdog.firing", "a watchdog fired (no WATCHDOG=1 by its deadline, or "
                "WATCHDOG=trigger): the fire and its `watchdog` event are written; no SIGABRT yet")
RETIRED = define("watchdog.retired", "SIGABRT was sent; the generation is a retiring member "
                 "(the stop path drains, kills and proves it) and its restart is queued")

REREAD = 5.0  # seconds between reads of what is watched (sooner after a drive made progress)
MIN_SECONDS = 0.5  # a shorter period would fire on any stall of a busy box
# The watchdog's own columns: its generation's state (current) is what guards them.
ARMED = Unfenced("a watchdog's deadline and fire, only while its generation is current")


def check_watchdog(value: object, what: str = "--watchdog") -> float | None:
    """`--watchdog SECONDS` (None: none); raises BadInput naming `what`."""
    if value is None:
        return None
    seconds = check_seconds(value, what, "10")
    if seconds < MIN_SECONDS:
        raise BadInput(f"{what + ' ' if what else ''}{seconds:g}s is shorter than the shortest "
                       f"watchdog, {MIN_SECONDS:g}s (any stall of the box would fire it)",
                       "give e.g. --watchdog 10" if what else "write e.g. 10")
    return seconds


def rearm(s: Session, gen_ids: list[int]) -> None:
    """On start, for the adopted generations: a full period from now, whatever the store
    said (no ping could reach the agent while it was down)."""
    if not gen_ids:
        return
    now = utcnow()
    periods = s.execute(select(Watchdog.period).where(
        Watchdog.generation_id.in_(gen_ids)).distinct()).scalars().all()
    for period in periods:
        move_many(s, Watchdog, [Watchdog.generation_id.in_(gen_ids), Watchdog.period == period,
                                Watchdog.fired_at.is_(None)],
                  {"deadline": now + timedelta(seconds=period)}, "watchdog re-armed",
                  fence=ARMED)


def _epoch(d: datetime) -> float:
    return (d - datetime(1970, 1, 1)).total_seconds()


def _stored(t: float) -> datetime:
    return datetime(1970, 1, 1) + timedelta(seconds=t)


@dataclass
class Armed:
    gen_id: int
    host: str
    period: float
    deadline: float  # epoch seconds
    ref: ProcRef
    fired: str | None  # why it fired, when its fire is written and not finished


class Watchdogs:
    """The watchdogs of the current generations this agent owns. `round()` fires or pushes
    the ones due; `pause()` says how long until the next is due; `refresh()` asks for a
    re-read soon. A WATCHDOG=trigger rings `wake` (the readiness's bell)."""

    def __init__(self, ctx: Context, kick: Callable[[], None]) -> None:
        self.ctx = ctx
        self.kick = kick  # the reconciler: a retired generation's obligations are due
        self.armed: dict[int, Armed] = {}
        self.read_at = 0.0
        self.dirty = True
        bell = getattr(ctx.ready, "watchdog_bell", None)
        self.wake: threading.Event = bell if bell is not None else threading.Event()

    def refresh(self) -> None:
        self.dirty = True
        self.wake.set()

    def pause(self) -> float:
        now = time.time()
        if self.dirty:
            return 0.0
        first = min((a.deadline for a in self.armed.values()), default=self.read_at)
        return max(0.0, min(first, self.read_at) - now)

    def round(self) -> None:
        now = time.time()
        if self.dirty or now >= self.read_at:
            self.dirty = False
            self._read()
            self.read_at = now + REREAD
        pushed: dict[int, float] = {}
        for a in list(self.armed.values()):
            seen, triggered = self._seen(a)
            if a.fired is None and triggered:
                self.fire(a, "the app sent WATCHDOG=trigger")
            elif a.fired is not None:
                self.fire(a, a.fired)
            elif a.deadline <= time.time():
                if seen is not None and seen + a.period > time.time():
                    pushed[a.gen_id] = a.deadline = seen + a.period
                else:
                    self.fire(a, f"no WATCHDOG=1 within {a.period:g}s")
        if pushed:
            self.ctx.store.write(lambda s: [move_many(
                s, Watchdog, [Watchdog.generation_id == gid, Watchdog.fired_at.is_(None)],
                {"deadline": _stored(t)}, f"watchdog g{gid} pinged", fence=ARMED)
                for gid, t in pushed.items()])

    def _seen(self, a: Armed) -> tuple[float | None, bool]:
        seen = getattr(self.ctx.ready, "watchdog_seen", None)
        return seen(a.ref.generation_uuid) if seen is not None else (None, False)

    def _read(self) -> None:
        rows = self.ctx.store.read(lambda s: s.execute(
            select(Watchdog.generation_id, Watchdog.host, Watchdog.period, Watchdog.deadline,
                   Watchdog.fired_at, Watchdog.reason, Generation.state, Generation.uuid, Generation.pid,
                   Generation.create_time, Generation.cgroup, Generation.current_at)
            .join(Generation, Generation.id == Watchdog.generation_id)
            .join(Lease, Lease.host == Watchdog.host)
            .where(Lease.holder == self.ctx.agent_id)).all())
        # Spawning and running (a readiness check) come before current: kept for it.
        gone = [r.generation_id for r in rows
                if r.state in (GenState.retiring, GenState.proven)]
        unarmed = [r for r in rows if r.state is GenState.current and r.deadline is None]
        if gone or unarmed:
            self.ctx.store.write(lambda s: _tidy(s, gone, unarmed))
        rows = [r for r in rows if r.state is GenState.current]
        old, self.armed = self.armed, {}
        for r in rows:
            kept = old.get(r.generation_id)
            deadline = _epoch(r.deadline) if r.deadline is not None else \
                _epoch((r.current_at or utcnow()) + timedelta(seconds=r.period))
            if kept is not None and kept.fired is None:
                deadline = max(deadline, kept.deadline)  # pushed here, maybe not written yet
            self.armed[r.generation_id] = Armed(
                r.generation_id, r.host, float(r.period), deadline,
                ProcRef(r.uuid, r.pid, r.create_time, r.cgroup),
                (r.reason or "fired") if r.fired_at is not None else None)

    def fire(self, a: Armed, why: str) -> None:
        """Intent (the fire, the event), SIGABRT, then the retirement and restart."""
        if a.fired is None:
            try:
                self.ctx.store.write(lambda s: _write_fire(s, a, why))
            except LostRace:  # no longer current: ended some other way
                self.armed.pop(a.gen_id, None)
                return
            a.fired = why
            crashpoint(FIRING)
        self.ctx.proc.signal_leader(a.ref, signal.SIGABRT)  # none when it had exited already
        self.ctx.store.write(lambda s: _retire(s, self.ctx, a))
        self.armed.pop(a.gen_id, None)
        crashpoint(RETIRED)
        self.kick()


def _tidy(s: Session, gone: list[int], unarmed: list[Any]) -> None:
    """Rows whose generation ended some other way are dropped; a generation that runs now
    gets its first deadline, a period after it became current."""
    if gone:
        s.execute(Watchdog.__table__.delete().where(Watchdog.generation_id.in_(gone)))
    for r in unarmed:
        move_many(s, Watchdog, [Watchdog.generation_id == r.generation_id,
                                Watchdog.deadline.is_(None)],
                  {"deadline": (r.current_at or utcnow()) + timedelta(seconds=r.period)},
                  "watchdog armed", fence=ARMED)


def _write_fire(s: Session, a: Armed, why: str) -> None:
    gen = s.get(Generation, a.gen_id)
    if gen is None or gen.state is not GenState.current:
        raise LostRace(f"generation g{a.gen_id} is no longer current")
    move(s, Watchdog, {"generation_id": a.gen_id, "fired_at": None},
         {"fired_at": utcnow(), "reason": why}, f"watchdog g{a.gen_id} fired", fence=ARMED)
    emit(s, "watchdog", a.host, a.gen_id, pid=gen.pid, period=a.period, reason=why)


def _retire(s: Session, ctx: Context, a: Armed) -> None:
    """The watchdog is done with; its generation, if still current (its exit may have
    been heard first, and retired it the same way), is retired and restarted."""
    s.execute(Watchdog.__table__.delete().where(Watchdog.generation_id == a.gen_id))
    gen = s.get(Generation, a.gen_id)
    if gen is not None and gen.state is GenState.current:
        retire(s, ctx, gen, f"watchdog: {a.fired}", restart=True)
