"""Jobs: hosts that run their build on a schedule (`--every S` or a `--schedule` cron line),
every run a row of `job_runs` (issue 40).

A run's row and the wake that starts it are written in one commit (the intent) before
anything of it runs; the row is unique per (host, scheduled instant), so no instant is ever
started twice, whoever writes it. Which instant is due is derived from the schedule and the
last instant recorded (not from a timer's memory): an agent that died finds the same answer.
The instants missed while no agent ran are run or recorded `missed` by the job's catch-up
policy (workflows/lifecycle/catchup.py), oldest first. A run due
while the last one still runs meets its overlap policy (workflows/lifecycle/job_overlap.py).

The run itself is the host's wake (cause `run`), a worker's start: its generation is current
while it runs (adopted after an agent's death like any other), ended by its exit or the stop
path. A wake of a run interrupted before its pid was written is reaped; its exec claim decides
(workflows/lifecycle/failed_wake.py never_ran): voided first, the build never ran and the
same run is started again; taken by its shim, it may have run: recorded `interrupted`, never
tried again. `close_runs` moves
every open run by what its wake and generation say, so no path that ends either one needs
to know about runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from models.errors import BadInput, NotFound
from models.states import OPEN_RUN, OWED_RUN, Desired, GenState, RunState, WakeState
from models.store import emit, utcnow
from models.tables import Generation, Host, JobRun, Wake
from models.transition import Unfenced, move
from workflows.base.context import Context
from workflows.base.crash import crashpoint, define
from workflows.leases.placement import may_hold
from workflows.lifecycle.catchup import CATCH_UP, Plan, plan, write_missed
from workflows.lifecycle.job_overlap import QUEUED, follow_queued, replaced_reason, write_run
from workflows.lifecycle.job_overlap import RUN as RUN  # the cause of a run's wake, said here too
from workflows.lifecycle.runpolicy import may_retry, note_exit, retry, time_out_runs

SCHEDULED = "schedule"  # a run's cause: its schedule (or `vigil run`: MANUAL)
MANUAL = "manual"
ENV_INSTANT = "VIGIL_SCHEDULED_AT"  # the run's scheduled instant, ISO 8601 UTC, in its env
EPOCH = datetime(1970, 1, 1)
BY_RUN = Unfenced("a run row moves by its own state; its wake and generation carry the fence")
FIX_CRON = ("give five crontab fields: minute hour day-of-month month day-of-week, "
            "e.g. --schedule '30 4 * * *'")

DUE = define("job.due", "a run's row and its wake are written (due); nothing of it exec'd yet")
SKIPPED = define("job.skipped", "a run due while the last one runs is written skipped")
STARTED = define("job.started", "a run's generation is current: the run is written running")
ENDED = define("job.ended", "a run's end (exit status, duration) is written")
MISSED = define("job.missed", "the instants missed while no agent ran are written: one row, "
                "missed, at the last of them (catchup.py)")


# -- the schedule ---------------------------------------------------------------------------


def is_job(host: Any) -> bool:
    """A job is stored as a worker whose schedule is set (migration 0040)."""
    return host.every is not None or host.schedule is not None


def kind_of(host: Any) -> str:
    return "job" if is_job(host) else host.kind.value


def check_job(kind: str, every: float | None, schedule: str | None,
              timezone: str | None) -> dict[str, Any]:
    """The job's columns from `--kind` and its schedule options, checked (BadInput)."""
    given = [o for o, v in (("--every", every), ("--schedule", schedule),
                            ("--timezone", timezone)) if v is not None]
    if kind != "job":
        if given:
            raise BadInput(f"{given[0]} is for a job; this host is a {kind}",
                           "add it with --kind job, or drop " + given[0])
        return {}
    if (every is None) == (schedule is None):
        raise BadInput("a job runs --every SECONDS or on --schedule CRON: give one of them"
                       + (", not both" if every is not None else ""),
                       "e.g. --every 10m, or --schedule '*/5 * * * *'")
    if every is not None and not (math.isfinite(every) and 1 <= every <= 366 * 86400):
        raise BadInput(f"--every {every:g}: a job runs at most once a second and at least "
                       "once a year", "give --every between 1s and 366d")
    zone = _zone(timezone)
    if schedule is not None:
        _cron(schedule, zone)
    return {"every": every, "schedule": schedule, "timezone": timezone, "one_shot": False}


UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_every(value: object, label: str = "--every ") -> float:
    """A job's period: seconds as a number, or with a unit: 90, 90s, 10m, 1h, 1d."""
    text = str(value).strip().lower()
    unit = UNITS.get(text[-1:], 0)
    try:
        seconds = float(text[:-1] if unit else text) * (unit or 1)
    except ValueError:
        raise BadInput(f"{label}{value}: not a period", "give seconds or a number with s, m, "
                       "h or d: e.g. 90, 10m, 1h") from None
    return seconds


def _zone(name: str | None) -> ZoneInfo:
    try:
        return ZoneInfo(name or "UTC")
    except (ZoneInfoNotFoundError, ValueError):
        raise BadInput(f"--timezone {name}: no such time zone",
                       "give an IANA name, e.g. --timezone Europe/Paris (default UTC)") from None


def _cron(expr: str, zone: ZoneInfo) -> Any:
    from apscheduler.triggers.cron import CronTrigger

    try:
        trigger = CronTrigger.from_crontab(expr, timezone=zone)
    except ValueError as exc:
        raise BadInput(f"--schedule {expr!r} is not a cron line ({exc})", FIX_CRON) from None
    if trigger.get_next_fire_time(None, datetime.now(UTC)) is None:  # e.g. 31 February
        raise BadInput(f"--schedule {expr!r} never fires", FIX_CRON)
    return trigger


def next_instant(host: Any, after: datetime) -> datetime | None:
    """The first instant of the schedule strictly after `after` (naive UTC, as the store).
    `--every S` instants are whole multiples of S since the epoch, so every agent and box
    derives the same ones."""
    if host.every is not None:
        step = round(host.every * 1e6)
        k = (after - EPOCH) // timedelta(microseconds=1) // step + 1
        return EPOCH + timedelta(microseconds=k * step)
    trigger = _cron(host.schedule, _zone(host.timezone))
    nxt = trigger.get_next_fire_time(None, after.replace(tzinfo=UTC) + timedelta(microseconds=1))
    return None if nxt is None else nxt.astimezone(UTC).replace(tzinfo=None)


LATE_FLOOR, LATE_SHARE, LATE_CAP = 1.0, 0.10, 60.0  # run_late: see late_bound


def late_bound(host: Any, instant: datetime) -> float:
    """Seconds a run may start after its instant before it is late (`--on run_late`):
    a tenth of its period (the gap to the next instant), at least 1 s (vigil's own start
    takes a fraction of it) and at most 60 s (an hour's delay of a daily job is news)."""
    nxt = next_instant(host, instant)
    period = (nxt - instant).total_seconds() if nxt is not None else LATE_CAP / LATE_SHARE
    return max(LATE_FLOOR, min(LATE_SHARE * period, LATE_CAP))


def heard_start(s: Session, run: JobRun, started: datetime | None, gen_id: int | None) -> None:
    """A run of its schedule that started past its late bound: a `run_late` event, in the
    commit that records its start (a manual run's instant is its asking, a retry's start
    its backoff: never late)."""
    host = s.get(Host, run.host)
    if started is None or run.cause == MANUAL or run.tries or host is None or not is_job(host):
        return
    late, bound = (started - run.scheduled_at).total_seconds(), late_bound(host, run.scheduled_at)
    if late > bound:
        emit(s, "run_late", run.host, gen_id, run=run.id, scheduled_at=run.scheduled_at.isoformat(),
             late_by=round(late, 3), bound=bound)


# -- the runs' rows ---------------------------------------------------------------------------


