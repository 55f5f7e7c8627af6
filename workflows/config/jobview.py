"""What `vigil status` (table and JSON), `host show`, `top`, the page and the metrics say of a
job (issue 40, item 5): its next run and how its last run ended, so a job between runs is
`scheduled`, not `asleep`.

`JobFacts` reads the runs of every job named in three grouped queries, whatever their
number (hostrows.Facts reads it with the rest). A job's last run is its newest run that ran
or was started (done, failed, interrupted): a skipped or missed instant does not hide how the
run before it ended; `vigil runs NAME` lists those."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from models.durations import iso
from models.errors import NotFound
from models.states import Desired, RunState
from models.tables import Host, JobRun
from workflows.lifecycle.jobs import is_job, next_instant

RAN = (RunState.done, RunState.failed, RunState.interrupted)  # a last result


@dataclass
class JobFacts:
    """The runs of the jobs among `hosts`, read at once."""

    last: dict[str, JobRun] = field(default_factory=dict)  # its newest run that ran
    success: dict[str, datetime] = field(default_factory=dict)  # its last run done: its end
    running: dict[str, JobRun] = field(default_factory=dict)  # its open run (due or running)

    @classmethod
    def read(cls, s: Session, hosts: list[Host]) -> JobFacts:
        names = [h.name for h in hosts if is_job(h)]
        out = cls()
        if not names:
            return out
        newest = (select(func.max(JobRun.id)).where(JobRun.host.in_(names),
                                                    JobRun.state.in_(RAN))
                  .group_by(JobRun.host).scalar_subquery())
        out.last = {r.host: r for r in s.execute(select(JobRun).where(JobRun.id.in_(newest)))
                    .scalars()}
        out.success = dict(s.execute(  # type: ignore[arg-type]
            select(JobRun.host, func.max(JobRun.ended_at)).where(
                JobRun.host.in_(names), JobRun.state == RunState.done).group_by(JobRun.host)).all())
        for r in s.execute(select(JobRun).where(JobRun.host.in_(names), JobRun.state.in_(
                (RunState.due, RunState.running))).order_by(JobRun.id)).scalars():
            out.running.setdefault(r.host, r)
        return out


def enabled(h: Host) -> bool:
    """`vigil wake` enabled its schedule and no stop disabled it since."""
    return is_job(h) and h.desired is Desired.up and h.runs_from is not None


def job_status(facts: JobFacts, h: Host, now: datetime) -> dict[str, Any]:
    """A job's part of its status row: `next_run` (None while disabled), `last_run` (how
    its newest run that ran ended), `last_success` (when its last run done ended) and
    `run` (the run in flight, if one is)."""
    if not is_job(h):
        return {}
    nxt = next_instant(h, now) if enabled(h) else None
    last, open_ = facts.last.get(h.name), facts.running.get(h.name)
    return {"next_run": iso(nxt), "last_success": iso(facts.success.get(h.name)),
            "last_run": None if last is None else {
                "id": last.id, "state": last.state.value, "scheduled_at": iso(last.scheduled_at),
                "ended_at": iso(last.ended_at), "exit_status": last.exit_status,
                "duration": last.duration, "reason": last.reason},
            "run": None if open_ is None else {
                "id": open_.id, "state": open_.state.value,
                "scheduled_at": iso(open_.scheduled_at)}}


def runs_by_result(s: Session) -> dict[tuple[str, str], int]:
    """(host, state) -> how many of its runs the store holds in that state (the metrics'
    vigil_job_runs_total; open runs count as their state: due, running, queued)."""
    return {(host, state.value): n for host, state, n in s.execute(
        select(JobRun.host, JobRun.state, func.count()).group_by(JobRun.host, JobRun.state))}


def run_generation(s: Session, host: str, run_id: int) -> int:
    """`vigil logs HOST --run N`: the generation run N of the job ran as (its output is
    that generation's), refused in one line when it has none."""
    run = s.get(JobRun, run_id)
    if run is None or run.host != host:
        if s.get(Host, host) is None:
            raise NotFound(f"no host named {host!r}", "see `vigil host list`")
        raise NotFound(f"{host} has no run #{run_id}", f"see its runs with `vigil runs {host}`")
    if run.generation_id is None:
        raise NotFound(f"run #{run_id} of {host} is {run.state.value}: nothing of it ran, so it "
                       "has no output", f"see its runs with `vigil runs {host}`")
    return run.generation_id
