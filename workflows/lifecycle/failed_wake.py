"""A wake that did not go through: a build refused before anything ran; a start that
failed, written `unproven` first (it keeps the lease and every new wake of the host is
refused) until its processes are proven gone; a start interrupted mid-way (the agent died),
reaped and then tried again. A job run's start is tried again only when its exec claim
proves its build never ran (never_ran); otherwise its run is recorded interrupted."""

from __future__ import annotations

from sqlalchemy import bindparam, select
from sqlalchemy.orm import Session

from models.errors import Refused, present
from models.states import GenState, RunState, WakeState
from models.store import emit, utcnow
from models.tables import Generation, JobRun, Wake
from models.transition import Fence, move, move_many
from workflows.base.context import Context, Poke, Result
from workflows.base.crash import crashpoint, define
from workflows.base.waivers import BY_STATE
from workflows.generations.ending import end_generation, mark_proven, mark_retiring, ref_of
from workflows.leases.lease import owe_release, release_owed
from workflows.lifecycle.jobs import BY_RUN, RUN
from workflows.lifecycle.workers import after_failed_start

FAILING = define("wake.failing", "the failed wake is written unproven; its processes not killed yet")
KILLED = define("wake.killed", "the failed generation was sent SIGKILL; no proof written yet")
PROVEN = define("wake.proven", "the failed generation is proven gone and the lease release owed")
REAPING = define("wake.reaping", "an interrupted wake is written reaping; nothing killed yet")
REAPED = define("wake.reaped", "the interrupted generation is proven; the wake is back to leased")
EVIDENCE = define("job.evidence", "an interrupted run's exec claim is read (voided here, or taken "
                                  "by its shim); the wake not written reaping yet")
NEVER_RAN = "its start never exec'd its build (its exec claim voided)"

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
               gen_from: GenState, reason: str, kind: str = "wake_failed") -> Result:
    """Write the failure first (unproven: keeps the lease, refuses wakes), then kill, prove.
    `kind`: its event (`wake_cancelled` when a stop ended it: no build was judged)."""

    def step(s: Session) -> None:
        mark_retiring(s, gen.id, gen_from, reason)
        move(s, Wake, {"id": w.id},
             {"state": WakeState.unproven, "reason": reason, "last_error": reason,
              "since": utcnow()},
             f"wake #{w.id} -> unproven", fence=Fence(w.host, ctx.agent_id, w.fence or 0), col="state", frm=wake_from)
        emit(s, kind, w.host, gen.id, reason=reason)

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


def never_ran(ctx: Context, w: Wake) -> bool:
    """A run's start found mid-way with no pid: its exec claim voided here (True: its build
    never ran and now never can) or taken by its shim first (False: it may have run). Read
    before the reaping's commit and never dropped before the generation is proven, so a
    retry after a crash reads the same answer."""
    if w.cause != RUN or w.generation_id is None:
        return False
    gen = ctx.store.read(lambda s: s.get(Generation, w.generation_id))
    if gen is None or gen.pid is not None or gen.state is not GenState.spawning:
        return False
    never = ctx.files.void_claim(ctx.claim_for(gen.uuid))
    crashpoint(EVIDENCE)
    return never


def unbind_run(s: Session, wake_id: int, gen_id: int, why: str) -> None:
    """In the reaping's commit of a start proven never exec'd (failed_wake.never_ran): the
    run no longer names it, so its wake starts it again (bind_run) with its own instant."""
    move_many(s, JobRun, [JobRun.wake_id == wake_id, JobRun.state == RunState.due,
                          JobRun.generation_id == gen_id],
              {"generation_id": None, "reason": f"g{gen_id}: {why}; started again"},
              f"run of wake #{wake_id} drops g{gen_id}", fence=BY_RUN)


def rerun(s: Session, wake_id: int) -> bool:
    """The run of this reaped wake is started again: still due, naming no generation."""
    return s.execute(select(JobRun.id).where(JobRun.wake_id == wake_id,
                                             JobRun.state == RunState.due,
                                             JobRun.generation_id.is_(None))).first() is not None


def to_reaping(ctx: Context, w: Wake) -> None:
    never = never_ran(ctx, w)

    def step(s: Session) -> None:
        gen = s.get(Generation, w.generation_id) if w.generation_id else None
        if gen is not None and gen.state in (GenState.spawning, GenState.running):
            mark_retiring(s, gen.id, gen.state, NEVER_RAN if never else
                          "wake interrupted before it was current")
        if never and w.generation_id is not None:  # started again: same row and instant
            unbind_run(s, w.id, w.generation_id, NEVER_RAN)
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
        again = w.cause == RUN and rerun(s, w.id)
        if gen is not None and s.get(Generation, gen.id).state is GenState.retiring:  # type: ignore[union-attr]
            mark_proven(s, gen.id, NEVER_RAN if again else "wake interrupted before it was current")
        if w.cause == RUN and not again:  # it may have run: never started twice (jobs.py)
            move(s, Wake, {"id": w.id}, {"state": WakeState.cancelled, "ended_at": utcnow(),
                                         "reason": "the agent died before the run's pid was "
                                                   "written; its exec claim was taken: it may have run"},
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
