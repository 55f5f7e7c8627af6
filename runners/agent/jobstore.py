"""Scheduled restarts (`vigil schedule`), kept in APScheduler's SQLAlchemy job store in
vigil's own database (table `apscheduler_jobs`, created by migration 0005).

The CLI writes and reads the jobs through a paused scheduler, so it needs no running
agent; the agent's scheduler carries the same store as a second job store and runs them.
Each job is `fire(host)`, stored by textual reference. Misfires: a run missed while no
agent was running (or late by any amount) is coalesced, so the agent runs it ONCE when it
is back, however many fire times it missed (coalesce=True, misfire_grace_time=None)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

from apscheduler.jobstores.base import ConflictingIdError, JobLookupError
from apscheduler.jobstores.sqlalchemy import SQLAlchemyJobStore
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.schedulers.base import BaseScheduler
from apscheduler.triggers.cron import CronTrigger

from models.errors import BadInput, NotFound
from models.store import JOBS_POOL, Store, make_engine
from models.tables import Host
from runners.agent.trust import Trouble, guarded
from workflows.base.context import Context
from workflows.deploys.schedules import request_restart

log = logging.getLogger("vigil.schedules")

ALIAS = "schedules"
FIRE = "runners.agent.jobstore:fire"
FIX_CRON = ("give five crontab fields in UTC: minute hour day-of-month month day-of-week, "
            "e.g. --cron '30 4 * * *'")

_agent: dict[str, Any] = {}  # the running agent's context and reconciler kick


def job_id(host: str) -> str:
    return f"restart:{host}"


def jobstore(store: Store, *, readonly: bool = False) -> SQLAlchemyJobStore:
    # An engine of its own (same URL, same pragmas and IMMEDIATE writes): the job store
    # disposes its engine when its scheduler shuts down. Read-only: its transactions never
    # wait for (or take) SQLite's write lock.
    engine = make_engine(store.url, "FULL", 5000, pooled=store.pooled)
    return SQLAlchemyJobStore(engine=engine.execution_options(vigil_readonly=True)
                              if readonly else engine)


def cron(expr: str) -> CronTrigger:
    try:
        trigger = CronTrigger.from_crontab(expr, timezone=UTC)
    except ValueError as exc:
        raise BadInput(f"invalid cron expression {expr!r} ({exc})", FIX_CRON) from None
    if trigger.get_next_fire_time(None, datetime.now(UTC)) is None:  # e.g. 31 February
        raise BadInput(f"cron expression {expr!r} never fires", FIX_CRON)
    return trigger


class StoreOnly(BaseScheduler):
    """The CLI's handle on the job store: a scheduler with no thread, started paused, so it
    writes and reads jobs and never runs one. (A paused BackgroundScheduler is not enough:
    on shutdown its thread processes due jobs once more, consuming a missed run.)"""

    def shutdown(self, wait: bool = True) -> None:
        super().shutdown(wait)

    def wakeup(self) -> None:
        pass


@contextmanager
def opened(store: Store, *, readonly: bool = False) -> Iterator[BaseScheduler]:
    scheduler = StoreOnly(jobstores={"default": jobstore(store, readonly=readonly)}, timezone=UTC)
    scheduler.start(paused=True)
    try:
        yield scheduler
    finally:
        scheduler.shutdown(wait=False)


def add(store: Store, host: str, expr: str) -> dict[str, Any]:
    trigger = cron(expr)
    if store.read(lambda s: s.get(Host, host)) is None:
        raise NotFound(f"no host named {host!r}", "see `vigil host list`")
    with opened(store) as scheduler:
        try:
            job = scheduler.add_job(FIRE, trigger, args=[host], id=job_id(host), name=expr,
                                    coalesce=True, misfire_grace_time=None, max_instances=1)
        except ConflictingIdError:
            raise BadInput(f"host {host} already has a restart schedule",
                           f"remove it first with `vigil schedule rm {host}`") from None
        return describe(job)


def listing(store: Store) -> list[dict[str, Any]]:
    with opened(store, readonly=True) as scheduler:
        return [describe(j) for j in scheduler.get_jobs() if j.id.startswith("restart:")]


def remove(store: Store, host: str) -> None:
    with opened(store) as scheduler:
        try:
            scheduler.remove_job(job_id(host))
        except JobLookupError:
            if store.read(lambda s: s.get(Host, host)) is None:
                raise NotFound(f"no host named {host!r}", "see `vigil host list`") from None
            raise NotFound(f"host {host!r} has no restart schedule",
                           "see `vigil schedule list`") from None


def forget(store: Store, host: str) -> None:
    """A removed host's schedule goes with it (a firing for a host that is gone only
    writes a `restart_skipped` event)."""
    with opened(store) as scheduler:
        try:
            scheduler.remove_job(job_id(host))
        except JobLookupError:
            pass


def describe(job: Any) -> dict[str, Any]:
    nxt = job.next_run_time
    return {"host": job.args[0], "cron": job.name,
            "next_run": nxt.astimezone(UTC).isoformat() if nxt else None}


# -- in the agent ---------------------------------------------------------------------------

STORE_RETRY = 10.0  # seconds before the agent's scheduler reads a failed job store again


class AgentJobStore(SQLAlchemyJobStore):
    """The agent's job store: when the store itself fails (full, unreachable), the agent's
    watch says so once (`on_error` returns True) instead of APScheduler's warning at every
    wake-up of its loop, or the traceback that ends that loop when the failure comes while
    it asks for the next run time."""

    def __init__(self, on_error: Trouble, **kw: Any) -> None:
        super().__init__(**kw)
        self.on_error = on_error

    def get_due_jobs(self, now: datetime) -> list[Any]:
        with guarded(self.on_error):
            return super().get_due_jobs(now)  # type: ignore[no-any-return]
        return []

    def get_next_run_time(self) -> datetime | None:
        with guarded(self.on_error):
            return super().get_next_run_time()  # type: ignore[no-any-return]
        return datetime.now(UTC) + timedelta(seconds=STORE_RETRY)

    def update_job(self, job: Any) -> None:
        with guarded(self.on_error):  # the run happened; a run again is coalesced (55 s guard)
            super().update_job(job)


def attach(scheduler: BackgroundScheduler, ctx: Context, kick: Callable[[], None],
           on_error: Trouble, may_act: Callable[[], bool]) -> None:
    """Give the agent's scheduler the job store (before it starts: misfired runs go first).
    `on_error(exc)`: True when the store failed and the agent has said so; `may_act()`:
    False once the agent stopped acting on its store."""
    _agent.update(ctx=ctx, kick=kick, on_error=on_error, may_act=may_act)
    engine = make_engine(ctx.store.url, "FULL", 5000, name=lambda: f"{ctx.store.app_name}-jobs",
                         pool_size=JOBS_POOL, max_overflow=0, pooled=ctx.store.pooled,
                         prepare=lambda: ctx.store.prepare)
    scheduler.add_jobstore(AgentJobStore(on_error, engine=engine), alias=ALIAS)


def detach(scheduler: BackgroundScheduler) -> None:
    """Before the agent's scheduler shuts down: its thread processes due jobs once more on
    shutdown, with the executors gone, which would consume a run that is due right then."""
    scheduler.remove_jobstore(ALIAS, shutdown=True)


def fire(host: str) -> None:
    """One firing (run by the agent's scheduler): write the restart attempt, ring."""
    ctx: Context = _agent["ctx"]
    if ctx.shutting_down.is_set() or not _agent["may_act"]():
        return
    with guarded(_agent["on_error"]):  # said by the agent's store watch, not as APScheduler's traceback
        attempt = ctx.store.write(lambda s: request_restart(s, host))
        log.info("scheduled restart host=%s attempt=%s", host,
                 attempt.id if attempt is not None else "skipped")
        _agent["kick"]()
