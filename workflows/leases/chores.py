"""The store-wide chores, done by one agent of the fleet for all (issue 28 item 1): the
history prune, and the scheduled restarts' job store (APScheduler 3 must never share one
job store between schedulers: two would each fire a run). The `chores` row is held like a
host's lease: written and judged by the store's clock, renewed by its holder, taken by
any agent once expired, its epoch counting the holders. Each call is one statement or two,
O(1) whatever the size of the fleet."""

from __future__ import annotations

from datetime import timedelta

from sqlalchemy.orm import Session

from models import facts
from models.store import emit, store_clock
from workflows.base.context import Context
from workflows.base.crash import crashpoint, define

STORE = "store"  # the one row: every chore that is the whole store's
TAKEN = define("chores.taken", "this agent took the store's chores; nothing of them runs yet")


def hold(s: Session, ctx: Context) -> tuple[int, bool] | None:
    """Renew the chores when this agent holds them, else take them when free or expired:
    (epoch, newly taken), or None when another agent holds them."""
    now = store_clock(s)
    got = facts.hold_chores(s, STORE, ctx.agent_id, now, now + timedelta(seconds=ctx.lease_ttl))
    if got is not None and got[1]:
        emit(s, "chores_taken", None, epoch=got[0], box=ctx.agent_id)
    return got


def take_or_renew(ctx: Context) -> tuple[int, bool] | None:
    """hold() in a transaction of its own; the crash point after a taking commits."""
    got = ctx.store.write(lambda s: hold(s, ctx))
    if got is not None and got[1]:
        crashpoint(TAKEN)
    return got


def let_go(ctx: Context) -> None:
    """A clean stop: the chores are free at once for another agent (no wait for expiry)."""
    ctx.store.write(lambda s: facts.free_chores(s, STORE, ctx.agent_id))
