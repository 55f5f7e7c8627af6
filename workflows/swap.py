"""Deploy attempts: an overlap swap (successor beside the current, then an atomic switch)
or a hold swap (stop the current, then start the new build). Every step is written on the
attempt row before it is taken; a driver that finds an attempt mid-way (the agent died)
abandons it before the switch and finishes it at or after the switch (DESIGN §4-5)."""

from __future__ import annotations

import json
import os
import uuid as uuidlib
from datetime import UTC

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from models.errors import BadInput, NotFound
from models.states import (
    OPEN_STOP,
    OPEN_WAKE,
    AttemptStep,
    Cause,
    Desired,
    GenState,
    HostKind,
    MemberRole,
    Mode,
    Outcome,
    WakeState,
)
from models.store import emit, utcnow
from models.tables import Attempt, Build, Generation, Host, Member, Stop, Wake
from models.transition import Unfenced, move, move_many
from workflows.access import grant_socket, prepare_socket_dir
from workflows.classify import BuildFailed, Cancelled, Stale, StepEnd, classify
from workflows.context import Context, Poke, Result
from workflows.crash import crashpoint, define
from workflows.ending import end_generation, mark_proven, mark_retiring, ref_of
from workflows.lease import acquire, held_fence, owe_release, release_owed
from workflows.members import drive_member, leave_set, run_restores
from workflows.ports import SpawnError, SpawnSpec
from workflows.workers import (
    COALESCED,
    ONESHOT_DONE,
    clean_attempt,
    settle_one_shot,
    yield_own_starts,
)

# Moves that carry no lease fence, each with the reason it needs none.
BY_STEP = Unfenced("the attempt's own step guards it; the gate checks the lease before each step")
BY_STATE = Unfenced("the attempt's own generation, guarded by its state; the gate checked the lease")

ADMITTED = define("swap.admitted", "the attempt is admitted (overlap: its successor is a member)")
RAISED = define("swap.raised", "the parent limit is raised (or there is none); nothing spawned")
PUBLISHED = define("swap.published", "the build is written as referenced; nothing spawned")
SPAWNING = define("swap.spawning", "the gate passed and the spawn is written; nothing exec'd yet")
EXECD = define("swap.execd", "the successor is exec'd; its pid is not recorded yet")
SPAWNED = define("swap.spawned", "the successor's pid is recorded; health not checked yet")
HEALTHY = define("swap.healthy", "the successor answered its health check")
SETTLED = define("swap.settled", "the canary settle window passed")
SWITCHED = define("swap.switched", "the successor is current and linked; the old one is retiring")
DRAIN_TERMED = define("swap.drain_termed", "the retiring generation was sent SIGTERM")
DRAIN_KILLED = define("swap.drain_killed", "the retiring generation's containment was sent SIGKILL")
DRAINED = define("swap.drained", "the retiring generation is proven and left the set; done")
ENDED = define("swap.ended", "an attempt that did not switch is ended; its successor not reaped yet")
OLD_STOPPING = define("swap.old_stopping", "hold: the old current is a retiring member, unlinked")
OLD_STOPPED = define("swap.old_stopped", "hold: the old generation is proven gone")
SUCCESSOR = define("swap.successor", "hold: the successor's generation and member are written; nothing spawned")

# Steps from which an attempt is finished, not abandoned, when a step fails unexpectedly.
_FINISH_OVERLAP = {AttemptStep.switched, AttemptStep.drained}
_FINISH_HOLD = {AttemptStep.stopping_old, AttemptStep.published, AttemptStep.spawning,
                AttemptStep.spawned, AttemptStep.healthy, AttemptStep.settled, AttemptStep.switched}

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
    a = s.execute(select(Attempt).where(Attempt.host == host, Attempt.outcome.in_(
        (Outcome.failed, Outcome.down))).order_by(Attempt.id.desc()).limit(1)).scalar_one_or_none()
    if a is None:
        raise BadInput(f"host {host} has no failed deploy to retry", "deploy a build with `vigil deploy`")
    b = s.get(Build, a.build_id)
    assert b is not None
    return b, a


