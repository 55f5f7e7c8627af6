"""Claiming due rows when several agents share a PostgreSQL store.

Before a round drives its rows, it claims them in one short transaction: each row is
locked with `SELECT ... FOR UPDATE SKIP LOCKED` (a row another agent is claiming at this
instant is skipped, never waited for) and, if still due, its `next_attempt_at` is pushed
CLAIM_HOLD ahead, so no other agent sees it due while it is being driven. The drive's own
pacing write (run_one) then sets the real next try. The hold is longer than the backoff
ceiling (5 s), so a pushed-out row is recognisably a claim: an agent that restarts after a
crash brings its claims back (release_claims) instead of waiting the hold out.

Correctness does not rest on the claim: every step is a fenced compare-and-set. The claim
keeps two agents from doing the same work twice. On SQLite (one box) nothing is claimed.
"""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy import exists, or_, select, update
from sqlalchemy.orm import Session

from models.store import utcnow
from models.tables import Lease
from models.transition import affected
from workflows.base.context import Context

CLAIM_HOLD = 30.0
BACKOFF_CEILING = 5.0


def claim(ctx: Context, rows: list) -> list:  # type: ignore[type-arg]
    """The rows (obligations.Due) this agent won; the others are someone else's now."""
    if ctx.store.dialect != "postgresql" or not rows:
        return rows
    from workflows.engine.obligations import KINDS

    def step(s: Session) -> list:  # type: ignore[type-arg]
        now = utcnow()
        won = []
        for d in rows:
            k = KINDS[d.kind]
            q = select(k.key).where(k.key == d.id, k.model.next_attempt_at <= now)
            if k.open is not None:
                q = q.where(k.open)
            if s.execute(q.with_for_update(skip_locked=True)).first() is None:
                continue
            s.execute(update(k.model).where(k.key == d.id)
                      .values(next_attempt_at=now + timedelta(seconds=CLAIM_HOLD)))
            won.append(d)
        return won

    return ctx.store.write(step)


def release_claims(ctx: Context) -> int:
    """On start: rows this box may have claimed before it died are due again now (rows of
    hosts it holds or nobody holds; a row backed off is never further out than 5 s)."""
    if ctx.store.dialect != "postgresql":
        return 0
    from workflows.engine.obligations import KINDS

    def step(s: Session) -> int:
        now = utcnow()
        n = 0
        for k in KINDS.values():
            # Per row, by the lease's primary key: not a NOT IN over the fleet's leases.
            others = exists().where(Lease.host == k.host, Lease.holder != ctx.agent_id)
            where = [k.model.next_attempt_at > now + timedelta(seconds=BACKOFF_CEILING + 1),
                     ~others]
            if k.open is not None:
                where.append(or_(k.open))
            r = s.execute(update(k.model).where(*where).values(next_attempt_at=now))
            n += affected(r)
        return n

    return ctx.store.write(step)
