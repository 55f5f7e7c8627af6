"""Hold deploys: the current generation is stopped and proven gone first, then the new
build is started (for apps that cannot run twice at once)."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC

from sqlalchemy import select
from sqlalchemy.orm import Session

from models.errors import BrokenInvariant
from models.states import AttemptStep, GenState, MemberRole, Mode, Outcome
from models.store import emit, utcnow
from models.tables import Attempt, Build, Generation, Host, Member
from models.transition import move_many
from workflows.base.context import Context, Poke
from workflows.base.crash import define
from workflows.builds.staged import set_build
from workflows.deploys import steps as deploy
from workflows.deploys.steps import Run
from workflows.generations.create import join_set
from workflows.generations.ending import end_generation, mark_proven, mark_retiring, ref_of
from workflows.generations.stopway import stop_way
from workflows.leases.lease import owe_release, release_owed
from workflows.lifecycle.members import leave_set
from workflows.lifecycle.start import Step, Steps, link
from workflows.lifecycle.workers import COALESCED, ONESHOT_DONE, clean_attempt

OLD_STOPPING = define("swap.old_stopping", "hold: the old current is a retiring member, unlinked")
OLD_STOPPED = define("swap.old_stopped", "hold: the old generation is proven gone")
SUCCESSOR = define("swap.successor", "hold: the successor's generation and member are written; nothing spawned")


def run_hold(ctx: Context, a: Attempt) -> None:
    """Stop the current generation (proven), then start the new build. A host of
    instances: every one is stopped and proven first (the sockets stay held, connections
    wait in their backlog), then each slot without a current generation is started and
    made current in turn, the last one in the attempt's end."""
    run, steps = deploy.begin(ctx, a)
    if a.step is AttemptStep.queued:
        admitted = _admit(ctx, run, steps)
        if admitted is None:
            return
        run, steps, build = admitted
    else:
        build = _resume(ctx, run, steps)
    going: Run | None = run
    while going is not None:
        going = _start_one(ctx, going, steps, build)


def _start_one(ctx: Context, run: Run, steps: Steps, build: Build) -> Run | None:
    """The next successor, spawned, checked and made current; None when it was the last
    (the attempt ended)."""
    if steps.row.at in (AttemptStep.admitted, AttemptStep.stopping_old):
        run = _finish_old(ctx, run, steps)
    host = ctx.store.read(lambda s: s.get(Host, run.host))
    if host is None:
        raise BrokenInvariant("host is missing")
    gen, last = steps.decide(lambda s: _new_successor(s, ctx, run, host))
    run = replace(run, successor_id=gen.id)
    gen = deploy.start(ctx, steps, run, host, build, gen)
    clean = deploy.answer(ctx, host, gen, run)
    steps.commit(deploy.healthy(gen))
    if run.canary and not clean:
        deploy.settle(ctx, steps, run, gen)
    if not last and not clean:
        # This slot's successor is current; the attempt goes on to the next slot (back at
        # stopping_old: nothing is left to stop, the build is published).
        steps.commit(Step(AttemptStep.stopping_old, deploy.SWITCHED, lambda s: _current_in(
            s, run, gen), then=lambda: link(ctx, run.host, gen)))
        return run
    proven = clean and end_generation(ctx, gen, drain_until=None) is None
    steps.commit(Step(AttemptStep.switched), Step(
        AttemptStep.ended, ONESHOT_DONE if clean else deploy.SWITCHED,
        lambda s: _current(s, ctx, run, gen, clean, proven),
        {"outcome": Outcome.done, "executed": True, "ended_at": utcnow(),
         "reason": "one-shot run exited 0" if clean else "replaced",
         **({"clean_exit": True} if clean else {})},
        then=(lambda: ctx.proc.release(ref_of(gen))) if proven else None))
    if clean:
        release_owed(ctx, run.host)
    link(ctx, run.host, gen)
    return None


def _current_in(s: Session, run: Run, gen: Generation) -> None:
    deploy.make_current_in(s, gen)
    set_build(s, run.host, run.build_id)
    emit(s, "switched_slot", run.host, gen.id, attempt=run.id, slot=gen.slot)


def _admit(ctx: Context, run: Run, steps: Steps) -> tuple[Run, Steps, Build] | None:
    """A queued attempt: admitted, then the old generation made a retiring member. None when it
    ended at admission (the host was asleep) or gave way to it (a worker's own restart)."""
    build = deploy.verify(ctx, run)

    def admission(s: Session) -> tuple[Run | None, list[Step]]:
        coalesced: list[int] = []  # a worker's own queued restart that gave way to this
        admitted = deploy.admit_in(s, ctx, run, coalesced)
        if isinstance(admitted, Step):
            return None, [admitted, *([Step(None, COALESCED)] if coalesced else [])]
        ran = admitted[1]
        return ran, [Step(AttemptStep.admitted, deploy.ADMITTED, values={"fence": ran.fence})]

    ran = steps.decide(admission, gated=False)  # it gates once it has read the fence
    if ran is None:
        return None
    steps = deploy.gated(ctx, ran, steps.row.at)
    return _stop_old(ctx, ran, steps), steps, build