def drive_attempt(ctx: Context, attempt_id: int) -> Result:
    a = _load(ctx, attempt_id)
    if a is None or a.outcome is not None:
        return Result.gone
    try:
        if a.effective_mode is Mode.overlap:
            _overlap(ctx, a)
        else:
            _hold(ctx, a)
    except (Stale, Cancelled, BuildFailed, SpawnError) as exc:
        _end(ctx, attempt_id, exc)
    except Poke:
        raise
    except Exception as exc:  # a lost race or a store error mid-step: never the build's fault
        why = f"step {a.step.value} failed: {type(exc).__name__}: {exc}"
        stored = _load(ctx, attempt_id)
        if stored is not None and stored.outcome is None and stored.step in (
                _FINISH_OVERLAP if stored.effective_mode is Mode.overlap else _FINISH_HOLD):
            # Past the switch (overlap) or past stopping the old one (hold): finish, never
            # abandon; the sweep resumes from the last written step, as recovery does.
            raise Poke(why) from None
        _end(ctx, attempt_id, Stale(why))
    return Result.progress


def _load(ctx: Context, attempt_id: int) -> Attempt | None:
    return ctx.store.read(lambda s: s.get(Attempt, attempt_id))


# -- the gate --------------------------------------------------------------------------


def gate(s: Session, ctx: Context, a: Attempt) -> None:
    """Re-checked before every step that acts: the newest attempt, the lease, not stopping."""
    if ctx.shutting_down.is_set():  # the gate refusing (DESIGN §4 rule 7): stale
        raise Stale("the agent is shutting down")
    stop = s.execute(select(Stop.id).where(Stop.host == a.host, Stop.state.in_(OPEN_STOP))).first()
    if stop is not None:
        raise Cancelled(f"host {a.host} is being stopped (stop #{stop.id})")
    newest = s.execute(select(func.max(Attempt.revision)).where(Attempt.host == a.host)).scalar()
    if newest is not None and newest > a.revision:
        raise Stale(f"superseded by a newer attempt (revision {newest} > {a.revision})")
    if a.fence is not None and held_fence(s, ctx, a.host) != a.fence:
        raise Stale(f"lease of {a.host} lost (fence {a.fence} is no longer held)")


def _step(s: Session, a: Attempt, new: AttemptStep, **values: object) -> None:
    move(s, Attempt, [Attempt.id == a.id, Attempt.outcome.is_(None)],
         {"step": new, **values}, f"attempt #{a.id} {a.step.value} -> {new.value}",
         fence=BY_STEP, col="step", frm=a.step)
    a.step = new


def _verify(ctx: Context, a: Attempt) -> Build:
    """The bytes first: an artifact that is not the one chosen never reaches admission."""
    build = ctx.store.read(lambda s: s.get(Build, a.build_id))
    assert build is not None
    root = os.path.realpath(ctx.state_dir / "builds") + os.sep
    if not os.path.realpath(build.path).startswith(root):
        raise Stale(f"build {build.path} is outside the staging root {root}")
    try:
        digest = ctx.files.digest(build.path)
    except OSError as exc:
        raise Stale(f"staged build {build.path} unreadable: {exc.strerror}") from None
    if digest != a.digest:
        raise Stale(f"staged build {build.path} does not match its digest "
                    f"({digest[:12]} != {a.digest[:12]}); deploy the build again")
    return build


def _asleep(s: Session, ctx: Context, a: Attempt, h: Host,
            coalesced: list[int] | None = None) -> bool:
    """A host with nothing current: the build is set for its next start (a documented
    choice), and a host that should be up gets a wake. True when the attempt ended here."""
    if s.execute(select(Generation.id).where(Generation.host == a.host,
                                             Generation.state == GenState.current)).first():
        return False
    waking = s.execute(select(Wake.id).where(Wake.host == a.host, Wake.state.in_(OPEN_WAKE))).first()
    # A worker's own restart still waiting out its backoff gives way: this attempt spawns.
    if waking is not None and not yield_own_starts(s, a.host, coalesced):
        raise Poke(f"waiting for wake #{waking.id} of {a.host}")
    if h.one_shot:
        return False  # a one-shot worker's attempt runs the job itself (clean_exit recorded)
    s.execute(Host.__table__.update().where(Host.name == a.host).values(build_id=a.build_id))
    reason = "host was not running: build set for its next wake"
    if h.desired is Desired.up:
        now = utcnow()
        s.add(Wake(host=a.host, state=WakeState.queued, cause="deploy", since=now,
                   next_attempt_at=now, created_at=now))
        reason = "host was down: build set and a wake queued"
    _step(s, a, AttemptStep.ended, outcome=Outcome.done, executed=False, reason=reason,
          ended_at=utcnow())
    emit(s, "deployed_asleep", a.host, attempt=a.id, reason=reason)
    return True


