"""Deploy attempts: the request, and the driver that runs an attempt in its mode (overlap
or hold). Every step is written on the attempt row before it is taken; a driver that finds
an attempt mid-way (the agent died) abandons it before the switch and finishes it at or
after the switch."""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from models.errors import BadInput, BrokenInvariant, NotFound, Refused
from models.states import (
    AttemptStep,
    Cause,
    GenState,
    HostKind,
    MemberRole,
    Mode,
    Outcome,
)
from models.store import emit, utcnow
from models.tables import Attempt, Build, Generation, Host, Member
from models.transition import move, move_many
from workflows.base.classify import BuildFailed, Cancelled, Stale, StepEnd, classify
from workflows.base.context import Context, Poke, Result
from workflows.base.crash import crashpoint, define
from workflows.base.ports import SpawnError
from workflows.builds.book import attempt_ended
from workflows.deploys.hold import run_hold
from workflows.deploys.overlap import run_overlap
from workflows.deploys.steps import (
    BY_STEP,
    load,
    reap_inline,
    relink,
)
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


def request_deploy(s: Session, host: str, build: Build, *, mode: Mode, canary: bool,
                   cause: Cause) -> Attempt:
    """The CLI's intent: one attempt row (write-ahead: cause, build, digest, both modes,
    the host's next scheduler revision, canary)."""
    h = s.get(Host, host)
    if h is None:
        raise NotFound(f"no host named {host!r}", "see `vigil host list`")
    effective = Mode.hold if h.kind is HostKind.worker else mode
    revision = (s.execute(select(func.max(Attempt.revision)).where(Attempt.host == host))
                .scalar() or 0) + 1
    now = utcnow()
    a = Attempt(host=host, build_id=build.id, digest=build.digest, cause=cause, mode=mode,
                effective_mode=effective, revision=revision, canary=canary,
                step=AttemptStep.queued, since=now, next_attempt_at=now, created_at=now)
    s.add(a)
    s.flush()
    emit(s, "deploy_requested", host, attempt=a.id, build=build.digest[:12], mode=mode.value,
         effective_mode=effective.value, cause=cause.value, canary=canary)
    return a


def last_failed(s: Session, host: str) -> tuple[Build, Attempt]:
    """What `vigil retry` re-arms: the newest attempt of the host that failed, and its build."""
    if s.get(Host, host) is None:
        raise NotFound(f"no host named {host!r}", "see `vigil host list`")
    a = s.execute(select(Attempt).where(Attempt.host == host, Attempt.outcome.in_(
        (Outcome.failed, Outcome.down))).order_by(Attempt.id.desc()).limit(1)).scalar_one_or_none()
    if a is None:
        raise BadInput(f"host {host} has no failed deploy to retry", "deploy a build with `vigil deploy`")
    b = s.get(Build, a.build_id)
    if b is None:
        raise BrokenInvariant("b is missing")
    if b.deleted_at is not None:
        raise no_longer_staged(host, b)
    return b, a


def no_longer_staged(host: str, b: Build) -> Refused:
    return Refused(f"the last failed build of {host} ({b.digest[:12]}) is no longer staged "
                   "(`vigil gc` removed it)",
                   f"stage it again with `vigil deploy {host} {b.source}`")


def drive_attempt(ctx: Context, attempt_id: int) -> Result:
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
        why = f"step {a.step.value} failed: {type(exc).__name__}: {exc}"
        stored = load(ctx, attempt_id)
        if stored is not None and stored.outcome is None and stored.step in (
                _FINISH_OVERLAP if stored.effective_mode is Mode.overlap else _FINISH_HOLD):
            # Past the switch (overlap) or past stopping the old one (hold): finish, never
            # abandon; the sweep resumes from the last written step, as recovery does.
            raise Poke(why) from None
        _end(ctx, attempt_id, Stale(why))
    return Result.progress


def _end(ctx: Context, attempt_id: int, exc: BaseException) -> None:
    end = classify(exc)
    a = load(ctx, attempt_id)
    if a is None:
        raise BrokenInvariant("a is missing")
    if a.outcome is not None:
        return
    # Execution evidence: false only when it is proven nothing of the build ran.
    executed = a.step in _EXECUTED_FROM and not isinstance(exc, SpawnError)
    hold_down = a.effective_mode is Mode.hold and a.retiring_id is not None
    outcome = {StepEnd.failed: Outcome.down if hold_down else Outcome.failed,
               StepEnd.cancelled: Outcome.cancelled,
               StepEnd.stale: Outcome.abandoned}[end]
    successor = a.successor_id if a.step is not AttemptStep.switched else None

    def step(s: Session) -> None:
        if successor is not None:
            g = s.get(Generation, successor)
            if g is not None and g.state in (GenState.spawning, GenState.running):
                mark_retiring(s, g.id, g.state, f"attempt #{a.id} {outcome.value}: {exc}")
            move_many(s, Member, [Member.generation_id == successor],
                      {"role": MemberRole.retiring, "unproven": True},
                      f"member g{successor} retiring", fence=BY_STEP, col="role",
                      frm=tuple(MemberRole))
        move(s, Attempt, [Attempt.id == a.id, Attempt.outcome.is_(None)],
             {"step": AttemptStep.ended, "outcome": outcome, "reason": str(exc),
              "executed": executed, "ended_at": utcnow()},
             f"attempt #{a.id} -> ended", fence=BY_STEP, col="step",
             frm=[st for st in AttemptStep if st is not AttemptStep.ended])
        emit(s, f"deploy_{outcome.value}", a.host, successor, attempt=a.id, reason=str(exc),
             executed=executed, mode=a.effective_mode.value)
        if outcome is Outcome.down:
            emit(s, "down", a.host, None, attempt=a.id, reason=str(exc))
        attempt_ended(s, a, outcome, str(exc))  # the failure book; its rollout, if any
        owe_release(s, ctx, a.host)  # e.g. a one-shot attempt's lease, when nothing needs it

    ctx.store.write(step)
    crashpoint(ENDED)
    release_owed(ctx, a.host)
    relink(ctx, a.host)
    if successor is not None:
        reap_inline(ctx, successor)
