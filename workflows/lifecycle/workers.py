"""Workers (kind `worker`): background processes that serve no socket.

A worker's start is a wake like any other (the generation row, naming its build, is
written before the exec), but what it execs is pinned: a restart, a max-run recycle or a
converge queues a wake whose `build_id` names the exact staged build to run. A worker that
exits is respawned onto its *captured* build (the one its generation exec'd), after the
restart policy's backoff (workflows/lifecycle/restarts.py), never onto whatever build
is newest. It moves to the host's live build (`hosts.build_id`, set by a release) only by
a release attempt (`vigil deploy`: stop-then-start) or by converging once the drift has
lasted the host's grace, at most a budgeted number of converges per sweep box-wide.
A restart, recycle or converge that finds a release attempt queued gives way to it: the
attempt makes the one spawn. A one-shot worker runs once: exit 0 within the settle window
is a success (the build marked good), any other exit the build's failure; no respawn.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from models import facts
from models.durations import check_seconds
from models.errors import BadInput, LostRace, present
from models.states import OPEN_WAKE, Desired, GenState, HostKind, MemberRole, WakeState
from models.store import emit, utcnow
from models.tables import Attempt, Build, Generation, Host, Lease, Member, Wake
from models.transition import Fence, Unfenced, move, move_many
from workflows.base.context import Context
from workflows.base.crash import crashpoint, define
from workflows.base.lookups import open_attempt, open_stop
from workflows.base.ports import ProcRef
from workflows.base.queue import enqueue_wake
from workflows.base.sanity import impossible_hosts
from workflows.base.waivers import BY_STATE
from workflows.builds.book import held, held_line
from workflows.builds.staged import set_build
from workflows.generations.create import join_set
from workflows.generations.ending import end_generation, mark_proven, mark_retiring, ref_of
from workflows.leases.lease import owe_release, release_owed
from workflows.lifecycle.jobs import is_job, run_exited
from workflows.lifecycle.order import wake_waiters
from workflows.lifecycle.restarts import exit_code, exit_line, parse_start_limit, schedule, uptime

# Moves that carry no lease fence, each with the reason it needs none.
ONE_SHOT = Unfenced("the attempt ending its one-shot run: its gate checked the lease")
OWN_SWEEP = Unfenced("host-scoped bookkeeping of this agent's own sweep")

DRIFT = define("worker.drift", "a worker's drift from its live build is written (or cleared)")
RECYCLING = define("worker.recycling", "a max-run recycle is written: the old generation is a "
                   "retiring member and a start of its captured build is queued; nothing signalled")
CONVERGING = define("worker.converging", "a converge is written: the old generation is a retiring "
                    "member and a start of the live build is queued; nothing signalled")
COALESCED = define("worker.coalesced", "a queued restart gave way to a queued release attempt")
CLEAN_EXIT = define("oneshot.clean_exit", "a one-shot wake's run exited 0: the wake is done and "
                    "the build marked good; the release is owed")
ONESHOT_DONE = define("oneshot.done", "a one-shot attempt's run exited 0: the attempt is done, "
                      "clean_exit recorded, the build marked good")

# Wakes a worker queues for itself; each gives way to a queued release attempt.
OWN_STARTS = ("restart", "recycle", "converge")

POLICY_DEFAULTS = {"one_shot": False, "max_run": None, "restart_floor": 1.0, "restart_cap": 30.0,
                   "restart_reset": 60.0, "converge_grace": 60.0, "start_limit": None}


RESTART_POLICY = ("restart_floor", "restart_cap", "restart_reset", "start_limit")  # instances' too


def check_policy(kind: HostKind, policy: dict[str, object]) -> dict[str, object]:
    """Validate `vigil host add`'s worker options (the restart policy is every host's);
    returns the columns to write."""
    given = {k: v for k, v in policy.items() if v is not None and v is not False}
    # --watchdog is every host's too (checked by its option: workflows/lifecycle/watchdog.py)
    only_workers = {k: v for k, v in given.items() if k not in (*RESTART_POLICY, "watchdog")}
    if only_workers and kind is not HostKind.worker:
        flags = ", ".join("--" + k.replace("_", "-") for k in sorted(only_workers))
        raise BadInput(f"{flags} only apply to workers", "add --kind worker, or drop them")
    out = {**POLICY_DEFAULTS, **given}
    for key in ("max_run", "restart_floor", "restart_cap", "restart_reset", "converge_grace"):
        if out[key] is not None:
            check_seconds(out[key], f"--{key.replace('_', '-')}", "5")
    if out["start_limit"] is not None:
        out["start_limit"] = parse_start_limit(str(out["start_limit"]))
    if float(out["restart_cap"]) < float(out["restart_floor"]):  # type: ignore[arg-type]
        raise BadInput(f"--restart-cap {out['restart_cap']} is below --restart-floor "
                       f"{out['restart_floor']}", "pass a cap at least as large as the floor")
    if out["one_shot"] and out["max_run"] is not None:
        raise BadInput("--max-run recycles an always-on worker; a --one-shot worker runs once",
                       "drop one of the two")
    return out


def _busy(s: Session, host: str) -> str | None:
    """Why the sweep leaves a worker alone: something else is already moving it."""
    a = open_attempt(s, host)
    if a is not None:
        return f"attempt #{a} is open"
    if open_stop(s, host) is not None:
        return "a stop is open"
    if s.execute(select(Wake.id).where(Wake.host == host, Wake.state.in_(OPEN_WAKE))).first():
        return "a wake is open"
    return None


# -- exits and restarts -------------------------------------------------------------------


def worker_exited(s: Session, gen: Generation, host: Host, code: int | None,
                  oom: str | None) -> None:
    """A worker's current generation ended (in the transaction that retires it, which read
    its status `code` and `oom`, the words of an OOM kill): a one-shot run is over (a clean
    exit marks the build good); anything else restarts, with backoff."""
    code_line = oom or exit_line(code)
    if is_job(host):  # a run's end: recorded, never restarted (workflows/lifecycle/jobs.py)
        run_exited(s, gen, code, code_line)
        return
    if host.one_shot:
        if code == 0:
            mark_good(s, gen.build_id)
        emit(s, "run_ended", host.name, gen.id, exit_code=code, one_shot=True)
        return
    queue_restart(s, host, gen.build_id, uptime(gen), code_line)


def queue_restart(s: Session, host: Host, build_id: int, up: float, why: str) -> None:
    """Queue the next start of `build_id` (the captured build) by the restart policy."""
    if host.desired is not Desired.up or host.one_shot:
        return
    if s.execute(select(Wake.id).where(Wake.host == host.name, Wake.state.in_(OPEN_WAKE))).first():
        return
    a = open_attempt(s, host.name)
    if a is not None:
        emit(s, "restart_coalesced", host.name, attempt=a, reason=why)
        return
    hold = held(s, host.name, build_id)
    if hold is not None:  # the failure book: a restart never puts a held-down build back
        emit(s, "restart_skipped", host.name, build_id=build_id, reason=held_line(hold))
        return
    schedule(s, host, up, why, build_id=build_id)


def after_failed_start(s: Session, w: Wake) -> None:
    """A worker's own start whose run failed (it exited at once) is tried again later."""
    if w.cause not in OWN_STARTS:
        return
    host = s.get(Host, w.host)
    if host is not None and host.kind is HostKind.worker:
        build_id = w.build_id if w.build_id is not None else host.build_id
        queue_restart(s, host, build_id, 0.0, "its restart failed")


