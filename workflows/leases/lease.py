"""A host's lease: only its holder acts on the host, and every write checks the fence."""

from __future__ import annotations

import json
from contextlib import suppress
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from sqlalchemy import and_, bindparam, delete, exists, func, insert, or_, select, update
from sqlalchemy.orm import Session

from models import facts
from models.states import LIVE_GEN, OPEN_STOP, OPEN_WAKE
from models.store import emit, store_now, utcnow
from models.tables import (
    Attempt,
    BoxLease,
    Event,
    Generation,
    Host,
    Lease,
    Member,
    Release,
    Restore,
    Stop,
    Wake,
)
from workflows.base.context import Context, Held, Poke, Result
from workflows.base.crash import crashpoint, define
from workflows.base.lookups import lease_of
from workflows.base.pacing import backoff
from workflows.leases import box, placement

RELEASE_DONE = define("release.done", "the lease row and the owed release are deleted")


# Built once (a statement built per call cost more than running it).
# (Table columns, not the mapped ones: no ORM bookkeeping for a plain row.)
_H = Host.__table__.c
_COUNTER_OF = select(_H.fence_seq, _H.box).where(_H.name == bindparam("host"))
_L = Lease.__table__.c
# Until when another agent's lease of the host is valid (None: not valid, or no lease).
_VALID_UNTIL = select(func.coalesce(BoxLease.__table__.c.expires_at, _L.expires_at)).select_from(
    Lease.__table__.outerjoin(BoxLease.__table__, and_(
        BoxLease.__table__.c.box == _L.holder, BoxLease.__table__.c.epoch == _L.epoch))).where(
    _L.host == bindparam("host"), facts.live(Lease.__table__, bindparam("now")))


@dataclass(frozen=True)
class Holding:
    """What acquire() reads first, when the caller has read it already in its transaction:
    the host's lease (None: unleased), its fence counter and its placement."""

    lease: Any
    fence_seq: int
    box: str | None


def acquire(s: Session, ctx: Context, host: str, known: Holding | None = None) -> int:
    """Take (or re-take) the host's lease with a new fence, inside the caller's transaction,
    under this box's live box lease epoch (taken first if it is not live). Any owed release
    naming an older fence becomes stale: the fence moved on. Another agent's lease is taken
    only while it is not valid (its holder's box lease expired or moved to a newer epoch),
    judged by the store's clock (store_now), never by this box's."""
    now = store_now(s)
    if known is None:
        lease = lease_of(s, host)
        seq, placed = s.execute(_COUNTER_OF, {"host": host}).one()
    else:
        lease, seq, placed = known.lease, known.fence_seq, known.box
    if not placement.may_hold(placed, ctx.agent_id):
        raise Poke(f"host {host} is placed on {placed}, not on this box ({ctx.agent_id})")
    other = lease if lease is not None and lease.holder != ctx.agent_id else None
    if other is not None:
        until = s.execute(_VALID_UNTIL, {"host": host, "now": now}).scalar()
        if until is not None:
            raise Poke(f"lease of {host} is held by agent {other.holder} until {until}")
        if not placement.may_take_over(placed, ctx.agent_id):
            raise Poke(f"lease of {host} expired with agent {other.holder}; only a box the host "
                       "is placed on takes it over (`vigil host add ... --box BOX`)")
    epoch, box_expires = box.my_epoch(s, ctx, now)
    fence = facts.take_lease(s, host, seq, lease, {"holder": ctx.agent_id, "acquired_at": now,
                                                   "expires_at": box_expires, "epoch": epoch}, now)
    emit(s, "leased", host, fence=fence)
    return fence


def held_fence(s: Session, ctx: Context, host: str) -> int | None:
    lease = lease_of(s, host)
    return lease.fence if lease is not None and lease.holder == ctx.agent_id else None


def _retainers(host: Any) -> list[tuple[Any, str]]:
    """What keeps a host's lease (retain until proven): SQL conditions on a host column or
    name, each with the words that say it."""
    return [(exists().where(Generation.host == host, Generation.state.in_(LIVE_GEN)),
             "a generation is live"),
            (exists().where(Wake.host == host, Wake.state.in_(OPEN_WAKE)), "a wake is open"),
            (exists().where(Stop.host == host, Stop.state.in_(OPEN_STOP)), "a stop is open"),
            (exists().where(Member.host == host), "its operation set is not empty"),
            (exists().where(Restore.host == host), "a parent-limit restore is pending"),
            (exists().where(Attempt.host == host, Attempt.outcome.is_(None)),
             "a deploy attempt is open"),
            (exists().where(Host.name == host, Host.raised.is_(True)),
             "its parent limit is still raised")]


def still_needed(s: Session, host: str) -> str | None:
    """Why the host must keep its lease, or None when it may go."""
    return next((why for cond, why in _retainers(host) if s.execute(select(cond)).scalar()), None)


def needed(host: Any) -> Any:
    """still_needed() as one SQL condition on a host column, for set-based statements."""
    return or_(*(cond for cond, _ in _retainers(host)))


_LEASES, _RELEASES, _EVENTS = Lease.__table__, Release.__table__, Event.__table__


