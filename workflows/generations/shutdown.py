"""`vigil shutdown`: this box's listeners once the fd holder has closed them. Each held row
becomes lost with the reason, as any socket lost would (written after the sockets were
closed: an interruption in between leaves rows that say held of sockets nobody has, which
the next agent's start finds and marks lost by itself). The host's next start binds the
address again and records `listener_reopened` with this reason."""

from __future__ import annotations

from sqlalchemy import select, text
from sqlalchemy.orm import Session

from models.states import ListenerState
from models.store import emit
from models.tables import Lease, Listener
from models.transition import move
from workflows.base.waivers import OPERATOR

REASON = "closed by `vigil shutdown`"


def closed(r: Listener) -> bool:
    """A listener shutdown closed on purpose: lost, with shutdown's reason (said `closed`,
    not `lost`: nothing went wrong)."""
    return r.state is ListenerState.lost and r.reason == REASON


def mark_closed(s: Session, agent_id: str) -> int:
    """The held listeners of box `agent_id` marked lost with shutdown's reason, each a
    `listener_closed` event (not `listener_lost`: no notification of a deliberate close).
    Returns how many."""
    rows = list(s.execute(select(Listener).where(Listener.agent_id == agent_id,
                                                 Listener.state == ListenerState.held)).scalars())
    for r in rows:
        move(s, Listener, {"host": r.host, "position": r.position, "agent_id": agent_id},
             {"state": ListenerState.lost, "reason": REASON},
             f"listener {r.address} held -> lost", fence=OPERATOR, col="state",
             frm=ListenerState.held)
        emit(s, "listener_closed", r.host, None, address=r.address, reason=REASON)
    return len(rows)


def hosts_of_box(s: Session, agent_id: str | None, every: bool) -> list[str]:
    """What shutdown stops: every host (one box on the store) but those with nothing to
    stop (asleep, no lease, nothing owed: a stop of each cost a round trip, issue 39), else
    those whose lease this box holds (several boxes on one PostgreSQL store: the others'
    hosts are theirs)."""
    from models.states import Desired
    from models.tables import Host

    if every:
        owed = set(s.execute(text("SELECT DISTINCT host FROM pending_obligations")).scalars())
        leased = set(s.execute(select(Lease.host)).scalars())
        rows = s.execute(select(Host.name, Host.desired).order_by(Host.name))
        return [n for n, d in rows if d is Desired.up or n in leased or n in owed]
    return list(s.execute(select(Lease.host).where(Lease.holder == agent_id)
                          .order_by(Lease.host)).scalars())