def coalesce(s: Session, w: Wake) -> int | None:
    """A worker's own queued start gives way to a queued release attempt: cancelled here,
    so the attempt makes the one spawn. Returns that attempt's id, or None."""
    a = open_attempt(s, w.host) if w.cause in OWN_STARTS else None
    if a is None:
        return None
    move(s, Wake, {"id": w.id}, {"state": WakeState.cancelled, "ended_at": utcnow(),
                                 "reason": f"coalesced: attempt #{a} makes the spawn"},
         f"wake #{w.id} queued -> cancelled", fence=BY_STATE, col="state", frm=WakeState.queued)
    emit(s, "restart_coalesced", w.host, attempt=a, wake=w.id, cause=w.cause)
    return a


def yield_own_starts(s: Session, host: str, cancelled: list[int] | None = None) -> bool:
    """For an attempt finding its host asleep: the worker's own queued starts give way to
    it (their ids appended to `cancelled`). True when no open wake is left to wait for."""
    for w in s.execute(select(Wake).where(Wake.host == host, Wake.state == WakeState.queued,
                                          Wake.cause.in_(OWN_STARTS))).scalars().all():
        if coalesce(s, w) is not None and cancelled is not None:
            cancelled.append(w.id)
    return s.execute(select(Wake.id).where(Wake.host == host,
                                           Wake.state.in_(OPEN_WAKE))).first() is None


