"""Overlap deploys: the successor starts beside the current generation, answers its health
check, then one transaction switches them; the old one drains and is proven gone."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from models.errors import BrokenInvariant
from models.states import (
    AttemptStep,
    GenState,
    MemberRole,
    Outcome,
)
from models.store import emit, utcnow
from models.tables import Attempt, Generation, Host, Member
from models.transition import move
from workflows.base.classify import BuildFailed, Interrupted, Stale
from workflows.base.context import Context, Poke
from workflows.base.crash import crashpoint, define
from workflows.base.waivers import BY_STATE
from workflows.builds.book import attempt_ended
from workflows.deploys.steps import (
    ADMITTED,
    HEALTHY,
    PUBLISHED,
    SWITCHED,
    asleep,
    check,
    end_retiring,
    gate,
    healthy_in,
    probe,
    publish,
    publish_in,
    spawn,
    step_to,
    verify,
)
from workflows.generations.create import intend, join_set
from workflows.generations.ending import mark_proven, mark_retiring, ref_of
from workflows.leases.lease import held_fence
from workflows.lifecycle.members import leave_set, run_restores

RAISED = define("swap.raised", "the parent limit is raised (or there is none); nothing spawned")
DRAINED = define("swap.drained", "the retiring generation is proven and left the set; done")


def run_overlap(ctx: Context, a: Attempt) -> None:
    if a.step in (AttemptStep.switched, AttemptStep.drained):
        return _drain(ctx, a)
    if a.step is not AttemptStep.queued:
        why = ctx.cut_short.pop(a.id, None)
        found = (f"this agent's last try of it stopped there: {why}" if why is not None
                 else "found mid-way by a new driver: the agent restarted")
        raise Interrupted(f"interrupted at step {a.step.value}, before the switch ({found})")
    build = verify(ctx, a)

    def admit(s: Session) -> tuple[Host, Generation] | None:
        h = s.get(Host, a.host)
        if h is None:
            raise BrokenInvariant("h is missing")
        a.fence = held_fence(s, ctx, a.host)
        gate(s, ctx, a)
        if asleep(s, ctx, a, h):
            return None
        if a.fence is None:
            raise Stale(f"this agent does not hold the lease of {a.host}")
        members = s.execute(select(Member.generation_id).where(Member.host == a.host)).scalars().all()
        if members:
            raise Poke(f"waiting for member(s) {members} of {a.host} to be proven gone")
        if h.raised:
            raise Poke(f"parent limit of {a.host} is still raised: a restore is pending")
        g = intend(s, ctx, h, a.build_id, a.fence)
        join_set(s, g.id, a.host, MemberRole.spawning, a.fence, attempt_id=a.id)
        step_to(s, a, AttemptStep.admitted, fence=a.fence, successor_id=g.id)
        if not _can_raise(ctx, h):
            # Nothing to raise: the raise and the publication ride in this commit (one
            # fsync instead of three before the exec); their crash points follow it. (The
            # spawn's intent stays a commit of its own: a crash before it proves that
            # nothing of the build ran, executed=false.)
            step_to(s, a, AttemptStep.raised)
            publish_in(s, a)
        s.flush()
        return h, g

    admitted = ctx.store.write(admit)
    if admitted is None:
        return None
    host, gen = admitted
    a.successor_id = gen.id
    crashpoint(ADMITTED)
    if a.step is AttemptStep.published:
        crashpoint(RAISED)
        crashpoint(PUBLISHED)
    else:
        _raise_parent(ctx, a, host)
        publish(ctx, a)
    spawned = spawn(ctx, a, host, build, gen)
    # Without a canary settle, "healthy" rides in the switch's commit (one fsync between
    # the answer and the switch); its crash point follows that commit.
    merged = not a.canary
    if merged:
        probe(ctx, host, gen)
    else:
        check(ctx, a, host, gen, spawned)

    old_id = None

    def switch(s: Session) -> None:
        nonlocal old_id
        if merged:
            healthy_in(s, ctx, a, gen)
        gate(s, ctx, a)
        # None when the old current died mid-deploy (the liveness sweep already made it a
        # retiring member): the successor still takes over, there is nothing to drain.
        old = s.execute(select(Generation).where(Generation.host == a.host,
                                                 Generation.state == GenState.current)).scalar_one_or_none()
        old_id = old.id if old is not None else None
        if old is not None:
            mark_retiring(s, old.id, GenState.current, f"replaced by g{gen.id}")
        move(s, Generation, gen.id,
             {"state": GenState.current, "current_at": utcnow()},
             f"generation g{gen.id} running -> current", fence=BY_STATE, col="state",
             frm=GenState.running)
        s.execute(Member.__table__.delete().where(Member.generation_id == gen.id))
        if old is not None:
            join_set(s, old.id, a.host, MemberRole.retiring, a.fence or 0, attempt_id=a.id)
        s.execute(Host.__table__.update().where(Host.name == a.host).values(build_id=a.build_id))
        step_to(s, a, AttemptStep.switched, retiring_id=old_id)
        emit(s, "switched", a.host, gen.id, attempt=a.id, retiring=old_id)
        s.flush()
        # The rename happens inside the transaction: if the commit fails, the attempt's end
        # (`relink`), or recovery after a crash, re-points the link at whatever the store
        # says is current.
        if gen.socket:
            ctx.files.point_link(ctx.link_for(a.host), gen.socket)

    if not ctx.proc.leader_alive(ref_of(gen)):
        raise BuildFailed("successor exited before the switch")
    ctx.store.write(switch)
    a.retiring_id = old_id
    if merged:
        crashpoint(HEALTHY)
    crashpoint(SWITCHED)
    _drain(ctx, a)
    return None


def _can_raise(ctx: Context, host: Host) -> bool:
    """Whether this deploy raises the parent memory limit (a tier, and a box that can)."""
    return bool(host.memory_tier_mb) and ctx.limits is not None and ctx.limits.available()


def _raise_parent(ctx: Context, a: Attempt, host: Host) -> None:
    """Mark raised before asking (a half-done raise may have changed it); a box without a
    memory controller refuses before writing anything, so nothing is left to restore."""
    can = _can_raise(ctx, host)

    def step(s: Session) -> None:
        gate(s, ctx, a)
        if can:
            s.execute(Host.__table__.update().where(Host.name == a.host).values(raised=True))
        step_to(s, a, AttemptStep.raised)

    ctx.store.write(step)
    if can:
        if not (ctx.limits is not None and host.memory_tier_mb):
            raise BrokenInvariant("expected ctx.limits is not None and host.memory_tier_mb")
        try:
            ctx.limits.set_limit(a.host, 2 * host.memory_tier_mb)
        except OSError as exc:
            raise Stale(f"parent limit raise failed: {exc}") from None
    crashpoint(RAISED)


def _drain(ctx: Context, a: Attempt) -> None:
    """At or after the switch: finish. SIGTERM, the app's drain, SIGKILL, proof, leave."""
    if a.retiring_id is None:
        return _nothing_to_drain(ctx, a)
    old, drain = end_retiring(ctx, a, mark_unproven=True)

    def step(s: Session) -> None:
        if s.get(Generation, old.id).state is GenState.retiring:  # type: ignore[union-attr]
            mark_proven(s, old.id, "drained")
        leave_set(s, ctx, a.host, old.id)
        step_to(s, a, AttemptStep.ended, outcome=Outcome.done, executed=True, drain_seconds=drain,
                reason="switched and drained", ended_at=utcnow())
        emit(s, "swapped", a.host, a.successor_id, attempt=a.id, mode=a.effective_mode.value,
             retired=old.id, drain_seconds=round(drain, 3))
        attempt_ended(s, a, Outcome.done)

    ctx.store.write(step)
    ctx.proc.release(ref_of(old))
    crashpoint(DRAINED)
    run_restores(ctx, a.host)


def _nothing_to_drain(ctx: Context, a: Attempt) -> None:
    """The switch found no current generation (it had died and is a member the sweep reaps):
    done. The successor's own member row left at the switch, so if that made the set empty
    the restore is owed here."""

    def step(s: Session) -> None:
        leave_set(s, ctx, a.host, a.successor_id)  # type: ignore[arg-type]
        step_to(s, a, AttemptStep.ended, outcome=Outcome.done, executed=True, drain_seconds=0.0,
                reason="switched (the old generation had already exited)", ended_at=utcnow())
        emit(s, "swapped", a.host, a.successor_id, attempt=a.id, mode=a.effective_mode.value,
             retired=None, drain_seconds=0.0)
        attempt_ended(s, a, Outcome.done)

    ctx.store.write(step)
    crashpoint(DRAINED)
    run_restores(ctx, a.host)
