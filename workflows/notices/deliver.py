"""Delivering one event to one notifier, at least once: a try is written (intent) before
the command runs or the POST is sent, its outcome after. A try found open at the next
drive was cut short by the agent's death: the receiver may have had it, so it is closed
as `interrupted` and the event sent again. The receiver deduplicates on the event's id."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import insert, select
from sqlalchemy.orm import Session

from models.errors import LostRace
from models.states import TryOutcome
from models.store import utcnow
from models.tables import Delivery, DeliveryTry, Notifier
from models.transition import Unfenced, move
from workflows.base.context import Context, Held, Poke, Result
from workflows.base.crash import crashpoint, define
from workflows.base.ports import NoticePort, Sent

# A delivery belongs to no host's lease: any agent may send it; its rows guard themselves.
OWN_ROW = Unfenced("a delivery and its tries are guarded by their own columns")

BEGUN = define("notify.begun", "a try is written; the command has not run, the POST not sent")
SENT = define("notify.sent", "the command ended or the webhook answered; the outcome is not written")
RECORDED = define("notify.recorded", "the try's outcome is written, and the delivery delivered if it was")

CUT_SHORT = "the agent ended during this try: it may have reached the receiver; sent again"


@dataclass(frozen=True)
class Begun:
    delivery: int
    attempt: int  # the try's id
    notifier: str
    command: str | None
    webhook: str | None
    timeout: float
    payload: str
    event_id: int


def drive_delivery(ctx: Context, delivery_id: int) -> Result:
    port = ctx.notices
    if port is None:
        raise Held("this agent has no notification sender")
    begun = ctx.store.write(lambda s: _begin(s, ctx, delivery_id))
    if begun is None:
        return Result.gone
    crashpoint(BEGUN)
    try:
        sent = _send(port, begun)
    except Exception as exc:  # the try's own failure, recorded as itself (not as `interrupted`)
        sent = Sent(TryOutcome.failed, None, f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:300])
    crashpoint(SENT)
    ctx.store.write(lambda s: _record(s, begun, sent))
    crashpoint(RECORDED)
    if sent.outcome is not TryOutcome.delivered:
        raise Poke(f"notifier {begun.notifier}: {sent.error or sent.outcome.value}")
    return Result.progress


def _send(port: NoticePort, b: Begun) -> Sent:
    body = b.payload.encode()
    if b.command is not None:
        env = {"VIGIL_NOTIFIER": b.notifier, "VIGIL_EVENT_ID": str(b.event_id)}
        return port.run(b.command, body, env, b.timeout)
    # The table holds exactly one of the two (its CHECK one_target).
    headers = {"Content-Type": "application/json", "X-Vigil-Notifier": b.notifier,
               "X-Vigil-Event-Id": str(b.event_id)}
    return port.post(b.webhook or "", body, headers, b.timeout)


def _begin(s: Session, ctx: Context, delivery_id: int) -> Begun | None:
    row = s.execute(select(Delivery.notifier, Delivery.payload, Delivery.event_id,
                           Delivery.delivered_at, Notifier.exec, Notifier.webhook,
                           Notifier.timeout)
                    .join(Notifier, Notifier.name == Delivery.notifier)
                    .where(Delivery.id == delivery_id)).first()
    if row is None or row.delivered_at is not None:
        return None
    now = utcnow()
    for open_try in s.execute(select(DeliveryTry.id).where(
            DeliveryTry.delivery_id == delivery_id, DeliveryTry.outcome.is_(None))).scalars():
        move(s, DeliveryTry, {"id": open_try, "outcome": None},
             {"outcome": TryOutcome.interrupted, "ended_at": now, "error": CUT_SHORT},
             f"delivery try #{open_try} -> interrupted", fence=OWN_ROW)
    result: Any = s.execute(insert(DeliveryTry).values(
        delivery_id=delivery_id, agent_id=ctx.agent_id, started_at=now))
    return Begun(delivery_id, int(result.inserted_primary_key[0]), row.notifier, row.exec,
                 row.webhook, row.timeout, row.payload, row.event_id)


def _record(s: Session, b: Begun, sent: Sent) -> None:
    now = utcnow()
    move(s, DeliveryTry, {"id": b.attempt, "outcome": None},
         {"outcome": sent.outcome, "status": sent.status, "error": sent.error, "ended_at": now},
         f"delivery try #{b.attempt} -> {sent.outcome.value}", fence=OWN_ROW)
    if sent.outcome is TryOutcome.delivered:
        try:
            move(s, Delivery, {"id": b.delivery, "delivered_at": None}, {"delivered_at": now},
                 f"delivery #{b.delivery} -> delivered", fence=OWN_ROW)
        except LostRace:
            pass  # delivered by another try meanwhile (or removed with its notifier)