def _resume(ctx: Context, run: Run, steps: Steps) -> Build:
    """An attempt found mid-way: a successor of an earlier try is ended before another one
    is written (interrupted after the old one was stopped, the attempt goes back to
    stopping_old; written by a try that died before its spawn step, it never ran, but it
    is a member)."""
    back = steps.row.at in (AttemptStep.spawning, AttemptStep.spawned, AttemptStep.healthy,
                            AttemptStep.settled)
    if back or run.successor_id is not None:
        steps.commit(Step(AttemptStep.stopping_old if back else None,
                          write=lambda s: _retire_successor(s, run)), gated=False)
    if run.successor_id is not None:
        deploy.reap_inline(ctx, run.successor_id)
    return deploy.verify(ctx, run)


def _new_successor(s: Session, ctx: Context, run: Run, host: Host
                   ) -> tuple[tuple[Generation, bool], list[Step]]:
    """The successor of the lowest slot with nothing current; True when it is the last."""
    taken = set(s.execute(select(Generation.slot).where(
        Generation.host == run.host, Generation.state == GenState.current)).scalars())
    free = [n for n in range(host.instances) if n not in taken] or [0]
    g = deploy.successor_in(s, ctx, run, host, slot=free[0])
    return (g, len(free) == 1), [Step(None, SUCCESSOR, values={"successor_id": g.id})]


def _current(s: Session, ctx: Context, run: Run, gen: Generation, clean: bool,
             proven: bool) -> None:
    """The successor is current and the attempt done (a one-shot run that exited 0: nothing
    becomes current, and the lease goes back once nothing else needs it)."""
    if clean:
        a = s.get(Attempt, run.id)
        if a is None:
            raise BrokenInvariant(f"attempt #{run.id} is missing")
        clean_attempt(s, ctx, a, gen, proven)
    else:
        deploy.make_current_in(s, gen)
    set_build(s, run.host, run.build_id)
    emit(s, "swapped", run.host, gen.id, attempt=run.id, mode=Mode.hold.value,
         retired=run.retiring_id, drain_seconds=round(run.drain_seconds or 0.0, 3))
    deploy.ended(s, run)
    if clean:
        owe_release(s, ctx, run.host)


def _retire_successor(s: Session, a: Run) -> None:
    """hold: the successor of an interrupted try becomes a retiring member to be reaped."""
    if a.successor_id is None:
        return
    g = s.get(Generation, a.successor_id)
    if g is not None and g.state in (GenState.spawning, GenState.running):
        mark_retiring(s, g.id, g.state, "hold interrupted before it was current")
        move_many(s, Member, [Member.generation_id == g.id],
                  {"role": MemberRole.retiring, "unproven": True}, f"member g{g.id} retiring",
                  fence=deploy.BY_STEP, col="role", frm=tuple(MemberRole))


def _stop_old(ctx: Context, run: Run, steps: Steps) -> Run:
    def stop(s: Session) -> tuple[int | None, list[Step]]:
        olds = list(s.execute(select(Generation).where(
            Generation.host == run.host, Generation.state == GenState.current)
            .order_by(Generation.slot)).scalars())  # instances: every one
        if not olds:  # a one-shot worker with no run in progress: nothing to stop
            return None, [Step(AttemptStep.stopping_old, OLD_STOPPING)]
        for old in olds:
            mark_retiring(s, old.id, GenState.current, "hold swap")
            join_set(s, old.id, run.host, MemberRole.retiring, run.fence or 0, attempt_id=run.id)
        for old in olds:
            if old.socket:
                ctx.files.remove_link(ctx.link_for(run.host), only_if_target=old.socket)
        return olds[0].id, [Step(AttemptStep.stopping_old, OLD_STOPPING,
                                 values={"retiring_id": olds[0].id})]

    retiring = steps.decide(stop)
    return run if retiring is None else replace(run, retiring_id=retiring)


def _finish_old(ctx: Context, run: Run, steps: Steps) -> Run:
    """The old generation: drain, kill, proof; then the build is published for the start."""
    if steps.row.at is AttemptStep.admitted:
        run = _stop_old(ctx, run, steps)
    old, drain = deploy.end_retiring(ctx, run, mark_unproven=False) \
        if run.retiring_id is not None else (None, 0.0)
    gone = [*_end_others(ctx, run), *([old] if old is not None else [])]

    def proven(s: Session) -> None:
        for g in gone:
            if s.get(Generation, g.id).state is GenState.retiring:  # type: ignore[union-attr]
                mark_proven(s, g.id, "hold swap")
            if s.get(Member, g.id) is not None:
                leave_set(s, ctx, run.host, g.id)

    def release() -> None:
        for g in gone:
            ctx.proc.release(ref_of(g))

    steps.commit(Step(None, write=proven), replace(
        deploy.published(run.build_id), point=OLD_STOPPED, values={"drain_seconds": drain},
        then=release), gated=False)
    return replace(run, drain_seconds=drain)


def _end_others(ctx: Context, a: Run) -> list[Generation]:
    """A host of instances: the attempt's other retiring members (every old slot but the
    one it names), each drained from when it became a member, killed and proven."""
    rows = ctx.store.read(lambda s: s.execute(select(Generation, Member.since).join(
        Member, Member.generation_id == Generation.id).where(
        Member.attempt_id == a.id, Member.role == MemberRole.retiring,
        Generation.id != a.retiring_id)).all())
    host = ctx.store.read(lambda s: s.get(Host, a.host)) if rows else None
    for g, since in rows:
        if g.state is GenState.proven or host is None:
            continue
        until = since.replace(tzinfo=UTC).timestamp() + host.drain_timeout
        problem = end_generation(ctx, g, drain_until=until, way=stop_way(host, g))
        if problem is not None:
            raise Poke(problem)
    return [g for g, _ in rows]
