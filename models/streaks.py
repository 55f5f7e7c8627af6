"""The one store of restart streaks (their policy: workflows/lifecycle/restarts.py): a slot's
quick exits in a row, a `slot_streaks` row per host and slot (slot 0 too, since migration
0033), written by `set_streak` alone, whose docstring opens with its guard (models/facts.py)."""

from __future__ import annotations

from sqlalchemy import select, true
from sqlalchemy.orm import Session

from models.errors import LostRace
from models.tables import SlotStreak
from models.transition import Unfenced, move

_EXIT = Unfenced("written in the transaction of the exit it counts, whose move guards it")


def streaks(s: Session, hosts: list[str] | None = None) -> dict[tuple[str, int], int]:
    """The streaks of these hosts' slots (None: every host's), by (host, slot); none is 0."""
    where = SlotStreak.host.in_(hosts) if hosts is not None else true()
    return {(r.host, r.slot): r.streak for r in s.execute(
        select(SlotStreak.host, SlotStreak.slot, SlotStreak.streak).where(where))}


def set_streak(s: Session, host: str, slot: int, n: int) -> None:
    """Guard: the exit it counts, whose move (a current generation retiring, by its state;
    a worker's own failed start) is in this transaction: no lease fence of its own."""
    try:
        move(s, SlotStreak, {"host": host, "slot": slot}, {"streak": n},
             f"restart streak of {host}/{slot}", fence=_EXIT)
    except LostRace:  # its first quick exit
        s.add(SlotStreak(host=host, slot=slot, streak=n))
        s.flush()
