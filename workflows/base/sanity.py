"""A cheap sanity check of a host's rows before the agent acts on it.

A host whose rows are in a state the store's own constraints should make impossible (more
than one current generation in a slot; a host of one instance has only slot 0) is not acted on at all: no drive, no liveness retire, no
adoption. Each of its obligations is refused with the reason written on the row
(`last_error`, so `vigil obligations` shows it) and, once per row, in a `refused` event;
the sweep keeps retrying with its backoff, so the host resumes by itself once an operator
has repaired the rows. Other hosts are not affected.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from sqlalchemy import bindparam, func, select
from sqlalchemy.orm import Session

from models.states import GenState
from models.store import emit
from models.tables import Generation
from workflows.base.context import Context, Poke

_G = Generation.__table__.c
_CURRENTS = select(_G.id, _G.slot).where(_G.host == bindparam("host"),
                                         _G.state == GenState.current).order_by(_G.id)


def impossible(s: Session, host: str) -> str | None:
    """Why the host's rows cannot be acted on, or None when they pass the check."""
    rows = s.execute(_CURRENTS, {"host": host}).all()
    ids = [r.id for r in rows]
    # More current slots than instances is no impossibility: a scale down stops them.
    if len({r.slot for r in rows}) < len(ids):
        return (f"host {host} is in an impossible state: {len(ids)} current generations "
                f"({', '.join(f'g{i}' for i in ids)}); the agent will not act on it until "
                "its rows are repaired (see `vigil check`)")
    return None


def impossible_hosts(s: Session, among: Collection[str] | None = None) -> set[str]:
    """Every host (of `among`, if given) that fails the check: one query, for the sweeps
    and for a round's rows."""
    if among is not None and not among:
        return set()
    q = select(_G.host).where(_G.state == GenState.current)
    if among is not None:
        q = q.where(_G.host.in_(sorted(among)))
    return set(s.execute(q.group_by(_G.host, _G.slot).having(func.count() > 1)).scalars())


def refuse_if_impossible(ctx: Context, model: Any, key: Any, row_id: int, host: str) -> None:
    """Raise Poke (the row keeps its obligation, with the reason as its last_error) when
    the host fails the check; the first refusal of a row is also written as an event."""
    reason = ctx.store.read(lambda s: impossible(s, host))
    if reason is None:
        return

    def step(s: Session) -> None:
        if s.execute(select(model.last_error).where(key == row_id)).scalar() != reason:
            emit(s, "refused", host, reason=reason)

    ctx.store.write(step)
    raise Poke(reason)
