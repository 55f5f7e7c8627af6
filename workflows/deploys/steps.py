"""The steps every deploy attempt shares, overlap or hold: the gate before each step, the
step written on the attempt row before it is taken, the artifact check, the spawn of the
successor and its health check, and ending a retiring generation."""

from __future__ import annotations

from datetime import UTC

from sqlalchemy import select
from sqlalchemy.orm import Session

from models.errors import BrokenInvariant
from models.states import (
    OPEN_WAKE,
    AttemptStep,
    Desired,
    GenState,
    HostKind,
    MemberRole,
    Outcome,
)
from models.store import emit, utcnow
from models.tables import Attempt, Build, Generation, Host, Listener, Member, Wake
from models.transition import Unfenced, move, move_many
from workflows.base.classify import BuildFailed, Cancelled, Stale
from workflows.base.context import Context, Held, Poke
from workflows.base.crash import crashpoint, define
from workflows.base.lookups import newest_revision, open_stop
from workflows.base.queue import wake_host
from workflows.base.waivers import BY_STATE
from workflows.builds.book import attempt_ended
from workflows.builds.staged import mark_published, set_build, staged_problem
from workflows.generations.access import grant_socket
from workflows.generations.create import launch, record
from workflows.generations.ending import end_generation, ref_of
from workflows.generations.known import note
from workflows.generations.listeners import stored
from workflows.generations.readiness import ready_problem
from workflows.leases.lease import acquire, held_fence
from workflows.lifecycle.members import drive_member
from workflows.lifecycle.scale import scaling_down
from workflows.lifecycle.workers import (
    settle_one_shot,
    yield_own_starts,
)

# Moves that carry no lease fence, each with the reason it needs none.
BY_STEP = Unfenced("the attempt's own step guards it; the gate checks the lease before each step")

ADMITTED = define("swap.admitted", "the attempt is admitted (overlap: its successor is a member)")
PUBLISHED = define("swap.published", "the build is written as referenced; nothing spawned")
SPAWNING = define("swap.spawning", "the gate passed and the spawn is written; nothing exec'd yet")
EXECD = define("swap.execd", "the successor is exec'd; its pid is not recorded yet")
SPAWNED = define("swap.spawned", "the successor's pid is recorded; health not checked yet")
HEALTHY = define("swap.healthy", "the successor answered its health check")
SETTLED = define("swap.settled", "the canary settle window passed")
SWITCHED = define("swap.switched", "the successor is current and linked; the old one is retiring")
DRAIN_TERMED = define("swap.drain_termed", "the retiring generation was sent SIGTERM")
DRAIN_KILLED = define("swap.drain_killed", "the retiring generation's containment was sent SIGKILL")


def load(ctx: Context, attempt_id: int) -> Attempt | None:
    return ctx.store.read(lambda s: s.get(Attempt, attempt_id))


def gate(s: Session, ctx: Context, a: Attempt) -> None:
    """Re-checked before every step that acts: the newest attempt, the lease, not stopping."""
    if ctx.shutting_down.is_set():  # the gate refusing: stale, not a build failure
        raise Stale("the agent is shutting down")
    stop = open_stop(s, a.host)
    if stop is not None:
        raise Cancelled(f"host {a.host} is being stopped (stop #{stop})")
    newest = newest_revision(s, a.host)
    if newest is not None and newest > a.revision:
        raise Stale(f"superseded by a newer attempt (revision {newest} > {a.revision})")
    if a.fence is not None and held_fence(s, ctx, a.host) != a.fence:
        raise Stale(f"lease of {a.host} lost (fence {a.fence} is no longer held)")


def step_to(s: Session, a: Attempt, new: AttemptStep, **values: object) -> None:
    move(s, Attempt, {"id": a.id, "outcome": None},
         {"step": new, **values}, f"attempt #{a.id} {a.step.value} -> {new.value}",
         fence=BY_STEP, col="step", frm=a.step)
    a.step = new


def verify(ctx: Context, a: Attempt) -> Build:
    """The bytes first: an artifact that is not the one chosen never reaches admission."""
    build = ctx.store.read(lambda s: s.get(Build, a.build_id))
    if build is None:
        raise BrokenInvariant("build is missing")
    problem = staged_problem(ctx, build.path, a.digest, executable=False)
    if problem is not None:
        raise Stale(problem)
    return build


