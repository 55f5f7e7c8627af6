"""Wake: lease, prove no leftover, then the generation's start (workflows/lifecycle/start.py:
intend, spawn on its own socket, record, check, current, link) carried by the wake's `state`.

Each step is one short transaction guarded by the expected state and the lease fence;
the generation row (write-ahead intent) exists before anything is exec'd. A failed wake
is first written `unproven` (it keeps the lease and refuses new wakes), then killed and
proven; only the proof closes it and owes the lease back.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Integer, Select, bindparam, func, select
from sqlalchemy.orm import Session

from models.errors import BrokenInvariant, NotFound
from models.states import LIVE_GEN, OPEN_STOP, OPEN_WAKE, Desired, GenState, HostKind, WakeState
from models.store import emit, utcnow
from models.streaks import clear_failed
from models.tables import Build, Generation, Host, Lease, Stop, Wake
from models.transition import Fence, Unfenced, move_many
from workflows.base.context import Context, Held, Poke, Result
from workflows.base.crash import define
from workflows.base.lookups import open_stop
from workflows.base.ports import SpawnError
from workflows.base.queue import enqueue_slots, enqueue_wake
from workflows.base.waivers import BY_STATE, OPERATOR
from workflows.builds.staged import mark_published, staged_problem
from workflows.generations.create import intend
from workflows.leases.lease import Holding, acquire
from workflows.lifecycle.failed_wake import (
    fail_start,
    prove_failed,
    reap_interrupted,
    refuse_build,
    refuse_if_unproven,
    to_reaping,
)
from workflows.lifecycle.jobs import RUN, bind_run, enable, is_job
from workflows.lifecycle.order import go_on, hold, names_of, unready, wake_waiters
from workflows.lifecycle.start import (
    Carrier,
    Start,
    Step,
    Steps,
    at_once,
    check,
    current_in,
    link,
    record,
    spawn,
)
from workflows.lifecycle.workers import COALESCED, clean_wake, coalesce

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


def _current(s: Session, host: str) -> int | None:
    return s.execute(select(Generation.id).where(
        Generation.host == host, Generation.state == GenState.current)).scalar()


def request_wake(s: Session, host: str, cause: str = "wake") -> WakeRequest:
    """The CLI's intent (one transaction): refused while a failed wake is unproven."""
    h = s.get(Host, host)
    if h is None:
        raise NotFound(f"no host named {host!r}", "see `vigil host list`, or add it with `vigil host add`")
    refuse_if_unproven(s, host)
    if clear_failed(s, host):  # an operator's wake (or `vigil retry`) undoes the start limit
        emit(s, "failed_cleared", host, by=cause)
    was = h.desired
    move_many(s, Host, [Host.name == host], {"desired": Desired.up}, f"host {host} up",
              fence=OPERATOR, col="desired", frm=tuple(Desired))
    if is_job(h):  # a job's wake enables its schedule; its runs are its own wakes
        if was is not Desired.up or h.runs_from is None:
            enable(s, h)
        return WakeRequest(None, "enabled")
    stopping = open_stop(s, host)  # then only a queued wake runs after it: one under way ends first
    open_wake = s.execute(select(Wake).where(Wake.host == host, Wake.state.in_(
        (WakeState.queued,) if stopping else OPEN_WAKE)).order_by(Wake.id).limit(1)).scalar_one_or_none()
    if open_wake is not None:
        return WakeRequest(open_wake.id, open_wake.state.value)
    if h.instances > 1:
        return _wake_slots(s, h, cause, stopping is not None)
    if _current(s, host) is not None and stopping is None:
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
    started = start_wake(ctx, wake_id)  # the usual case, queued or leased: read in the start's commit
    if started is not None:
        return started
    w = ctx.store.read(lambda s: s.get(Wake, wake_id))
    if w is None or w.state not in OPEN_WAKE:
        return Result.gone
    if w.state in (WakeState.spawning, WakeState.checking):
        # Found mid-flight by a driver that did not start it: the agent died (or a step
        # failed) between spawn and current. Whatever ran is ended, then the wake retried.
        to_reaping(ctx, w)
        w = ctx.store.read(lambda s: s.get(Wake, wake_id))
        if w is None:
            return Result.gone
    if w.state is WakeState.unproven:
        return prove_failed(ctx, w)
    if w.state is WakeState.reaping:
        reap_interrupted(ctx, w)
        w = ctx.store.read(lambda s: s.get(Wake, wake_id))
        if w is None:
            return Result.gone
    if w.state in (WakeState.queued, WakeState.leased):
        return start_wake(ctx, wake_id) or Result.progress
    return Result.progress


