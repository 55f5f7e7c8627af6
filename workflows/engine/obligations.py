"""Every kind of obligation in one place: where its open rows are, what drives them, and
the per-row pacing: exponential backoff from 100 ms doubling to 5 s,
persisted on the row so it survives restarts."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import String, cast, exists, func, literal, or_, select, union_all, update
from sqlalchemy.orm import Session

from models.states import OPEN_RELOAD, OPEN_ROLLOUT, OPEN_STOP, OPEN_WAKE, HostKind
from models.store import utcnow
from models.tables import (
    Attempt,
    Delivery,
    Host,
    Lease,
    Member,
    Release,
    Reload,
    Restore,
    Rollout,
    Stop,
    Wake,
)
from models.trouble import diagnose, refine
from workflows.base.context import Context, Held, Poke, Result, Until
from workflows.base.pacing import backoff
from workflows.base.sanity import impossible_hosts, refuse_if_impossible
from workflows.deploys.driver import drive_attempt
from workflows.deploys.reload import drive_reload
from workflows.leases.lease import drive_release, give_back
from workflows.lifecycle.members import drive_member, drive_restore
from workflows.lifecycle.stop import drive_stop
from workflows.lifecycle.wake import drive_wake
from workflows.lifecycle.wake_group import drive_wakes
from workflows.notices.deliver import drive_delivery
from workflows.rollouts.driver import drive_rollout


@dataclass(frozen=True)
class Kind:
    name: str
    model: Any
    key: Any  # the primary-key column
    open: Any  # SQL condition for "still open", or None when every row is open
    drive: Callable[[Context, int], Result]
    # Store-only kinds also drain in groups: batch(ctx, limit) takes up to `limit` of this
    # agent's due rows in one transaction (rows matching `batched(ctx)`); the round's
    # per-host drives leave those rows to it.
    batch: Callable[[Context, int], int] | None = None
    batched: Callable[[Context], Any] | None = None
    # The name the round paces the row under (one row per name per round, at most 8 names
    # in flight), when it is not the row's host: a rollout belongs to no host.
    label: Any = None
    # Rows driven together, up to a group's size in one drive (SQL: true for such a row),
    # by `drive_group(ctx, ids)`: a worker's wake, whose start has nothing slow to check.
    grouped: Any = None
    drive_group: Callable[[Context, list[int]], dict[int, Result | Exception]] | None = None
    # Driven on slots of its own (a notification waits on a receiver outside vigil): never
    # on the slots the restarts, wakes and stops of hosts need.
    outside: bool = False

    @property
    def host(self) -> Any:
        return self.label if self.label is not None else self.model.host


KINDS: dict[str, Kind] = {
    k.name: k
    for k in (
        Kind("stop", Stop, Stop.id, Stop.state.in_(OPEN_STOP), drive_stop),
        Kind("wake", Wake, Wake.id, Wake.state.in_(OPEN_WAKE), drive_wake,
             grouped=exists().where(Host.name == Wake.host, Host.kind == HostKind.worker,
                                    Host.one_shot.is_(False)), drive_group=drive_wakes),
        Kind("member", Member, Member.generation_id, None, drive_member),
        Kind("attempt", Attempt, Attempt.id, Attempt.outcome.is_(None), drive_attempt),
        Kind("restore", Restore, Restore.id, None, drive_restore),
        # `vigil reload`: its drive waits (up to the health timeout) for the app back ready.
        Kind("reload", Reload, Reload.id, Reload.state.in_(OPEN_RELOAD), drive_reload),
        Kind("release", Release, Release.id, None, drive_release, give_back,
             lambda ctx: Release.holder == ctx.agent_id),
        # Advanced by whichever agent claims it; its attempts by each host's lease holder.
        Kind("rollout", Rollout, Rollout.id, Rollout.state.in_(OPEN_ROLLOUT), drive_rollout,
             label=literal("rollout #", String) + cast(Rollout.id, String)),
        # Sent by any agent, one try per notifier in flight (paced under `notify NAME`), on
        # the reconciler's send slots.
        Kind("notification", Delivery, Delivery.id, Delivery.delivered_at.is_(None),
             drive_delivery, label=literal("notify ", String) + Delivery.notifier,
             outside=True),
    )
}


@dataclass(frozen=True)
class Due:
    kind: str
    id: int
    host: str
    at: datetime
    attempts: int | None = None  # as read with the row (None: not known, read it)
    last_error: str | None = None
    sane: bool = False  # its host passed the sanity check when the round read it
    grouped: bool = False  # it may be driven in a group of its kind (Kind.grouped)


def _open_rows(ctx: Context, *, per_host: bool = False, due_by: datetime | None = None) -> Any:
    """Open rows of every kind on hosts this agent may act on (its own or unleased).
    per_host: only the rows a per-host drive takes (not those a batch drains); due_by: only
    the rows due by then.

    A CTE the database materializes: each branch reads its table's open rows alone (by its
    (state, next_attempt_at) index, migration 0008) before anything ranks them by host, so
    the read follows the open rows, never the history (ranking the union directly had the
    planner walk every past row of a table in host order)."""
    selects = []
    for k in KINDS.values():
        q = select(literal(k.name, String).label("kind"), k.key.label("id"),
                   k.host.label("host"), k.model.next_attempt_at.label("at"),
                   k.model.attempts.label("attempts"), k.model.last_error.label("last_error"),
                   (k.grouped if k.grouped is not None else literal(False)).label("grouped"))
        if k.open is not None:
            q = q.where(k.open)
        if due_by is not None:
            q = q.where(k.model.next_attempt_at <= due_by)
        if per_host and k.batch is not None and k.batched is not None:
            q = q.where(~k.batched(ctx))
        selects.append(q)
    return union_all(*selects).cte("open_rows").prefix_with("MATERIALIZED")


def not_ours(ctx: Context, host: Any) -> Any:
    """True for a host this agent must not act on: leased by another agent (expired or not:
    only a takeover moves such a lease, workflows/lifecycle/takeover.py) or placed on other
    boxes only. Correlated per open row (its lease and its host by primary key), not a NOT IN
    over every other box's leases: the read costs this box's open rows, not the fleet."""
    placed = literal(",").concat(Host.box).concat(",")
    me = ctx.agent_id.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    leased_elsewhere = exists().where(Lease.host == host, Lease.holder != ctx.agent_id)
    placed_elsewhere = exists().where(Host.name == host, Host.box.is_not(None),
                                      placed.not_like(f"%,{me},%", escape="\\"))
    return or_(leased_elsewhere, placed_elsewhere)


def due(ctx: Context, now: datetime, *, skip: Collection[str] = (), after: str | None = None,
        limit: int | None = None) -> list[Due]:
    """The earliest due row of each host (one row per host per round). With `after`, hosts
    sorted by name from just past `after` round to the start (the reconciler's rotation),
    leaving out `skip` and stopping at `limit` hosts: the database picks the round's rows,
    so a round costs the same with 10 or 10,000 open rows."""
    if limit == 0:
        return []
    rows = _open_rows(ctx, per_host=True, due_by=now)

    def q(s: Session) -> list[Due]:
        where = [~not_ours(ctx, rows.c.host)]
        if skip:
            where.append(rows.c.host.not_in(list(skip)))
        rank = func.row_number().over(partition_by=rows.c.host, order_by=(rows.c.at, rows.c.id))
        ranked = select(rows, rank.label("rank")).where(*where).subquery()
        stmt = select(ranked.c.kind, ranked.c.id, ranked.c.host, ranked.c.at, ranked.c.attempts,
                      ranked.c.last_error, ranked.c.grouped).where(ranked.c.rank == 1)
        if after is not None:
            stmt = stmt.order_by(ranked.c.host <= after, ranked.c.host)
        else:
            stmt = stmt.order_by(ranked.c.at, ranked.c.id)
        if limit is not None:
            stmt = stmt.limit(limit)
        found = s.execute(stmt).all()
        # The sanity check (workflows/base/sanity.py) for the whole round in one query, instead
        # of a read per drive; a host that fails it is checked again, and refused, by its drive.
        bad = impossible_hosts(s, {r.host for r in found})
        return [Due(r.kind, r.id, r.host, r.at, r.attempts, r.last_error, r.host not in bad,
                    bool(r.grouped)) for r in found]

    return ctx.store.read(q)


def next_due(ctx: Context, busy: set[str]) -> datetime | None:
    rows = _open_rows(ctx)

    def q(s: Session) -> datetime | None:
        # As in due(): a host another agent holds is not ours, nor is its overdue row our
        # next wake-up (it would hide every retry of ours until the safety scan).
        stmt = select(func.min(rows.c.at)).where(~not_ours(ctx, rows.c.host))
        if busy:
            stmt = stmt.where(rows.c.host.not_in(busy))
        return s.execute(stmt).scalar()

    return ctx.store.read(q)


def drain_batches(ctx: Context, limit: int = 256, rounds: int = 16) -> tuple[int, bool]:
    """Drain every batched kind's due rows, `limit` per transaction, at most `rounds`
    transactions per kind (the per-host rows of the round wait that long at most).
    Returns (rows taken, whether a kind stopped at its cap with rows still due)."""
    total, more = 0, False
    for k in KINDS.values():
        if k.batch is None:
            continue
        for _ in range(rounds):
            taken = k.batch(ctx, limit)
            total += taken
            if taken < limit:
                break
        else:
            more = True
    return total, more


def run_one(ctx: Context, item: Due) -> tuple[Result, str | None]:
    """Drive one row and persist its pacing. Never raises for the row's own trouble."""
    kind = KINDS[item.kind]
    try:
        if not item.sane:
            refuse_if_impossible(ctx, kind.model, kind.key, item.id, item.host)
        outcome: Result | Exception = kind.drive(ctx, item.id)
    except Exception as exc:
        outcome = exc
    return pace(ctx, [(item, outcome)])[0]


def run_group(ctx: Context, items: list[Due],
              drive: Callable[[Context, list[int]], dict[int, Result | Exception]]
              ) -> list[tuple[Result, str | None]]:
    """Drive rows of one kind together (`drive` takes their ids: grouped worker wakes),
    then persist each row's pacing as run_one would, in one transaction."""
    kind = KINDS[items[0].kind]
    refused: dict[int, Exception] = {}
    for item in items:
        if not item.sane:
            try:
                refuse_if_impossible(ctx, kind.model, kind.key, item.id, item.host)
            except Exception as exc:
                refused[item.id] = exc
    try:
        got = drive(ctx, [d.id for d in items if d.id not in refused]) if len(refused) < len(items) else {}
    except Exception as exc:  # the group's own commit failed: every row of it is retried
        got = {d.id: exc for d in items}
    return pace(ctx, [(d, refused.get(d.id) or got.get(d.id, Result.progress)) for d in items])


def _classify(outcome: Result | Exception, url: str) -> tuple[Result, str | None, datetime | None]:
    """A drive's outcome as (result, error, due again at): its own trouble is a result; a
    failure of the whole store is raised (no pacing could be written either)."""
    if isinstance(outcome, Result):
        return outcome, None, None
    if isinstance(outcome, Until):  # due again at a time of the row's own, not after a backoff
        return Result.waiting, str(outcome), outcome.at
    if isinstance(outcome, Held):
        return Result.held, str(outcome), None
    if isinstance(outcome, Poke):
        return Result.poked, str(outcome), None
    trouble = diagnose(outcome)  # a step lost a race or the store failed: retry later
    if trouble is not None and refine(trouble, url).whole_store:
        # Not this row's trouble: the store is full, gone, locked or damaged. The agent
        # backs off as a whole.
        raise outcome
    return Result.poked, f"{type(outcome).__name__}: {outcome}", None


def pace(ctx: Context, done: list[tuple[Due, Result | Exception]]) -> list[tuple[Result, str | None]]:
    """Each row's result and error, its pacing written (one transaction for all of them)."""
    now, out, writes = utcnow(), [], []
    for item, outcome in done:
        kind = KINDS[item.kind]
        result, error, until = _classify(outcome, ctx.store.url)
        out.append((result, error))
        if until is not None:
            paced: tuple[Any, str | None, Any] = (0, error, until)
        elif result in (Result.poked, Result.held):
            tried = item.attempts if item.attempts is not None else _attempts(ctx, kind, item.id)
            paced = (kind.model.attempts + 1, error, now + timedelta(seconds=backoff(tried + 1)))
        elif result is Result.progress:
            if item.attempts == 0 and item.last_error is None and ctx.store.dialect == "sqlite":
                # Nothing to reset: it was due, and it still is. (On PostgreSQL the claim pushed
                # its due time ahead, workflows/engine/claim.py: that must be undone.)
                continue
            paced = (0, None, now)
        else:
            continue
        writes.append((kind, item.id, paced))
    if writes:
        try:
            ctx.store.write(lambda s: [s.execute(update(k.model).where(k.key == key).values(
                attempts=n, last_error=e, next_attempt_at=at)) for k, key, (n, e, at) in writes])
        except Exception as exc:  # pacing is advisory; the rows stay open and due
            out = [(r, f"{e}; pacing not written: {exc}") for r, e in out]
    return out


def _attempts(ctx: Context, kind: Kind, key: int) -> int:
    return ctx.store.read(lambda s: s.execute(select(kind.model.attempts).where(kind.key == key))
                          .scalar() or 0)
