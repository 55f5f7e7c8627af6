"""Deploy requests: the operator's intent as an attempt row (`vigil deploy`, `vigil retry`, a
config apply, a scheduled restart, a rollout's wave), and the same request written again
when an attempt was interrupted before its switch (cause `resumed`).

An interrupted attempt is the agent's failure, not the operator's change of mind: the agent
restarted while the successor was starting, so the driver that finds it abandons it and
kills its successor (never a build failure) and, in that same transaction, writes the
request again, naming the attempt it replaces. At most MAX_RESUMES times for one request,
so a build whose start kills the agent cannot loop forever; a rollout's attempts are left
to the rollout, which writes them again by its own budget."""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from models.errors import BadInput, Refused, present
from models.states import AttemptStep, Cause, HostKind, Mode, Outcome
from models.store import emit, utcnow
from models.streaks import clear_failed
from models.tables import Attempt, Build
from workflows.base.lookups import get_host, newest_revision, open_stop

MAX_RESUMES = 3  # times one request is written again after an interruption, at most


def request_deploy(s: Session, host: str, build: Build, *, mode: Mode, canary: bool,
                   cause: Cause, resumed_from: int | None = None) -> Attempt:
    """The CLI's intent: one attempt row (write-ahead: cause, build, digest, both modes,
    the host's next scheduler revision, canary; the attempt it writes again, if any)."""
    h = get_host(s, host)
    if resumed_from is None and clear_failed(s, host):  # a deploy undoes the start limit
        emit(s, "failed_cleared", host, by=f"deploy ({cause.value})")
    effective = Mode.hold if h.kind is HostKind.worker else mode
    revision = (s.execute(select(func.max(Attempt.revision)).where(Attempt.host == host))
                .scalar() or 0) + 1
    now = utcnow()
    a = Attempt(host=host, build_id=build.id, digest=build.digest, cause=cause, mode=mode,
                effective_mode=effective, revision=revision, canary=canary,
                step=AttemptStep.queued, since=now, next_attempt_at=now, created_at=now,
                resumed_from=resumed_from)
    s.add(a)
    s.flush()
    emit(s, "deploy_requested", host, attempt=a.id, build=build.digest[:12], mode=mode.value,
         effective_mode=effective.value, cause=cause.value, canary=canary,
         **({"resumed_from": resumed_from} if resumed_from is not None else {}))
    return a


def last_failed(s: Session, host: str) -> tuple[Build, Attempt]:
    """What `vigil retry` re-arms: the newest attempt of the host that failed, and its build."""
    get_host(s, host)
    a = s.execute(select(Attempt).where(Attempt.host == host, Attempt.outcome.in_(
        (Outcome.failed, Outcome.down))).order_by(Attempt.id.desc()).limit(1)).scalar_one_or_none()
    if a is None:
        raise BadInput(f"host {host} has no failed deploy to retry", "deploy a build with `vigil deploy`")
    b = present(s.get(Build, a.build_id), "b is missing")
    if b.deleted_at is not None:
        raise no_longer_staged(host, b)
    return b, a


def no_longer_staged(host: str, b: Build) -> Refused:
    return Refused(f"the last failed build of {host} ({b.digest[:12]}) is no longer staged "
                   "(`vigil gc` removed it)",
                   f"stage it again with `vigil deploy {host} {b.source}`")


def chain_of(s: Session, a: Attempt) -> list[int]:
    """The ids of the attempts `a` writes again, oldest (the original request) first, then
    `a` itself. Bounded: a chain is never longer than MAX_RESUMES + 1."""
    ids = [a.id]
    back = a.resumed_from
    while back is not None and len(ids) <= MAX_RESUMES + 1:
        ids.insert(0, back)
        back = s.execute(select(Attempt.resumed_from).where(Attempt.id == back)).scalar()
    return ids


def resume_in(s: Session, a: Attempt) -> tuple[Attempt | None, str | None]:
    """In the transaction that abandons the interrupted attempt `a`: the same request as a
    new attempt, or why not (None for a rollout's attempt: its rollout decides)."""
    if a.cause is Cause.rollout:
        return None, None
    chain = chain_of(s, a)
    if len(chain) > MAX_RESUMES:
        ids = ", ".join(f"#{i}" for i in chain)
        return None, (f"already resumed {MAX_RESUMES} times (attempts {ids}); deploy it again "
                      "once the agent stays up")
    newest = newest_revision(s, a.host)
    if newest is not None and newest > a.revision:
        return None, f"superseded by a newer attempt (revision {newest} > {a.revision})"
    stop = open_stop(s, a.host)
    if stop is not None:
        return None, f"host {a.host} is being stopped (stop #{stop})"
    build = s.get(Build, a.build_id)
    if build is None or build.deleted_at is not None:
        return None, "its build is no longer staged"
    new = request_deploy(s, a.host, build, mode=a.mode, canary=a.canary, cause=Cause.resumed,
                         resumed_from=a.id)
    emit(s, "deploy_resumed", a.host, attempt=new.id, resumed_from=a.id, original=chain[0],
         resumption=len(chain), of=MAX_RESUMES)
    return new, None
