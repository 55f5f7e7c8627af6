"""Overlap deploys: the successor starts beside the current generation, answers its health
check, then one transaction switches them; the old one drains and is proven gone."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from models.errors import BrokenInvariant
from models.states import AttemptStep, GenState, MemberRole, Outcome
from models.store import emit, utcnow
from models.tables import Attempt, Build, Generation, Host, Member
from workflows.base.classify import BuildFailed, Interrupted, Stale
from workflows.base.context import Context, Held
from workflows.base.crash import crashpoint, define
from workflows.builds.book import attempt_ended
from workflows.builds.staged import set_build
from workflows.deploys import steps
from workflows.generations.create import intend, join_set
from workflows.generations.ending import mark_proven, mark_retiring, ref_of
from workflows.generations.known import note
from workflows.lifecycle.members import leave_set, run_restores

RAISED = define("swap.raised", "the parent limit is raised (or there is none); nothing spawned")
DRAINED = define("swap.drained", "the retiring generation is proven and left the set; done")


def _interrupted(ctx: Context, a: Attempt) -> str:
    """Why an attempt found before its switch ended there: this agent's own cut-short try
    (a failed store, kept in memory), else the agent restarted."""
    why = ctx.cut_short.pop(a.id, None)
    found = (f"this agent's last try of it stopped there: {why}" if why is not None
             else "found mid-way by a new driver: the agent restarted")
    return f"interrupted at step {a.step.value}, before the switch ({found})"


def run_overlap(ctx: Context, a: Attempt) -> None:
    """A host of instances is replaced one slot at a time, slot 0 first (the batch is one
    instance): its successor starts beside it, is checked, switched, and the old one
    drained and proven before the next slot's successor is admitted (in the drain's own
    commit), so N are current at every instant."""
    if a.step in (AttemptStep.switched, AttemptStep.drained):
        admitted = _drain(ctx, a)
        if admitted is None:
            return None
        build = steps.verify(ctx, a)
    elif a.step is not AttemptStep.queued:
        raise Interrupted(_interrupted(ctx, a))
    else:
        build = steps.verify(ctx, a)
        admitted = ctx.store.write(lambda s: _admit(s, ctx, a))
    while admitted is not None:
        _replace(ctx, a, build, *admitted)
        admitted = _drain(ctx, a)
    return None


def _replace(ctx: Context, a: Attempt, build: Build, host: Host, gen: Generation) -> None:
    """One slot: from its admitted successor to the switch."""
    a.successor_id = gen.id
    crashpoint(steps.ADMITTED)
    if a.step is AttemptStep.published:
        crashpoint(RAISED)
        crashpoint(steps.PUBLISHED)
    else:
        _raise_parent(ctx, a, host)
        steps.publish(ctx, a)
    spawned = steps.spawn(ctx, a, host, build, gen)
    # Without a canary settle, "healthy" rides in the switch's commit (one fsync between
    # the answer and the switch); its crash point follows that commit.
    merged = not a.canary
    if merged:
        _probe_and_switch(ctx, a, host, gen)
        crashpoint(steps.HEALTHY)
    else:
        steps.check(ctx, a, host, gen, spawned)
        _alive_and_switch(ctx, a, gen, merged=False)
    crashpoint(steps.SWITCHED)


def _probe_and_switch(ctx: Context, a: Attempt, host: Host, gen: Generation) -> None:
    """Health, then the switch, with the walk of the successor's descendants after the
    switch's commit instead of between the answer and the switch (a walk reads the whole
    process table: 5 ms on a quiet box, over 100 ms on a loaded one). A walk is an
    observation, not a step (workflows/generations/known.py); it still runs before a
    failed successor is reaped, since the reap reads what it recorded."""
    try:
        steps.probe(ctx, host, gen, walk=False)
        _alive_and_switch(ctx, a, gen, merged=True)
    finally:
        note(ctx, {gen.id: ref_of(gen)})


def _alive_and_switch(ctx: Context, a: Attempt, gen: Generation, *, merged: bool) -> None:
    if not ctx.proc.leader_alive(ref_of(gen)):
        raise BuildFailed("successor exited before the switch")
    a.retiring_id = ctx.store.write(lambda s: _switch(s, ctx, a, gen, merged))


def _admit(s: Session, ctx: Context, a: Attempt) -> tuple[Host, Generation] | None:
    """Admission: no other member, no raised limit; the successor is written a member."""
    admitted = steps.admit_in(s, ctx, a)
    if admitted is None:
        return None
    h, fence = admitted
    members = s.execute(select(Member.generation_id).where(Member.host == a.host)).scalars().all()
    if members:
        raise Held(f"waiting for member(s) {members} of {a.host} to be proven gone")
    if h.raised:
        raise Held(f"parent limit of {a.host} is still raised: a restore is pending")
    g = intend(s, ctx, h, a.build_id, fence)
    join_set(s, g.id, a.host, MemberRole.spawning, fence, attempt_id=a.id)
    steps.step_to(s, a, AttemptStep.admitted, fence=fence, successor_id=g.id)
    _raised_in(s, ctx, a, h)
    s.flush()
    return h, g


def _raised_in(s: Session, ctx: Context, a: Attempt, h: Host) -> None:
    if not _can_raise(ctx, h):
        # Nothing to raise: the raise and the publication ride in this commit (one
        # fsync instead of three before the exec); their crash points follow it. (The
        # spawn's intent stays a commit of its own: a crash before it proves that
        # nothing of the build ran, executed=false.)
        steps.step_to(s, a, AttemptStep.raised)
        steps.publish_in(s, a)


def _next_slot(s: Session, ctx: Context, a: Attempt) -> tuple[Host, Generation] | None:
    """In the drain's commit: the successor of the slot after the one just replaced (a
    host of instances), admitted as the first was; None when that was the last slot."""
    h = s.get(Host, a.host)
    done = s.get(Generation, a.successor_id)
    if h is None or done is None or done.slot + 1 >= h.instances:
        return None
    steps.gate(s, ctx, a)
    g = intend(s, ctx, h, a.build_id, a.fence, slot=done.slot + 1)
    join_set(s, g.id, a.host, MemberRole.spawning, a.fence or 0, attempt_id=a.id)
    steps.step_to(s, a, AttemptStep.admitted, successor_id=g.id, retiring_id=None)
    a.successor_id, a.retiring_id = g.id, None
    _raised_in(s, ctx, a, h)
    return h, g


def current_locked(s: Session, host: str, slot: int = 0) -> Generation | None:
    """The host's current generation, its row locked until this step commits. On
    PostgreSQL an exit noticed at the same moment (current -> exited, committed between a
    plain read and the switch's own move) would otherwise make that move a LostRace and
    drop the deploy: locked, the read waits for it and then finds no current generation.
    (SQLite's writers are serialized already: FOR UPDATE is left out there.)"""
    return s.execute(select(Generation).where(
        Generation.host == host, Generation.slot == slot, Generation.state == GenState.current)
        .with_for_update()).scalar_one_or_none()


def _switch(s: Session, ctx: Context, a: Attempt, gen: Generation, merged: bool) -> int | None:
    """The successor becomes current and the old current a retiring member (its id, or
    None when it died mid-deploy: the liveness sweep already made it a retiring member, the
    successor still takes over, there is nothing to drain)."""
    if merged:
        steps.healthy_in(s, ctx, a, gen)
    steps.gate(s, ctx, a)
    old = current_locked(s, a.host, gen.slot)
    old_id = old.id if old is not None else None
    if old is not None:
        mark_retiring(s, old.id, GenState.current, f"replaced by g{gen.id}")
    steps.make_current_in(s, gen)
    if old is not None:
        join_set(s, old.id, a.host, MemberRole.retiring, a.fence or 0, attempt_id=a.id)
    set_build(s, a.host, a.build_id)
    steps.step_to(s, a, AttemptStep.switched, retiring_id=old_id)
    emit(s, "switched", a.host, gen.id, attempt=a.id, retiring=old_id)
    s.flush()
    # The rename happens inside the transaction: if the commit fails, the attempt's end
    # (`relink`), or recovery after a crash, re-points the link at whatever the store
    # says is current.
    if gen.socket:
        ctx.files.point_link(ctx.link_for(a.host), gen.socket)
    return old_id


def _can_raise(ctx: Context, host: Host) -> bool:
    """Whether this deploy raises the parent memory limit (a tier, and a box that can)."""
    return bool(host.memory_tier_mb) and ctx.limits is not None and ctx.limits.available()


def _raise_parent(ctx: Context, a: Attempt, host: Host) -> None:
    """Mark raised before asking (a half-done raise may have changed it); a box without a
    memory controller refuses before writing anything, so nothing is left to restore."""
    can = _can_raise(ctx, host)

    def step(s: Session) -> None:
        steps.gate(s, ctx, a)
        if can:
            s.execute(Host.__table__.update().where(Host.name == a.host).values(raised=True))
        steps.step_to(s, a, AttemptStep.raised)

    ctx.store.write(step)
    if can:
        if not (ctx.limits is not None and host.memory_tier_mb):
            raise BrokenInvariant("expected ctx.limits is not None and host.memory_tier_mb")
        try:
            ctx.limits.set_limit(a.host, 2 * host.memory_tier_mb)
        except OSError as exc:
            raise Stale(f"parent limit raise failed: {exc}") from None
    crashpoint(RAISED)


def _drain(ctx: Context, a: Attempt) -> tuple[Host, Generation] | None:
    """At or after the switch: finish. SIGTERM, the app's drain, SIGKILL, proof, leave;
    a host of instances with a slot still to go: its successor admitted (returned)."""
    if a.retiring_id is None:
        return _nothing_to_drain(ctx, a)
    old, drain = steps.end_retiring(ctx, a, mark_unproven=True)

    def step(s: Session) -> tuple[Host, Generation] | None:
        if s.get(Generation, old.id).state is GenState.retiring:  # type: ignore[union-attr]
            mark_proven(s, old.id, "drained")
        leave_set(s, ctx, a.host, old.id)
        admitted = _next_slot(s, ctx, a)
        if admitted is not None:
            emit(s, "switched_slot", a.host, a.successor_id, attempt=a.id, retired=old.id,
                 drain_seconds=round(drain, 3))
            return admitted
        steps.step_to(s, a, AttemptStep.ended, outcome=Outcome.done, executed=True,
                      drain_seconds=drain, reason="switched and drained", ended_at=utcnow())
        emit(s, "swapped", a.host, a.successor_id, attempt=a.id, mode=a.effective_mode.value,
             retired=old.id, drain_seconds=round(drain, 3))
        attempt_ended(s, a, Outcome.done)
        return None

    admitted = ctx.store.write(step)
    ctx.proc.release(ref_of(old))
    crashpoint(DRAINED)
    run_restores(ctx, a.host)
    return admitted


def _nothing_to_drain(ctx: Context, a: Attempt) -> tuple[Host, Generation] | None:
    """The switch found no current generation (it had died and is a member the sweep reaps):
    done, or the next slot admitted. The successor's own member row left at the switch, so
    if that made the set empty the restore is owed here."""

    def step(s: Session) -> tuple[Host, Generation] | None:
        leave_set(s, ctx, a.host, a.successor_id)  # type: ignore[arg-type]
        admitted = _next_slot(s, ctx, a)
        if admitted is not None:
            return admitted
        steps.step_to(s, a, AttemptStep.ended, outcome=Outcome.done, executed=True,
                      drain_seconds=0.0, reason="switched (the old generation had already exited)",
                      ended_at=utcnow())
        emit(s, "swapped", a.host, a.successor_id, attempt=a.id, mode=a.effective_mode.value,
             retired=None, drain_seconds=0.0)
        attempt_ended(s, a, Outcome.done)
        return None

    admitted = ctx.store.write(step)
    crashpoint(DRAINED)
    run_restores(ctx, a.host)
    return admitted
