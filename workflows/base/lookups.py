"""Lookups the steps make on every drive, each statement built once with bound parameters
(building and cache-keying a statement per call cost more than running it). Plain rows
come from table columns: no ORM bookkeeping."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Row, bindparam, func, select
from sqlalchemy.orm import Session

from models.errors import NotFound
from models.states import OPEN_STOP
from models.tables import Attempt, Host, Lease, Stop

_S, _A, _L = Stop.__table__.c, Attempt.__table__.c, Lease.__table__.c
_OPEN_STOP = select(_S.id).where(_S.host == bindparam("host"), _S.state.in_(OPEN_STOP)).limit(1)
_NEWEST_REVISION = select(func.max(_A.revision)).where(_A.host == bindparam("host"))
_LEASE = select(_L.holder, _L.fence, _L.expires_at).where(_L.host == bindparam("host"))
_OPEN_ATTEMPT = (select(_A.id).where(_A.host == bindparam("host"), _A.outcome.is_(None))
                 .order_by(_A.id).limit(1))


def get_host(s: Session, name: str) -> Host:
    """The host row, or NotFound (the operator's error)."""
    h = s.get(Host, name)
    if h is None:
        raise NotFound(f"no host named {name!r}", "see `vigil host list`")
    return h


def open_stop(s: Session, host: str) -> int | None:
    """The id of an open stop of the host, if any."""
    return s.execute(_OPEN_STOP, {"host": host}).scalar()


def open_attempt(s: Session, host: str) -> int | None:
    """The id of the host's oldest open attempt, if any."""
    return s.execute(_OPEN_ATTEMPT, {"host": host}).scalar()


def newest_revision(s: Session, host: str) -> int | None:
    return s.execute(_NEWEST_REVISION, {"host": host}).scalar()


def lease_of(s: Session, host: str) -> Row[Any] | None:
    """The host's lease row (holder, fence, expires_at), or None."""
    return s.execute(_LEASE, {"host": host}).first()
