"""Wake: lease, prove no leftover, spawn on its own socket, health, make current, link.

Each step is one short transaction guarded by the expected state and the lease fence;
the generation row (write-ahead intent) exists before anything is exec'd. A failed wake
is first written `unproven` (it keeps the lease and refuses new wakes), then killed and
proven; only the proof closes it and owes the lease back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import Integer, bindparam, func, select
from sqlalchemy.orm import Session

from models.errors import BrokenInvariant, NotFound
from models.states import LIVE_GEN, OPEN_STOP, OPEN_WAKE, Desired, GenState, HostKind, WakeState
from models.store import emit, utcnow
from models.tables import Build, Generation, Host, Lease, Stop, Wake
from models.transition import Fence, move, move_many
from workflows.base.context import Context, Held, Poke, Result
from workflows.base.crash import crashpoint, define
from workflows.base.lookups import open_stop
from workflows.base.ports import Spawned, SpawnError
from workflows.base.queue import enqueue_slots, enqueue_wake
from workflows.base.waivers import BY_STATE, OPERATOR
from workflows.builds.staged import mark_published, staged_problem
from workflows.generations.access import grant_socket
from workflows.generations.create import intend, launch
from workflows.generations.ending import ref_of
from workflows.generations.known import note
from workflows.generations.readiness import ready_problem
from workflows.leases.lease import Holding, acquire
from workflows.lifecycle.failed_wake import (
    fail_start,
    prove_failed,
    reap_interrupted,
    refuse_build,
    refuse_if_unproven,
    to_reaping,
)
from workflows.lifecycle.order import go_on, hold, names_of, unready, wake_waiters
from workflows.lifecycle.wake_steps import always_on, current, recorded, recorded_current
from workflows.lifecycle.workers import (
    COALESCED,
    clean_wake,
    coalesce,
    settle_one_shot,
)

# Moves that carry no lease fence, each with the reason it needs none.

LEASED = define("wake.leased", "the lease is taken and its fence written on the wake")
INTENT = define("wake.intent", "the generation row is written (spawning); nothing exec'd yet")
SPAWNED = define("wake.spawned", "the build is exec'd; its pid is not recorded yet")
RECORDED = define("wake.recorded", "pid and create_time are recorded; health not checked yet")
CURRENT = define("wake.current", "the generation is current; the canonical link not repointed yet")
WAITING = define("wake.waiting", "the queued wake waits on hosts it starts after; its row says which")


@dataclass(frozen=True)
class WakeRequest:
    id: int | None  # None: the host is already awake, nothing was queued
    state: str


# The statements a wake runs every time, built once (building one cost more than running it).
_WAKE = select(Wake).where(Wake.id == bindparam("id"))
# (Table columns, not the mapped ones: no ORM bookkeeping for a plain row.)
_G = Generation.__table__.c
_CURRENT = select(_G.id).where(_G.host == bindparam("host"), _G.state == GenState.current)
# A start's host and the build it execs: a worker's restart, recycle or converge names its
# build (`pinned`); anything else starts the host's.
_HOST_BUILD = select(Host, Build).join(
    Build, Build.id == func.coalesce(bindparam("pinned", type_=Integer), Host.build_id)
).where(Host.name == bindparam("name"))
_H, _L, _S, _W = Host.__table__.c, Lease.__table__.c, Stop.__table__.c, Wake.__table__.c


def _first(col: Any, *where: Any) -> Any:
    return select(col).where(*where).order_by(col).limit(1).scalar_subquery()  # type: ignore[arg-type]


# Everything a start checks before it leases, in one read (a query each cost more than the
# checks): the host's lease, fence counter and placement; an open stop, an unproven wake,
# a current generation of the wake's slot, any generation of it not proven gone, and
# (instances) a live generation of another slot: the lease it runs under is kept.
_SLOT = bindparam("slot", type_=Integer)
_BEFORE_START = select(
    _H.fence_seq, _H.box, _H.start_after, _L.holder, _L.fence, _L.expires_at,
    _first(_S.id, _S.host == _H.name, _S.state.in_(OPEN_STOP)).label("stop"),  # type: ignore[attr-defined]
    _first(_W.id, _W.host == _H.name, _W.state == WakeState.unproven).label("unproven"),  # type: ignore[attr-defined]
    _first(_G.id, _G.host == _H.name, _G.slot == _SLOT, _G.state == GenState.current).label("current"),  # type: ignore[attr-defined]
    _first(_G.id, _G.host == _H.name, _G.slot == _SLOT, _G.state.in_(LIVE_GEN)).label("live"),  # type: ignore[attr-defined]
    _first(_G.id, _G.host == _H.name, _G.slot != _SLOT, _G.state.in_(LIVE_GEN)).label("sibling"),  # type: ignore[attr-defined]
).select_from(Host.__table__.outerjoin(Lease.__table__, _L.host == _H.name)).where(
    _H.name == bindparam("host"))
_GEN_STATE = select(_G.state).where(_G.id == bindparam("id"))


def _wake(s: Session, wake_id: int) -> Wake | None:
    return s.execute(_WAKE, {"id": wake_id}).scalar_one_or_none()


def request_wake(s: Session, host: str, cause: str = "wake") -> WakeRequest:
    """The CLI's intent (one transaction): refused while a failed wake is unproven."""
    h = s.get(Host, host)
    if h is None:
        raise NotFound(f"no host named {host!r}", "see `vigil host list`, or add it with `vigil host add`")
    refuse_if_unproven(s, host)
    move_many(s, Host, [Host.name == host], {"desired": Desired.up}, f"host {host} up",
              fence=OPERATOR, col="desired", frm=tuple(Desired))
    stopping = open_stop(s, host)  # then only a queued wake runs after it: one under way ends first
    open_wake = s.execute(select(Wake).where(Wake.host == host, Wake.state.in_(
        (WakeState.queued,) if stopping else OPEN_WAKE)).order_by(Wake.id).limit(1)).scalar_one_or_none()
    if open_wake is not None:
        return WakeRequest(open_wake.id, open_wake.state.value)
    if h.instances > 1:
        return _wake_slots(s, h, cause, stopping is not None)
    current = s.execute(_CURRENT, {"host": host}).first()
    if current is not None and stopping is None:
        return WakeRequest(None, "awake")
    w = enqueue_wake(s, host, cause)
    s.flush()
    emit(s, "wake_requested", host, wake=w.id, cause=cause)
    return WakeRequest(w.id, w.state.value)