def admit_in(s: Session, ctx: Context, a: Attempt,
             coalesced: list[int] | None = None) -> tuple[Host, int] | None:
    """In the caller's transaction, the checks every admission makes: the gate, a host with
    nothing current (the attempt ends here: None), and the lease this agent holds (a
    one-shot run, with nothing running, takes it). Returns the host and the fence."""
    h = s.get(Host, a.host)
    if h is None:
        raise BrokenInvariant("h is missing")
    a.fence = held_fence(s, ctx, a.host)
    scaling = scaling_down(s, a.host)
    if scaling is not None:  # not "being stopped": one slot is, and this replaces the rest after
        raise Held(f"waiting for stop #{scaling[0]} of slot {scaling[1]} of {a.host} (a "
                   "scale-down) to end")
    gate(s, ctx, a)
    if asleep(s, ctx, a, h, coalesced):
        return None
    if a.fence is None and h.one_shot:  # nothing runs: the run takes the lease
        a.fence = acquire(s, ctx, a.host)
    if a.fence is None:
        raise Stale(f"this agent does not hold the lease of {a.host}")
    return h, a.fence


def asleep(s: Session, ctx: Context, a: Attempt, h: Host,
            coalesced: list[int] | None = None) -> bool:
    """A host with nothing current: the build is set for its next start (a documented
    choice), and a host that should be up gets a wake. True when the attempt ended here."""
    if s.execute(select(Generation.id).where(Generation.host == a.host,
                                             Generation.state == GenState.current)).first():
        return False
    waking = s.execute(select(Wake.id).where(Wake.host == a.host, Wake.state.in_(OPEN_WAKE))).first()
    # A worker's own restart still waiting out its backoff gives way: this attempt spawns.
    if waking is not None and not yield_own_starts(s, a.host, coalesced):
        raise Held(f"waiting for wake #{waking.id} of {a.host}")
    if h.one_shot:
        return False  # a one-shot worker's attempt runs the job itself (clean_exit recorded)
    set_build(s, a.host, a.build_id)
    reason = "host was not running: build set for its next wake"
    if h.desired is Desired.up:
        wake_host(s, a.host, "deploy")
        reason = "host was down: build set and a wake queued"
    step_to(s, a, AttemptStep.ended, outcome=Outcome.done, executed=False, reason=reason,
            ended_at=utcnow())
    emit(s, "deployed_asleep", a.host, attempt=a.id, reason=reason)
    attempt_ended(s, a, Outcome.done)
    return True


def publish_in(s: Session, a: Attempt) -> None:
    """In the caller's transaction: the build is written as referenced, the step moves."""
    mark_published(s, a.build_id)
    step_to(s, a, AttemptStep.published)


def publish(ctx: Context, a: Attempt) -> None:
    """Publish before exec: the build is referenced in the store before any of it runs."""

    def step(s: Session) -> None:
        gate(s, ctx, a)
        publish_in(s, a)

    ctx.store.write(step)
    crashpoint(PUBLISHED)


def spawn(ctx: Context, a: Attempt, host: Host, build: Build, gen: Generation) -> Generation:
    def intent(s: Session) -> list[Listener]:
        gate(s, ctx, a)
        if s.execute(select(Build.published_at).where(Build.id == a.build_id)).scalar() is None:
            raise Stale("build not published")
        step_to(s, a, AttemptStep.spawning)
        return stored(s, host.name)  # the listeners, read here rather than in a read of their own

    listeners = ctx.store.write(intent)
    crashpoint(SPAWNING)
    spawned = launch(ctx, host, build, gen, listeners)
    crashpoint(EXECD)

    def recorded(s: Session) -> None:
        record(s, gen, spawned, BY_STATE)
        step_to(s, a, AttemptStep.spawned)

    ctx.store.write(recorded)
    gen.pid, gen.create_time, gen.state = spawned.pid, spawned.create_time, GenState.running
    crashpoint(SPAWNED)
    note(ctx, {gen.id: ref_of(gen)})  # what it forked already (mostly nothing yet)
    return gen


def check(ctx: Context, a: Attempt, host: Host, gen: Generation, _spawned: Generation) -> bool:
    """Health, then the optional canary settle: failures here are the build's own.
    True when a one-shot run already exited 0."""
    clean = probe(ctx, host, gen)
    ctx.store.write(lambda s: healthy_in(s, ctx, a, gen))
    crashpoint(HEALTHY)
    if not a.canary or clean:
        return clean
    ref = ref_of(gen)
    deadline = ctx.clock.now() + ctx.settle_seconds
    next_gate = 0.0
    while ctx.clock.now() < deadline:
        if not ctx.proc.leader_alive(ref):
            raise BuildFailed(f"successor exited during the {ctx.settle_seconds:g}s canary settle")
        if ctx.clock.now() >= next_gate:
            ctx.store.read(lambda s: gate(s, ctx, a))
            next_gate = ctx.clock.now() + 0.5
        ctx.clock.sleep(0.05)
    def settled(s: Session) -> None:
        gate(s, ctx, a)
        step_to(s, a, AttemptStep.settled)
    ctx.store.write(settled)
    crashpoint(SETTLED)
    return False


