"""Takeover: the hosts placed on this box whose lease lapsed in another agent's hands: that
agent's box lease expired (workflows/leases/box.py), or, for a lease from before migration
0029, its own expiry passed.

A dead box's hosts are spread over the live boxes each is placed on by one deterministic
rule every survivor computes alike from the host's name (owner(): rendezvous hashing): no
two survivors race for a host, and one does not take everything. Each survivor takes its share in one transaction of a few
set-based statements (the lease CAS for all of them, then each kind of row they left open,
settled for all at once) and rings its reconciler as soon as it commits, so every taken
host's wake starts at once. A host whose assigned box does not take it within a lease's
length after the dead box's expiry is open to every box it is placed on.

The old owner self-fenced before its lease expired (runners/agent/fencing.py: its generations
are killed on its own clock, a margin before the expiry it wrote), so by the time the
expiry has passed nothing of it can still serve. A `keep` host (`--on-store-loss keep`) is
the exception its operator chose: its old owner left it running and stops it only once it
reaches the store again and finds the lease in another box's hands; it is taken over only
by a box that has itself reached the store for a lease's length (see take_over). The new owner therefore takes the lease
with a new fence and, in the same transaction, settles everything the old incarnation left
open: its live generations are ended (proven by the self-fence contract), its members,
restores and owed releases dropped, its wakes/stops/attempts in flight closed; a host
wanted up gets a fresh wake. Rows of the old fence can no longer write (every write
carries the fence), so nothing of the old incarnation is ever applied to the new one.

The new owner cannot signal another box's processes. Where the old generation's leader is
alive on this machine with the same pid and start time (two state dirs on one machine),
it is ended first anyway (kill and proof); on a real second box the check finds nothing.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import exists, select, union_all
from sqlalchemy.orm import Session

from models import facts
from models.errors import LostRace
from models.states import LIVE_GEN, AttemptStep, Desired, GenState, Outcome, StopState, WakeState
from models.store import emit, store_now, utcnow
from models.tables import (
    Attempt,
    BoxLease,
    Generation,
    Host,
    Lease,
    Member,
    Release,
    Restore,
    SlotStreak,
    Stop,
    Wake,
)
from models.transition import Unfenced, move_many
from workflows.base.context import Context, Poke
from workflows.base.crash import crashpoint, define
from workflows.base.queue import wake_host
from workflows.builds.book import nudge_many
from workflows.generations.ending import end_generation, ref_of
from workflows.leases import box, placement
from workflows.leases.lease import give_back, needed

TAKEN = define("takeover.done", "a dead box's hosts are leased here with new fences; the old "
                                "owner's generations are ended and its obligations settled")
# The settling moves of a takeover: every host they name had its lease taken, at a new
# fence, by the statement before them in the same transaction.
TAKEN_HERE = Unfenced("takeover: each row's host lease was taken in this very transaction")

# Open wake states of the old incarnation and where each one ends (all allowed transitions).
_WAKE_END = {WakeState.leased: WakeState.cancelled, WakeState.spawning: WakeState.failed,
             WakeState.checking: WakeState.failed, WakeState.reaping: WakeState.cancelled,
             WakeState.unproven: WakeState.failed}
# An attempt that had not reached the spawn is proven not to have run anything.
_NOT_EXECUTED = (AttemptStep.admitted, AttemptStep.raised, AttemptStep.published)
_L, _H, _B = Lease.__table__.c, Host.__table__.c, BoxLease.__table__.c


@dataclass(frozen=True)
class Lapsed:
    """A lease another agent let lapse, with its host's placement."""

    host: str
    holder: str
    fence: int
    epoch: int
    lapsed_at: Any
    box: str | None
    on_store_loss: str


def _lapsed(s: Session, ctx: Context, now: Any) -> list[Lapsed]:
    """The leases another agent let lapse: those of a box whose box lease expired (read by
    the expiry index, then each dead box's leases by holder), and those from before 0029
    past their own expiry. Never a scan of the fleet's leases or hosts: the hosts of what
    was found are read by name after (a join let the planner scan every host)."""
    cols = (_L.host, _L.holder, _L.fence, _L.epoch)
    dead = (select(*cols, _B.expires_at.label("lapsed_at"))
            .select_from(BoxLease.__table__.join(Lease.__table__, _L.holder == _B.box))
            .where(_B.expires_at <= now, _B.box != ctx.agent_id))
    old = (select(*cols, _L.expires_at.label("lapsed_at"))
           .where(_L.epoch == 0, _L.expires_at <= now, _L.holder != ctx.agent_id,
                  ~exists().where(_B.box == _L.holder)))
    rows = s.execute(union_all(dead, old)).all()
    if not rows:
        return []
    placed = {name: (box, loss) for name, box, loss in s.execute(
        select(_H.name, _H.box, _H.on_store_loss).where(_H.name.in_([r.host for r in rows])))}
    return [Lapsed(r.host, r.holder, r.fence, r.epoch, r.lapsed_at, *placed[r.host])
            for r in rows if r.host in placed]


