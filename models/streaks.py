"""The one store of restart streaks (their policy: workflows/lifecycle/restarts.py): a slot's
quick exits in a row, a `slot_streaks` row per host and slot (slot 0 too, since migration
0033), written by `set_streak` alone, whose docstring opens with its guard (models/facts.py).
The start limit's facts live on the same row (migration 0037): the times of the slot's recent
quick exits, written with its streak, and `failed_at`, set by `fail_slot` and cleared by
`clear_failed`."""

from __future__ import annotations

import json
from datetime import datetime

from sqlalchemy import select, true
from sqlalchemy.orm import Session

from models.errors import LostRace
from models.tables import SlotStreak
from models.transition import Unfenced, move, move_many

_EXIT = Unfenced("written in the transaction of the exit it counts, whose move guards it")
_ASKED = Unfenced("an operator's request to start the host again: the start it queues is gated")


def streaks(s: Session, hosts: list[str] | None = None) -> dict[tuple[str, int], int]:
    """The streaks of these hosts' slots (None: every host's), by (host, slot); none is 0."""
    where = SlotStreak.host.in_(hosts) if hosts is not None else true()
    return {(r.host, r.slot): r.streak for r in s.execute(
        select(SlotStreak.host, SlotStreak.slot, SlotStreak.streak).where(where))}


def set_streak(s: Session, host: str, slot: int, n: int,
               quick: list[float] | None = None) -> None:
    """Guard: the exit it counts, whose move (a current generation retiring, by its state;
    a worker's own failed start) is in this transaction: no lease fence of its own.
    `quick`: the epoch seconds of the slot's recent quick exits (None: left as they are)."""
    values: dict[str, object] = {"streak": n}
    if quick is not None:
        values["quick_exits"] = json.dumps(quick)
    try:
        move(s, SlotStreak, {"host": host, "slot": slot}, values,
             f"restart streak of {host}/{slot}", fence=_EXIT)
    except LostRace:  # its first quick exit
        s.add(SlotStreak(host=host, slot=slot, streak=n, quick_exits=json.dumps(quick or [])))
        s.flush()


def quick_exits(s: Session, host: str, slot: int) -> list[float]:
    """The epoch seconds of the slot's recent quick exits, oldest first."""
    raw = s.execute(select(SlotStreak.quick_exits).where(
        SlotStreak.host == host, SlotStreak.slot == slot)).scalar()
    return [float(t) for t in json.loads(raw)] if raw else []


def failed_slots(s: Session, hosts: list[str] | None = None) -> dict[tuple[str, int], datetime]:
    """The slots the start limit made give up, by (host, slot): when."""
    where = SlotStreak.host.in_(hosts) if hosts is not None else true()
    return {(r.host, r.slot): r.failed_at for r in s.execute(
        select(SlotStreak.host, SlotStreak.slot, SlotStreak.failed_at).where(
            where, SlotStreak.failed_at.is_not(None)))}


def fail_slot(s: Session, host: str, slot: int, at: datetime) -> None:
    """Guard: the exit that reached the start limit, whose move is in this transaction (as
    `set_streak`'s, which wrote the row first): no lease fence of its own."""
    move(s, SlotStreak, {"host": host, "slot": slot}, {"failed_at": at},
         f"start limit of {host}/{slot} reached", fence=_EXIT)


def clear_failed(s: Session, host: str) -> int:
    """Guard: the operator's request that brings the host back (`vigil retry`, a wake, a
    deploy), whose own row the lease then gates; only slots still failed are cleared, with
    their streak and window. Returns how many were."""
    return move_many(s, SlotStreak, [SlotStreak.host == host, SlotStreak.failed_at.is_not(None)],
                     {"failed_at": None, "streak": 0, "quick_exits": "[]"},
                     f"failed slots of {host} cleared", fence=_ASKED)