def enable(s: Session, host: Host) -> None:
    """`vigil wake` of a job: its schedule runs from now (no instant before it is due)."""
    move(s, Host, {"name": host.name}, {"runs_from": utcnow()}, f"job {host.name} enabled",
         fence=Unfenced("the operator's intent: when its schedule starts"))
    emit(s, "job_enabled", host.name, every=host.every, schedule=host.schedule)


def request_run(s: Session, host: str) -> JobRun:
    """`vigil run NAME`: a run now, outside the schedule (while one runs: by its overlap)."""
    h = s.get(Host, host)
    if h is None:
        raise NotFound(f"no host named {host!r}", "see `vigil host list`")
    if not is_job(h):
        raise BadInput(f"host {host} is a {h.kind.value}, not a job: it has no runs",
                       f"start it with `vigil wake {host}`")
    return write_run(s, host, utcnow(), MANUAL)


def bind_run(s: Session, wake_id: int, gen_id: int) -> None:
    """In the run's generation intent: the run names its generation (before it is exec'd),
    once: a run whose wake is reaped is never started again (failed_wake.reap_interrupted)."""
    move(s, JobRun, {"wake_id": wake_id, "state": RunState.due, "generation_id": None},
         {"generation_id": gen_id}, f"run of wake #{wake_id} names g{gen_id}",
         fence=Unfenced("the wake's intent, in this commit, carries the fence"))


def run_exited(s: Session, gen: Generation, code: int | None, why: str) -> None:
    """A run's generation exited (in the transaction that retires it): its end, with the
    exit status when this agent knows it."""
    run = s.execute(select(JobRun).where(JobRun.generation_id == gen.id,
                                         JobRun.state.in_(OPEN_RUN))).scalar_one_or_none()
    if run is not None:
        if code not in (None, 0) and may_retry(s, run):  # retried by close_runs (runpolicy.py)
            note_exit(s, run, code, why)
            return
        _end(s, run, gen, code, why)


def _end(s: Session, run: JobRun, gen: Generation | None, code: int | None, why: str) -> None:
    now = utcnow()
    started = run.started_at or (gen.current_at if gen is not None else None)
    state = RunState.done if code == 0 else RunState.failed
    replaced = replaced_reason(run, gen)  # ended by its replacement's stop: failed, saying so
    if replaced is not None:
        state, why = RunState.failed, replaced
    if run.started_at is None:  # ended before a tick saw it running: its start is heard here
        heard_start(s, run, started, run.generation_id)
    move(s, JobRun, {"id": run.id},
         {"state": state, "ended_at": now, "exit_status": code, "started_at": started,
          "duration": (now - started).total_seconds() if started else None, "reason": why},
         f"run #{run.id} {run.state.value} -> {state.value}", fence=BY_RUN, col="state",
         frm=run.state)
    emit(s, "run_ended", run.host, run.generation_id, run=run.id, exit_code=code,
         result=state.value, scheduled_at=run.scheduled_at.isoformat())


# -- the agent's tick ---------------------------------------------------------------------------


def tick(ctx: Context, up_since: datetime | None = None,
         wrote: Callable[[], None] = lambda: None) -> datetime | None:
    """Write the run of every job due now (each host in a commit of its own: a row another
    box wrote first is left to it), move the open runs by their wakes and generations, and
    say when the next instant of any job comes (None: no job is enabled here)."""
    deadline = close_runs(ctx)  # a running run's --timeout, the timer woken for it too
    follow_queued(ctx)  # a queued run goes on once the one before it ended (job_overlap.py)
    # The instants after the runs' ends are moved: a run that ended while no agent ran no
    # longer holds back the instants missed behind it (catch-up all).
    now = utcnow()
    since = up_since or now
    hosts = ctx.store.read(lambda s: _enabled(s, ctx.agent_id))
    for h in hosts:  # read first: a job with nothing to write takes no write lock
        p = plan(h, partial(next_instant, h), h.last, now, since)
        # the missed instants' row, then the run: oldest first, a commit each
        for step in [s for s, due in ((MISSED, p.missed), (DUE, p.run)) if due is not None]:
            try:
                point = ctx.store.write(partial(_write_due, h.name, step, now, since))
            except IntegrityError:
                break  # an instant has its row already (another box): never twice
            if point is not None:
                crashpoint(point)
            if point == DUE:
                wrote()  # a wake is owed: a round now, not at the next sweep
    later = utcnow()
    return min((t for t in [deadline, *(next_instant(h, max(later, h.last or later)) for h in hosts)]
                if t is not None), default=None)


