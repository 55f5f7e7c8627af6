"""The steps every deploy attempt shares, overlap or hold: the attempt as a plain record
(`Run`) and the runner of its steps (workflows/lifecycle/start.py) with the gate before
each one, the artifact check, admission, the successor's start (spawn, record, answer),
and ending a retiring generation."""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields, replace
from datetime import UTC

from sqlalchemy import select
from sqlalchemy.orm import Session

from models.errors import BrokenInvariant
from models.states import (
    OPEN_WAKE,
    AttemptStep,
    Desired,
    GenState,
    MemberRole,
    Mode,
    Outcome,
)
from models.store import emit, utcnow
from models.tables import Attempt, Build, Generation, Host, Listener, Member, Wake
from models.transition import Unfenced, move_many
from workflows.base.classify import BuildFailed, Cancelled, Stale
from workflows.base.context import Context, Held, Poke
from workflows.base.crash import define
from workflows.base.lookups import newest_revision, open_stop
from workflows.base.queue import wake_host
from workflows.base.waivers import BY_STATE
from workflows.builds.book import attempt_ended
from workflows.builds.staged import mark_published, set_build, staged_problem
from workflows.generations.create import intend, join_set
from workflows.generations.ending import end_generation, ref_of
from workflows.generations.listeners import stored
from workflows.generations.stopway import stop_way
from workflows.leases.lease import acquire, held_fence
from workflows.lifecycle.members import MEMBER_NOTE, drive_member
from workflows.lifecycle.scale import scaling_down
from workflows.lifecycle.start import Carrier, Start, Step, Steps, check, current_in, record, spawn
from workflows.lifecycle.workers import yield_own_starts

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
DRAIN_TERMED = define("swap.drain_termed", "the retiring generation was sent its host's stop "
                      "signal (SIGTERM unless set) or its stop command was started")
DRAIN_KILLED = define("swap.drain_killed", "the retiring generation's containment was sent SIGKILL")


@dataclass(frozen=True)
class Run:
    """An attempt as this drive knows it: a plain record, replaced (never changed) as its
    steps commit. Its step is its runner's (`Steps.row.at`)."""

    id: int
    host: str
    build_id: int
    digest: str
    revision: int
    canary: bool
    effective_mode: Mode
    fence: int | None
    successor_id: int | None
    retiring_id: int | None
    drain_seconds: float | None


def load(ctx: Context, attempt_id: int) -> Attempt | None:
    return ctx.store.read(lambda s: s.get(Attempt, attempt_id))


def begin(ctx: Context, a: Attempt) -> tuple[Run, Steps]:
    """The attempt as a record, and the runner of its steps from the step it is at."""
    run = Run(**{f.name: getattr(a, f.name) for f in fields(Run)})
    return run, gated(ctx, run, a.step)


def gated(ctx: Context, run: Run, at: enum.Enum) -> Steps:
    """The runner of the attempt's steps, each commit gated for `run` (its fence)."""
    return Steps(ctx, Carrier(Attempt, {"id": run.id, "outcome": None}, "step", at, BY_STEP,
                              gate=lambda s: gate(s, ctx, run), label=f"attempt #{run.id}"))


def gate(s: Session, ctx: Context, a: Run) -> None:
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


def ended(s: Session, run: Run, outcome: Outcome = Outcome.done) -> None:
    """In the commit that ends the attempt: its failure book and rollout (the row read
    again in this commit)."""
    a = s.get(Attempt, run.id)
    if a is None:
        raise BrokenInvariant(f"attempt #{run.id} is missing")
    attempt_ended(s, a, outcome)


def verify(ctx: Context, a: Run) -> Build:
    """The bytes first: an artifact that is not the one chosen never reaches admission."""
    build = ctx.store.read(lambda s: s.get(Build, a.build_id))
    if build is None:
        raise BrokenInvariant("build is missing")
    problem = staged_problem(ctx, build.path, a.digest, executable=False)
    if problem is not None:
        raise Stale(problem)
    return build


def admit_in(s: Session, ctx: Context, a: Run, coalesced: list[int] | None = None
             ) -> tuple[Host, Run] | Step:
    """In the admission's commit, the checks every admission makes: the gate, a host with
    nothing current (the attempt ends here: the Step that ends it), and the lease this
    agent holds (a one-shot run, with nothing running, takes it). Returns the host and the
    attempt with its fence."""
    h = s.get(Host, a.host)
    if h is None:
        raise BrokenInvariant("h is missing")
    a = replace(a, fence=held_fence(s, ctx, a.host))
    scaling = scaling_down(s, a.host)
    if scaling is not None:  # not "being stopped": one slot is, and this replaces the rest after
        raise Held(f"waiting for stop #{scaling[0]} of slot {scaling[1]} of {a.host} (a "
                   "scale-down) to end")
    gate(s, ctx, a)
    asleep = _asleep(s, a, h, coalesced)
    if asleep is not None:
        return asleep
    if a.fence is None and h.one_shot:  # nothing runs: the run takes the lease
        a = replace(a, fence=acquire(s, ctx, a.host))
    if a.fence is None:
        raise Stale(f"this agent does not hold the lease of {a.host}")
    return h, a


