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

from sqlalchemy import bindparam, or_, select
from sqlalchemy.orm import Session

from models import facts
from models.store import emit, store_clock
from models.tables import BoxLease, Host, Lease
from workflows.base.context import Context
from workflows.base.crash import define
from workflows.leases import placement

TAKEN = define("boxlease.taken", "this agent took its box lease at a new epoch and adopted "
                                 "the host leases no box took meanwhile")

_B, _L, _H = BoxLease.__table__.c, Lease.__table__.c, Host.__table__.c
_KEPT_EPOCH = "vigil.box_epoch"  # s.info: (transaction, box, epoch, expiry) read live in it
_LIVE_EPOCH = select(_B.epoch, _B.expires_at).where(_B.box == bindparam("box"))


def epoch_of(s: Session, box: str, now: Any) -> tuple[int, Any] | None:
    """(epoch, expiry) of the box's lease while it is live, else None."""
    row = s.execute(_LIVE_EPOCH, {"box": box}).first()
    return None if row is None or row.expires_at is None or row.expires_at <= now else (
        row.epoch, row.expires_at)


def my_epoch(s: Session, ctx: Context, now: Any) -> tuple[int, Any]:
    """This box's live epoch and its expiry, the box lease taken first when it is not live.
    A live one read is kept for the rest of the transaction (a group of wakes leases each
    of its hosts in one commit: one read, not one a host); hold() forgets it, and one read
    after a hold is not kept (a savepoint may roll the hold back)."""
    kept, this = s.info.get(_KEPT_EPOCH), (s.get_transaction(), ctx.agent_id)
    if kept is not None and kept[0] is this[0] and kept[1] == this[1] and kept[3] > now:
        return kept[2], kept[3]
    got = epoch_of(s, ctx.agent_id, now)
    if got is not None:
        s.info[_KEPT_EPOCH] = (*this, *got)
        return got
    hold(s, ctx)
    got = epoch_of(s, ctx.agent_id, now)
    if got is None:  # just taken in this transaction: live by construction
        raise RuntimeError(f"box lease of {ctx.agent_id} not live right after taking it")
    return got


def hold(s: Session, ctx: Context, due_only: bool = False) -> tuple[int, bool]:
    """Renew this box's lease (one UPDATE), or take it anew at the next epoch when it is
    missing or expired, adopting its host leases: (epoch, newly taken). `due_only`: renew
    only past half its length."""
    s.info.pop(_KEPT_EPOCH, None)  # my_epoch reads it again
    now = store_clock(s)
    epoch, taken = facts.hold_box(s, ctx.agent_id, now, timedelta(seconds=ctx.lease_ttl), due_only)
    if taken:
        retaken = adopt(s, ctx, epoch, now)
        emit(s, "box_lease_taken", None, box=ctx.agent_id, epoch=epoch, retaken=retaken)
    return epoch, taken


def adopt(s: Session, ctx: Context, epoch: int, now: Any) -> list[str]:
    """The host leases still this agent's under an older epoch, made valid at `epoch`, set
    based: `keep` hosts whose lease lapsed re-taken with a new fence from their counters
    (what was in flight under the old one is refused and retried), the others as they are.
    Returns the re-taken hosts."""
    lapsed: dict[str, int] = dict(s.execute(
        select(_L.host, _L.fence).join(Host.__table__, _H.name == _L.host).where(
            _L.holder == ctx.agent_id, _L.epoch != epoch, _H.on_store_loss == placement.KEEP,
            or_(_L.epoch != 0, _L.expires_at <= now))).tuples().all())
    retaken = facts.adopt_leases(s, ctx.agent_id, epoch, now, list(lapsed))
    for host, fence in sorted(retaken.items()):
        emit(s, "lease_retaken", host, old_fence=lapsed[host], fence=fence,
             why="the store could not be reached past the box lease's expiry; the app "
                 "was kept")
    return sorted(lapsed)


def held_hosts(s: Session, ctx: Context, epoch: int) -> set[str]:
    """The hosts this box holds at `epoch` (a read by its holder index: O(this box))."""
    return set(s.execute(select(_L.host).where(_L.holder == ctx.agent_id,
                                               _L.epoch == epoch)).scalars())