def _write_due(host: str, step: str, now: datetime, up_since: datetime,
               s: Session) -> str | None:
    """One step of the plan of `host` (MISSED: the missed instants' row; DUE: the run),
    the plan made again in its commit (its last instant and runs owed read afresh)."""
    h = next(iter(_enabled(s, None, host)), None)
    p = Plan() if h is None else plan(h, partial(next_instant, h), h.last, now, up_since)
    if step == MISSED and p.missed is not None and h is not None:
        write_missed(s, host, p.missed, h.catch_up)
        return MISSED
    if step == DUE and p.missed is None and p.run is not None:
        state = write_run(s, host, p.run, p.cause).state
        return {RunState.due: DUE, RunState.queued: QUEUED}.get(state, SKIPPED)
    return None


@dataclass(frozen=True)
class Enabled:
    name: str
    every: float | None
    schedule: str | None
    timezone: str | None
    runs_from: datetime | None
    last: datetime | None  # the last instant its schedule recorded
    catch_up: str = "one"  # none | one | all (catchup.py)
    catch_up_window: float | None = None
    owed: tuple[str, ...] = ()  # the causes of its runs owed now


def _enabled(s: Session, agent_id: str | None, only: str | None = None) -> list[Enabled]:
    """The jobs enabled that this agent may run (agent_id None: any), or the one named."""
    last = (select(func.max(JobRun.scheduled_at)).where(
        JobRun.host == Host.name, JobRun.cause.in_((SCHEDULED, CATCH_UP))).scalar_subquery())
    rows = s.execute(select(Host.name, Host.every, Host.schedule, Host.timezone, Host.runs_from,
                            Host.box, Host.catch_up, Host.catch_up_window, last.label("last"))
                     .where((Host.every.is_not(None)) | (Host.schedule.is_not(None)),
                            Host.desired == Desired.up, Host.runs_from.is_not(None),
                            *([Host.name == only] if only is not None else []))).all()
    owed: dict[str, list[str]] = {}
    for host, cause in s.execute(select(JobRun.host, JobRun.cause).where(
            JobRun.state.in_(OWED_RUN), *([JobRun.host == only] if only is not None else []))):
        owed.setdefault(host, []).append(cause)
    return [Enabled(r.name, r.every, r.schedule, r.timezone, r.runs_from, r.last, r.catch_up,
                    r.catch_up_window, tuple(owed.get(r.name, ())))
            for r in rows if agent_id is None or may_hold(r.box, agent_id)]


def close_runs(ctx: Context) -> datetime | None:
    """Every open run moved by what its wake and generation say: current -> running; ended
    (exit, stop, death found after a crash) -> its end; a wake failed -> failed; a wake
    cancelled (interrupted before its pid, or by a stop before it ran) -> interrupted.
    Read first: an agent with no open run takes no write lock for it. Then the runs past
    their --timeout are ended (runpolicy.py); returns the next such deadline."""
    if ctx.store.read(lambda s: s.execute(select(JobRun.id).where(
            JobRun.state.in_(OPEN_RUN)).limit(1)).first()) is None:
        return None
    moved = ctx.store.write(_close_open)
    for point in moved:
        crashpoint(point)
    return time_out_runs(ctx)