def give_back(ctx: Context, limit: int = 256) -> int:
    """Group commit of this agent's due owed releases: one transaction and a fixed handful
    of set-based statements for up to `limit` rows, each row still guarded on its own
    (holder, fence, nothing retains the host). A row whose lease moved on is dropped; a row
    whose host is still needed keeps its obligation and backs off. Returns rows taken."""

    def step(s: Session) -> tuple[int, int]:
        now = utcnow()
        c = s.connection()
        due = (select(_RELEASES.c.id, _RELEASES.c.host, _RELEASES.c.attempts)
               .where(_RELEASES.c.holder == ctx.agent_id, _RELEASES.c.next_attempt_at <= now)
               .order_by(_RELEASES.c.next_attempt_at, _RELEASES.c.id).limit(limit))
        if ctx.store.dialect == "postgresql":  # another box's agent takes other rows
            due = due.with_for_update(skip_locked=True)
        rows = c.execute(due).all()
        if not rows:
            return 0, 0
        ids = [r.id for r in rows]
        # The host list first: it keeps SQLite on the primary key instead of testing the
        # correlated guards on every lease of the store (0.8 ms a row with 10,000 leases).
        released = facts.give_back_owed(s, _RELEASES.c.id.in_(ids), sorted({r.host for r in rows}),
                                        needed)
        # Resolved (lease just deleted) or stale (the lease moved on): the row goes.
        lease_of = exists().where(_LEASES.c.host == _RELEASES.c.host,
                                  _LEASES.c.holder == _RELEASES.c.holder,
                                  _LEASES.c.fence == _RELEASES.c.fence)
        dropped = set(c.execute(delete(_RELEASES).where(_RELEASES.c.id.in_(ids), ~lease_of)
                                .returning(_RELEASES.c.id)).scalars())
        if released:
            c.execute(insert(_EVENTS), [
                {"at": now, "host": host, "generation_id": None, "kind": "released",
                 "detail": json.dumps({"fence": fence})} for host, fence in released])
        kept = [r for r in rows if r.id not in dropped]
        if kept:  # the rare case: something retains the host again; say what
            c.execute(update(_RELEASES).where(_RELEASES.c.id == bindparam("rid")).values(
                attempts=bindparam("n"), last_error=bindparam("why"),
                next_attempt_at=bindparam("at")), [
                {"rid": r.id, "n": r.attempts + 1, "at": now + timedelta(seconds=backoff(r.attempts + 1)),
                 "why": f"lease of {r.host} still needed: {still_needed(s, r.host)}"}
                for r in kept])
        return len(rows), len(dropped)

    if not ctx.store.read(lambda s: s.execute(select(_RELEASES.c.id).where(
            _RELEASES.c.holder == ctx.agent_id, _RELEASES.c.next_attempt_at <= utcnow())
            .limit(1)).first()):
        # Every fresh round asks; mostly nothing is owed. A read does not take the write
        # lock, which a deploy's admission, queued behind it, would wait for.
        return 0
    taken, resolved = ctx.store.write(step)
    if resolved:
        crashpoint(RELEASE_DONE)
    return taken


def owe_release(s: Session, ctx: Context, host: str) -> bool:
    """Write the owed release when nothing retains the lease any more."""
    fence = held_fence(s, ctx, host)
    if fence is None or still_needed(s, host) is not None:
        return False
    now = utcnow()
    s.add(Release(host=host, holder=ctx.agent_id, fence=fence, since=now, next_attempt_at=now))
    return True


def drive_release(ctx: Context, release_id: int) -> Result:
    """The same conditional delete every time: holder and fence must match."""

    def step(s: Session) -> Result:
        row = s.get(Release, release_id)
        if row is None:
            return Result.gone
        lease = s.get(Lease, row.host)
        # Plain deletes, each by its own guard: the batch (give_back) may take the same row
        # between this step's reads and its writes (PostgreSQL reads are not locked).
        drop = delete(_RELEASES).where(_RELEASES.c.id == release_id)
        if lease is None or lease.holder != row.holder or lease.fence != row.fence:
            s.execute(drop)  # an older incarnation: the lease moved on, nothing to give back
            return Result.gone
        why = still_needed(s, row.host)
        if why is not None:
            raise Held(f"lease of {row.host} still needed: {why}")
        gone = facts.give_back(s, row.host, row.holder, row.fence)
        s.execute(drop)
        if not gone:  # given back meanwhile, with its own event
            return Result.gone
        emit(s, "released", row.host, fence=row.fence)
        return Result.progress

    result = ctx.store.write(step)
    crashpoint(RELEASE_DONE)
    return result


def renew_in(s: Session, ctx: Context) -> int:
    """Renew this box's lease past half its length, in the caller's transaction (one
    UPDATE of one row, whatever the number of hosts; none while under half): its epoch."""
    return box.hold(s, ctx, due_only=True)[0]


def renew(ctx: Context) -> int:
    """Renew (or take anew) this box's lease in a transaction of its own: its epoch (the
    crash point of a new epoch after its commit)."""
    epoch, taken = ctx.store.write(lambda s: box.hold(s, ctx))
    if taken:
        crashpoint(box.TAKEN)
    return epoch


def renew_held(ctx: Context) -> set[str]:
    """Renew this box's lease (one UPDATE) and say which hosts it still holds at its epoch
    (the others are lost: another box took them over while its lease had expired)."""

    def step(s: Session) -> tuple[set[str], bool]:
        epoch, fresh = box.hold(s, ctx)
        return box.held_hosts(s, ctx, epoch), fresh

    held, fresh = ctx.store.write(step)
    if fresh:
        crashpoint(box.TAKEN)
    return held


def release_owed(ctx: Context, host: str) -> None:
    """Give the lease back now if a release was just owed; the sweep retries it otherwise."""
    ids = ctx.store.read(lambda s: s.execute(
        select(Release.id).where(Release.host == host)).scalars().all())
    for rid in ids:
        with suppress(Poke):
            drive_release(ctx, rid)
