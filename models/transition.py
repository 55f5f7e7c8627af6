"""The one way a row's state moves: a guarded compare-and-set.

`move()` changes one row, `move_many()` any number of rows in one statement. Both check
the move against the transition table (models/states.py) before any SQL runs and raise
IllegalTransition (never an assert: `python -O` strips those), then UPDATE only rows still
in the expected state(s) and, unless waived by name, only while the host's lease still
carries the writer's fence. `move()` raises LostRace when its row did not match. A state
column set without `col`/`frm` is refused (TypeError): the table is always consulted. A
`move` of no state column writes a fact of one row guarded by its `where` (the other
protocol facts: models/facts.py; the rule: docs/internals/architecture.md).
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import CursorResult, Result, bindparam, exists, update
from sqlalchemy.orm import Session
from sqlalchemy.orm.attributes import set_committed_value
from sqlalchemy.orm.util import identity_key

from models.errors import IllegalTransition, LostRace
from models.states import TRANSITIONS, allowed
from models.tables import Lease


def affected(result: Result[Any]) -> int:
    """Rows an UPDATE or DELETE matched (a DML statement's result is a CursorResult, which
    SQLAlchemy's types for Session.execute do not say)."""
    if not isinstance(result, CursorResult):
        raise TypeError("affected() takes the result of an UPDATE or DELETE")
    return int(result.rowcount)


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


@functools.cache
def state_columns(model: Any) -> frozenset[str]:
    """The columns of `model` whose moves the transition table rules (models/states.py)."""
    return frozenset(c.name for c in model.__table__.columns
                     if getattr(c.type, "enum_class", None) in TRANSITIONS)


def _expected(model: Any, col: str | None, values: dict[str, Any], frm: Any,
              what: str) -> tuple[Any, ...]:
    """The states `col` may be in for this move (checked against the table if it moves).
    A state column set other than as `col` (with its `frm`) is refused: TypeError."""
    stray = state_columns(model).intersection(values).difference([col] if frm is not None else [])
    if stray:
        raise TypeError(f"{what}: {', '.join(sorted(stray))} is a state column: move it with "
                        "col= and frm= (the transition table is consulted)")
    if col is None:
        return ()
    new = values.get(col)
    if new is not None:
        return check(frm, new, what)
    return (frm,) if isinstance(frm, enum.Enum) else tuple(frm)


def _statement(model: Any, where: list[Any], values: dict[str, Any], what: str,
               fence: Fence | Unfenced, col: str | None, frm: Any) -> Any:
    if not isinstance(fence, Fence | Unfenced):
        raise TypeError(f"{what}: fence must be Fence(...) or Unfenced('why')")
    where = list(where)
    states = _expected(model, col, values, frm, what)
    if col is not None:
        column = getattr(model, col)
        where.append(column == states[0] if len(states) == 1 else column.in_(states))
    clause = fence.clause()
    if clause is not None:
        where.append(clause)
    return update(model).where(*where).values(**values)


# Statements of moves by equalities (the primary key, say), one per shape: table, columns
# compared, columns set, expected states, fenced or not; built once with bound parameters.
# Building and cache-keying a statement cost ~0.25 ms a time, several times the UPDATE
# itself (a wake makes seven moves).
_SHAPES: dict[tuple[Any, ...], Any] = {}


def _shaped(model: Any, equal: tuple[tuple[str, bool], ...], values: dict[str, Any],
            col: str | None, states: tuple[Any, ...], fenced: bool) -> Any:
    shape = (model, equal, tuple(sorted(values)), col, states, fenced)
    stmt = _SHAPES.get(shape)
    if stmt is None:
        t = model.__table__
        # A None compares as IS NULL (`= NULL` would match nothing).
        where = [t.c[k].is_(None) if null else t.c[k] == bindparam(f"w_{k}", type_=t.c[k].type)
                 for k, null in equal]
        if col is not None:
            c = t.c[col]
            where.append(c == states[0] if len(states) == 1 else c.in_(states))
        if fenced:
            where.append(exists().where(Lease.host == bindparam("f_host"),
                                        Lease.holder == bindparam("f_holder"),
                                        Lease.fence == bindparam("f_value")))
        stmt = update(t).where(*where).values(
            {k: bindparam(f"v_{k}", type_=t.c[k].type) for k in values})
        _SHAPES[shape] = stmt
    return stmt


def move(session: Session, model: Any, where: dict[str, Any], values: dict[str, Any], what: str,
         *, fence: Fence | Unfenced, col: str | None = None, frm: Any = None) -> None:
    """One row: UPDATE model SET values WHERE where [AND col IN frm] [AND fence holds], `where`
    a dict of column -> value (None compares IS NULL); flushed before (the fence's lease may
    be pending), and the session's copy of the row synchronized after. Raises TypeError for
    a state column set without `col`/`frm`, IllegalTransition for a move the table forbids
    (both before any SQL), LostRace when no row matched."""
    if not isinstance(fence, Fence | Unfenced):
        raise TypeError(f"{what}: fence must be Fence(...) or Unfenced('why')")
    if not isinstance(where, dict):
        raise TypeError(f"{what}: where is a dict of column -> value")
    if isinstance(fence, Fence) and not isinstance(fence.host, str):
        raise TypeError(f"{what}: a move by column values is fenced by a host name")
    stmt, params = _equalities(model, where, values, what, fence, col, frm)  # checks first
    session.flush()
    if affected(session.execute(stmt, params)) != 1:
        raise LostRace(what)
    _synchronize(session, model, where, values)


def _synchronize(session: Session, model: Any, where: dict[str, Any], values: dict[str, Any]) -> None:
    """As the ORM form does: a copy of the row this session already holds takes the new
    values, so a later read in the same step does not see the old state."""
    names = [c.name for c in model.__table__.primary_key.columns]
    ident = tuple(where.get(n) for n in names)
    key = None if None in ident else (ident[0] if len(ident) == 1 else ident)
    obj = session.identity_map.get(identity_key(model, key)) if key is not None else None
    if obj is not None:
        for k, v in values.items():
            set_committed_value(obj, k, v)


def _equalities(model: Any, where: dict[str, Any], values: dict[str, Any], what: str,
                fence: Fence | Unfenced, col: str | None, frm: Any) -> tuple[Any, dict[str, Any]]:
    """The cached statement of this move's shape, and its parameters."""
    states = _expected(model, col, values, frm, what)
    params = {**{f"w_{k}": v for k, v in where.items() if v is not None},
              **{f"v_{k}": v for k, v in values.items()}}
    if isinstance(fence, Fence):
        params.update(f_host=fence.host, f_holder=fence.holder, f_value=fence.value)
    equal = tuple((k, v is None) for k, v in where.items())
    return _shaped(model, equal, values, col, states, isinstance(fence, Fence)), params


def move_many(session: Session, model: Any, where: list[Any], values: dict[str, Any], what: str,
              *, fence: Fence | Unfenced, col: str | None = None, frm: Any = None) -> int:
    """Every row matching where, in one of `frm`, with its fence holding: moved in one
    statement. A row that fails its guard is left as it is. Returns how many moved."""
    stmt = _statement(model, where, values, what, fence, col, frm)
    result = session.execute(stmt)
    return affected(result)