def _wake_slots(s: Session, h: Host, cause: str, stopping: bool) -> WakeRequest:
    """A host of instances: a wake of every slot not up and not waking (after a stop under
    way, every slot: the stop ends them all). The request names the first one queued."""
    if stopping:
        queued = set(s.execute(select(Wake.slot).where(
            Wake.host == h.name, Wake.state == WakeState.queued)).scalars())
        woken = [enqueue_wake(s, h.name, cause, slot=n) for n in range(h.instances)
                 if n not in queued]
    else:
        woken = enqueue_slots(s, h.name, cause, h.instances)
    if not woken:
        return WakeRequest(None, "awake")
    s.flush()
    for w in woken:
        emit(s, "wake_requested", h.name, wake=w.id, cause=cause, slot=w.slot)
    return WakeRequest(woken[0].id, woken[0].state.value)


def drive_wake(ctx: Context, wake_id: int) -> Result:
    """Advance one wake as far as it can go now."""
    started = _start(ctx, wake_id)  # the usual case, queued or leased: read in the start's commit
    if started is not None:
        return started
    w = ctx.store.read(lambda s: _wake(s, wake_id))
    if w is None or w.state not in OPEN_WAKE:
        return Result.gone
    if w.state in (WakeState.spawning, WakeState.checking):
        # Found mid-flight by a driver that did not start it: the agent died (or a step
        # failed) between spawn and current. Whatever ran is ended, then the wake retried.
        to_reaping(ctx, w)
        w = ctx.store.read(lambda s: _wake(s, wake_id))
        if w is None:
            return Result.gone
    if w.state is WakeState.unproven:
        return prove_failed(ctx, w)
    if w.state is WakeState.reaping:
        reap_interrupted(ctx, w)
        w = ctx.store.read(lambda s: _wake(s, wake_id))
        if w is None:
            return Result.gone
    if w.state in (WakeState.queued, WakeState.leased):
        return _start(ctx, wake_id) or Result.progress
    return Result.progress


@dataclass
class Intent:
    wake: Wake  # as written (leased, or spawning with its generation)
    fresh: bool  # it was queued: this commit leased it
    host: Host | None = None
    build: Build | None = None
    gen: Generation | None = None  # None: nothing written past the lease
    why_not: str | None = None  # a leftover to wait for (Poke)
    waiting: bool = False  # held back by the start order: still queued, nothing taken
    refusal: str | None = None  # the staged build cannot run


def _lease(s: Session, ctx: Context, w: Wake, fence: int) -> None:
    move(s, Wake, w.id, {"state": WakeState.leased, "fence": fence, "attempts": 0},
         f"wake #{w.id} queued -> leased", fence=Fence(w.host, ctx.agent_id, fence),
         col="state", frm=WakeState.queued)