def start_wake(ctx: Context, wake_id: int) -> Result | None:
    """(queued ->) leased -> spawning -> checking -> done, or -> unproven on the build's
    failure. The wake is read, checked, leased (if queued) and its generation's intent
    written in one commit (one fsync before the exec); the lease alone commits when the
    start cannot go on (a leftover to wait for, a build that cannot run). None: the wake
    is in a state no start begins from (the caller looks at it)."""
    go = begun(ctx.store.write(lambda s: intent(s, ctx, wake_id)))
    return go if not isinstance(go, Launch) else started(ctx, go)


@dataclass(frozen=True)
class Launch:
    """A wake whose generation's intent is committed: its start and the runner of its steps."""

    wake: Wake  # as its first commit read it
    start: Start
    steps: Steps
    ours: Fence  # every move of this start, and its generation's


Then = Launch | Result | Poke | Callable[[], Result] | None


@dataclass(frozen=True)
class First:
    """What a start's first commit decided: the steps it took (their crash points follow
    the commit), then the start to go on with, what the drive returns, what stops it
    (raised) or does instead; None: the wake was found mid-flight."""

    then: Then = None
    runner: Steps | None = None
    steps: tuple[Step, ...] = ()


def begun(first: First) -> Launch | Result | None:
    """After a start's first commit: its crash points, then its outcome; a Launch when
    its generation's intent is written and nothing stands in the way of the spawn."""
    if first.runner is not None:
        first.runner.taken(*first.steps)
    if isinstance(first.then, Poke):
        raise first.then
    return first.then() if callable(first.then) else first.then


def _took(s: Session, runner: Steps, then: Then, *steps: Step) -> First:
    runner.take(s, *steps)
    return First(then, runner, steps)


def _runner(ctx: Context, w: Wake, fence: Fence | Unfenced) -> Steps:
    return Steps(ctx, Carrier(Wake, {"id": w.id}, "state", w.state, fence, label=f"wake #{w.id}"))