# -- overlap ---------------------------------------------------------------------------


def _overlap(ctx: Context, a: Attempt) -> None:
    if a.step in (AttemptStep.switched, AttemptStep.drained):
        return _drain(ctx, a)
    if a.step is not AttemptStep.queued:
        raise Stale(f"interrupted at step {a.step.value}, before the switch (found mid-way by a "
                    "new driver: the agent restarted)")
    build = _verify(ctx, a)
    gen_uuid = str(uuidlib.uuid4())
    cgroup = ctx.proc.containment_for(gen_uuid)

    def admit(s: Session) -> tuple[Host, Generation] | None:
        h = s.get(Host, a.host)
        assert h is not None
        a.fence = held_fence(s, ctx, a.host)
        gate(s, ctx, a)
        if _asleep(s, ctx, a, h):
            return None
        if a.fence is None:
            raise Stale(f"this agent does not hold the lease of {a.host}")
        members = s.execute(select(Member.generation_id).where(Member.host == a.host)).scalars().all()
        if members:
            raise Poke(f"waiting for member(s) {members} of {a.host} to be proven gone")
        if h.raised:
            raise Poke(f"parent limit of {a.host} is still raised: a restore is pending")
        g = Generation(uuid=gen_uuid, host=a.host, build_id=a.build_id, state=GenState.spawning,
                       fence=a.fence, cgroup=cgroup, agent_id=ctx.agent_id, created_at=utcnow())
        s.add(g)
        s.flush()
        g.socket = ctx.socket_for(a.host, g.id) if h.kind is HostKind.instance else None
        now = utcnow()
        s.add(Member(generation_id=g.id, host=a.host, role=MemberRole.spawning, attempt_id=a.id,
                     fence=a.fence, since=now, next_attempt_at=now))
        _step(s, a, AttemptStep.admitted, fence=a.fence, successor_id=g.id)
        s.flush()
        return h, g

    admitted = ctx.store.write(admit)
    if admitted is None:
        return None
    host, gen = admitted
    a.successor_id = gen.id
    crashpoint(ADMITTED)
    _raise_parent(ctx, a, host)
    _publish(ctx, a)
    spawned = _spawn(ctx, a, host, build, gen)
    _check(ctx, a, host, gen, spawned)

    old_id = None

    def switch(s: Session) -> None:
        nonlocal old_id
        gate(s, ctx, a)
        # None when the old current died mid-deploy (the liveness sweep already made it a
        # retiring member): the successor still takes over, there is nothing to drain.
        old = s.execute(select(Generation).where(Generation.host == a.host,
                                                 Generation.state == GenState.current)).scalar_one_or_none()
        old_id = old.id if old is not None else None
        if old is not None:
            mark_retiring(s, old.id, GenState.current, f"replaced by g{gen.id}")
        move(s, Generation, [Generation.id == gen.id],
             {"state": GenState.current, "current_at": utcnow()},
             f"generation g{gen.id} running -> current", fence=BY_STATE, col="state",
             frm=GenState.running)
        s.execute(Member.__table__.delete().where(Member.generation_id == gen.id))
        now = utcnow()
        if old is not None:
            s.add(Member(generation_id=old.id, host=a.host, role=MemberRole.retiring,
                         attempt_id=a.id, fence=a.fence, since=now, next_attempt_at=now))
        s.execute(Host.__table__.update().where(Host.name == a.host).values(build_id=a.build_id))
        _step(s, a, AttemptStep.switched, retiring_id=old_id)
        emit(s, "switched", a.host, gen.id, attempt=a.id, retiring=old_id)
        s.flush()
        # The rename happens inside the transaction: if the commit fails, the attempt's end
        # (`_relink`), or recovery after a crash, re-points the link at whatever the store
        # says is current.
        if gen.socket:
            ctx.files.point_link(ctx.link_for(a.host), gen.socket)

    if not ctx.proc.leader_alive(ref_of(gen)):
        raise BuildFailed("successor exited before the switch")
    ctx.store.write(switch)
    a.retiring_id = old_id
    crashpoint(SWITCHED)
    _drain(ctx, a)
    return None


