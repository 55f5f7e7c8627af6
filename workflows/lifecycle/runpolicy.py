"""A job run's bound and its second chances (issue 40, item 4): `--timeout PERIOD` and
`--retries N` (Host.run_timeout, Host.run_retries; JobRun.tries; migration 0041).

Timeout. A run still running past its row's `started_at` plus the host's `run_timeout` is
ended by the stop path: one commit writes the intent (its generation current -> retiring,
a retiring member of its host's operation set, the run's reason naming the timeout), then
the member's drive ends it as a stop does (workflows/lifecycle/members.py drive_member:
the host's stop signal or command, the drain timeout, SIGKILL to its whole containment,
the proof), and the run is recorded failed by its close (workflows/lifecycle/jobs.py).
The deadline is read from the row each turn, never kept in a timer: an agent killed at
any instant finds the same deadline, already passed or not.

Retries. A try that failed by itself (a known non-zero exit status or a signal, or its
start failed) is started again, same row, while `tries` is below the host's `run_retries`:
the row goes back to `due` with a new wake due after the restart backoff (floor * 2**n,
capped, ±20 %: workflows/lifecycle/restarts.py restart_delay), `tries` + 1, in one commit
(crash point job.retried); it stays owed in `pending_obligations` meanwhile. Never
retried: a run ended by a stop or by its timeout (a run that overran once likely overruns
again: each try would cost the whole bound), one whose exit status is unknown (adopted
after an agent's death: it may have succeeded; at most once when unsure), an interrupted
one, and any while a stop of its host is open or a scheduled run's job is disabled.
"""

from __future__ import annotations

import math
from datetime import datetime, timedelta
from functools import partial

from sqlalchemy import select
from sqlalchemy.orm import Session

from models.errors import BadInput, LostRace, present
from models.states import OPEN_STOP, Desired, GenState, MemberRole, RunState
from models.store import emit, utcnow
from models.tables import Generation, Host, JobRun, Lease, Stop
from models.transition import Fence, Unfenced, move
from workflows.base.context import Context
from workflows.base.crash import crashpoint, define
from workflows.base.queue import enqueue_wake
from workflows.generations.create import join_set
from workflows.leases.lease import held_fence
from workflows.lifecycle.restarts import restart_delay

MAX_RETRIES = 100  # beyond, a run that fails that often is a worker with a restart policy
MAX_TIMEOUT = 366 * 86400.0
TIMED_OUT = "timeout: "  # the words a timed-out run's reason starts with
BY_ROW = Unfenced("a run row moves by its own state; its wake and generation carry the fence")

TIMEOUT = define("job.timeout", "a run past its --timeout: its generation retiring and a member "
                 "(the stop path's intent), its reason written; nothing signalled yet")
RETRIED = define("job.retried", "a failed try's row is due again with its next wake (tries + 1); "
                 "nothing of the next try exec'd yet")


def check_run_policy(kind: str, timeout: float | None, retries: int | None) -> dict[str, object]:
    """A job's --timeout (seconds) and --retries, checked (BadInput, one line); the columns
    to write ({} for a host that is not a job and gave neither)."""
    given = [o for o, v in (("--timeout", timeout), ("--retries", retries)) if v is not None]
    if kind != "job":
        if given:
            raise BadInput(f"{given[0]} is for a job; this host is a {kind}",
                           "add it with --kind job, or drop " + given[0])
        return {}
    if timeout is not None and not (math.isfinite(timeout) and 1 <= timeout <= MAX_TIMEOUT):
        raise BadInput(f"--timeout {timeout:g}: a run's bound is between 1 s and 366 days",
                       "give e.g. --timeout 30m")
    if retries is not None and not 0 <= retries <= MAX_RETRIES:
        raise BadInput(f"--retries {retries}: a run is tried again 0 to {MAX_RETRIES} times",
                       "give e.g. --retries 2")
    return {"run_timeout": timeout, "run_retries": retries or 0}


# -- timeout ----------------------------------------------------------------------------------