def intent(s: Session, ctx: Context, wake_id: int) -> First:
    """The start's first commit: the wake read and checked, leased if it was queued, and
    (no leftover, a build that can run) its generation's intent written."""
    w = s.get(Wake, wake_id)
    if w is None or w.state not in OPEN_WAKE:
        return First(Result.gone)
    if w.state not in (WakeState.queued, WakeState.leased):
        return First()
    if ctx.shutting_down.is_set():
        raise Poke("agent shutting down")
    seen = s.execute(_before_start(), {"host": w.host, "slot": w.slot}).first()
    if seen is None:
        raise BrokenInvariant(f"host {w.host} of wake #{w.id} is missing")
    fence = _take_lease(s, ctx, w, seen) if w.state is WakeState.queued else w.fence
    if isinstance(fence, First):
        return fence
    if fence is None:
        raise BrokenInvariant("w.fence is missing")
    ours = Fence(w.host, ctx.agent_id, fence)
    steps = _runner(ctx, w, ours)
    leased = (Step(WakeState.leased, LEASED, values={"fence": fence, "attempts": 0}),) \
        if w.state is WakeState.queued else ()
    # No leftover process before anything new is spawned.
    if seen.live is not None:
        state = s.execute(select(Generation.state).where(Generation.id == seen.live)).scalar()
        return _took(s, steps, Poke(f"generation g{seen.live} of {w.host} is "
                                    f"{getattr(state, 'value', state)}, not proven gone"), *leased)
    # A worker's restart, recycle or converge names its build (`pinned`).
    host, build = s.execute(_host_build(), {"pinned": w.build_id, "name": w.host}).one()
    refusal = staged_problem(ctx, build.path, build.digest,
                             executable=host.kind is HostKind.worker,
                             in_root=host.kind is HostKind.worker)
    if refusal is not None:
        return _took(s, steps, lambda: refuse_build(ctx, w, refusal), *leased)
    g = intend(s, ctx, host, build.id, fence, slot=w.slot)
    if w.cause == RUN:
        bind_run(s, w.id, g.id)  # the run names its generation before it is exec'd
    # Publish before exec: the build is referenced in the store before any of it runs.
    mark_published(s, build.id, seen=build)
    go = Launch(w, Start(host, build, g, SPAWNED, Step(WakeState.checking, RECORDED)), steps, ours)
    return _took(s, steps, go, *leased,
                 Step(WakeState.spawning, INTENT, values={"generation_id": g.id}))


def _take_lease(s: Session, ctx: Context, w: Wake, seen: Any) -> int | First:
    """A queued wake: ended at once (a worker's own start yields to a queued release, an
    earlier failed wake is unproven, the host is already awake), or the fence of the lease
    it takes. Waits (Held) while the host is being stopped, and (Result.waiting, written on
    the row) while a host it starts after is not ready."""
    if seen.stop is not None:
        raise Held(f"waiting for stop #{seen.stop} of {w.host} to finish")
    by_state = _runner(ctx, w, BY_STATE)
    if coalesce(s, w) is not None:
        return _took(s, by_state, Result.progress, Step(None, COALESCED))
    if seen.unproven is not None:
        return _took(s, by_state, Result.progress, Step(WakeState.failed, values={
            "ended_at": utcnow(), "reason": "refused: an earlier failed wake is unproven"}))
    if seen.current is not None:
        return _took(s, by_state, Result.progress, Step(WakeState.done, values={
            "ended_at": utcnow(), "generation_id": seen.current, "reason": "already awake"}))
    waits = unready(s, names_of(seen.start_after))
    if waits:
        hold(s, w, waits)  # due again at the time its row says (order.RECHECK)
        return _took(s, by_state, Result.waiting, Step(None, WAITING))
    go_on(s, w)
    if seen.sibling is not None and seen.holder == ctx.agent_id:
        return int(seen.fence)  # another instance runs under this lease: its fence stays
    lease = None if seen.holder is None else seen
    return acquire(s, ctx, w.host, Holding(lease, seen.fence_seq, seen.box))


@functools.cache
def _host_build() -> Select[Any]:
    """A start's host and the build it execs, built once (as _before_start)."""
    pinned = bindparam("pinned", type_=Integer)
    return select(Host, Build).join(Build, Build.id == func.coalesce(pinned, Host.build_id)).where(
        Host.name == bindparam("name"))