def _raise_parent(ctx: Context, a: Attempt, host: Host) -> None:
    """Mark raised before asking (a half-done raise may have changed it); a box without a
    memory controller refuses before writing anything, so nothing is left to restore."""
    can = bool(host.memory_tier_mb) and ctx.limits is not None and ctx.limits.available()

    def step(s: Session) -> None:
        gate(s, ctx, a)
        if can:
            s.execute(Host.__table__.update().where(Host.name == a.host).values(raised=True))
        _step(s, a, AttemptStep.raised)

    ctx.store.write(step)
    if can:
        assert ctx.limits is not None and host.memory_tier_mb
        try:
            ctx.limits.set_limit(a.host, 2 * host.memory_tier_mb)
        except OSError as exc:
            raise Stale(f"parent limit raise failed: {exc}") from None
    crashpoint(RAISED)


def _publish(ctx: Context, a: Attempt) -> None:
    """Publish before exec: the build is referenced in the store before any of it runs."""

    def step(s: Session) -> None:
        gate(s, ctx, a)
        s.execute(Build.__table__.update().where(Build.id == a.build_id,
                                                 Build.published_at.is_(None))
                  .values(published_at=utcnow()))
        _step(s, a, AttemptStep.published)

    ctx.store.write(step)
    crashpoint(PUBLISHED)


def _spawn(ctx: Context, a: Attempt, host: Host, build: Build, gen: Generation) -> Generation:
    def intent(s: Session) -> None:
        gate(s, ctx, a)
        if s.execute(select(Build.published_at).where(Build.id == a.build_id)).scalar() is None:
            raise Stale("build not published")
        _step(s, a, AttemptStep.spawning)

    ctx.store.write(intent)
    crashpoint(SPAWNING)
    os.makedirs(os.path.dirname(ctx.log_for(a.host)), exist_ok=True)
    if gen.socket:
        prepare_socket_dir(ctx, host, gen.socket)
    spec = SpawnSpec(generation_uuid=gen.uuid, host=a.host, argv=[build.path, *json.loads(host.args)],
                     env={**json.loads(host.env), "VIGIL_HOME": str(ctx.state_dir)}, cwd=host.cwd,
                     socket_path=gen.socket, log_path=ctx.log_for(a.host), cgroup=gen.cgroup)
    spawned = ctx.proc.spawn(spec)
    crashpoint(EXECD)

    def recorded(s: Session) -> None:
        move(s, Generation, [Generation.id == gen.id],
             {"state": GenState.running, "pid": spawned.pid,
              "create_time": spawned.create_time},
             f"generation g{gen.id} spawning -> running", fence=BY_STATE, col="state",
             frm=GenState.spawning)
        _step(s, a, AttemptStep.spawned)

    ctx.store.write(recorded)
    gen.pid, gen.create_time, gen.state = spawned.pid, spawned.create_time, GenState.running
    crashpoint(SPAWNED)
    return gen


