"""Retention: history that nothing needs any more is deleted, a small batch at a time.

History is what the store keeps after the work is done: events, ended attempts, proven
generations, closed wakes and stops (about 1.2 KB a deploy), delivered notifications and
the tries of any. A row goes once it ended
longer ago than `Keep.older_than`, unless something still needs it:

- each host's newest `Keep.last` attempts, generations, wakes and stops stay whatever their
  age (the newest attempt of a host, its last failed one for `vigil retry`, the last wake a
  worker's status shows, the generation it last ran);
- a row an open obligation names stays: an open attempt, wake or stop is not history, a
  member names its attempt and its generation, and a generation any remaining row names
  (a wake, a stop, an attempt's successor or retiring one) stays until that row goes;
- only proven generations go (never a live one), and builds are never deleted here (gc's
  business, which keeps every referenced build).

Each batch is one statement (`DELETE ... WHERE id IN (SELECT id ... LIMIT n)`) in its own
transaction, so a writer never waits long behind it. Events go first, then wakes and stops,
then attempts, then generations, so the rows that name a generation leave before it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import partial
from typing import Any

from sqlalchemy import ColumnElement, and_, delete, exists, func, not_, or_, select
from sqlalchemy.orm import Session

from models.states import OPEN_STOP, OPEN_WAKE, GenState
from models.store import Store, store_now, utcnow
from models.tables import (
    Attempt,
    Delivery,
    DeliveryTry,
    Event,
    Generation,
    Member,
    Ring,
    Stop,
    Wake,
)
from models.transition import affected

KEEP_DAYS = 30  # default of `--keep-history`
KEEP_LAST = 20  # default of `--keep-last`
BATCH = 500  # rows per statement


@dataclass(frozen=True)
class Keep:
    older_than: timedelta | None = timedelta(days=KEEP_DAYS)  # None: keep all of it
    last: int = KEEP_LAST  # per host and per kind, the newest rows kept whatever their age

    def __post_init__(self) -> None:
        if self.last < 1:
            raise ValueError("at least the newest row of each host is kept")


E = Event.__table__.c
W = Wake.__table__.c
S = Stop.__table__.c
A = Attempt.__table__.c
G = Generation.__table__.c
M = Member.__table__.c
D = Delivery.__table__.c
T = DeliveryTry.__table__.c


def _older_than_newest(table: Any, last: int) -> ColumnElement[bool]:
    """Not among its host's newest `last` rows (by the (host, id) index: migration 0008).
    A host with fewer rows has no `last`-th newest: false (0, never NULL, so that NOT of
    the whole condition is true for a row that stays)."""
    newer = table.alias("newer")
    nth = (select(newer.c.id).where(newer.c.host == table.c.host).order_by(newer.c.id.desc())
           .offset(last - 1).limit(1).scalar_subquery())
    return table.c.id < func.coalesce(nth, 0)


def _ended_before(table: Any, cutoff: datetime) -> ColumnElement[bool]:
    return func.coalesce(table.c.ended_at, table.c.created_at) < cutoff


def prunable(keep: Keep, now: datetime, *, ahead: bool = False
             ) -> dict[str, tuple[Any, list[ColumnElement[bool]]]]:
    """table name -> (table, the conditions a row must meet to be pruned), in pruning order.
    `ahead`: as of the end of a whole prune, where a generation named only by rows that go
    before it goes too (for a count; a prune itself deletes in order and needs no look-ahead)."""
    if keep.older_than is None:
        return {}
    cutoff = now - keep.older_than
    wakes, stops, attempts, gens = (Wake.__table__, Stop.__table__, Attempt.__table__,
                                    Generation.__table__)
    wake_goes = [W.state.not_in(OPEN_WAKE), _ended_before(wakes, cutoff),
                 _older_than_newest(wakes, keep.last)]
    stop_goes = [S.state.not_in(OPEN_STOP), _ended_before(stops, cutoff),
                 _older_than_newest(stops, keep.last)]
    attempt_goes = [A.outcome.is_not(None), _ended_before(attempts, cutoff),
                    _older_than_newest(attempts, keep.last), ~exists().where(M.attempt_id == A.id)]

    def stays(goes: list[ColumnElement[bool]]) -> list[ColumnElement[bool]]:
        return [not_(and_(*goes))] if ahead else []

    return {
        "events": (Event.__table__, [E.at < cutoff]),
        "wakes": (wakes, wake_goes),
        "stops": (stops, stop_goes),
        "attempts": (attempts, attempt_goes),
        "generations": (gens, [G.state == GenState.proven, _ended_before(gens, cutoff),
                               _older_than_newest(gens, keep.last),
                               ~exists().where(M.generation_id == G.id),
                               ~exists().where(W.generation_id == G.id, *stays(wake_goes)),
                               ~exists().where(S.generation_id == G.id, *stays(stop_goes)),
                               ~exists().where(or_(A.successor_id == G.id,
                                                   A.retiring_id == G.id),
                                               *stays(attempt_goes))]),
        # A notification's tries, ended before the cutoff (a receiver down for weeks has
        # many); a delivered notification then, its last tries with it (ON DELETE CASCADE).
        "delivery_tries": (DeliveryTry.__table__, [T.outcome.is_not(None), T.ended_at < cutoff]),
        "deliveries": (Delivery.__table__, [D.delivered_at.is_not(None), D.delivered_at < cutoff]),
    }


def prune_batch(s: Session, table: Any, where: list[ColumnElement[bool]], limit: int) -> int:
    """One statement: delete up to `limit` of the oldest rows that meet `where`."""
    ids = select(table.c.id).where(and_(*where)).order_by(table.c.id).limit(limit)
    return affected(s.execute(delete(table).where(table.c.id.in_(ids))))


def count(s: Session, keep: Keep, now: datetime | None = None) -> dict[str, int]:
    """What a prune would delete now, per table (for `vigil gc --dry-run`)."""
    return {name: s.execute(select(func.count()).select_from(table).where(and_(*where)))
            .scalar_one() for name, (table, where) in prunable(keep, now or utcnow(),
                                                               ahead=True).items()}


RINGS_KEPT = timedelta(hours=1)  # a ring is read within seconds (runners/base/wakeup.py Rings)


def _batches(store: Store, table: Any, where: list[ColumnElement[bool]], batch: int,
             max_batches: int | None, go_on: Callable[[], bool] = lambda: True) -> int:
    done = n = 0
    while go_on() and (max_batches is None or n < max_batches):
        deleted = store.write(partial(prune_batch, table=table, where=where, limit=batch))
        done, n = done + deleted, n + 1
        if deleted < batch:
            break
    return done


def prune_rings(store: Store, *, batch: int = BATCH, max_batches: int = 20) -> int:
    """Delete the rings (migration 0032) older than RINGS_KEPT, whatever the history kept:
    they are not history, only what an agent without LISTEN reads in its next sweep."""
    cutoff = store.read(store_now) - RINGS_KEPT
    return _batches(store, Ring.__table__, [Ring.__table__.c.at < cutoff], batch, max_batches)


def prune(store: Store, keep: Keep, *, batch: int = BATCH, max_batches: int | None = None,
          go_on: Callable[[], bool] = lambda: True) -> dict[str, int]:
    """Delete what `keep` lets go, `batch` rows per transaction, at most `max_batches`
    batches per table (None: until none is left), while `go_on()`. Returns the rows deleted
    per table."""
    return {name: _batches(store, table, where, batch, max_batches, go_on)
            for name, (table, where) in prunable(keep, utcnow()).items()}
