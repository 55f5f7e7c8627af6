"""Hold deploys: the current generation is stopped and proven gone first, then the new
build is started (for apps that cannot run twice at once)."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from models.errors import BrokenInvariant
from models.states import AttemptStep, GenState, MemberRole, Mode, Outcome
from models.store import emit, utcnow
from models.tables import Attempt, Build, Generation, Host, Member
from models.transition import move, move_many
from workflows.base.context import Context
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
    """Stop the current generation (proven), then start the new build."""
    build = _resume(ctx, a) if a.step is not AttemptStep.queued else _admit(ctx, a)
    if build is None:
        return
    if a.step in (AttemptStep.admitted, AttemptStep.stopping_old):
        _finish_old(ctx, a)
    host = ctx.store.read(lambda s: s.get(Host, a.host))
    if host is None:
        raise BrokenInvariant("host is missing")
    gen = ctx.store.write(lambda s: _new_successor(s, ctx, a, host))
    a.successor_id = gen.id
    crashpoint(SUCCESSOR)
    spawned = steps.spawn(ctx, a, host, build, gen)
    clean = steps.check(ctx, a, host, gen, spawned)
    proven = clean and end_generation(ctx, gen, drain_until=None) is None
    ctx.store.write(lambda s: _current(s, ctx, a, gen, clean, proven))
    if proven:
        ctx.proc.release(ref_of(gen))
    crashpoint(ONESHOT_DONE if clean else steps.SWITCHED)
    if clean:
        release_owed(ctx, a.host)
    if gen.socket:
        ctx.files.point_link(ctx.link_for(a.host), gen.socket)


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


def _new_successor(s: Session, ctx: Context, a: Attempt, host: Host) -> Generation:
    steps.gate(s, ctx, a)
    g = intend(s, ctx, host, a.build_id, a.fence)
    join_set(s, g.id, a.host, MemberRole.spawning, a.fence or 0, attempt_id=a.id)
    move(s, Attempt, a.id, {"successor_id": g.id},
         f"attempt #{a.id} successor", fence=steps.BY_STEP)
    s.flush()
    return g


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
        old = s.execute(select(Generation).where(Generation.host == a.host,
                                                 Generation.state == GenState.current)).scalar_one_or_none()
        if old is None:  # a one-shot worker with no run in progress: nothing to stop
            steps.step_to(s, a, AttemptStep.stopping_old)
            return
        mark_retiring(s, old.id, GenState.current, "hold swap")
        join_set(s, old.id, a.host, MemberRole.retiring, a.fence or 0, attempt_id=a.id)
        steps.step_to(s, a, AttemptStep.stopping_old, retiring_id=old.id)
        a.retiring_id = old.id
        old_socket = old.socket
        if old_socket:
            ctx.files.remove_link(ctx.link_for(a.host), only_if_target=old_socket)

    ctx.store.write(step)
    crashpoint(OLD_STOPPING)


def _finish_old(ctx: Context, a: Attempt) -> None:
    """The old generation: drain, kill, proof; then the build is published for the start."""
    if a.step is AttemptStep.admitted:
        _stop_old(ctx, a)
    old, drain = steps.end_retiring(ctx, a, mark_unproven=False) if a.retiring_id is not None \
        else (None, 0.0)

    def step(s: Session) -> None:
        if old is not None and s.get(Generation, old.id).state is GenState.retiring:  # type: ignore[union-attr]
            mark_proven(s, old.id, "hold swap")
        if old is not None and s.get(Member, old.id) is not None:
            leave_set(s, ctx, a.host, old.id)
        mark_published(s, a.build_id)
        steps.step_to(s, a, AttemptStep.published, drain_seconds=drain)

    ctx.store.write(step)
    a.drain_seconds = drain
    if old is not None:
        ctx.proc.release(ref_of(old))
    crashpoint(OLD_STOPPED)
