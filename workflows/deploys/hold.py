"""Hold deploys: the current generation is stopped and proven gone first, then the new
build is started (for apps that cannot run twice at once)."""

from __future__ import annotations

from datetime import UTC

from sqlalchemy import select
from sqlalchemy.orm import Session

from models.errors import BrokenInvariant
from models.states import AttemptStep, GenState, MemberRole, Mode, Outcome
from models.store import emit, utcnow
from models.tables import Attempt, Build, Generation, Host, Member
from models.transition import move, move_many
from workflows.base.context import Context, Poke
from workflows.base.crash import crashpoint, define
from workflows.builds.book import attempt_ended
from workflows.builds.staged import mark_published, set_build
from workflows.deploys import steps
from workflows.generations.create import intend, join_set
from workflows.generations.ending import end_generation, mark_proven, mark_retiring, ref_of
from workflows.leases.lease import owe_release, release_owed
from workflows.lifecycle.members import leave_set
from workflows.lifecycle.workers import COALESCED, ONESHOT_DONE, clean_attempt

OLD_STOPPING = define("swap.old_stopping", "hold: the old current is a retiring member, unlinked")
OLD_STOPPED = define("swap.old_stopped", "hold: the old generation is proven gone")
SUCCESSOR = define("swap.successor", "hold: the successor's generation and member are written; nothing spawned")


def run_hold(ctx: Context, a: Attempt) -> None:
    """Stop the current generation (proven), then start the new build. A host of
    instances: every one is stopped and proven first (the sockets stay held, connections
    wait in their backlog), then each slot without a current generation is started and
    made current in turn, the last one in the attempt's end."""
    build = _resume(ctx, a) if a.step is not AttemptStep.queued else _admit(ctx, a)
    if build is None:
        return
    while not _start_one(ctx, a, build):
        crashpoint(steps.SWITCHED)  # one slot's successor is current; the next one's not written


def _start_one(ctx: Context, a: Attempt, build: Build) -> bool:
    """The next successor, spawned, checked and made current; True when it was the last
    (the attempt ended)."""
    if a.step in (AttemptStep.admitted, AttemptStep.stopping_old):
        _finish_old(ctx, a)
    host = ctx.store.read(lambda s: s.get(Host, a.host))
    if host is None:
        raise BrokenInvariant("host is missing")
    gen, last = ctx.store.write(lambda s: _new_successor(s, ctx, a, host))
    a.successor_id = gen.id
    crashpoint(SUCCESSOR)
    spawned = steps.spawn(ctx, a, host, build, gen)
    clean = steps.check(ctx, a, host, gen, spawned)
    if not last and not clean:
        ctx.store.write(lambda s: _slot_current(s, ctx, a, gen))
        if gen.socket:
            ctx.files.point_link(ctx.link_for(a.host), gen.socket)
        return False
    proven = clean and end_generation(ctx, gen, drain_until=None) is None
    ctx.store.write(lambda s: _current(s, ctx, a, gen, clean, proven))
    if proven:
        ctx.proc.release(ref_of(gen))
    crashpoint(ONESHOT_DONE if clean else steps.SWITCHED)
    if clean:
        release_owed(ctx, a.host)
    if gen.socket:
        ctx.files.point_link(ctx.link_for(a.host), gen.socket)
    return True


def _slot_current(s: Session, ctx: Context, a: Attempt, gen: Generation) -> None:
    """A host of instances: this slot's successor is current, the attempt goes on to the
    next slot (back at stopping_old: nothing is left to stop, the build is published)."""
    steps.gate(s, ctx, a)
    steps.make_current_in(s, gen)
    set_build(s, a.host, a.build_id)
    steps.step_to(s, a, AttemptStep.stopping_old)
    emit(s, "switched_slot", a.host, gen.id, attempt=a.id, slot=gen.slot)


def _admit(ctx: Context, a: Attempt) -> Build | None:
    """A queued attempt: admitted, then the old generation made a retiring member. None when it
    ended at admission (the host was asleep) or gave way to it (a worker's own restart)."""
    build = steps.verify(ctx, a)
    coalesced: list[int] = []  # a worker's own queued restart that gave way to this

    def admit(s: Session) -> bool:
        if steps.admit_in(s, ctx, a, coalesced) is None:
            return False
        steps.step_to(s, a, AttemptStep.admitted, fence=a.fence)
        return True

    if not ctx.store.write(admit):
        if coalesced:
            crashpoint(COALESCED)
        return None
    crashpoint(steps.ADMITTED)
    _stop_old(ctx, a)
    return build


def _resume(ctx: Context, a: Attempt) -> Build:
    """An attempt found mid-way: a successor of an earlier try is ended before another one
    is written."""
    if a.step in (AttemptStep.spawning, AttemptStep.spawned, AttemptStep.healthy,
                  AttemptStep.settled):
        # Interrupted after the old one was stopped: end what was starting, start again.
        def back(s: Session) -> None:
            _retire_successor(s, a)
            steps.step_to(s, a, AttemptStep.stopping_old)

        ctx.store.write(back)
        if a.successor_id is not None:
            steps.reap_inline(ctx, a.successor_id)
    elif a.successor_id is not None:
        # A successor written by a try that died before its spawn step: it never ran,
        # but it is a member; reap it before another one is written.
        ctx.store.write(lambda s: _retire_successor(s, a))
        steps.reap_inline(ctx, a.successor_id)
    return steps.verify(ctx, a)