def _check(ctx: Context, a: Attempt, host: Host, gen: Generation, _spawned: Generation) -> bool:
    """Health, then the optional canary settle: failures here are the build's own.
    True when a one-shot run already exited 0."""
    ref = ref_of(gen)
    clean = False
    if gen.socket:
        problem = ctx.health.check(gen.socket, host.health_timeout,
                                   alive=lambda: ctx.proc.leader_alive(ref))
        if problem is not None:
            raise BuildFailed(problem)
        problem = grant_socket(ctx, host, gen.socket)  # before the switch makes it canonical
        if problem is not None:
            raise Stale(problem)
    elif host.one_shot:
        code = settle_one_shot(ctx, ref)
        if code not in (None, 0):
            raise BuildFailed(f"one-shot run exited with status {code}")
        clean = code == 0
    elif not ctx.proc.leader_alive(ref):
        raise BuildFailed("worker exited right after its start")

    def healthy(s: Session) -> None:
        gate(s, ctx, a)
        move_many(s, Member, [Member.generation_id == gen.id], {"role": MemberRole.successor},
                  f"member g{gen.id} successor", fence=BY_STEP, col="role",
                  frm=MemberRole.spawning)
        _step(s, a, AttemptStep.healthy)

    ctx.store.write(healthy)
    crashpoint(HEALTHY)
    if not a.canary or clean:
        return clean
    deadline = ctx.clock.now() + ctx.settle_seconds
    next_gate = 0.0
    while ctx.clock.now() < deadline:
        if not ctx.proc.leader_alive(ref):
            raise BuildFailed(f"successor exited during the {ctx.settle_seconds:g}s canary settle")
        if ctx.clock.now() >= next_gate:
            ctx.store.read(lambda s: gate(s, ctx, a))
            next_gate = ctx.clock.now() + 0.5
        ctx.clock.sleep(0.05)
    ctx.store.write(lambda s: (gate(s, ctx, a), _step(s, a, AttemptStep.settled)))
    crashpoint(SETTLED)
    return False


def _drain(ctx: Context, a: Attempt) -> None:
    """At or after the switch: finish. SIGTERM, the app's drain, SIGKILL, proof, leave."""
    if a.retiring_id is None:
        return _nothing_to_drain(ctx, a)
    old, drain = _end_retiring(ctx, a, mark_unproven=True)

    def step(s: Session) -> None:
        if s.get(Generation, old.id).state is GenState.retiring:  # type: ignore[union-attr]
            mark_proven(s, old.id, "drained")
        leave_set(s, ctx, a.host, old.id)
        _step(s, a, AttemptStep.ended, outcome=Outcome.done, executed=True, drain_seconds=drain,
              reason="switched and drained", ended_at=utcnow())
        emit(s, "swapped", a.host, a.successor_id, attempt=a.id, mode=a.effective_mode.value,
             retired=old.id, drain_seconds=round(drain, 3))

    ctx.store.write(step)
    ctx.proc.release(ref_of(old))
    crashpoint(DRAINED)
    run_restores(ctx, a.host)


def _end_retiring(ctx: Context, a: Attempt, *, mark_unproven: bool) -> tuple[Generation, float]:
    """SIGTERM the attempt's retiring generation, its drain up to the host's drain timeout
    (counted from when it became a member), SIGKILL, proof. Returns it and the drain time;
    raises Poke while it is not proven gone (optionally marking the member unproven)."""
    old = ctx.store.read(lambda s: s.get(Generation, a.retiring_id))
    member = ctx.store.read(lambda s: s.get(Member, a.retiring_id))
    host = ctx.store.read(lambda s: s.get(Host, a.host))
    assert old is not None and host is not None
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


def _nothing_to_drain(ctx: Context, a: Attempt) -> None:
    """The switch found no current generation (it had died and is a member the sweep reaps):
    done. The successor's own member row left at the switch, so if that made the set empty
    the restore is owed here."""

    def step(s: Session) -> None:
        leave_set(s, ctx, a.host, a.successor_id)  # type: ignore[arg-type]
        _step(s, a, AttemptStep.ended, outcome=Outcome.done, executed=True, drain_seconds=0.0,
              reason="switched (the old generation had already exited)", ended_at=utcnow())
        emit(s, "swapped", a.host, a.successor_id, attempt=a.id, mode=a.effective_mode.value,
             retired=None, drain_seconds=0.0)

    ctx.store.write(step)
    crashpoint(DRAINED)
    run_restores(ctx, a.host)


# -- hold ------------------------------------------------------------------------------