@functools.cache
def _before_start() -> Select[Any]:
    """Everything a start checks before it leases, in one read (a query each cost more
    than the checks): the host's lease, fence counter and placement; an open stop, an
    unproven wake, a current generation of the wake's slot, any generation of it not
    proven gone, and (instances) a live generation of another slot: the lease it runs
    under is kept. Built once (building it cost more than running it)."""
    def first(col: Any, *where: Any) -> Any:
        return select(col).where(*where).order_by(col).limit(1).scalar_subquery()

    g, slot = Generation, bindparam("slot", type_=Integer)
    here = Generation.host == Host.name
    return select(
        Host.fence_seq, Host.box, Host.start_after, Lease.holder, Lease.fence, Lease.expires_at,
        first(Stop.id, Stop.host == Host.name, Stop.state.in_(OPEN_STOP)).label("stop"),
        first(Wake.id, Wake.host == Host.name, Wake.state == WakeState.unproven).label("unproven"),
        first(g.id, here, g.slot == slot, g.state == GenState.current).label("current"),
        first(g.id, here, g.slot == slot, g.state.in_(LIVE_GEN)).label("live"),
        first(g.id, here, g.slot != slot, g.state.in_(LIVE_GEN)).label("sibling"),
    ).outerjoin(Lease, Lease.host == Host.name).where(Host.name == bindparam("host"))


def started(ctx: Context, go: Launch) -> Result:
    """Spawn (a spawn that fails fails the wake), record the pid; a worker with nothing to
    check is current in that same commit, anything else is checked, then made current."""
    gen = spawned(ctx, go)
    if isinstance(gen, Result):
        return gen
    if at_once(ctx, go.start.host, gen):
        record(go.steps, go.start, gen, go.ours, serve=serve(go, gen, recorded=False))
        return Result.progress
    return settle(ctx, go, gen)


def spawned(ctx: Context, go: Launch) -> Generation | Result:
    """The generation as its record writes it, or (it did not start) the wake failed."""
    try:
        return spawn(ctx, go.start)
    except SpawnError as exc:
        return fail_start(ctx, go.wake, go.start.gen, WakeState.spawning, GenState.spawning,
                          f"spawn failed: {exc}")


def serve(go: Launch, gen: Generation, *, recorded: bool = True, waiters: bool = True) -> Step:
    """The wake's last step: its generation current, the wake done (and the wakes that
    wait on hosts told; a group tells them once for all its wakes)."""
    def write(s: Session) -> None:
        current_in(s, gen, go.ours, recorded=recorded)
        emit(s, "woke", go.wake.host, gen.id, pid=gen.pid, build=go.start.build.digest[:12])
        if go.wake.cause == "restart":  # back after an exit (the `restarted` notification)
            emit(s, "restarted", go.wake.host, gen.id, pid=gen.pid, slot=gen.slot)
        if waiters:
            wake_waiters(s)

    return Step(WakeState.done, CURRENT, write, {"ended_at": utcnow()})


def settle(ctx: Context, go: Launch, gen: Generation) -> Result:
    """A started generation that is not current at once: pid recorded, then checked (an
    instance's readiness, a one-shot's exit, a worker alive), then current and linked; a
    failed check fails the wake."""
    record(go.steps, go.start, gen, go.ours)
    try:
        found = check(ctx, go.start.host, gen, watch=functools.partial(_stop_watch, ctx, go.wake))
    except StoppedMeanwhile as exc:
        return fail_start(ctx, go.wake, gen, WakeState.checking, GenState.running, str(exc),
                          kind="wake_cancelled")
    if found.clean:
        clean_wake(ctx, go.wake, gen)
        return Result.progress
    if found.problem is not None:
        return fail_start(ctx, go.wake, gen, WakeState.checking, GenState.running, found.problem)
    go.steps.commit(serve(go, gen))
    link(ctx, go.wake.host, gen)
    return Result.progress


class StoppedMeanwhile(Exception):
    """A stop of the host (or of the wake's slot) was asked while the wake waited on its
    readiness: the wait ends at once rather than after the health timeout, for the stop
    waits on it."""


def _stop_watch(ctx: Context, w: Wake) -> None:
    stop = ctx.store.glance(lambda s: s.execute(select(Stop.id).where(
        Stop.host == w.host, Stop.state.in_(OPEN_STOP),
        (Stop.slot.is_(None)) | (Stop.slot == w.slot)).limit(1)).scalar())
    if stop is not None:
        raise StoppedMeanwhile(f"cancelled by stop #{stop} before it was ready")