# -- staged builds ---------------------------------------------------------------------------


def mark_good(s: Session, build_id: int) -> None:
    facts.stamp(s, Build, {"id": build_id}, "good_at", utcnow())


def stage_live(s: Session, host: str, build: Build) -> None:
    """`vigil deploy --converge`: the build becomes the worker's live build with no attempt;
    a running worker converges onto it after its grace, a stopped one starts it next."""
    h = s.get(Host, host)
    if h is None:
        raise BadInput(f"no host named {host!r}", "see `vigil host list`")
    if h.kind is not HostKind.worker:
        raise BadInput(f"host {host} is an instance: only workers converge",
                       f"deploy it with `vigil deploy {host} BUILD`")
    set_build(s, host, build.id)
    emit(s, "build_staged", host, build=build.digest[:12], converge_grace=h.converge_grace)


# -- one-shot runs --------------------------------------------------------------------------


def settle_one_shot(ctx: Context, ref: ProcRef) -> int | None:
    """Wait up to the settle window for a one-shot run to end: its exit status (-1 when it
    cannot be known), or None when it is still running at the end of the window."""
    if not ctx.wait_until(lambda: not ctx.proc.leader_alive(ref), ctx.settle_seconds, 0.02):
        return None
    code = exit_code(ctx, ref.pid)
    return -1 if code is None else code


def _end_clean_run(s: Session, gen: Generation, proven: bool, fence: int) -> None:
    """running -> retiring -> proven (or a retiring member when something of it is left)."""
    mark_retiring(s, gen.id, GenState.running, "one-shot run exited 0")
    if proven:
        mark_proven(s, gen.id)
    else:
        join_set(s, gen.id, gen.host, MemberRole.retiring, fence, unproven=True)
    mark_good(s, gen.build_id)


def clean_wake(ctx: Context, w: Wake, gen: Generation) -> None:
    """A one-shot wake whose run exited 0 within the settle window: done."""
    proven = end_generation(ctx, gen, drain_until=None) is None

    def step(s: Session) -> None:
        _end_clean_run(s, gen, proven, w.fence or 0)
        move(s, Wake, {"id": w.id},
             {"state": WakeState.done, "ended_at": utcnow(),
              "reason": "one-shot run exited 0"},
             f"wake #{w.id} checking -> done", fence=Fence(w.host, ctx.agent_id, w.fence or 0), col="state",
             frm=WakeState.checking)
        emit(s, "clean_exit", w.host, gen.id, wake=w.id, pid=gen.pid)
        owe_release(s, ctx, w.host)
        wake_waiters(s)  # a one-shot that ran is ready for the hosts that start after it

    ctx.store.write(step)
    if proven:
        ctx.proc.release(ref_of(gen))
    crashpoint(CLEAN_EXIT)
    release_owed(ctx, w.host)


def clean_attempt(s: Session, ctx: Context, a: Attempt, gen: Generation, proven: bool) -> None:
    """In the transaction that ends a one-shot attempt whose run exited 0."""
    _end_clean_run(s, gen, proven, a.fence or 0)
    if proven:
        s.execute(Member.__table__.delete().where(Member.generation_id == gen.id))
    else:
        move_many(s, Member, [Member.generation_id == gen.id],
                  {"role": MemberRole.retiring, "unproven": True}, f"member g{gen.id} retiring",
                  fence=ONE_SHOT, col="role", frm=tuple(MemberRole))
    emit(s, "clean_exit", a.host, gen.id, attempt=a.id, pid=gen.pid)


# -- the sweep: drift, converge, max-run ---------------------------------------------------


def _needs_sweep(ctx: Context) -> Any:
    """This agent's running workers with something a sweep may do: drift seen or noted,
    or a max-run."""
    return (select(Generation, Host).join(Host, Host.name == Generation.host)
            .join(Lease, Lease.host == Generation.host)
            .where(Generation.state == GenState.current, Host.kind == HostKind.worker,
                   Lease.holder == ctx.agent_id, Host.every.is_(None), Host.schedule.is_(None),
                   or_(Host.build_id != Generation.build_id, Host.drift_since.is_not(None),
                       Host.max_run.is_not(None))))


def any_to_sweep(ctx: Context) -> bool:
    """Whether a sweep has anything to look at. Drift only starts with an intent (a deploy
    or an apply), which starts a round; the agent asks this after rounds, not every second."""
    return ctx.store.read(lambda s: s.execute(
        _needs_sweep(ctx).with_only_columns(Generation.id).limit(1)).first() is not None)


