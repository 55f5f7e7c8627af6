"""A job's instants missed while no agent ran, and its catch-up policy (`--catch-up
none|one|all`, `--catch-up-window`; issue 40 item 4): which instants the agent's tick
writes, oldest first (workflows/lifecycle/jobs.py tick).

The instants due are those of the schedule after the last one recorded (and after its
enabling), at or before now. One of them is *late* when it passed before this agent's job
timer began (no agent ran then, as far as this box knows) or more than NO_AGENT seconds
before now (the store was out of reach, the box suspended):

- none: the newest instant runs if it is not late; every other one is missed.
- one (the default): the newest runs (once), within the window if one is set; the earlier
  ones are missed.
- all: every instant within the window runs, oldest first, one at a time; at most the
  newest CATCH_UP_CAP of them (a job every second down a day would be 86,400 runs);
  older ones are missed. A late instant waits while a run of the job is owed (never
  skipped for overlapping a run it only follows), and so does an instant on time while a
  catch-up run is owed: the instants due meanwhile run after it, in their order.

The missed instants are one row, at the last of them, its reason giving how many and the
first: a job every second down a day writes one row, not 86,400, and an operator (and
`--on run_missed`) hears of an outage once. The row is a real instant of the schedule, so
the store's unique (host, instant) keeps it, as any run, to one writer; no instant before
it is ever written again (the next ones start after the last recorded).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Protocol

from sqlalchemy.orm import Session

from models.errors import BadInput
from models.states import RunState
from models.store import emit, utcnow
from models.tables import JobRun

POLICIES = ("none", "one", "all")
DEFAULT = "one"
SCHEDULED = "schedule"  # a run's cause: its schedule (jobs.py SCHEDULED)
CATCH_UP = "catch-up"  # a run's cause: an instant late at its turn, run by the policy
CATCH_UP_CAP = 100  # `all`: the newest instants missed that run at most; older: missed
NO_AGENT = 30.0  # seconds: an instant whose turn came later than this had no agent
WALK = 2000  # cron instants walked at most in one turn (28 us each here: ~60 ms)

Next = Callable[[datetime], "datetime | None"]  # the schedule's first instant after one


def check_catch_up(kind: str, catch_up: str | None, window: float | None) -> dict[str, Any]:
    """The catch-up columns from `--catch-up` and `--catch-up-window`, checked (BadInput);
    {} when neither is given."""
    given = [o for o, v in (("--catch-up", catch_up), ("--catch-up-window", window))
             if v is not None]
    if kind != "job" and given:
        raise BadInput(f"{given[0]} is for a job; this host is a {kind}",
                       "add it with --kind job, or drop " + given[0])
    if catch_up is not None and catch_up not in POLICIES:
        raise BadInput(f"--catch-up {catch_up}: not a policy", "give none, one or all")
    if window is not None and not (math.isfinite(window) and 1 <= window <= 366 * 86400):
        raise BadInput(f"--catch-up-window {window:g}: out of range",
                       "give a period between 1s and 366d, e.g. 1h")
    if window is not None and catch_up == "none":
        raise BadInput("--catch-up-window bounds what one or all run; none runs nothing missed",
                       "drop --catch-up-window, or give --catch-up one or all")
    return {k: v for k, v in (("catch_up", catch_up), ("catch_up_window", window))
            if v is not None}


@dataclass(frozen=True)
class Backlog:
    tail: list[datetime]  # the newest instants due (at most keep + 1), oldest first
    count: int  # how many are due in all (at least that many when not exact)
    first: datetime | None  # the oldest due
    exact: bool = True


@dataclass(frozen=True)
class Missed:
    first: datetime
    last: datetime  # the instant its row is written at
    count: int
    exact: bool

    def reason(self, policy: str) -> str:
        many = f"{'' if self.exact else 'at least '}{self.count} instant{'s' if self.count > 1 else ''}"
        span = (f"{self.first.isoformat()}" if self.count == 1
                else f"{self.first.isoformat()} .. {self.last.isoformat()}")
        return f"{many} missed ({span}), not run: catch-up {policy}"


@dataclass(frozen=True)
class Plan:
    missed: Missed | None = None
    run: datetime | None = None  # the instant whose run is written now
    cause: str = SCHEDULED
    waits: bool = False  # an instant is due but waits for the run owed

    @property
    def writes(self) -> bool:
        return self.missed is not None or self.run is not None


class Job(Protocol):
    """What the plan reads of a job (the tick's Enabled)."""

    @property
    def every(self) -> float | None: ...
    @property
    def catch_up(self) -> str: ...
    @property
    def catch_up_window(self) -> float | None: ...
    @property
    def runs_from(self) -> datetime | None: ...
    @property
    def owed(self) -> tuple[str, ...]: ...  # the causes of its runs owed now


def backlog(every: float | None, nxt: Next, anchor: datetime, now: datetime,
            keep: int) -> Backlog:
    """The instants after `anchor`, at or before `now`: the newest keep + 1 and how many."""
    first = nxt(anchor)
    if first is None or first > now:
        return Backlog([], 0, None)
    if every is not None:  # whole multiples of the period: counted, not walked
        step = timedelta(microseconds=round(every * 1e6))
        n = (now - first) // step + 1
        return Backlog([first + k * step for k in range(max(0, n - keep - 1), n)], n, first)
    tail, n, end = _walk(nxt, first, now, keep)
    if end:
        return Backlog(tail, n, first)
    # More than WALK instants since the anchor: the newest are walked from WALK minutes
    # back (a cron line fires at most once a minute), and the count is then a floor.
    start = max(tail[-1], now - timedelta(minutes=WALK))
    newer, m, _ = _walk(nxt, start, now, keep, include_start=False)
    joined = tail + newer if start == tail[-1] or not newer else newer
    return Backlog(joined[-(keep + 1):], n + m, first, exact=False)


def _walk(nxt: Next, start: datetime, now: datetime, keep: int,
          include_start: bool = True) -> tuple[list[datetime], int, bool]:
    """The newest keep + 1 instants from `start` to `now`, how many, and whether `now`
    was reached within WALK steps."""
    tail = [start] if include_start else []
    n, t = len(tail), start
    for _ in range(WALK):
        nt = nxt(t)
        if nt is None or nt > now:
            return tail[-(keep + 1):], n, True
        t = nt
        tail.append(t)
        n += 1
        if len(tail) > 2 * (keep + 1):
            del tail[: len(tail) - (keep + 1)]
    return tail[-(keep + 1):], n, False


def plan(job: Job, nxt: Next, last: datetime | None, now: datetime,
         up_since: datetime) -> Plan:
    """What the tick writes for `job` now: the missed instants' row and the run, if any."""
    anchor = max((t for t in (last, job.runs_from) if t is not None), default=None)
    if anchor is None:
        return Plan()
    keep = CATCH_UP_CAP if job.catch_up == "all" else 1
    b = backlog(job.every, nxt, anchor, now, keep)
    if not b.tail:
        return Plan()

    def late(t: datetime) -> bool:
        return t < up_since or (now - t).total_seconds() > NO_AGENT

    def within(t: datetime) -> bool:
        return job.catch_up_window is None or (now - t).total_seconds() <= job.catch_up_window

    newest = b.tail[-1]
    if job.catch_up == "all":
        runs = [t for t in b.tail[-keep:] if within(t)]
    elif job.catch_up == "none":
        runs = [] if late(newest) else [newest]
    else:
        runs = [newest] if within(newest) else []
    if len(runs) == len(b.tail) and b.count > len(b.tail):  # the one before is unknown
        runs = runs[1:]
    missed = None
    if b.count > len(runs) and b.first is not None:
        before = b.tail[len(b.tail) - len(runs) - 1]
        missed = Missed(b.first, before, b.count - len(runs), b.exact)
    if not runs:
        return Plan(missed)
    run = runs[0]
    caught = late(run) or run != newest
    if job.catch_up == "all" and job.owed and (caught or CATCH_UP in job.owed):
        return Plan(missed, waits=True)
    return Plan(missed, run, CATCH_UP if caught else SCHEDULED)


def write_missed(s: Session, host: str, m: Missed, policy: str) -> JobRun:
    """The missed instants' one row (at the last of them) and its `run_missed` event."""
    now = utcnow()
    run = JobRun(host=host, scheduled_at=m.last, state=RunState.missed, cause=SCHEDULED,
                 since=now, next_attempt_at=now, ended_at=now, reason=m.reason(policy))
    s.add(run)
    s.flush()
    emit(s, "run_missed", host, run=run.id, scheduled_at=m.last.isoformat(),
         first=m.first.isoformat(), count=m.count, exact=m.exact, catch_up=policy)
    return run
