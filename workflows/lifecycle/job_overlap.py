"""A job's run due while the last one still runs: its overlap policy (`--overlap`, issue 40
item 4), decided in the commit that writes the run's row (`write_run`, for the tick of
workflows/lifecycle/jobs.py and `vigil run`), with the host's row locked so that two
writers of one job (the tick, `vigil run`, another box on PostgreSQL) decide one after
the other.

- skip (the default): the instant is written `skipped`; it never runs.
- queue: it is written `queued` (owed in pending_obligations, no wake yet). Once no run of
  the job is open it becomes `due` with its wake in one commit (`follow_queued`); its start
  then waits, as every start does, until the last run's processes are proven gone: never
  two at once. At most one run waits: an instant due while one is queued is skipped (as
  Temporal's BUFFER_ONE). A job that outruns its period every time would otherwise queue
  without bound, each run later than the one before; one waiting run is the "once more
  after this one" a queue is for.
- replace: the new run is written `queued`, naming the run it replaces, and that run's row
  says `replaced by run #N` (the intent, one commit). Then, once that run's generation is
  current, a stop of its instance is written (`follow_queued`): the stop path ends it (its
  stop signal or command, the drain timeout, SIGKILL, proof) and it is recorded failed with
  that reason; the new run is made due as with queue, and its start waits for the proof.
  One replacement waits at a time: an instant due meanwhile is skipped.
- allow: the run is due at once in a free slot of the host (a generation of its own: pid,
  proof, log), as an instance of a host of instances is; up to MAX_AT_ONCE runs at once
  (a job an hour long every second would otherwise be a fork bomb), past that skipped.

A queued run of a job stopped (`vigil stop`) is ended `interrupted`: it never ran.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from functools import partial

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from models.errors import BadInput, LostRace, present
from models.states import (
    LIVE_GEN,
    OPEN_RUN,
    OPEN_STOP,
    OPEN_WAKE,
    Desired,
    GenState,
    RunState,
    StopState,
)
from models.store import emit, utcnow
from models.tables import Generation, Host, JobRun, Stop, Wake
from models.transition import Unfenced, move
from workflows.base.context import Context
from workflows.base.crash import crashpoint, define
from workflows.base.queue import enqueue_wake
from workflows.generations.slots import MAX_INSTANCES

RUN = "run"  # the cause of a job run's wake
OVERLAPS = ("skip", "queue", "replace", "allow")
MAX_AT_ONCE = MAX_INSTANCES  # overlap allow: runs of one job at once, each in its slot
REPLACED = "replaced by run #"
BY_ROW = Unfenced("a run row moves by its own state; the host's row lock orders its writers")

QUEUED = define("job.queued", "a run due while the last one runs is written queued "
                "(overlap queue, or replace with the replaced run's row marked)")
DEQUEUED = define("job.dequeued", "a queued run is written due with its wake: no run of "
                  "its job is open; nothing of it exec'd yet")
REPLACING = define("job.replacing", "the stop of the replaced run's instance is written; "
                   "nothing signalled yet")


def check_overlap(kind: str, overlap: str | None) -> dict[str, str]:
    """The overlap column from `--overlap` (None: not given), checked (BadInput)."""
    if overlap is None:
        return {}
    if kind != "job":
        raise BadInput(f"--overlap is for a job; this host is a {kind}",
                       "add it with --kind job, or drop --overlap")
    if overlap not in OVERLAPS:
        raise BadInput(f"--overlap {overlap}: not a policy",
                       "give --overlap skip, queue, replace or allow")
    return {"overlap": overlap}


@dataclass(frozen=True)
class Placed:
    """Where a new run goes: due (in `slot`), queued (behind or replacing `other`) or
    skipped (with `reason`)."""

    state: RunState
    slot: int = 0
    reason: str | None = None
    other: int | None = None  # the open run it waits on, replaces, or was skipped for
    replaces: int | None = None  # overlap replace: the open run it replaces


def place(s: Session, host: str) -> Placed:
    """The new run's place by the host's policy, its row locked first (PostgreSQL: two
    writers of one job would both see no open run; SQLite's one writer already orders them)."""
    policy = s.execute(select(Host.overlap).where(Host.name == host).with_for_update()).scalar_one()
    last = s.execute(select(JobRun.id, JobRun.scheduled_at).where(
        JobRun.host == host, JobRun.state.in_(OPEN_RUN)).order_by(JobRun.id.desc()).limit(1)).first()
    if policy == "allow":
        slot = _free_slot(s, host)
        if slot is None:
            return Placed(RunState.skipped, reason=f"{MAX_AT_ONCE} runs of it run at once: "
                          "overlap allow", other=last.id if last else None)
        return Placed(RunState.due, slot)
    waiting = s.execute(select(JobRun.id, JobRun.reason).where(
        JobRun.host == host, JobRun.state == RunState.queued).order_by(JobRun.id).limit(1)).first()
    if last is None and waiting is None:
        return Placed(RunState.due)
    if waiting is not None:  # one waits already (or waits to be made due): one at most
        return Placed(RunState.skipped, reason=f"run #{waiting.id} already waits "
                      f"({waiting.reason}): overlap {policy} keeps one waiting",
                      other=last.id if last else waiting.id)
    last = present(last, "an open run read in this commit")
    if policy == "skip":
        return Placed(RunState.skipped, reason=f"run #{last.id} (of "
                      f"{last.scheduled_at.isoformat()}) still runs: overlap skip", other=last.id)
    if policy == "queue":
        return Placed(RunState.queued, reason=f"behind run #{last.id}: overlap queue", other=last.id)
    return Placed(RunState.queued, reason=f"replaces run #{last.id}: overlap replace",
                  other=last.id, replaces=last.id)


def write_run(s: Session, host: str, instant: datetime, cause: str) -> JobRun:
    """The run of `instant`: due with its wake (one commit, before anything runs), or, when
    a run of the host is still open, by its overlap policy (`place`): skipped, queued,
    queued to replace it, or due beside it (allow: in a free slot). Raises IntegrityError when
    that instant already has its row (another writer got there first)."""
    now = utcnow()
    placed = place(s, host)
    row = dict(host=host, scheduled_at=instant, cause=cause, since=now, next_attempt_at=now)
    if placed.state is not RunState.due:
        run = JobRun(state=placed.state, reason=placed.reason, **row,
                     **({"ended_at": now} if placed.state is RunState.skipped else {}))
        s.add(run)
        s.flush()
        kind = "run_skipped" if placed.state is RunState.skipped else "run_queued"
        emit(s, kind, host, run=run.id, scheduled_at=instant.isoformat(), running=placed.other,
             reason=placed.reason)
        if placed.replaces is not None:
            mark_replaced(s, placed.replaces, run.id)
        return run
    wake = enqueue_wake(s, host, RUN, slot=placed.slot)
    s.flush()
    run = JobRun(state=RunState.due, wake_id=wake.id, **row)
    s.add(run)
    s.flush()
    emit(s, "run_due", host, run=run.id, wake=wake.id, scheduled_at=instant.isoformat(), cause=cause,
         **({"slot": placed.slot} if placed.slot else {}))
    return run


def _free_slot(s: Session, host: str) -> int | None:
    """The lowest slot with no live generation and no open wake (a run just ended is a live
    generation until proven gone: its slot is not reused before)."""
    busy = set(s.execute(select(Generation.slot).where(
        Generation.host == host, Generation.state.in_(LIVE_GEN))).scalars())
    busy |= set(s.execute(select(Wake.slot).where(
        Wake.host == host, Wake.state.in_(OPEN_WAKE))).scalars())
    return next((n for n in range(MAX_AT_ONCE) if n not in busy), None)


def mark_replaced(s: Session, replaced: int, by: int) -> None:
    """In the new run's commit: the run it replaces says so (its end keeps the reason),
    guarded by the state it was read in (LostRace: it ended meanwhile; the write is retried)."""
    state = s.execute(select(JobRun.state).where(JobRun.id == replaced)).scalar_one()
    move(s, JobRun, {"id": replaced, "state": state}, {"reason": f"{REPLACED}{by}"},
         f"run #{replaced} to be replaced by run #{by}", fence=BY_ROW)


def replaced_reason(run: JobRun, gen: Generation | None) -> str | None:
    """A run ended by the stop its replacement wrote: `replaced by run #N` (a run that
    ended by itself first keeps its own end)."""
    if run.reason and run.reason.startswith(REPLACED) and gen is not None \
            and gen.end_reason == "stopped":
        return run.reason
    return None


# -- after a run: the queued one goes on ------------------------------------------------------


def follow_queued(ctx: Context) -> None:
    """Each job with a queued run: made due once no run of it is open (ended `interrupted`
    if the job was stopped meanwhile), or (replace) the stop of the run it replaces written.
    Decided first in a read (a queued run waiting on a long run costs no write lock each
    turn), then again under the host's row lock in the commit that acts, one job a commit."""
    hosts = ctx.store.read(lambda s: [h for h in s.execute(select(JobRun.host).where(
        JobRun.state == RunState.queued).distinct()).scalars() if _next_step(s, h) is not None])
    for host in sorted(hosts):
        try:
            point = ctx.store.write(partial(follow_one, host=host))
        except (IntegrityError, LostRace):
            continue  # another agent moved it first: its next turn reads it again
        if point is not None:
            crashpoint(point)


@dataclass(frozen=True)
class Step:
    action: str  # due | end (its job stopped) | stop (the run it replaces)
    queued: JobRun
    replaced: JobRun | None = None  # stop: the run it replaces
    gen: Generation | None = None  # ... and that run's generation, current


def _next_step(s: Session, host: str) -> Step | None:
    """What a job's oldest queued run needs now (reads only), None: it waits."""
    desired = s.execute(select(Host.desired).where(Host.name == host)).scalar()
    queued = s.execute(select(JobRun).where(JobRun.host == host, JobRun.state == RunState.queued)
                       .order_by(JobRun.id).limit(1)).scalar_one_or_none()
    if desired is None or queued is None:
        return None
    if desired is not Desired.up:
        return Step("end", queued)
    last = s.execute(select(JobRun).where(JobRun.host == host, JobRun.state.in_(OPEN_RUN))
                     .order_by(JobRun.id.desc()).limit(1)).scalar_one_or_none()
    if last is None:
        return Step("due", queued)
    if last.reason != f"{REPLACED}{queued.id}" or last.generation_id is None:
        return None  # it waits behind the run (queue), or for the run it replaces to start
    gen = s.get(Generation, last.generation_id)
    if gen is None or gen.state is not GenState.current or s.execute(select(Stop.id).where(
            Stop.host == host, Stop.state.in_(OPEN_STOP))).first() is not None:
        return None  # not current yet (a failed start needs no stop), or a stop is under way
    return Step("stop", queued, last, gen)


def follow_one(s: Session, *, host: str) -> str | None:
    """The job's queued run moved on, under its host's row lock: due, interrupted, or the
    stop of the run it replaces written; returns the crash point, None: it still waits."""
    s.execute(select(Host.name).where(Host.name == host).with_for_update())
    step = _next_step(s, host)
    if step is None:
        return None
    if step.action == "stop" and step.replaced is not None and step.gen is not None:
        _stop_replaced(s, step.replaced, step.gen, step.queued.id)
        return REPLACING
    if step.action == "due":
        _make_due(s, step.queued)
    else:
        _end_queued(s, step.queued)
    return DEQUEUED


def _make_due(s: Session, run: JobRun) -> None:
    wake = enqueue_wake(s, run.host, RUN)
    s.flush()
    move(s, JobRun, {"id": run.id}, {"state": RunState.due, "wake_id": wake.id,
                                     "since": utcnow(), "next_attempt_at": utcnow()},
         f"run #{run.id} queued -> due", fence=BY_ROW, col="state", frm=RunState.queued)
    emit(s, "run_due", run.host, run=run.id, wake=wake.id, scheduled_at=run.scheduled_at.isoformat(),
         cause=run.cause, was="queued")


def _end_queued(s: Session, run: JobRun) -> None:
    move(s, JobRun, {"id": run.id}, {"state": RunState.interrupted, "ended_at": utcnow(),
                                     "reason": "cancelled by a stop (executed: no); not run"},
         f"run #{run.id} queued -> interrupted", fence=BY_ROW, col="state", frm=RunState.queued)
    emit(s, "run_ended", run.host, run=run.id, exit_code=None, result=RunState.interrupted.value,
         scheduled_at=run.scheduled_at.isoformat())


def _stop_replaced(s: Session, run: JobRun, gen: Generation, by: int) -> None:
    """The stop of the replaced run's instance (its slot: the job stays enabled, its wakes
    are left be)."""
    now = utcnow()
    st = Stop(host=run.host, state=StopState.queued, since=now, next_attempt_at=now,
              created_at=now, slot=gen.slot, reason=f"{REPLACED}{by}")
    s.add(st)
    s.flush()
    emit(s, "run_replacing", run.host, gen.id, run=run.id, by=by, stop=st.id, pid=gen.pid)