def sweep(ctx: Context, budget: int, sweep_no: int = 0) -> int:
    """One pass over this agent's running workers: note or clear drift, converge the ones
    whose drift outlasted their grace (at most `budget` in this sweep), recycle the ones past
    their max-run. Returns how many were moved."""
    rows = ctx.store.read(lambda s: s.execute(
        _needs_sweep(ctx).order_by(Generation.host)).all())
    if not rows:
        return 0
    refused = ctx.store.read(impossible_hosts)
    moved = 0
    for gen, host in rows:
        if gen.host in refused or not ctx.proc.leader_alive(ref_of(gen)):
            continue  # the liveness sweep's (or the operator's) business
        try:
            moved_how = _sweep_one(ctx, gen, host, budget > 0, sweep_no)
            if moved_how:
                moved += 1
                budget -= moved_how == "converge"
        except LostRace:  # the host moved under us (a CLI intent, a lease): next sweep
            continue
    return moved


def _sweep_one(ctx: Context, gen: Generation, host: Host, may_converge: bool,
               sweep_no: int) -> str | None:
    """How the worker was moved ("converge" or "recycle"), or None."""
    if ctx.store.read(lambda s: _busy(s, gen.host)):
        return None  # coalescing: whatever is open makes the next spawn
    now = utcnow()
    drifting = host.build_id != gen.build_id
    if drifting != (host.drift_since is not None):
        _note_drift(ctx, host, now if drifting else None)
        return None
    lasted = (now - host.drift_since).total_seconds() if host.drift_since is not None else 0.0
    if drifting and lasted >= host.converge_grace and may_converge and \
            ctx.store.read(lambda s: held(s, host.name, host.build_id)) is None:
        # (A live build held down on the worker is left alone: only `vigil retry` or an
        # explicit deploy puts it back.)
        if not _replace(ctx, gen, host, "converge", None,
                        f"live build differs for {lasted:.1f}s", sweep_no):
            return None
        crashpoint(CONVERGING)
        return "converge"
    # Not converging (no drift, within its grace, or this sweep's budget is spent): a
    # worker past its max-run is recycled onto its captured build all the same.
    if host.max_run is None or gen.current_at is None or \
            (now - gen.current_at).total_seconds() < host.max_run:
        return None
    if not _replace(ctx, gen, host, "recycle", gen.build_id,
                    f"up for {host.max_run:g}s (max-run)", sweep_no):
        return None
    crashpoint(RECYCLING)
    return "recycle"


def _note_drift(ctx: Context, host: Host, since: object) -> None:
    def step(s: Session) -> None:
        # A drift is noted once: its age is kept until it is cleared.
        move(s, Host, {"name": host.name, **({"drift_since": None} if since is not None else {})},
             {"drift_since": since}, f"drift of {host.name}", fence=OWN_SWEEP)
        if since is not None:
            emit(s, "drift", host.name, live_build_id=host.build_id,
                 grace=host.converge_grace)

    ctx.store.write(step)
    crashpoint(DRIFT)


def _replace(ctx: Context, gen: Generation, host: Host, cause: str, build_id: int | None,
             why: str, sweep_no: int) -> bool:
    """Stop-then-start in one transaction of intent: the current generation becomes a
    retiring member (the member driver drains, kills and proves it) and a wake of `cause`
    pinned to `build_id` (None: the live build) waits for that proof, then spawns."""

    def step(s: Session) -> bool:
        busy = _busy(s, gen.host)
        if busy is not None:
            return False
        lease = present(s.get(Lease, gen.host), "lease is missing")
        move(s, Generation, {"id": gen.id},
             {"state": GenState.retiring, "end_reason": f"{cause}: {why}"},
             f"generation g{gen.id} current -> retiring", fence=Fence(gen.host, ctx.agent_id, lease.fence), col="state",
             frm=GenState.current)
        join_set(s, gen.id, gen.host, MemberRole.retiring, lease.fence)
        enqueue_wake(s, gen.host, cause, build_id=build_id)
        if cause == "converge":  # a recycle keeps the drift's age: it must not starve it
            move_many(s, Host, [Host.name == gen.host], {"drift_since": None},
                      f"drift of {gen.host} cleared", fence=BY_STATE)
        emit(s, "converging" if cause == "converge" else "recycling", gen.host, gen.id,
             reason=why, sweep=sweep_no, onto_build_id=build_id or host.build_id)
        return True

    return ctx.store.write(step)
