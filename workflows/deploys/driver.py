"""Deploy attempts: the driver that runs an attempt in its mode (overlap or hold). Every
step is written on the attempt row before it is taken; a driver that finds an attempt
mid-way (the agent died) abandons it before the switch, writing the same request again
(workflows/deploys/request.py), and finishes it at or after the switch."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from models.errors import present
from models.states import AttemptStep, GenState, MemberRole, Mode, Outcome
from models.store import emit, utcnow
from models.tables import Attempt, Generation, Member
from models.transition import move, move_many
from models.trouble import diagnose, one_line
from workflows.base.classify import BuildFailed, Cancelled, Interrupted, Stale, StepEnd, classify
from workflows.base.context import Context, Poke, Result
from workflows.base.crash import crashpoint, define
from workflows.base.ports import SpawnError
from workflows.builds.book import attempt_ended
from workflows.deploys.hold import run_hold
from workflows.deploys.overlap import run_overlap
from workflows.deploys.request import resume_in
from workflows.deploys.steps import BY_STEP, load, reap_inline, relink
from workflows.generations.ending import mark_retiring
from workflows.leases.lease import owe_release, release_owed

ENDED = define("swap.ended", "an attempt that did not switch is ended; its successor not reaped yet")

# Steps from which an attempt is finished, not abandoned, when a step fails unexpectedly.
_FINISH_OVERLAP = {AttemptStep.switched, AttemptStep.drained}
_FINISH_HOLD = {AttemptStep.stopping_old, AttemptStep.published, AttemptStep.spawning,
                AttemptStep.spawned, AttemptStep.healthy, AttemptStep.settled, AttemptStep.switched}
# Steps at or past which the build has been exec'd.
_EXECUTED_FROM = {AttemptStep.spawning, AttemptStep.spawned, AttemptStep.healthy,
                  AttemptStep.settled, AttemptStep.switched, AttemptStep.drained}


def drive_attempt(ctx: Context, attempt_id: int) -> Result:
    try:
        result = _drive_attempt(ctx, attempt_id)
        ctx.cut_short.pop(attempt_id, None)
        return result
    except Poke:
        raise
    except Exception as exc:  # left mid-way (its end could not be written): the next try says why
        t = diagnose(exc)
        ctx.cut_short[attempt_id] = (f"the store failed ({t.kind}: {t.detail})" if t is not None
                                     else f"{type(exc).__name__}: {one_line(exc)}")
        raise


def _drive_attempt(ctx: Context, attempt_id: int) -> Result:
    a = load(ctx, attempt_id)
    if a is None or a.outcome is not None:
        return Result.gone
    try:
        if a.effective_mode is Mode.overlap:
            run_overlap(ctx, a)
        else:
            run_hold(ctx, a)
    except (Stale, Cancelled, BuildFailed, SpawnError) as exc:
        _end(ctx, attempt_id, exc)
    except Poke:
        raise
    except Exception as exc:  # a lost race or a store error mid-step: never the build's fault
        stored = load(ctx, attempt_id)  # the step it failed at: `a` is as the drive began
        step = (stored or a).step
        why = f"step {step.value} failed: {type(exc).__name__}: {exc}"
        if stored is not None and stored.outcome is None and stored.step in (
                _FINISH_OVERLAP if stored.effective_mode is Mode.overlap else _FINISH_HOLD):
            # Past the switch (overlap) or past stopping the old one (hold): finish, never
            # abandon; the sweep resumes from the last written step, as recovery does.
            raise Poke(why) from None
        _end(ctx, attempt_id, Stale(why))
    return Result.progress


def _ran_in_a_slot(ctx: Context, a: Attempt) -> bool:
    """A host of instances: a successor past slot 0 means an earlier slot's ran the build."""
    if a.successor_id is None:
        return False
    slot = ctx.store.read(lambda s: s.execute(select(Generation.slot).where(
        Generation.id == a.successor_id)).scalar())
    return bool(slot)


def _end(ctx: Context, attempt_id: int, exc: BaseException) -> None:
    end = classify(exc)
    a = present(load(ctx, attempt_id), "a is missing")
    if a.outcome is not None:
        return
    # Execution evidence: false only when it is proven nothing of the build ran.
    executed = (a.step in _EXECUTED_FROM and not isinstance(exc, SpawnError)) or _ran_in_a_slot(
        ctx, a)
    hold_down = a.effective_mode is Mode.hold and a.retiring_id is not None
    outcome = {StepEnd.failed: Outcome.down if hold_down else Outcome.failed,
               StepEnd.cancelled: Outcome.cancelled,
               StepEnd.stale: Outcome.abandoned}[end]
    successor = a.successor_id if a.step is not AttemptStep.switched else None

    def step(s: Session) -> None:
        reason, resumed = str(exc), None
        if isinstance(exc, Interrupted):  # the operator's request outlives the agent
            resumed, why_not = resume_in(s, a)
            if resumed is not None:
                reason += f"; resumed as attempt #{resumed.id}"
            elif why_not is not None:
                reason += f"; not resumed: {why_not}"
                emit(s, "deploy_not_resumed", a.host, attempt=a.id, reason=why_not)
        if successor is not None:
            g = s.get(Generation, successor)
            if g is not None and g.state in (GenState.spawning, GenState.running):
                mark_retiring(s, g.id, g.state, f"attempt #{a.id} {outcome.value}: {exc}")
            move_many(s, Member, [Member.generation_id == successor],
                      {"role": MemberRole.retiring, "unproven": True},
                      f"member g{successor} retiring", fence=BY_STEP, col="role",
                      frm=tuple(MemberRole))
        move(s, Attempt, {"id": a.id, "outcome": None},
             {"step": AttemptStep.ended, "outcome": outcome, "reason": reason,
              "executed": executed, "ended_at": utcnow()},
             f"attempt #{a.id} -> ended", fence=BY_STEP, col="step",
             frm=[st for st in AttemptStep if st is not AttemptStep.ended])
        emit(s, f"deploy_{outcome.value}", a.host, successor, attempt=a.id, reason=reason,
             executed=executed, mode=a.effective_mode.value,
             **({"resumed_as": resumed.id} if resumed is not None else {}))
        if outcome is Outcome.down:
            emit(s, "down", a.host, None, attempt=a.id, reason=reason)
        attempt_ended(s, a, outcome, reason)  # the failure book; its rollout, if any
        owe_release(s, ctx, a.host)  # e.g. a one-shot attempt's lease, when nothing needs it

    ctx.store.write(step)
    crashpoint(ENDED)
    release_owed(ctx, a.host)
    relink(ctx, a.host)
    if successor is not None:
        reap_inline(ctx, successor)