def probe(ctx: Context, host: Host, gen: Generation, *, walk: bool = True) -> bool:
    """The successor's health (a worker: that it lives). Raises BuildFailed for the build's
    own failure; True when a one-shot run already exited 0. `walk` False: the caller walks
    the descendants (readiness.ready_problem)."""
    ref = ref_of(gen)
    clean = False
    if host.kind is HostKind.instance:
        problem = ready_problem(ctx, host, gen, walk=walk)
        if problem is not None:
            raise BuildFailed(problem)
        # before the switch makes it canonical
        problem = grant_socket(ctx, host, gen.socket) if gen.socket else None
        if problem is not None:
            raise Stale(problem)
    elif host.one_shot:
        code = settle_one_shot(ctx, ref)
        if code not in (None, 0):
            raise BuildFailed(f"one-shot run exited with status {code}")
        clean = code == 0
    elif not ctx.proc.leader_alive(ref):
        raise BuildFailed("worker exited right after its start")
    return clean


def healthy_in(s: Session, ctx: Context, a: Attempt, gen: Generation) -> None:
    """In the caller's transaction: the successor is written healthy."""
    gate(s, ctx, a)
    move_many(s, Member, [Member.generation_id == gen.id], {"role": MemberRole.successor},
              f"member g{gen.id} successor", fence=BY_STEP, col="role",
              frm=MemberRole.spawning)
    step_to(s, a, AttemptStep.healthy)


def make_current_in(s: Session, gen: Generation) -> None:
    """In the caller's transaction: the successor is current and no longer a member."""
    move(s, Generation, gen.id,
         {"state": GenState.current, "current_at": utcnow()},
         f"generation g{gen.id} running -> current", fence=BY_STATE, col="state",
         frm=GenState.running)
    s.execute(Member.__table__.delete().where(Member.generation_id == gen.id))


def end_retiring(ctx: Context, a: Attempt, *, mark_unproven: bool) -> tuple[Generation, float]:
    """SIGTERM the attempt's retiring generation, its drain up to the host's drain timeout
    (counted from when it became a member), SIGKILL, proof. Returns it and the drain time;
    raises Poke while it is not proven gone (optionally marking the member unproven)."""
    old = ctx.store.read(lambda s: s.get(Generation, a.retiring_id))
    member = ctx.store.read(lambda s: s.get(Member, a.retiring_id))
    host = ctx.store.read(lambda s: s.get(Host, a.host))
    if old is None or host is None:
        raise BrokenInvariant("old or host is missing")
    started = (member.since if member is not None else utcnow()).replace(tzinfo=UTC).timestamp()
    if old.state is not GenState.proven:
        problem = end_generation(ctx, old, drain_until=started + host.drain_timeout,
                                 points=(DRAIN_TERMED, DRAIN_KILLED))
        if problem is not None:
            if mark_unproven:
                ctx.store.write(lambda s: s.execute(Member.__table__.update().where(
                    Member.generation_id == old.id).values(unproven=True, retried_at=utcnow())))
            raise Poke(problem)
    return old, max(0.0, ctx.clock.now() - started)


def reap_inline(ctx: Context, gen_id: int) -> None:
    """Reap a member now if it goes quickly; the sweep retries it otherwise."""
    try:
        drive_member(ctx, gen_id)
    except Poke:
        pass


def relink(ctx: Context, host: str) -> None:
    """The canonical link follows the store. A switch (or a hold's unlink) moves the link
    inside its transaction; if that commit failed, the link names a generation that is not
    current: point it back at the one that is."""
    sockets = ctx.store.read(lambda s: s.execute(select(Generation.socket).where(
        Generation.host == host, Generation.state == GenState.current)
        .order_by(Generation.slot)).scalars().all())  # instances: any current one's will do
    if sockets and sockets[0] and ctx.files.read_link(ctx.link_for(host)) not in sockets:
        ctx.files.point_link(ctx.link_for(host), sockets[0])