def owner(host: str, boxes: set[str] | frozenset[str]) -> str:
    """The box of `boxes` that takes `host` over: the highest hash of (box, host)
    (rendezvous hashing). Every survivor computes it alike from the host's name alone, so
    the deal does not depend on which hosts were taken already; a dead box's hosts spread
    evenly over the survivors, and only a dead box's hosts move."""
    return max(sorted(boxes), key=lambda b: hashlib.blake2b(
        f"{b}\0{host}".encode(), digest_size=8).digest())


def spread(rows: list[Any], live: set[str], me: str, overdue: Any) -> list[Any]:
    """This box's share of the lapsed leases: each host to owner() among the live boxes it
    is placed on. A lease lapsed before `overdue` goes to whoever is placed (its owner by
    the deal has not taken it in a lease's length)."""
    if me not in live:
        return []  # this box's own lease first: it renews before it takes anything
    return [r for r in sorted(rows, key=lambda r: r.host)
            if me in placement.boxes(r.box)
            and (owner(r.host, placement.boxes(r.box) & live) == me or r.lapsed_at <= overdue)]


def plan(s: Session, ctx: Context, keep_too: bool = True) -> list[Any]:
    """The lapsed leases this box takes over now (`keep` hosts only when `keep_too`)."""
    now = store_now(s)
    rows = [r for r in _lapsed(s, ctx, now) if keep_too or r.on_store_loss != placement.KEEP]
    if not rows:
        return []
    live = set(s.execute(select(_B.box).where(_B.expires_at > now)).scalars())
    return spread(rows, live, ctx.agent_id, now - timedelta(seconds=ctx.lease_ttl))


def orphans(ctx: Context, keep_too: bool = True) -> list[str]:
    """The hosts plan() gives this box."""
    return sorted(r.host for r in ctx.store.read(lambda s: plan(s, ctx, keep_too)))


def take_over(ctx: Context, keep_too: bool = True,
              on_taken: Callable[[], None] | None = None) -> int:
    """Take over this box's share of the lapsed hosts; returns how many were taken.
    `keep_too` False: not the `keep` hosts (their owner did not fence them, so they may
    still run there): the caller holds them back until this box has reached the store for
    a lease's length, so after an outage of the store their owner renews first.
    `on_taken` runs as soon as the takeover commits (the reconciler's doorbell)."""
    rows = ctx.store.read(lambda s: plan(s, ctx, keep_too))
    if not rows:
        return 0
    hosts = [r.host for r in rows]
    gens = ctx.store.read(lambda s: list(s.execute(select(Generation).where(
        Generation.host.in_(hosts), Generation.state.in_(LIVE_GEN))).scalars()))
    for g in gens:  # a leader found here: the old box is this very machine
        if ctx.proc.leader_alive(ref_of(g)):
            end_generation(ctx, g, drain_until=None)
    try:
        taken = ctx.store.write(lambda s: _take(s, ctx, rows))
    except (Poke, LostRace):  # this box's lease lapsed meanwhile: renewed first
        return 0
    if not taken:  # renewed meanwhile, or another box was faster
        return 0
    crashpoint(TAKEN)
    if on_taken is not None:
        on_taken()
    for g in gens:
        if g.host in taken:
            ctx.proc.release(ref_of(g))  # an empty cgroup left here, if any
    give_back(ctx)  # a host wanted down: its lease goes back at once
    return len(taken)


def _take(s: Session, ctx: Context, rows: list[Any]) -> set[str]:
    """The lease CAS for every row at once: only leases still at the fence and epoch read,
    still not valid; each at a new fence from its host's counter, under this box's epoch."""
    now = store_now(s)
    mine = box.epoch_of(s, ctx.agent_id, now)
    if mine is None:
        raise Poke(f"the box lease of {ctx.agent_id} is not live: it is renewed first")
    fences = facts.take_leases(s, rows, ctx.agent_id, mine[0], now, mine[1])
    groups: dict[tuple[str, str], list[str]] = {}
    for r in rows:
        if r.host in fences:
            groups.setdefault((r.holder, r.on_store_loss), []).append(r.host)
    for (holder, loss), group in groups.items():
        _settle(s, ctx, group, holder, loss, {r.host: r.fence for r in rows}, fences)
    return set(fences)