def _hold(ctx: Context, a: Attempt) -> None:
    """Stop the current generation (proven), then start the new build."""
    if a.step is AttemptStep.queued:
        build = _verify(ctx, a)
        coalesced: list[int] = []  # a worker's own queued restart that gave way to this

        def admit(s: Session) -> bool:
            h = s.get(Host, a.host)
            assert h is not None
            a.fence = held_fence(s, ctx, a.host)
            gate(s, ctx, a)
            if _asleep(s, ctx, a, h, coalesced):
                return False
            if a.fence is None and h.one_shot:  # nothing runs: the run takes the lease
                a.fence = acquire(s, ctx, a.host)
            if a.fence is None:
                raise Stale(f"this agent does not hold the lease of {a.host}")
            _step(s, a, AttemptStep.admitted, fence=a.fence)
            return True

        if not ctx.store.write(admit):
            if coalesced:
                crashpoint(COALESCED)
            return
        crashpoint(ADMITTED)
        _stop_old(ctx, a)
    elif a.step in (AttemptStep.spawning, AttemptStep.spawned, AttemptStep.healthy,
                    AttemptStep.settled):
        # Interrupted after the old one was stopped: end what was starting, start again.
        def back(s: Session) -> None:
            _retire_successor(s, a)
            _step(s, a, AttemptStep.stopping_old)

        ctx.store.write(back)
        if a.successor_id is not None:
            _reap_inline(ctx, a.successor_id)
        build = _verify(ctx, a)
    else:
        if a.successor_id is not None:
            # A successor written by a try that died before its spawn step: it never ran,
            # but it is a member; reap it before another one is written.
            ctx.store.write(lambda s: _retire_successor(s, a))
            _reap_inline(ctx, a.successor_id)
        build = _verify(ctx, a)
    if a.step in (AttemptStep.admitted, AttemptStep.stopping_old):
        _finish_old(ctx, a)
    host = ctx.store.read(lambda s: s.get(Host, a.host))
    assert host is not None
    gen_uuid = str(uuidlib.uuid4())
    cgroup = ctx.proc.containment_for(gen_uuid)

    def new_gen(s: Session) -> Generation:
        gate(s, ctx, a)
        g = Generation(uuid=gen_uuid, host=a.host, build_id=a.build_id, state=GenState.spawning,
                       fence=a.fence, cgroup=cgroup, agent_id=ctx.agent_id, created_at=utcnow())
        s.add(g)
        s.flush()
        g.socket = ctx.socket_for(a.host, g.id) if host.kind is HostKind.instance else None
        now = utcnow()
        s.add(Member(generation_id=g.id, host=a.host, role=MemberRole.spawning, attempt_id=a.id,
                     fence=a.fence or 0, since=now, next_attempt_at=now))
        move(s, Attempt, [Attempt.id == a.id], {"successor_id": g.id},
             f"attempt #{a.id} successor", fence=BY_STEP)
        s.flush()
        return g

    gen = ctx.store.write(new_gen)
    a.successor_id = gen.id
    crashpoint(SUCCESSOR)
    spawned = _spawn(ctx, a, host, build, gen)
    clean = _check(ctx, a, host, gen, spawned)
    proven = clean and end_generation(ctx, gen, drain_until=None) is None

    def current(s: Session) -> None:
        gate(s, ctx, a)
        if clean:  # a one-shot run that exited 0: nothing becomes current
            clean_attempt(s, ctx, a, gen, proven)
        else:
            move(s, Generation, [Generation.id == gen.id],
                 {"state": GenState.current, "current_at": utcnow()},
                 f"generation g{gen.id} running -> current", fence=BY_STATE, col="state",
                 frm=GenState.running)
            s.execute(Member.__table__.delete().where(Member.generation_id == gen.id))
        s.execute(Host.__table__.update().where(Host.name == a.host).values(build_id=a.build_id))
        _step(s, a, AttemptStep.switched)
        _step(s, a, AttemptStep.ended, outcome=Outcome.done, executed=True,
              reason="one-shot run exited 0" if clean else "replaced", ended_at=utcnow(),
              **({"clean_exit": True} if clean else {}))
        emit(s, "swapped", a.host, gen.id, attempt=a.id, mode=Mode.hold.value,
             retired=a.retiring_id, drain_seconds=round(a.drain_seconds or 0.0, 3))
        if clean:  # nothing current: the lease goes back once nothing else needs it
            owe_release(s, ctx, a.host)

    ctx.store.write(current)
    if proven:
        ctx.proc.release(ref_of(gen))
    crashpoint(ONESHOT_DONE if clean else SWITCHED)
    if clean:
        release_owed(ctx, a.host)
    if gen.socket:
        ctx.files.point_link(ctx.link_for(a.host), gen.socket)


