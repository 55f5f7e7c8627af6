"""Overlap deploys: the successor starts beside the current generation, answers its health
check, then one transaction switches them; the old one drains and is proven gone."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from models.errors import BrokenInvariant
from models.states import AttemptStep, GenState, MemberRole, Outcome
from models.store import emit, utcnow
from models.tables import Attempt, Build, Generation, Host, Member
from models.transition import move_many
from workflows.base.classify import BuildFailed, Interrupted, Stale
from workflows.base.context import Context, Held
from workflows.base.crash import define
from workflows.builds.staged import set_build
from workflows.deploys import steps as deploy
from workflows.deploys.steps import Run
from workflows.generations.create import join_set
from workflows.generations.ending import mark_proven, mark_retiring, ref_of
from workflows.generations.known import note
from workflows.lifecycle.members import leave_set, run_restores
from workflows.lifecycle.start import Step, Steps, link

RAISED = define("swap.raised", "the parent limit is raised (or there is none); nothing spawned")
DRAINED = define("swap.drained", "the retiring generation is proven and left the set; done")

Slot = tuple[Run, Steps, Host, Generation]  # an admitted successor, and its attempt's runner


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
    run, steps = deploy.begin(ctx, a)
    if a.step in (AttemptStep.switched, AttemptStep.drained):
        slot = _drain(ctx, run, steps)
        build = deploy.verify(ctx, run) if slot is not None else None
    elif a.step is not AttemptStep.queued:
        raise Interrupted(_interrupted(ctx, a))
    else:
        build = deploy.verify(ctx, run)
        slot = _admit(ctx, run, steps)
    while slot is not None and build is not None:
        slot = _drain(ctx, *_replace(ctx, build, *slot))


def _admit(ctx: Context, run: Run, steps: Steps) -> Slot | None:
    """Admission: no other member, no raised limit; the successor is written a member."""
    def admission(s: Session) -> tuple[Slot | None, list[Step]]:
        admitted = deploy.admit_in(s, ctx, run)
        if isinstance(admitted, Step):
            return None, [admitted]
        h, ran = admitted
        members = s.execute(select(Member.generation_id).where(Member.host == run.host)).scalars().all()
        if members:
            raise Held(f"waiting for member(s) {members} of {run.host} to be proven gone")
        if h.raised:
            raise Held(f"parent limit of {run.host} is still raised: a restore is pending")
        return _admitted(s, ctx, ran, steps, h, 0, fence=ran.fence)

    slot = steps.decide(admission, gated=False)  # it gates once it has read the fence
    if slot is None:
        return None
    ran, _, h, g = slot
    return ran, deploy.gated(ctx, ran, steps.row.at), h, g


def _admitted(s: Session, ctx: Context, run: Run, steps: Steps, h: Host, slot: int,
              **values: Any) -> tuple[Slot, list[Step]]:
    """The successor of `slot` is written (its generation, a member) and the attempt
    admitted. Nothing to raise: the raise and the publication ride in this commit (one
    fsync instead of three before the exec); their crash points follow it. (The spawn's
    intent stays a commit of its own: a crash before it proves that nothing of the build
    ran, executed=false.)"""
    g = deploy.successor_in(s, ctx, run, h, slot=slot)
    ran = replace(run, successor_id=g.id, **values)
    taken = [Step(AttemptStep.admitted, deploy.ADMITTED, values={"successor_id": g.id, **values})]
    if not _can_raise(ctx, h):
        taken += [Step(AttemptStep.raised, RAISED), deploy.published(run.build_id)]
    return (ran, steps, h, g), taken


def _replace(ctx: Context, build: Build, run: Run, steps: Steps, host: Host,
             gen: Generation) -> tuple[Run, Steps]:
    """One slot: from its admitted successor to the switch."""
    if steps.row.at is not AttemptStep.published:
        steps.commit(_raise_parent(ctx, run, host))
        steps.commit(deploy.published(run.build_id))
    gen = deploy.start(ctx, steps, run, host, build, gen)
    if run.canary:
        clean = deploy.answer(ctx, host, gen, run)
        steps.commit(deploy.healthy(gen))
        if not clean:
            deploy.settle(ctx, steps, run, gen)
        _alive(ctx, gen)
        return replace(run, retiring_id=steps.decide(_switch(ctx, run, gen))), steps
    # Without a canary settle, "healthy" rides in the switch's commit (one fsync between
    # the answer and the switch); its crash point follows that commit. So does the walk of
    # the successor's descendants, instead of standing between the answer and the switch
    # (a walk reads the whole process table: 5 ms on a quiet box, over 100 ms on a loaded
    # one); it still runs before a failed successor is reaped, since the reap reads what
    # it recorded.
    try:
        deploy.answer(ctx, host, gen, run, walk=False)
        _alive(ctx, gen)
        switch = _switch(ctx, run, gen, deploy.healthy(gen))
        retiring, taken = ctx.store.write(lambda s: steps.decide_in(s, switch))
    finally:
        note(ctx, {gen.id: ref_of(gen)})
    steps.taken(*taken)
    return replace(run, retiring_id=retiring), steps


def _alive(ctx: Context, gen: Generation) -> None:
    if not ctx.proc.leader_alive(ref_of(gen)):
        raise BuildFailed("successor exited before the switch")


def current_locked(s: Session, host: str, slot: int = 0) -> Generation | None:
    """The host's current generation, its row locked until this step commits. On
    PostgreSQL an exit noticed at the same moment (current -> exited, committed between a
    plain read and the switch's own move) would otherwise make that move a LostRace and
    drop the deploy: locked, the read waits for it and then finds no current generation.
    (SQLite's writers are serialized already: FOR UPDATE is left out there.)"""
    return s.execute(select(Generation).where(
        Generation.host == host, Generation.slot == slot, Generation.state == GenState.current)
        .with_for_update()).scalar_one_or_none()


def _switch(ctx: Context, run: Run, gen: Generation, *before: Step
            ) -> Callable[[Session], tuple[int | None, list[Step]]]:
    """The successor becomes current and the old current a retiring member (its id, or
    None when it died mid-deploy: the liveness sweep already made it a retiring member, the
    successor still takes over, there is nothing to drain)."""
    def switch(s: Session) -> tuple[int | None, list[Step]]:
        old = current_locked(s, run.host, gen.slot)
        old_id = old.id if old is not None else None

        def write(s: Session) -> None:
            if old_id is not None:
                mark_retiring(s, old_id, GenState.current, f"replaced by g{gen.id}")
            deploy.make_current_in(s, gen)
            if old_id is not None:
                join_set(s, old_id, run.host, MemberRole.retiring, run.fence or 0,
                         attempt_id=run.id)
            set_build(s, run.host, run.build_id)
            emit(s, "switched", run.host, gen.id, attempt=run.id, retiring=old_id)
            s.flush()
            # The rename happens inside the transaction: if the commit fails, the attempt's
            # end (`relink`), or recovery after a crash, re-points the link at whatever the
            # store says is current.
            link(ctx, run.host, gen)

        return old_id, [*before, Step(AttemptStep.switched, deploy.SWITCHED, write,
                                      {"retiring_id": old_id})]

    return switch


def _can_raise(ctx: Context, host: Host) -> bool:
    """Whether this deploy raises the parent memory limit (a tier, and a box that can)."""
    return bool(host.memory_tier_mb) and ctx.limits is not None and ctx.limits.available()


def _raise_parent(ctx: Context, run: Run, host: Host) -> Step:
    """Mark raised before asking (a half-done raise may have changed it); a box without a
    memory controller refuses before writing anything, so nothing is left to restore."""
    if not _can_raise(ctx, host):
        return Step(AttemptStep.raised, RAISED)

    def ask() -> None:
        if not (ctx.limits is not None and host.memory_tier_mb):
            raise BrokenInvariant("expected ctx.limits is not None and host.memory_tier_mb")
        try:
            ctx.limits.set_limit(run.host, 2 * host.memory_tier_mb)
        except OSError as exc:
            raise Stale(f"parent limit raise failed: {exc}") from None

    return Step(AttemptStep.raised, RAISED, lambda s: move_many(
        s, Host, [Host.name == run.host], {"raised": True}, f"parent limit of {run.host} raised",
        fence=deploy.BY_STEP), then=ask)


def _drain(ctx: Context, run: Run, steps: Steps) -> Slot | None:
    """At or after the switch: finish. The stop signal, the app's drain, SIGKILL, proof, leave;
    a host of instances with a slot still to go: its successor admitted (returned). No
    gate: nothing refuses the end of a switched attempt."""
    if run.retiring_id is None:  # it had died: a member the sweep reaps
        slot = steps.decide(lambda s: _after(s, ctx, run, steps, None, 0.0), gated=False)
    else:
        old, drain = deploy.end_retiring(ctx, run, mark_unproven=True)

        def proven(s: Session) -> tuple[Slot | None, list[Step]]:
            if s.get(Generation, old.id).state is GenState.retiring:  # type: ignore[union-attr]
                mark_proven(s, old.id, "drained")
            return _after(s, ctx, run, steps, old.id, drain)

        slot = steps.decide(proven, gated=False)
        ctx.proc.release(ref_of(old))
    run_restores(ctx, run.host)
    return slot


def _after(s: Session, ctx: Context, run: Run, steps: Steps, old_id: int | None,
           drain: float) -> tuple[Slot | None, list[Step]]:
    """In the drain's commit: the old generation (or, none, the successor's own member
    row) leaves the set; then the successor of the next slot (a host of instances) is
    admitted as the first was, or the attempt ends."""
    leave_set(s, ctx, run.host, old_id if old_id is not None else run.successor_id)  # type: ignore[arg-type]
    drained = Step(None, DRAINED)
    h, done = s.get(Host, run.host), s.get(Generation, run.successor_id)
    if h is not None and done is not None and done.slot + 1 < h.instances:
        deploy.gate(s, ctx, run)
        if old_id is not None:
            emit(s, "switched_slot", run.host, run.successor_id, attempt=run.id, retired=old_id,
                 drain_seconds=round(drain, 3))
        slot, taken = _admitted(s, ctx, run, steps, h, done.slot + 1, retiring_id=None)
        return slot, [drained, *taken]
    why = "switched and drained" if old_id is not None else \
        "switched (the old generation had already exited)"
    emit(s, "swapped", run.host, run.successor_id, attempt=run.id, mode=run.effective_mode.value,
         retired=old_id, drain_seconds=round(drain, 3))
    return None, [drained, Step(AttemptStep.ended, None, lambda s: deploy.ended(s, run), {
        "outcome": Outcome.done, "executed": True, "drain_seconds": drain, "reason": why,
        "ended_at": utcnow()})]
