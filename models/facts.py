"""Protocol facts: columns that are no state of the transition table yet guard what another
writer relies on (a host's fence counter, the host and box leases, the store's chores, a
time written once). Each is written here only, by a function whose docstring opens with its
guard; workflows/ compose them and write none by hand. A fact of one row guarded by its own
columns (a delivery, a host's raised limit) is a `move` (models/transition.py) with that
guard in its `where` and its waiver named. The rule: docs/internals/architecture.md, "How
rows change"."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import and_, delete, exists, insert, or_, select, tuple_, update
from sqlalchemy.orm import Session

from models.errors import LostRace
from models.tables import BoxLease, Chore, Host, Lease, Release
from models.transition import Unfenced, _shaped, affected, move

_B, _L, _H, _C = BoxLease.__table__.c, Lease.__table__.c, Host.__table__.c, Chore.__table__.c
_LEASES = Lease.__table__
_LIVE_BOX = BoxLease.__table__.alias("live_box")
_COUNTER = select(_H.fence_seq).where(_H.name == _L.host).scalar_subquery()
_OWN = Unfenced("a lease row or counter: its guard is in the where")


def live(lease: Any, now: Any) -> Any:
    """A host lease's validity as one SQL condition on the columns of `lease` (a table or
    alias of `leases`): its holder's box lease is live at its epoch (epoch 0: its own
    expiry, a lease from before migration 0029)."""
    b = _LIVE_BOX  # an alias: a statement that reads box_leases itself keeps its own
    return or_(and_(lease.c.epoch == 0, lease.c.expires_at > now),
               exists().where(b.c.box == lease.c.holder, b.c.epoch == lease.c.epoch,
                              b.c.expires_at > now))


def next_fences(s: Session, hosts: Iterable[str]) -> None:
    """Guard: none needed. Each host's fence counter moves on by one, its row locked till
    commit; a value drawn and then not used (the lease not taken) is only skipped."""
    s.execute(update(Host).where(Host.name.in_(list(hosts))).values(fence_seq=Host.fence_seq + 1))


def take_lease(s: Session, host: str, seq: int, lease: Any, values: dict[str, Any],
               now: Any) -> int:
    """Guard: the counter still at `seq` and the lease still as read (`lease`): none (a second
    insert breaks the primary key), the taker's own at its fence, or another holder's at its
    fence and not valid at `now` (a renewal committed first wins). LostRace otherwise.
    Returns the new fence, written with `values` (holder, epoch, times)."""
    move(s, Host, {"name": host, "fence_seq": seq}, {"fence_seq": seq + 1},
         f"fence counter of {host}", fence=_OWN)
    values = {**values, "fence": seq + 1}
    if lease is None:
        s.execute(insert(_LEASES), {"host": host, **values})
    elif lease.holder == values["holder"]:
        move(s, Lease, {"host": host, "fence": lease.fence}, values, f"lease of {host}", fence=_OWN)
    elif affected(s.execute(update(_LEASES).where(
            _L.host == host, _L.holder == lease.holder, _L.fence == lease.fence,
            ~live(_LEASES, now)).values(**values))) != 1:
        raise LostRace(f"lease of {host}")
    return seq + 1


def take_leases(s: Session, rows: list[Any], holder: str, epoch: int, now: Any,
                expires: Any) -> dict[str, int]:
    """Guard: each lease still at the (holder, fence, epoch) of its row read, and not valid
    at `now`. Those taken at a new fence from their counters: {host: new fence}."""
    next_fences(s, [r.host for r in rows])
    return dict(s.execute(update(_LEASES).where(
        tuple_(_L.host, _L.holder, _L.fence, _L.epoch).in_(
            [(r.host, r.holder, r.fence, r.epoch) for r in rows]), ~live(_LEASES, now))
        .values(holder=holder, epoch=epoch, fence=_COUNTER, acquired_at=now, expires_at=expires)
        .returning(_L.host, _L.fence)).tuples().all())


def adopt_leases(s: Session, holder: str, epoch: int, now: Any,
                 lapsed: list[str]) -> dict[str, int]:
    """Guard: the lease still `holder`'s. Each of an older epoch is valid at `epoch`; the
    `lapsed` hosts' re-taken at a new fence from their counters (what was in flight under
    the old one is refused): {host: new fence} of those."""
    retaken: dict[str, int] = {}
    if lapsed:
        next_fences(s, lapsed)
        retaken = dict(s.execute(update(_LEASES).where(_L.host.in_(lapsed), _L.holder == holder)
                                 .values(fence=_COUNTER, epoch=epoch, acquired_at=now)
                                 .returning(_L.host, _L.fence)).tuples().all())
    s.execute(update(_LEASES).where(_L.holder == holder, _L.epoch != epoch).values(epoch=epoch))
    return retaken


def give_back(s: Session, host: str, holder: str, fence: int) -> bool:
    """Guard: the lease still `holder`'s at `fence` (False: given back meanwhile, or taken
    by a newer fence). The lease row is deleted: the host is free."""
    return affected(s.execute(delete(_LEASES).where(_L.host == host, _L.holder == holder,
                                                    _L.fence == fence))) == 1


def give_back_owed(s: Session, releases: Any, hosts: list[str],
                   needed: Any) -> list[tuple[str, int]]:
    """Guard: each lease of `hosts` still at the holder and fence of an owed release among
    `releases` (a condition on the releases table), its host not `needed` (a condition on a
    host column: something retains it). The leases given back: (host, fence)."""
    r = Release.__table__.c
    owed = exists().where(releases, r.host == _L.host, r.holder == _L.holder, r.fence == _L.fence)
    return list(s.execute(delete(_LEASES).where(_L.host.in_(hosts), owed, ~needed(_L.host))
                          .returning(_L.host, _L.fence)).tuples().all())


def hold_box(s: Session, box: str, now: Any, ttl: timedelta,
             due_only: bool = False) -> tuple[int, bool]:
    """Guard: the box's own row, renewed only while live (`due_only`: and past half its
    length: a statement that matches nothing writes nothing), else taken anew at the next
    epoch (no other writer takes a box's lease). (epoch, newly taken)."""
    where = [_B.box == box, _B.expires_at > now]
    if due_only:
        where.append(_B.expires_at < now + ttl / 2)
    epoch = s.execute(update(BoxLease).where(*where).values(expires_at=now + ttl)
                      .returning(BoxLease.epoch)).scalar()
    if epoch is None and due_only:
        epoch = s.execute(select(_B.epoch).where(_B.box == box, _B.expires_at > now)).scalar()
    if epoch is not None:
        return epoch, False
    if s.execute(select(_B.box).where(_B.box == box)).first() is None:
        s.execute(insert(BoxLease).values(box=box, epoch=0, expires_at=None))
    return s.execute(update(BoxLease).where(BoxLease.box == box)
                     .values(epoch=BoxLease.epoch + 1, expires_at=now + ttl)
                     .returning(BoxLease.epoch)).scalar_one(), True


def hold_chores(s: Session, name: str, holder: str, now: Any,
                expires: Any) -> tuple[int, bool] | None:
    """Guard: renewed only while `holder` holds the row, taken only while it is free or
    expired by the store's clock (`now`). (epoch, newly taken), or None: another holds it."""
    mine = s.execute(update(Chore).where(_C.name == name, _C.holder == holder)
                     .values(expires_at=expires).returning(_C.epoch)).scalar()
    if mine is not None:
        return mine, False
    if s.execute(select(_C.name).where(_C.name == name)).first() is None:
        # The first agent on this store writes the row; two at once: one insert wins
        # (the primary key), the other's transaction fails and its next heartbeat retries.
        s.execute(insert(Chore).values(name=name, holder=None, epoch=0, expires_at=None))
    taken = s.execute(update(Chore).where(_C.name == name, or_(_C.holder.is_(None),
                                                                _C.expires_at <= now))
                      .values(holder=holder, epoch=_C.epoch + 1, expires_at=expires)
                      .returning(_C.epoch)).scalar()
    return None if taken is None else (taken, True)


def free_chores(s: Session, name: str, holder: str) -> None:
    """Guard: only while `holder` holds the row: free at once for another (no expiry wait)."""
    s.execute(update(Chore).where(_C.name == name, _C.holder == holder)
              .values(holder=None, expires_at=None))


def stamp(s: Session, model: Any, key: dict[str, Any], column: str, at: datetime) -> bool:
    """Guard: `column` still NULL: a time written once keeps its first value (a build's
    published_at, good_at, deleted_at). True when this call wrote it."""
    stmt = _shaped(model, (*((k, False) for k in key), (column, True)), {column: at}, None, (),
                   False)
    return affected(s.execute(stmt, {**{f"w_{k}": v for k, v in key.items()},
                                     f"v_{column}": at})) == 1