def _settle(s: Session, ctx: Context, hosts: list[str], old_holder: str, loss: str,
            old: dict[str, int], fences: dict[str, int]) -> None:
    """Everything the old incarnation of these hosts left open, settled for all at once."""
    now = utcnow()
    why = (f"fenced: box lease of agent {old_holder} expired; ended by its self-fence"
           if loss != placement.KEEP else
           f"taken over: box lease of agent {old_holder} expired; on_store_loss keep, so it "
           "may run there until that box reaches the store again and stops it")
    of = Generation.host.in_(hosts)
    gens = s.execute(select(Generation.id, Generation.host).where(
        of, Generation.state.in_(LIVE_GEN))).all()
    move_many(s, Generation, [of], {"state": GenState.retiring, "end_reason": why},
              "generations taken over", fence=TAKEN_HERE, col="state",
              frm=[g for g in LIVE_GEN if g is not GenState.retiring])
    move_many(s, Generation, [of], {"state": GenState.proven, "end_reason": why, "ended_at": now},
              "generations taken over", fence=TAKEN_HERE, col="state", frm=GenState.retiring)
    for model in (Member, Restore, Release):
        s.execute(model.__table__.delete().where(model.host.in_(hosts)))
    move_many(s, Host, [Host.name.in_(hosts)], {"raised": False}, "the old box's raised limits",
              fence=TAKEN_HERE)
    for state, to in _WAKE_END.items():
        move_many(s, Wake, [Wake.host.in_(hosts)], {"state": to, "ended_at": now, "reason": why},
                  "wakes taken over", fence=TAKEN_HERE, col="state", frm=state)
    move_many(s, Stop, [Stop.host.in_(hosts)], {"state": StopState.done, "ended_at": now,
                                                "reason": why},
              "stops taken over", fence=TAKEN_HERE, col="state", frm=StopState.signalled)
    for step, executed in ((_NOT_EXECUTED, False), (None, True)):
        cond = Attempt.step.in_(step) if step else Attempt.step.not_in(
            (*_NOT_EXECUTED, AttemptStep.queued, AttemptStep.ended))
        move_many(s, Attempt, [Attempt.host.in_(hosts), Attempt.outcome.is_(None), cond],
                  {"step": AttemptStep.ended, "outcome": Outcome.abandoned, "executed": executed,
                   "reason": f"lease lost: {why}", "ended_at": now},
                  "attempts taken over", fence=TAKEN_HERE, col="step",
                  frm=[st for st in AttemptStep if st is not AttemptStep.ended])
    _wake_wanted(s, hosts)
    ended: dict[str, list[int]] = {}
    for gid, host in gens:
        ended.setdefault(host, []).append(gid)
    for host in hosts:
        emit(s, "taken_over", host, old_holder=old_holder, old_fence=old[host],
             fence=fences[host], ended=ended.get(host, []))
    nudge_many(s, hosts)  # rollouts waiting for an attempt abandoned here
    _owe_releases(s, ctx, hosts, fences, now)


def _wake_wanted(s: Session, hosts: list[str]) -> None:
    """A fresh wake of each host wanted up with no queued wake or stop of its own; not of a
    job: its runs are its own wakes, written by its schedule (workflows/lifecycle/jobs.py)."""
    up = s.execute(select(_H.name).where(
        _H.name.in_(hosts), _H.desired == Desired.up, _H.every.is_(None), _H.schedule.is_(None),
        ~exists().where(Wake.host == _H.name, Wake.state == WakeState.queued),
        ~exists().where(Stop.host == _H.name, Stop.state == StopState.queued),
        # failed at its start limit: it stays down until an operator asks (`vigil retry`)
        ~exists().where(SlotStreak.host == _H.name, SlotStreak.failed_at.is_not(None)))).scalars()
    for host in sorted(up):
        wake_host(s, host, "takeover")
    s.flush()


def _owe_releases(s: Session, ctx: Context, hosts: list[str], fences: dict[str, int],
                  now: Any) -> None:
    """An owed release of each taken host nothing retains (wanted down, nothing open)."""
    free = s.execute(select(_H.name).where(_H.name.in_(hosts), ~needed(_H.name))).scalars()
    for host in sorted(free):
        s.add(Release(host=host, holder=ctx.agent_id, fence=fences[host], since=now,
                      next_attempt_at=now))