def _new_successor(s: Session, ctx: Context, a: Attempt, host: Host) -> tuple[Generation, bool]:
    """The successor of the lowest slot with nothing current; True when it is the last."""
    steps.gate(s, ctx, a)
    taken = set(s.execute(select(Generation.slot).where(
        Generation.host == a.host, Generation.state == GenState.current)).scalars())
    free = [n for n in range(host.instances) if n not in taken] or [0]
    g = intend(s, ctx, host, a.build_id, a.fence, slot=free[0])
    join_set(s, g.id, a.host, MemberRole.spawning, a.fence or 0, attempt_id=a.id)
    move(s, Attempt, a.id, {"successor_id": g.id},
         f"attempt #{a.id} successor", fence=steps.BY_STEP)
    s.flush()
    return g, len(free) == 1


def _current(s: Session, ctx: Context, a: Attempt, gen: Generation, clean: bool,
             proven: bool) -> None:
    """The successor is current and the attempt done (a one-shot run that exited 0: nothing
    becomes current, and the lease goes back once nothing else needs it)."""
    steps.gate(s, ctx, a)
    if clean:
        clean_attempt(s, ctx, a, gen, proven)
    else:
        steps.make_current_in(s, gen)
    set_build(s, a.host, a.build_id)
    steps.step_to(s, a, AttemptStep.switched)
    steps.step_to(s, a, AttemptStep.ended, outcome=Outcome.done, executed=True,
                  reason="one-shot run exited 0" if clean else "replaced", ended_at=utcnow(),
                  **({"clean_exit": True} if clean else {}))
    emit(s, "swapped", a.host, gen.id, attempt=a.id, mode=Mode.hold.value,
         retired=a.retiring_id, drain_seconds=round(a.drain_seconds or 0.0, 3))
    attempt_ended(s, a, Outcome.done)
    if clean:
        owe_release(s, ctx, a.host)


def _retire_successor(s: Session, a: Attempt) -> None:
    """hold: the successor of an interrupted try becomes a retiring member to be reaped."""
    if a.successor_id is None:
        return
    g = s.get(Generation, a.successor_id)
    if g is not None and g.state in (GenState.spawning, GenState.running):
        mark_retiring(s, g.id, g.state, "hold interrupted before it was current")
        move_many(s, Member, [Member.generation_id == g.id],
                  {"role": MemberRole.retiring, "unproven": True}, f"member g{g.id} retiring",
                  fence=steps.BY_STEP, col="role", frm=tuple(MemberRole))


def _stop_old(ctx: Context, a: Attempt) -> None:
    def step(s: Session) -> None:
        steps.gate(s, ctx, a)
        olds = list(s.execute(select(Generation).where(
            Generation.host == a.host, Generation.state == GenState.current)
            .order_by(Generation.slot)).scalars())  # instances: every one
        if not olds:  # a one-shot worker with no run in progress: nothing to stop
            steps.step_to(s, a, AttemptStep.stopping_old)
            return
        for old in olds:
            mark_retiring(s, old.id, GenState.current, "hold swap")
            join_set(s, old.id, a.host, MemberRole.retiring, a.fence or 0, attempt_id=a.id)
        steps.step_to(s, a, AttemptStep.stopping_old, retiring_id=olds[0].id)
        a.retiring_id = olds[0].id
        for old in olds:
            if old.socket:
                ctx.files.remove_link(ctx.link_for(a.host), only_if_target=old.socket)

    ctx.store.write(step)
    crashpoint(OLD_STOPPING)


def _finish_old(ctx: Context, a: Attempt) -> None:
    """The old generation: drain, kill, proof; then the build is published for the start."""
    if a.step is AttemptStep.admitted:
        _stop_old(ctx, a)
    old, drain = steps.end_retiring(ctx, a, mark_unproven=False) if a.retiring_id is not None \
        else (None, 0.0)
    others = _end_others(ctx, a)

    def step(s: Session) -> None:
        for g in [*others, *([old] if old is not None else [])]:
            if s.get(Generation, g.id).state is GenState.retiring:  # type: ignore[union-attr]
                mark_proven(s, g.id, "hold swap")
            if s.get(Member, g.id) is not None:
                leave_set(s, ctx, a.host, g.id)
        mark_published(s, a.build_id)
        steps.step_to(s, a, AttemptStep.published, drain_seconds=drain)

    ctx.store.write(step)
    a.drain_seconds = drain
    for g in [*others, *([old] if old is not None else [])]:
        ctx.proc.release(ref_of(g))
    crashpoint(OLD_STOPPED)


def _end_others(ctx: Context, a: Attempt) -> list[Generation]:
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
        problem = end_generation(ctx, g, drain_until=until)
        if problem is not None:
            raise Poke(problem)
    return [g for g, _ in rows]
