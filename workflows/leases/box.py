"""A box's lease on its hosts (issue 28 item 2, migration 0029): one row per agent
(holder, epoch, expiry by the store's clock), renewed by one UPDATE every few seconds
whatever the number of hosts. A host's lease row is written only on acquire, release and
takeover; it is valid while its holder's box lease is live at the epoch it names.

A box whose lease expired takes it anew at the next epoch: every host lease of the older
epoch is then no longer valid, and the hosts no box took over meanwhile are adopted in the
same transaction (a `keep` host with a new fence: what was in flight under the old one is
refused and retried; a `fence` host as it is: its app was killed at its deadline). A host
another box took over is gone: the renewal says which, and the agent stops its copy.

A lease of epoch 0 was written before 0029: it is judged by its own `expires_at` until
its holder, taking its first box lease, adopts it."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from sqlalchemy import and_, bindparam, exists, insert, or_, select, update
from sqlalchemy.orm import Session

from models.store import emit, store_clock
from models.tables import BoxLease, Host, Lease
from workflows.base.context import Context
from workflows.base.crash import crashpoint, define
from workflows.leases import placement

TAKEN = define("boxlease.taken", "this agent took its box lease at a new epoch and adopted "
                                 "the host leases no box took meanwhile")

_B, _L, _H = BoxLease.__table__.c, Lease.__table__.c, Host.__table__.c
_LIVE_BOX = BoxLease.__table__.alias("live_box")
_LIVE_EPOCH = select(_B.epoch, _B.expires_at).where(_B.box == bindparam("box"))


def live(lease: Any, now: Any) -> Any:
    """A host lease's validity as one SQL condition on the columns of `lease` (a table or
    alias of `leases`): its holder's box lease is live at its epoch (epoch 0: its own
    expiry, a lease from before migration 0029)."""
    b = _LIVE_BOX  # an alias: a statement that reads box_leases itself keeps its own
    return or_(and_(lease.c.epoch == 0, lease.c.expires_at > now),
               exists().where(b.c.box == lease.c.holder, b.c.epoch == lease.c.epoch,
                              b.c.expires_at > now))


def epoch_of(s: Session, box: str, now: Any) -> tuple[int, Any] | None:
    """(epoch, expiry) of the box's lease while it is live, else None."""
    row = s.execute(_LIVE_EPOCH, {"box": box}).first()
    return None if row is None or row.expires_at is None or row.expires_at <= now else (
        row.epoch, row.expires_at)


def my_epoch(s: Session, ctx: Context, now: Any) -> tuple[int, Any]:
    """This box's live epoch and its expiry, the box lease taken first when it is not live."""
    got = epoch_of(s, ctx.agent_id, now)
    if got is None:
        hold(s, ctx)
        got = epoch_of(s, ctx.agent_id, now)
        if got is None:  # just taken in this transaction: live by construction
            raise RuntimeError(f"box lease of {ctx.agent_id} not live right after taking it")
    return got


def hold(s: Session, ctx: Context, due_only: bool = False) -> tuple[int, bool]:
    """Renew this box's lease (one UPDATE), or take it anew at the next epoch when it is
    missing or expired: (epoch, newly taken). `due_only`: renew only past half its length
    (a statement that matches nothing writes nothing)."""
    now = store_clock(s)
    ttl = timedelta(seconds=ctx.lease_ttl)
    where = [_B.box == ctx.agent_id, _B.expires_at > now]
    if due_only:
        where.append(_B.expires_at < now + ttl / 2)
    epoch = s.execute(update(BoxLease).where(*where).values(expires_at=now + ttl)
                      .returning(BoxLease.epoch)).scalar()
    if epoch is not None:
        return epoch, False
    if due_only:
        row = s.execute(select(_B.epoch).where(_B.box == ctx.agent_id, _B.expires_at > now)).first()
        if row is not None:
            return row.epoch, False
    if s.execute(select(_B.box).where(_B.box == ctx.agent_id)).first() is None:
        s.execute(insert(BoxLease).values(box=ctx.agent_id, epoch=0, expires_at=None))
    epoch = s.execute(update(BoxLease).where(BoxLease.box == ctx.agent_id)
                      .values(epoch=BoxLease.epoch + 1, expires_at=now + ttl)
                      .returning(BoxLease.epoch)).scalar_one()
    retaken = adopt(s, ctx, epoch, now)
    emit(s, "box_lease_taken", None, box=ctx.agent_id, epoch=epoch, retaken=retaken)
    return epoch, True


def adopt(s: Session, ctx: Context, epoch: int, now: Any) -> list[str]:
    """The host leases still this agent's under an older epoch, made valid at `epoch`, set
    based: `keep` hosts whose lease lapsed re-taken with a new fence from their counters
    (what was in flight under the old one is refused and retried), the others as they are.
    Returns the re-taken hosts."""
    # (A Result has keys(): dict() of one reads it as a mapping.)
    lapsed: dict[str, int] = {host: fence for host, fence in s.execute(
        select(_L.host, _L.fence).join(Host.__table__, _H.name == _L.host).where(
            _L.holder == ctx.agent_id, _L.epoch != epoch, _H.on_store_loss == placement.KEEP,
            or_(_L.epoch != 0, _L.expires_at <= now)))}
    if lapsed:
        s.execute(update(Host).where(Host.name.in_(lapsed)).values(fence_seq=Host.fence_seq + 1))
        counter = select(_H.fence_seq).where(_H.name == _L.host).scalar_subquery()
        retaken = s.execute(update(Lease.__table__).where(
            _L.host.in_(lapsed), _L.holder == ctx.agent_id).values(
            fence=counter, epoch=epoch, acquired_at=now).returning(_L.host, _L.fence)).all()
        for host, fence in sorted(retaken):
            emit(s, "lease_retaken", host, old_fence=lapsed[host], fence=fence,
                 why="the store could not be reached past the box lease's expiry; the app "
                     "was kept")
    s.execute(update(Lease).where(Lease.holder == ctx.agent_id, Lease.epoch != epoch)
              .values(epoch=epoch))
    return sorted(lapsed)


def renew(s: Session, ctx: Context, due_only: bool = False) -> int:
    """hold() in the caller's transaction: the epoch. (The crash point of a new epoch is
    the caller's, after its commit: see renew_box.)"""
    return hold(s, ctx, due_only)[0]


def renew_box(ctx: Context, due_only: bool = False) -> tuple[int, bool]:
    """hold() in a transaction of its own; the crash point after a new epoch commits."""
    got = ctx.store.write(lambda s: hold(s, ctx, due_only))
    if got[1]:
        crashpoint(TAKEN)
    return got


def held_hosts(s: Session, ctx: Context, epoch: int) -> set[str]:
    """The hosts this box holds at `epoch` (a read by its holder index: O(this box))."""
    return set(s.execute(select(_L.host).where(_L.holder == ctx.agent_id,
                                               _L.epoch == epoch)).scalars())
