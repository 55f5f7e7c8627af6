"""Takeover: a host placed on this box whose lease expired in another agent's hands.

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

from functools import partial

from sqlalchemy import delete, select, update
from sqlalchemy.orm import Session

from models.errors import BrokenInvariant, LostRace
from models.states import LIVE_GEN, AttemptStep, Desired, GenState, Outcome, StopState, WakeState
from models.store import emit, store_clock, utcnow
from models.tables import Attempt, Generation, Host, Lease, Member, Release, Restore, Stop, Wake
from models.transition import Fence, move_many
from workflows.base.context import Context, Poke
from workflows.base.crash import crashpoint, define
from workflows.base.queue import wake_host
from workflows.builds.book import nudge
from workflows.generations.ending import end_generation, mark_proven, mark_retiring, ref_of
from workflows.leases import placement
from workflows.leases.lease import acquire, owe_release, release_owed

TAKEN = define("takeover.done", "an orphaned host is leased here with a new fence; the old "
                                "owner's generations are ended and its obligations settled")

# Open wake states of the old incarnation and where each one ends (all allowed transitions).
_WAKE_END = {WakeState.leased: WakeState.cancelled, WakeState.spawning: WakeState.failed,
             WakeState.checking: WakeState.failed, WakeState.reaping: WakeState.cancelled,
             WakeState.unproven: WakeState.failed}
# An attempt that had not reached the spawn is proven not to have run anything.
_NOT_EXECUTED = (AttemptStep.admitted, AttemptStep.raised, AttemptStep.published)


def orphans(ctx: Context, keep_too: bool = True) -> list[str]:
    """Hosts placed on this box whose lease expired with another agent (`keep` hosts only
    when `keep_too`)."""
    rows = ctx.store.read(lambda s: s.execute(
        select(Lease.host, Host.box, Host.on_store_loss).join(Host, Host.name == Lease.host).where(
            Lease.holder != ctx.agent_id, Lease.expires_at <= store_clock(s))).all())
    return sorted(h for h, box, loss in rows if placement.may_take_over(box, ctx.agent_id)
                  and (keep_too or loss != placement.KEEP))


def _live_generations(s: Session, host: str) -> list[Generation]:
    return list(s.execute(select(Generation).where(
        Generation.host == host, Generation.state.in_(LIVE_GEN))).scalars())


def take_over(ctx: Context, keep_too: bool = True) -> int:
    """Take over every orphaned host; returns how many were taken. `keep_too` False: not
    the `keep` hosts (their owner did not fence them, so they may still run there): the
    caller holds them back until this box has reached the store for a lease's length, so
    after an outage of the store their owner renews before anyone takes them."""
    taken = 0
    for host in orphans(ctx, keep_too):
        gens = ctx.store.read(partial(_live_generations, host=host))
        for g in gens:  # a leader found here: the old box is this very machine
            if ctx.proc.leader_alive(ref_of(g)):
                end_generation(ctx, g, drain_until=None)
        try:
            ctx.store.write(partial(_take, ctx=ctx, host=host))
        except (Poke, LostRace):  # renewed meanwhile, or another box was faster
            continue
        for g in gens:
            ctx.proc.release(ref_of(g))  # an empty cgroup left here, if any
        crashpoint(TAKEN)
        release_owed(ctx, host)
        taken += 1
    return taken


def _take(s: Session, ctx: Context, host: str) -> None:
    old = s.get(Lease, host)
    if old is None or old.holder == ctx.agent_id:
        raise Poke(f"lease of {host} is no longer another agent's")
    old_holder, old_fence = old.holder, old.fence
    fence = acquire(s, ctx, host)  # CAS: only while it is still expired and placed here
    taken = Fence(host, ctx.agent_id, fence)  # what follows is this box's, at its new fence
    now = utcnow()
    h = s.get(Host, host)
    if h is None:
        raise BrokenInvariant("h is missing")
    why = (f"fenced: lease of agent {old_holder} (fence {old_fence}) expired; ended by its self-fence"
           if h.on_store_loss != placement.KEEP else
           f"taken over: lease of agent {old_holder} (fence {old_fence}) expired; on_store_loss "
           "keep, so it may run there until that box reaches the store again and stops it")
    ended = []
    for g in s.execute(select(Generation).where(Generation.host == host,
                                                Generation.state.in_(LIVE_GEN))).scalars().all():
        if g.state is not GenState.retiring:
            mark_retiring(s, g.id, g.state, why)
        mark_proven(s, g.id, why)
        ended.append(g.id)
    for model in (Member, Restore, Release):
        s.execute(delete(model).where(model.host == host))
    s.execute(update(Host).where(Host.name == host).values(raised=False))  # the old box's limit
    for state, to in _WAKE_END.items():
        move_many(s, Wake, [Wake.host == host], {"state": to, "ended_at": now, "reason": why},
                  f"wakes of {host} ended", fence=taken, col="state", frm=state)
    move_many(s, Stop, [Stop.host == host], {"state": StopState.done, "ended_at": now,
                                             "reason": why},
              f"stops of {host} ended", fence=taken, col="state", frm=StopState.signalled)
    for step, executed in ((_NOT_EXECUTED, False), (None, True)):
        cond = Attempt.step.in_(step) if step else Attempt.step.not_in(
            (*_NOT_EXECUTED, AttemptStep.queued, AttemptStep.ended))
        move_many(s, Attempt, [Attempt.host == host, Attempt.outcome.is_(None), cond],
                  {"step": AttemptStep.ended, "outcome": Outcome.abandoned, "executed": executed,
                   "reason": f"lease lost: {why}", "ended_at": now},
                  f"attempts of {host} abandoned", fence=taken, col="step",
                  frm=[st for st in AttemptStep if st is not AttemptStep.ended])
    queued = s.execute(select(Wake.id).where(Wake.host == host,
                                             Wake.state == WakeState.queued)).first()
    if h.desired is Desired.up and queued is None and not s.execute(select(Stop.id).where(
            Stop.host == host, Stop.state == StopState.queued)).first():
        wake_host(s, host, "takeover")
    emit(s, "taken_over", host, old_holder=old_holder, old_fence=old_fence, fence=fence,
         ended=ended)
    nudge(s, host)  # a rollout waiting for an attempt abandoned here
    owe_release(s, ctx, host)
