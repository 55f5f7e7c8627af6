"""The one way a row's state moves: a guarded compare-and-set.

`move()` changes one row, `move_many()` any number of rows in one statement. Both check
the move against the transition table (models/states.py) before any SQL runs and raise
IllegalTransition (never an assert: `python -O` strips those), then UPDATE only rows still
in the expected state(s) and, unless waived by name, only while the host's lease still
carries the writer's fence. `move()` raises LostRace when its row did not match.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import exists, update
from sqlalchemy.orm import Session

from models.errors import IllegalTransition, LostRace
from models.states import allowed
from models.tables import Lease


@dataclass(frozen=True)
class Fence:
    """The write holds only while `holder` still holds the host's lease at `value`.
    `host` is a host name, or a column (a bulk move fences each row by its own host)."""

    host: Any
    holder: str
    value: int

    def clause(self) -> Any:
        return exists().where(Lease.host == self.host, Lease.holder == self.holder,
                              Lease.fence == self.value)


@dataclass(frozen=True)
class Unfenced:
    """An explicit waiver, with the reason the row needs no lease fence (an operator's
    intent written by the CLI, a row guarded by its own state alone, ...)."""

    why: str

    def clause(self) -> None:
        return None


def check(frm: enum.Enum | Iterable[enum.Enum], to: enum.Enum, what: str) -> tuple[enum.Enum, ...]:
    """Every `frm -> to` must be in the transition table; returns the expected states."""
    states = (frm,) if isinstance(frm, enum.Enum) else tuple(frm)
    for old in states:
        if old != to and not allowed(old, to):
            raise IllegalTransition(f"illegal transition {old} -> {to} ({what})")
    return states


def _statement(model: Any, where: list[Any], values: dict[str, Any], what: str,
               fence: Fence | Unfenced, col: str | None, frm: Any) -> Any:
    if not isinstance(fence, Fence | Unfenced):
        raise TypeError(f"{what}: fence must be Fence(...) or Unfenced('why')")
    where = list(where)
    if col is not None:
        new = values.get(col)
        states = check(frm, new, what) if new is not None else (
            (frm,) if isinstance(frm, enum.Enum) else tuple(frm))
        column = getattr(model, col)
        where.append(column == states[0] if len(states) == 1 else column.in_(states))
    clause = fence.clause()
    if clause is not None:
        where.append(clause)
    return update(model).where(*where).values(**values)


def move(session: Session, model: Any, where: list[Any], values: dict[str, Any], what: str, *,
         fence: Fence | Unfenced, col: str | None = None, frm: Any = None) -> None:
    """One row: UPDATE model SET values WHERE where [AND col IN frm] [AND fence holds].
    Raises IllegalTransition for a move the table forbids, LostRace when no row matched."""
    stmt = _statement(model, where, values, what, fence, col, frm)  # checks before any SQL
    result = session.execute(stmt)
    if result.rowcount != 1:  # type: ignore[attr-defined]
        raise LostRace(what)


def move_many(session: Session, model: Any, where: list[Any], values: dict[str, Any], what: str,
              *, fence: Fence | Unfenced, col: str, frm: Any) -> int:
    """Every row matching where, in one of `frm`, with its fence holding: moved in one
    statement. A row that fails its guard is left as it is. Returns how many moved."""
    stmt = _statement(model, where, values, what, fence, col, frm)
    result = session.execute(stmt)
    return int(result.rowcount)  # type: ignore[attr-defined]