def _start(ctx: Context, wake_id: int) -> Result | None:
    """(queued ->) leased -> spawning -> checking -> done, or -> unproven on the build's
    failure. The wake is read, checked, leased (if queued) and its generation's intent
    written in one commit (one fsync before the exec); the lease alone commits when the
    start cannot go on (a leftover to wait for, a build that cannot run). None: the wake
    is in a state no start begins from (the caller looks at it)."""
    coalesced: list[int] = []
    elsewhere: list[bool] = []
    it = ctx.store.write(lambda s: intent(s, ctx, wake_id, coalesced, elsewhere))
    go = after_intent(ctx, it, bool(coalesced), bool(elsewhere))
    if not isinstance(go, Launch):
        return go
    spawned = spawn(ctx, go)
    return spawned if isinstance(spawned, Result) else _launched(ctx, go, spawned)


@dataclass(frozen=True)
class Launch:
    """A start whose intent is committed: what its spawn needs."""
    wake: Wake
    host: Host
    build: Build
    gen: Generation
    ours: Fence  # every move of this start, and its generation's


def after_intent(ctx: Context, it: Intent | Result, coalesced: bool,
                 elsewhere: bool) -> Launch | Result | None:
    """The crash points and outcome of a start's first commit: a Launch when its
    generation's intent is written and nothing stands in the way of the spawn."""
    if coalesced:
        crashpoint(COALESCED)
    if elsewhere:
        return None
    if not isinstance(it, Intent):
        return it
    if it.waiting:
        crashpoint(WAITING)
        return Result.waiting  # due again at the time its row says (order.RECHECK)
    if it.fresh:
        crashpoint(LEASED)
    if it.why_not is not None:
        raise Poke(it.why_not)
    if it.refusal is not None:
        return refuse_build(ctx, it.wake, it.refusal)
    w, host, build, gen = it.wake, it.host, it.build, it.gen
    if host is None or build is None or gen is None or w.fence is None:
        raise BrokenInvariant("the start's intent is incomplete")
    return Launch(w, host, build, gen, Fence(w.host, ctx.agent_id, w.fence))


def intent(s: Session, ctx: Context, wake_id: int, coalesced: list[int],
            elsewhere: list[bool]) -> Intent | Result:
    """The start's first commit: the wake read and checked, leased if it was queued, and
    (no leftover, a build that can run) its generation's intent written."""
    w = _wake(s, wake_id)
    if w is None or w.state not in OPEN_WAKE:
        return Result.gone
    if w.state not in (WakeState.queued, WakeState.leased):
        elsewhere.append(True)
        return Result.progress
    if ctx.shutting_down.is_set():
        raise Poke("agent shutting down")
    fresh = w.state is WakeState.queued
    seen = s.execute(_BEFORE_START, {"host": w.host, "slot": w.slot}).first()
    if seen is None:
        raise BrokenInvariant(f"host {w.host} of wake #{w.id} is missing")
    if fresh:
        taken = _take_lease(s, ctx, w, seen, coalesced)
        if taken is Result.waiting:
            return Intent(w, fresh, waiting=True)
        if isinstance(taken, Result):
            return taken
        fence = taken
    elif w.fence is None:
        raise BrokenInvariant("w.fence is missing")
    else:
        fence = w.fence
    # No leftover process before anything new is spawned.
    if seen.live is not None:
        state = s.execute(_GEN_STATE, {"id": seen.live}).scalar()
        why = f"generation g{seen.live} of {w.host} is {getattr(state, 'value', state)}, not proven gone"
        if not fresh:
            raise Poke(why)
        _lease(s, ctx, w, fence)
        return Intent(w, fresh, why_not=why)
    host, build = s.execute(_HOST_BUILD, {"pinned": w.build_id, "name": w.host}).one()
    refusal = staged_problem(ctx, build.path, build.digest,
                             executable=host.kind is HostKind.worker,
                             in_root=host.kind is HostKind.worker)
    if refusal is not None:
        if fresh:
            _lease(s, ctx, w, fence)
        return Intent(w, fresh, host, build, refusal=refusal)
    g = intend(s, ctx, host, build.id, fence, slot=w.slot)
    # Publish before exec: the build is referenced in the store before any of it runs.
    mark_published(s, build.id, seen=build)
    values = {"state": WakeState.spawning, "generation_id": g.id}
    if fresh:  # leased in this same commit
        values.update(fence=fence, attempts=0)
    move(s, Wake, w.id, values, f"wake #{w.id} {w.state.value} -> spawning",
         fence=Fence(w.host, ctx.agent_id, fence), col="state", frm=w.state)
    return Intent(w, fresh, host, build, g)