def time_out_runs(ctx: Context) -> datetime | None:
    """End every run of this agent's hosts that is past its deadline (each in a commit of its
    own); returns the next deadline to come (None: no running run has one)."""
    now = utcnow()
    rows = ctx.store.read(lambda s: s.execute(
        select(JobRun.id, JobRun.started_at, Host.run_timeout)
        .join(Host, Host.name == JobRun.host).join(Lease, Lease.host == JobRun.host)
        .where(JobRun.state == RunState.running, JobRun.started_at.is_not(None),
               Host.run_timeout.is_not(None), Lease.holder == ctx.agent_id)).all())
    deadlines = [(r.id, r.started_at + timedelta(seconds=r.run_timeout)) for r in rows]
    for run_id, at in deadlines:
        if at > now:
            continue
        try:
            if ctx.store.write(partial(_time_out, ctx, run_id)):
                crashpoint(TIMEOUT)
        except LostRace:  # it ended, or the lease moved, meanwhile: nothing to end here
            continue
    return min((at for _, at in deadlines if at > now), default=None)


def _time_out(ctx: Context, run_id: int, s: Session) -> bool:
    """The intent: the run's generation retiring and a member (the member's drive ends and
    proves it by the stop path), the run's reason naming the timeout. False: nothing to end
    (the run is no longer running on a current generation, or the lease is not ours)."""
    run = s.get(JobRun, run_id)
    gen = s.get(Generation, run.generation_id) if run and run.generation_id else None
    host = s.get(Host, run.host) if run else None
    fence = held_fence(s, ctx, run.host) if run else None
    if run is None or run.state is not RunState.running or gen is None or host is None \
            or gen.state is not GenState.current or fence is None or host.run_timeout is None:
        return False
    why = f"{TIMED_OUT}ran past its --timeout {host.run_timeout:g} s"
    move(s, Generation, {"id": gen.id}, {"state": GenState.retiring, "end_reason": why},
         f"generation g{gen.id} current -> retiring (run #{run.id} timed out)",
         fence=Fence(run.host, ctx.agent_id, fence), col="state", frm=GenState.current)
    join_set(s, gen.id, run.host, MemberRole.retiring, fence)
    move(s, JobRun, {"id": run.id}, {"reason": why}, f"run #{run.id} timed out", fence=BY_ROW,
         col="state", frm=RunState.running)
    emit(s, "run_timeout", run.host, gen.id, run=run.id, pid=gen.pid, timeout=host.run_timeout,
         scheduled_at=run.scheduled_at.isoformat())
    return True


# -- retries ----------------------------------------------------------------------------------


def may_retry(s: Session, run: JobRun) -> bool:
    """Whether a try that failed by itself is started again (the caller knows it failed so:
    a known non-zero status, or a failed start)."""
    host = s.get(Host, run.host)
    if host is None or run.tries >= host.run_retries or (run.reason or "").startswith(TIMED_OUT):
        return False
    if host.desired is not Desired.up and run.cause == "schedule":
        return False  # its job was disabled (`vigil stop`): no new try of its schedule
    stopping = s.execute(select(Stop.id).where(Stop.host == run.host,
                                               Stop.state.in_(OPEN_STOP))).first()
    return stopping is None


def note_exit(s: Session, run: JobRun, code: int, why: str) -> None:
    """In the commit that retires the try's generation: its exit status, kept on the row
    (still running) for the close that retries it in a step of its own (job.retried)."""
    move(s, JobRun, {"id": run.id}, {"exit_status": code, "reason": why},
         f"run #{run.id} try {run.tries + 1} exited {code}", fence=BY_ROW, col="state",
         frm=run.state)


def retry(s: Session, run: JobRun, why: str, cause: str) -> str:
    """The row due again with a new wake (of `cause`) after the restart backoff, tries + 1;
    returns the crash point to reach after the commit."""
    host = present(s.get(Host, run.host), f"host {run.host}, read by may_retry in this commit")
    n = run.tries + 1  # the try that failed
    delay = restart_delay(host, run.tries)
    wake = enqueue_wake(s, run.host, cause, delay=delay)
    s.flush()
    values: dict[str, object] = {
        "tries": n, "wake_id": wake.id, "generation_id": None, "exit_status": None,
        "reason": f"try {n} failed ({why}); try {n + 1} of {host.run_retries + 1} "
                  f"after {delay:.1f} s"}
    if run.state is RunState.running:
        values["state"] = RunState.due
    move(s, JobRun, {"id": run.id}, values, f"run #{run.id} try {n} failed: due again",
         fence=BY_ROW, col="state", frm=run.state)
    emit(s, "run_retry", run.host, run.generation_id, run=run.id, tries=n, delay=round(delay, 3),
         reason=why, wake=wake.id, scheduled_at=run.scheduled_at.isoformat())
    return RETRIED
