"""A wake that did not go through: a build refused before anything ran; a start that
failed, written `unproven` first (it keeps the lease and every new wake of the host is
refused) until its processes are proven gone; a start interrupted mid-way (the agent died),
reaped and then tried again."""

from __future__ import annotations

from sqlalchemy import bindparam, select
from sqlalchemy.orm import Session

from models.errors import Refused, present
from models.states import GenState, WakeState
from models.store import emit, utcnow
from models.tables import Generation, Wake
from models.transition import Fence, move
from workflows.base.context import Context, Poke, Result
from workflows.base.crash import crashpoint, define
from workflows.base.waivers import BY_STATE
from workflows.generations.ending import end_generation, mark_proven, mark_retiring, ref_of
from workflows.leases.lease import owe_release, release_owed
from workflows.lifecycle.jobs import RUN
from workflows.lifecycle.workers import after_failed_start

FAILING = define("wake.failing", "the failed wake is written unproven; its processes not killed yet")
KILLED = define("wake.killed", "the failed generation was sent SIGKILL; no proof written yet")
PROVEN = define("wake.proven", "the failed generation is proven gone and the lease release owed")
REAPING = define("wake.reaping", "an interrupted wake is written reaping; nothing killed yet")
REAPED = define("wake.reaped", "the interrupted generation is proven; the wake is back to leased")

# Built once, as the wake's statements are (building one cost more than running it).
_UNPROVEN = select(Wake).where(Wake.host == bindparam("host"),
                               Wake.state == WakeState.unproven).limit(1)


def unproven_wake(s: Session, host: str) -> Wake | None:
    return s.execute(_UNPROVEN, {"host": host}).scalar_one_or_none()


def refuse_if_unproven(s: Session, host: str) -> None:
    w = unproven_wake(s, host)
    if w is not None:
        gen = s.get(Generation, w.generation_id) if w.generation_id else None
        pid = f" (pid {gen.pid})" if gen is not None and gen.pid else ""
        raise Refused(
            f"host {host}: the last wake failed and generation g{w.generation_id}{pid} is not "
            f"proven gone ({w.last_error or w.reason})",
            "the agent keeps retrying the proof: watch `vigil obligations`; if the process "
            "is stuck, end it yourself",
        )


def refuse_build(ctx: Context, w: Wake, reason: str) -> Result:
    """Nothing ran: the wake fails at once and the lease is owed back."""

    def step(s: Session) -> None:
        move(s, Wake, {"id": w.id}, {"state": WakeState.failed, "reason": reason,
                                          "ended_at": utcnow()},
             f"wake #{w.id} leased -> failed", fence=BY_STATE, col="state", frm=WakeState.leased)
        emit(s, "wake_failed", w.host, reason=reason, executed=False)
        owe_release(s, ctx, w.host)

    ctx.store.write(step)
    release_owed(ctx, w.host)
    return Result.progress


def fail_start(ctx: Context, w: Wake, gen: Generation, wake_from: WakeState,
               gen_from: GenState, reason: str) -> Result:
    """Write the failure first (unproven: keeps the lease, refuses wakes), then kill, prove."""

    def step(s: Session) -> None:
        mark_retiring(s, gen.id, gen_from, reason)
        move(s, Wake, {"id": w.id},
             {"state": WakeState.unproven, "reason": reason, "last_error": reason,
              "since": utcnow()},
             f"wake #{w.id} -> unproven", fence=Fence(w.host, ctx.agent_id, w.fence or 0), col="state", frm=wake_from)
        emit(s, "wake_failed", w.host, gen.id, reason=reason)

    ctx.store.write(step)
    crashpoint(FAILING)
    w2 = present(ctx.store.read(lambda s: s.get(Wake, w.id)), f"wake #{w.id} is missing")
    return prove_failed(ctx, w2)


def prove_failed(ctx: Context, w: Wake) -> Result:
    gen = present(ctx.store.read(lambda s: s.get(Generation, w.generation_id)), "gen is missing")
    if gen.state is not GenState.proven:
        problem = end_generation(ctx, gen, drain_until=None, points=(None, KILLED))
        if problem is not None:
            raise Poke(problem)

    def step(s: Session) -> None:
        if s.get(Generation, gen.id).state is not GenState.proven:  # type: ignore[union-attr]
            mark_proven(s, gen.id)
        move(s, Wake, {"id": w.id}, {"state": WakeState.failed, "ended_at": utcnow()},
             f"wake #{w.id} unproven -> failed", fence=BY_STATE, col="state",
             frm=WakeState.unproven)
        emit(s, "proven", w.host, gen.id, after="failed wake")
        after_failed_start(s, w)
        owe_release(s, ctx, w.host)

    ctx.store.write(step)
    ctx.proc.release(ref_of(gen))
    crashpoint(PROVEN)
    release_owed(ctx, w.host)
    return Result.progress


def to_reaping(ctx: Context, w: Wake) -> None:
    def step(s: Session) -> None:
        gen = s.get(Generation, w.generation_id) if w.generation_id else None
        if gen is not None and gen.state in (GenState.spawning, GenState.running):
            mark_retiring(s, gen.id, gen.state, "wake interrupted before it was current")
        move(s, Wake, {"id": w.id}, {"state": WakeState.reaping},
             f"wake #{w.id} {w.state.value} -> reaping", fence=BY_STATE, col="state",
             frm=w.state)
        emit(s, "wake_interrupted", w.host, w.generation_id, step=w.state.value)

    ctx.store.write(step)
    crashpoint(REAPING)


def reap_interrupted(ctx: Context, w: Wake) -> None:
    """End the interrupted generation, then send the wake back to leased to try again."""
    gen = ctx.store.read(lambda s: s.get(Generation, w.generation_id)) if w.generation_id else None
    if gen is not None and gen.state is not GenState.proven:
        problem = end_generation(ctx, gen, drain_until=None)
        if problem is not None:
            raise Poke(problem)

    def step(s: Session) -> None:
        if gen is not None and s.get(Generation, gen.id).state is GenState.retiring:  # type: ignore[union-attr]
            mark_proven(s, gen.id, "wake interrupted before it was current")
        if w.cause == RUN:  # a job's run may have run: never started twice (jobs.py)
            move(s, Wake, {"id": w.id}, {"state": WakeState.cancelled, "ended_at": utcnow(),
                                         "reason": "the agent died before the run's pid was written"},
                 f"wake #{w.id} reaping -> cancelled", fence=BY_STATE, col="state",
                 frm=WakeState.reaping)
            owe_release(s, ctx, w.host)
            return
        move(s, Wake, {"id": w.id}, {"state": WakeState.leased, "attempts": 0},
             f"wake #{w.id} reaping -> leased", fence=BY_STATE, col="state",
             frm=WakeState.reaping)

    ctx.store.write(step)
    if gen is not None:
        ctx.proc.release(ref_of(gen))
    crashpoint(REAPED)