def _take_lease(s: Session, ctx: Context, w: Wake, seen: Any,
                coalesced: list[int]) -> int | Result:
    """A queued wake: ended at once (a worker's own start yields to a queued release, an
    earlier failed wake is unproven, the host is already awake), or the fence of the lease
    it takes. Waits (Poke) while the host is being stopped, and (Result.waiting, written on
    the row) while a host it starts after is not ready."""
    if seen.stop is not None:
        raise Held(f"waiting for stop #{seen.stop} of {w.host} to finish")
    if coalesce(s, w) is not None:
        coalesced.append(w.id)
        return Result.progress
    if seen.unproven is not None:
        move(s, Wake, w.id, {"state": WakeState.failed, "ended_at": utcnow(),
                             "reason": "refused: an earlier failed wake is unproven"},
             f"wake #{w.id}", fence=BY_STATE, col="state", frm=WakeState.queued)
        return Result.progress
    if seen.current is not None:
        move(s, Wake, w.id, {"state": WakeState.done, "ended_at": utcnow(),
                             "generation_id": seen.current, "reason": "already awake"},
             f"wake #{w.id}", fence=BY_STATE, col="state", frm=WakeState.queued)
        return Result.progress
    waits = unready(s, names_of(seen.start_after))
    if waits:
        hold(s, w, waits)
        return Result.waiting
    go_on(s, w)
    if seen.sibling is not None and seen.holder == ctx.agent_id:
        return int(seen.fence)  # another instance runs under this lease: its fence stays
    lease = None if seen.holder is None else seen
    return acquire(s, ctx, w.host, Holding(lease, seen.fence_seq, seen.box))


def spawn(ctx: Context, go: Launch) -> Spawned | Result:
    """Exec the build of a start whose intent is committed; a spawn that fails fails it."""
    crashpoint(INTENT)
    try:
        spawned = launch(ctx, go.host, go.build, go.gen)
    except SpawnError as exc:  # it did not start
        return fail_start(ctx, go.wake, go.gen, WakeState.spawning, GenState.spawning,
                          f"spawn failed: {exc}")
    crashpoint(SPAWNED)
    go.gen.pid, go.gen.create_time = spawned.pid, spawned.create_time
    return spawned


def _launched(ctx: Context, go: Launch, spawned: Spawned) -> Result:
    """Record the pid; a worker with nothing to check is current in that same commit,
    anything else is settled (checked, then made current)."""
    w, host, build, gen, ours = go.wake, go.host, go.build, go.gen, go.ours
    ref = ref_of(gen)
    if always_on(host, gen) and ctx.proc.leader_alive(ref):
        def commit(s: Session) -> None:
            recorded_current(s, w, gen, build, spawned, ours)
            wake_waiters(s)

        ctx.store.write(commit)
        crashpoint(RECORDED)
        crashpoint(CURRENT)
        note(ctx, {gen.id: ref})  # the walk at spawn (an instance's next one is at health)
        return Result.progress
    return settle_started(ctx, go, spawned)


def settle_started(ctx: Context, go: Launch, spawned: Spawned) -> Result:
    """A started generation that is not current at once: pid recorded, then checked."""
    w, gen, ours = go.wake, go.gen, go.ours
    ctx.store.write(lambda s: recorded(s, w, gen, spawned, ours))
    crashpoint(RECORDED)
    note(ctx, {gen.id: ref_of(gen)})
    return _settle(ctx, w, go.host, go.build, gen, spawned, ours)


def _settle(ctx: Context, w: Wake, host: Host, build: Build, gen: Generation, spawned: Spawned,
            ours: Fence) -> Result:
    """The started generation's check (an instance's readiness, a one-shot's exit, a worker
    alive), then current and linked; a failed check fails the wake."""
    ref = ref_of(gen)
    if host.kind is HostKind.instance:
        problem = ready_problem(ctx, host, gen)
    elif host.one_shot:
        code = settle_one_shot(ctx, ref)
        if code == 0:
            clean_wake(ctx, w, gen)
            return Result.progress
        problem = None if code is None else f"one-shot run exited with status {code}"
    else:
        problem = None if ctx.proc.leader_alive(ref) else "worker exited right after its start"
    if problem is None and gen.socket:
        problem = grant_socket(ctx, host, gen.socket)  # before it is current and linked
    if problem is not None:
        return fail_start(ctx, w, gen, WakeState.checking, GenState.running, problem)

    ctx.store.write(lambda s: current(s, w, gen, build, spawned, ours))
    crashpoint(CURRENT)
    if gen.socket:
        ctx.files.point_link(ctx.link_for(w.host), gen.socket)
    return Result.progress
