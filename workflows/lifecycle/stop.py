"""Stop: retire the current generation, its stop signal (SIGTERM unless set) or stop command,
drain, SIGKILL, prove, give the lease back.

A stop whose proof fails stays `signalled` with its lease; the sweep retries it, sending
SIGKILL again and re-reading the proof, until it holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import select
from sqlalchemy.orm import Session

from models.errors import BrokenInvariant, present
from models.states import (
    OPEN_STOP,
    AttemptStep,
    Desired,
    GenState,
    MemberRole,
    Outcome,
    StopState,
    WakeState,
)
from models.store import emit, utcnow
from models.tables import Attempt, Generation, Host, Member, Stop, Wake
from models.transition import Fence, move, move_many
from workflows.base.context import Context, Held, Poke, Result
from workflows.base.crash import crashpoint, define
from workflows.base.lookups import get_host
from workflows.base.waivers import BY_STATE, OPERATOR
from workflows.builds.book import nudge
from workflows.generations.create import join_set
from workflows.generations.ending import end_generation, mark_proven, ref_of
from workflows.generations.stopway import stop_way
from workflows.leases.lease import held_fence, owe_release, release_owed
from workflows.lifecycle.order import refuse_stop, stop_waiters, stopping_dependents

INTENT = define("stop.intent", "the stop is signalled and the generation retiring; link still there")
UNLINKED = define("stop.unlinked", "the canonical link is removed; nothing signalled yet")
TERMED = define("stop.termed", "the host's stop signal (SIGTERM unless set) was sent to the "
                "leader, or its stop command started; drain in progress")
KILLED = define("stop.killed", "SIGKILL was sent to the containment; no proof written yet")
PROVEN = define("stop.proven", "the generation is proven gone, the stop done, the release owed")


@dataclass(frozen=True)
class StopRequest:
    id: int
    state: str


def request_stop(s: Session, host: str, force: bool = False) -> StopRequest:
    """The CLI's intent: wakes that have not spawned yet are cancelled in the same transaction.
    Refused while hosts that start after it are up, unless `force`."""
    get_host(s, host)
    if not force:
        refuse_stop(s, host)
    move_many(s, Host, [Host.name == host], {"desired": Desired.down}, f"host {host} down",
              fence=OPERATOR, col="desired", frm=tuple(Desired))
    open_stop = s.execute(select(Stop).where(Stop.host == host, Stop.state.in_(OPEN_STOP),
                                             Stop.slot.is_(None))  # not a scale's
                          .order_by(Stop.id).limit(1)).scalar_one_or_none()
    if open_stop is not None:
        return StopRequest(open_stop.id, open_stop.state.value)
    now = utcnow()
    for state in (WakeState.queued, WakeState.leased):
        move_many(s, Wake, [Wake.host == host],
                  {"state": WakeState.cancelled, "ended_at": now, "reason": "cancelled by a stop"},
                  f"wakes of {host} cancelled", fence=OPERATOR, col="state", frm=state)
    _cancel_queued(s, host, now)
    st = Stop(host=host, state=StopState.queued, since=now, next_attempt_at=now, created_at=now)
    s.add(st)
    s.flush()
    emit(s, "stop_requested", host, stop=st.id)
    return StopRequest(st.id, st.state.value)


def _cancel_queued(s: Session, host: str, now: datetime) -> None:
    """Attempts that have not started yet end here: nothing of them ran."""
    if move_many(s, Attempt, [Attempt.host == host, Attempt.outcome.is_(None)],
                 {"outcome": Outcome.cancelled, "step": AttemptStep.ended, "executed": False,
                  "reason": "cancelled by a stop", "ended_at": now},
                 f"queued attempts of {host} cancelled", fence=OPERATOR, col="step",
                 frm=AttemptStep.queued):
        nudge(s, host)  # a rollout waiting for one of them


def drive_stop(ctx: Context, stop_id: int) -> Result:
    st = ctx.store.read(lambda s: s.get(Stop, stop_id))
    if st is None or st.state not in OPEN_STOP:
        return Result.gone
    if st.state is StopState.queued:
        if not _signal(ctx, st):
            release_owed(ctx, st.host)
            return Result.progress
        st = ctx.store.read(lambda s: s.get(Stop, stop_id))
        if st is None:
            return Result.gone
    return _finish(ctx, st)


def _signal(ctx: Context, st: Stop) -> bool:
    """queued -> signalled with the current generation retiring; False when nothing runs."""

    def step(s: Session) -> bool:
        first = stopping_dependents(s, st.host) if st.slot is None else None
        if first:
            raise Held(f"waiting for {', '.join(first)} to stop first (they start after {st.host})")
        busy = s.execute(select(Wake.id, Wake.state).where(
            Wake.host == st.host,
            Wake.state.in_((WakeState.spawning, WakeState.checking, WakeState.reaping)))).first()
        if busy is not None:
            raise Held(f"waiting for wake #{busy.id} ({busy.state.value}) to settle")
        now = utcnow()
        if st.slot is None:  # a scale's stop of one slot leaves the operator's intents be
            _cancel_later_wakes(s, st.host, now)
            _cancel_queued(s, st.host, now)
        # The barrier: attempts in flight see this stop at their next gate and end;
        # members must all leave (proven) before the current generation is stopped.
        # A scale's stop passes an attempt still at admission: that one waits for the
        # scale-down's stops (workflows/deploys/steps.py admit_in), then replaces the rest.
        attempt = s.execute(select(Attempt.id, Attempt.step).where(
            Attempt.host == st.host, Attempt.outcome.is_(None),
            *([] if st.slot is None else [Attempt.step != AttemptStep.queued]))).first()
        if attempt is not None:
            raise Held(f"waiting for attempt #{attempt.id} ({attempt.step.value}) to end")
        member = s.execute(select(Member.generation_id).where(Member.host == st.host)).first()
        if member is not None:
            raise Held(f"waiting for member g{member.generation_id} to be proven gone")
        currents = list(s.execute(select(Generation).where(
            Generation.host == st.host, Generation.state == GenState.current,
            *([] if st.slot is None else [Generation.slot == st.slot]))
            .order_by(Generation.slot)).scalars())
        gen = currents[0] if currents else None  # instances: the others retire beside it
        if gen is None:
            move(s, Stop, {"id": st.id}, {"state": StopState.done, "ended_at": now,
                                               "reason": "nothing was running"},
                 f"stop #{st.id}", fence=BY_STATE, col="state", frm=StopState.queued)
            emit(s, "stopped", st.host, reason="nothing was running")
            owe_release(s, ctx, st.host)
            stop_waiters(s, st.host)
            return False
        fence = held_fence(s, ctx, st.host)
        if fence is None:
            raise Poke(f"this agent does not hold the lease of {st.host}")
        move(s, Generation, {"id": gen.id},
             {"state": GenState.retiring, "end_reason": "stopped"},
             f"generation g{gen.id} current -> retiring", fence=Fence(st.host, ctx.agent_id, fence), col="state",
             frm=GenState.current)
        move(s, Stop, {"id": st.id},
             {"state": StopState.signalled, "generation_id": gen.id, "fence": fence,
              "signalled_at": now}, f"stop #{st.id} queued -> signalled",
             fence=BY_STATE, col="state", frm=StopState.queued)
        retire_siblings(s, ctx, currents[1:], Fence(st.host, ctx.agent_id, fence))
        return True

    signalled = ctx.store.write(step)
    if signalled:
        crashpoint(INTENT)
    return signalled


def retire_siblings(s: Session, ctx: Context, gens: list[Generation], fence: Fence) -> None:
    """The other instances of a host being stopped: current -> retiring members in the
    stop's own transaction, so they drain beside the stop's generation (the member sweep
    ends and proves each) and none is restarted."""
    for g in gens:
        move(s, Generation, {"id": g.id}, {"state": GenState.retiring, "end_reason": "stopped"},
             f"generation g{g.id} current -> retiring", fence=fence, col="state",
             frm=GenState.current)
        join_set(s, g.id, g.host, MemberRole.retiring, fence.value)


def _cancel_later_wakes(s: Session, host: str, now: datetime) -> None:
    """Wakes written between the stop's request and its signal. The operator's `wake`
    after the `stop` (the host is desired up again) is the newer word: it stays queued and
    starts the host once this stop is done. Only while the host is still desired down are
    they cancelled (the request cancelled those before it)."""
    desired = s.execute(select(Host.desired).where(Host.name == host)).scalar()
    if desired is Desired.up:
        return
    for state in (WakeState.queued, WakeState.leased):
        if move_many(s, Wake, [Wake.host == host],
                     {"state": WakeState.cancelled, "ended_at": now,
                      "reason": "cancelled by a stop"},
                     f"wakes of {host} cancelled", fence=BY_STATE, col="state", frm=state):
            emit(s, "wake_cancelled", host, reason="cancelled by a stop", was=state.value)


def _finish(ctx: Context, st: Stop) -> Result:
    gen = ctx.store.read(lambda s: s.get(Generation, st.generation_id))
    if gen is None or st.signalled_at is None:
        raise BrokenInvariant("gen or st.signalled_at is missing")
    if gen.socket:
        ctx.files.remove_link(ctx.link_for(st.host), only_if_target=gen.socket)
        crashpoint(UNLINKED)
    siblings = [] if st.slot is not None else ctx.store.read(lambda s: s.execute(
        select(Member.generation_id).where(Member.host == st.host)).scalars().all())
    if gen.state is not GenState.proven:
        host = present(ctx.store.read(lambda s: s.get(Host, st.host)), "host is missing")
        # The drain deadline is measured from the first stop signal, so a retry after a
        # restart does not grant the app a second full drain.
        drain_until = st.signalled_at.replace(tzinfo=UTC).timestamp() + host.drain_timeout
        problem = end_generation(ctx, gen, drain_until=drain_until, points=(TERMED, KILLED),
                                 way=stop_way(host, gen))
        if problem is not None:
            raise Poke(problem)
    if siblings:  # the other instances drain as members, at once; the stop ends after them
        raise Held(f"waiting for instances {', '.join(f'g{i}' for i in siblings)} of "
                   f"{st.host} to be proven gone")

    def step(s: Session) -> None:
        if s.get(Generation, gen.id).state is GenState.retiring:  # type: ignore[union-attr]
            mark_proven(s, gen.id, "stopped")
        move(s, Stop, {"id": st.id}, {"state": StopState.done, "ended_at": utcnow()},
             f"stop #{st.id} signalled -> done", fence=BY_STATE, col="state",
             frm=StopState.signalled)
        emit(s, "stopped", st.host, gen.id, pid=gen.pid)
        owe_release(s, ctx, st.host)
        stop_waiters(s, st.host)

    ctx.store.write(step)
    ctx.proc.release(ref_of(gen))
    crashpoint(PROVEN)
    release_owed(ctx, st.host)
    return Result.progress