def _close_open(s: Session) -> list[str]:
    rows = s.execute(select(JobRun, Wake, Generation)
                     .outerjoin(Wake, Wake.id == JobRun.wake_id)
                     .outerjoin(Generation, Generation.id == JobRun.generation_id)
                     .where(JobRun.state.in_(OPEN_RUN))).all()
    return [p for run, wake, gen in rows if (p := _close_one(s, run, wake, gen)) is not None]


def _close_one(s: Session, run: JobRun, wake: Wake | None, gen: Generation | None) -> str | None:
    ended = gen is not None and gen.state in (GenState.retiring, GenState.proven) \
        and gen.pid is not None
    if gen is not None and gen.state is GenState.current and run.state is RunState.due:
        move(s, JobRun, {"id": run.id}, {"state": RunState.running, "started_at": gen.current_at},
             f"run #{run.id} due -> running", fence=BY_RUN, col="state", frm=RunState.due)
        emit(s, "run_started", run.host, gen.id, run=run.id, pid=gen.pid,
             scheduled_at=run.scheduled_at.isoformat())
        heard_start(s, run, gen.current_at, gen.id)
        return STARTED
    if ended and wake is not None and wake.state is WakeState.done:
        if run.exit_status not in (None, 0) and may_retry(s, run):  # it failed by itself
            return retry(s, run, run.reason or f"exited {run.exit_status}", RUN)
        _end(s, run, gen, run.exit_status, f"ended: {gen.end_reason}" if gen else "ended")  # type: ignore[union-attr]
        return ENDED
    if wake is not None and wake.state is WakeState.failed and may_retry(s, run):
        return retry(s, run, f"its start failed: {wake.reason}", RUN)
    if wake is None or wake.state is WakeState.failed:
        move(s, JobRun, {"id": run.id}, {"state": RunState.failed, "ended_at": utcnow(),
                                         "reason": wake.reason if wake else "its wake is gone"},
             f"run #{run.id} -> failed", fence=BY_RUN, col="state", frm=run.state)
        emit(s, "run_ended", run.host, run.generation_id, run=run.id, exit_code=None,
             result=RunState.failed.value, scheduled_at=run.scheduled_at.isoformat())
        return ENDED
    if wake.state is WakeState.cancelled and run.tries:  # a retry's wake, before it ran
        _end(s, run, None, None, f"{run.reason}; {wake.reason or 'cancelled'}: not tried again")
        return ENDED
    if wake.state is WakeState.cancelled:
        executed = "unknown" if gen is not None else "no"
        move(s, JobRun, {"id": run.id}, {
            "state": RunState.interrupted, "ended_at": utcnow(),
            "reason": f"{wake.reason or 'its start was cancelled'} (executed: {executed}); "
                      "not run again"},
             f"run #{run.id} due -> interrupted", fence=BY_RUN, col="state", frm=RunState.due)
        emit(s, "run_ended", run.host, run.generation_id, run=run.id, exit_code=None,
             result=RunState.interrupted.value, scheduled_at=run.scheduled_at.isoformat())
        return ENDED
    return None


def runs_of(s: Session, host: str, limit: int = 100) -> list[dict[str, Any]]:
    """`vigil runs NAME`: its runs, newest instant first."""
    h = s.get(Host, host)
    if h is None:
        raise NotFound(f"no host named {host!r}", "see `vigil host list`")
    rows = s.execute(select(JobRun).where(JobRun.host == host)
                     .order_by(JobRun.scheduled_at.desc()).limit(limit)).scalars().all()
    return [_run_view(r) for r in rows]


def _run_view(r: JobRun) -> dict[str, Any]:
    def iso(t: datetime | None) -> str | None:
        return None if t is None else t.replace(tzinfo=UTC).isoformat()

    return {"id": r.id, "host": r.host, "scheduled_at": iso(r.scheduled_at), "cause": r.cause,
            "state": r.state.value, "started_at": iso(r.started_at), "ended_at": iso(r.ended_at),
            "exit_status": r.exit_status, "duration": r.duration,
            "generation": r.generation_id, "reason": r.reason, "tries": r.tries}