def _retire_successor(s: Session, a: Attempt) -> None:
    """hold: the successor of an interrupted try becomes a retiring member to be reaped."""
    if a.successor_id is None:
        return
    g = s.get(Generation, a.successor_id)
    if g is not None and g.state in (GenState.spawning, GenState.running):
        mark_retiring(s, g.id, g.state, "hold interrupted before it was current")
        move_many(s, Member, [Member.generation_id == g.id],
                  {"role": MemberRole.retiring, "unproven": True}, f"member g{g.id} retiring",
                  fence=BY_STEP, col="role", frm=tuple(MemberRole))


def _stop_old(ctx: Context, a: Attempt) -> None:
    def step(s: Session) -> None:
        gate(s, ctx, a)
        old = s.execute(select(Generation).where(Generation.host == a.host,
                                                 Generation.state == GenState.current)).scalar_one_or_none()
        if old is None:  # a one-shot worker with no run in progress: nothing to stop
            _step(s, a, AttemptStep.stopping_old)
            return
        mark_retiring(s, old.id, GenState.current, "hold swap")
        now = utcnow()
        s.add(Member(generation_id=old.id, host=a.host, role=MemberRole.retiring, attempt_id=a.id,
                     fence=a.fence or 0, since=now, next_attempt_at=now))
        _step(s, a, AttemptStep.stopping_old, retiring_id=old.id)
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
    old, drain = _end_retiring(ctx, a, mark_unproven=False) if a.retiring_id is not None \
        else (None, 0.0)

    def step(s: Session) -> None:
        if old is not None and s.get(Generation, old.id).state is GenState.retiring:  # type: ignore[union-attr]
            mark_proven(s, old.id, "hold swap")
        if old is not None and s.get(Member, old.id) is not None:
            leave_set(s, ctx, a.host, old.id)
        s.execute(Build.__table__.update().where(Build.id == a.build_id, Build.published_at.is_(None))
                  .values(published_at=utcnow()))
        _step(s, a, AttemptStep.published, drain_seconds=drain)

    ctx.store.write(step)
    a.drain_seconds = drain
    if old is not None:
        ctx.proc.release(ref_of(old))
    crashpoint(OLD_STOPPED)


# -- ending an attempt that did not switch ---------------------------------------------


def _end(ctx: Context, attempt_id: int, exc: BaseException) -> None:
    end = classify(exc)
    a = _load(ctx, attempt_id)
    assert a is not None
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
        owe_release(s, ctx, a.host)  # e.g. a one-shot attempt's lease, when nothing needs it

    ctx.store.write(step)
    crashpoint(ENDED)
    release_owed(ctx, a.host)
    _relink(ctx, a.host)
    if successor is not None:
        _reap_inline(ctx, successor)


def _relink(ctx: Context, host: str) -> None:
    """The canonical link follows the store. A switch (or a hold's unlink) moves the link
    inside its transaction; if that commit failed, the link names a generation that is not
    current: point it back at the one that is."""
    socket = ctx.store.read(lambda s: s.execute(select(Generation.socket).where(
        Generation.host == host, Generation.state == GenState.current)).scalar_one_or_none())
    if socket and ctx.files.read_link(ctx.link_for(host)) != socket:
        ctx.files.point_link(ctx.link_for(host), socket)


def _reap_inline(ctx: Context, gen_id: int) -> None:
    """Reap a member now if it goes quickly; the sweep retries it otherwise."""
    try:
        drive_member(ctx, gen_id)
    except Poke:
        pass
