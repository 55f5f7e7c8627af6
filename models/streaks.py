"""The one store of restart streaks: a slot's quick exits in a row (the policy that counts
them is workflows/lifecycle/restarts.py), one row of `slot_streaks` per host and slot,
slot 0 included (migration 0033 moved it there from `hosts.restart_streak`). A worker, and
a host of one instance, is slot 0. No row is a streak of 0.

A streak is a protocol fact (the pattern of models/facts.py): written by `set_streak`
alone, whose docstring opens with its guard, as a `move` naming its waiver."""

from __future__ import annotations

from sqlalchemy import delete, select, true
from sqlalchemy.orm import Session

from models.errors import LostRace
from models.tables import SlotStreak
from models.transition import Unfenced, move

_EXIT = Unfenced("written in the transaction of the exit it counts, whose move guards it")


def streaks(s: Session, hosts: list[str] | None = None) -> dict[tuple[str, int], int]:
    """The streaks of these hosts' slots (None: every host's), by (host, slot)."""
    where = SlotStreak.host.in_(hosts) if hosts is not None else true()
    return {(r.host, r.slot): r.streak for r in s.execute(
        select(SlotStreak.host, SlotStreak.slot, SlotStreak.streak).where(where))}


def streak(s: Session, host: str, slot: int) -> int:
    row = s.get(SlotStreak, (host, slot))
    return row.streak if row is not None else 0


def set_streak(s: Session, host: str, slot: int, n: int) -> None:
    """Guard: the exit it counts. Written only in the transaction that records it (a current
    generation moved to retiring by its state, or a worker's own start failed), whose
    compare-and-set is the guard: no lease fence of its own."""
    try:
        move(s, SlotStreak, {"host": host, "slot": slot}, {"streak": n},
             f"restart streak of {host}/{slot}", fence=_EXIT)
    except LostRace:  # its first quick exit
        s.add(SlotStreak(host=host, slot=slot, streak=n))
        s.flush()


def forget_streaks(s: Session, host: str, from_slot: int) -> None:
    """Guard: the scale-down that removes those slots (its own intent, in this transaction):
    a slot scaled back later starts afresh."""
    s.execute(delete(SlotStreak).where(SlotStreak.host == host, SlotStreak.slot >= from_slot))