def _asleep(s: Session, a: Run, h: Host, coalesced: list[int] | None) -> Step | None:
    """A host with nothing current: the build is set for its next start (a documented
    choice), and a host that should be up gets a wake. The Step that ends the attempt."""
    if s.execute(select(Generation.id).where(Generation.host == a.host,
                                             Generation.state == GenState.current)).first():
        return None
    waking = s.execute(select(Wake.id).where(Wake.host == a.host, Wake.state.in_(OPEN_WAKE))).first()
    # A worker's own restart still waiting out its backoff gives way: this attempt spawns.
    if waking is not None and not yield_own_starts(s, a.host, coalesced):
        raise Held(f"waiting for wake #{waking.id} of {a.host}")
    if h.one_shot:
        return None  # a one-shot worker's attempt runs the job itself (clean_exit recorded)
    set_build(s, a.host, a.build_id)
    reason = "host was not running: build set for its next wake"
    if h.desired is Desired.up:
        wake_host(s, a.host, "deploy")
        reason = "host was down: build set and a wake queued"
    emit(s, "deployed_asleep", a.host, attempt=a.id, reason=reason)
    return Step(AttemptStep.ended, None, lambda s: ended(s, a), {
        "outcome": Outcome.done, "executed": False, "reason": reason, "ended_at": utcnow()})


def successor_in(s: Session, ctx: Context, a: Run, host: Host, slot: int = 0) -> Generation:
    """In the caller's commit: the successor's generation (intent) and its member row."""
    g = intend(s, ctx, host, a.build_id, a.fence, slot=slot)
    join_set(s, g.id, a.host, MemberRole.spawning, a.fence or 0, attempt_id=a.id)
    return g


def published(build_id: int) -> Step:
    """Publish before exec: the build is referenced in the store before any of it runs."""
    return Step(AttemptStep.published, PUBLISHED, lambda s: mark_published(s, build_id))


def start(ctx: Context, steps: Steps, a: Run, host: Host, build: Build,
          gen: Generation) -> Generation:
    """The successor's spawn: its step written (gated, the build published), exec'd, its
    pid recorded; the generation as recorded."""
    def intent(s: Session) -> tuple[list[Listener], list[Step]]:
        if s.execute(select(Build.published_at).where(Build.id == a.build_id)).scalar() is None:
            raise Stale("build not published")
        return stored(s, host.name), [Step(AttemptStep.spawning, SPAWNING)]

    listeners = steps.decide(intent)  # the listeners, read here rather than in a read of their own
    go = Start(host, build, gen, EXECD, Step(AttemptStep.spawned, SPAWNED), listeners)
    running = spawn(ctx, go)
    record(steps, go, running, BY_STATE)
    return running


def answer(ctx: Context, host: Host, gen: Generation, run: Run, *, walk: bool = True) -> bool:
    """The successor's health (a worker: that it lives). Raises BuildFailed for the build's
    own failure; True when a one-shot run already exited 0. The gate is read every half
    second of the wait: a stop or a newer attempt ends it (Cancelled, Stale) at once
    instead of after the health timeout."""
    found = check(ctx, host, gen, walk=walk,
                  watch=lambda: ctx.store.glance(lambda s: gate(s, ctx, run)))
    if found.problem is not None:
        raise (BuildFailed if found.build_fault else Stale)(found.problem)
    return found.clean


def healthy(gen: Generation) -> Step:
    """The successor is written healthy (its member a successor)."""
    return Step(AttemptStep.healthy, HEALTHY, lambda s: move_many(
        s, Member, [Member.generation_id == gen.id], {"role": MemberRole.successor},
        f"member g{gen.id} successor", fence=BY_STEP, col="role", frm=MemberRole.spawning))


def settle(ctx: Context, steps: Steps, a: Run, gen: Generation) -> None:
    """The optional canary settle: the successor must stay alive (the gate re-checked
    every half second), then its step is written."""
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
    steps.commit(Step(AttemptStep.settled, SETTLED))


def make_current_in(s: Session, gen: Generation) -> None:
    """In the caller's transaction: the successor is current and no longer a member."""
    current_in(s, gen, BY_STATE)
    s.execute(Member.__table__.delete().where(Member.generation_id == gen.id))


def end_retiring(ctx: Context, a: Run, *, mark_unproven: bool) -> tuple[Generation, float]:
    """Ask the attempt's retiring generation to stop (its host's stop signal or command),
    its drain up to the host's drain timeout (counted from when it became a member),
    SIGKILL, proof. Returns it and the drain time; raises Poke while it is not proven gone
    (optionally marking the member unproven)."""
    old = ctx.store.read(lambda s: s.get(Generation, a.retiring_id))
    member = ctx.store.read(lambda s: s.get(Member, a.retiring_id))
    host = ctx.store.read(lambda s: s.get(Host, a.host))
    if old is None or host is None:
        raise BrokenInvariant("old or host is missing")
    started = (member.since if member is not None else utcnow()).replace(tzinfo=UTC).timestamp()
    if old.state is not GenState.proven:
        problem = end_generation(ctx, old, drain_until=started + host.drain_timeout,
                                 points=(DRAIN_TERMED, DRAIN_KILLED), way=stop_way(host, old))
        if problem is not None:
            if mark_unproven:
                ctx.store.write(lambda s: move_many(
                    s, Member, [Member.generation_id == old.id],
                    {"unproven": True, "retried_at": utcnow()}, f"member g{old.id} unproven",
                    fence=MEMBER_NOTE))
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
