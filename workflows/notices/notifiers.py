"""The notifiers an operator adds, lists and removes, and the log of their tries. Every
refusal is raised before anything is written."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlsplit

from sqlalchemy import delete, func, insert, select
from sqlalchemy.orm import Session

from models.errors import BadInput, NotFound
from models.notices import WORDS
from models.store import utcnow
from models.tables import Delivery, DeliveryTry, Notifier, NotifyOn
from workflows.config.hosts import NAME

MAX_TIMEOUT = 20.0  # seconds: below the claim hold (30 s), so no second agent takes a try in flight
KNOWN = ", ".join(WORDS)


def parse_words(on: str) -> list[str]:
    words = [w.strip() for w in on.split(",") if w.strip()]
    unknown = [w for w in words if w not in WORDS]
    if unknown:
        raise BadInput(f"unknown --on word {unknown[0]!r}", f"use some of: {KNOWN}")
    if not words:
        raise BadInput("--on names no event", f"use some of: {KNOWN}")
    return list(dict.fromkeys(words))


def check(name: str, words: str, command: str | None, webhook: str | None,
          timeout: float) -> list[str]:
    """The notifier's --on words, once everything about it is known to be right."""
    if not NAME.fullmatch(name):
        raise BadInput(f"invalid notifier name {name!r}", "use 1-63 characters: lowercase "
                       "letters, digits and '-', not starting with '-'")
    parsed = parse_words(words)
    if (command is None) == (webhook is None):
        raise BadInput("a notifier needs exactly one of --exec CMD and --webhook URL",
                       "pass --exec 'a shell command' (reads the event on stdin) or "
                       "--webhook http://... (POSTed the event)")
    if command is not None and not command.strip():
        raise BadInput("--exec is empty", "pass a shell command, e.g. --exec 'mail -s vigil ops'")
    if webhook is not None:
        bad = next((c for c in webhook if c <= " " or c == "\x7f"), None)
        if bad is not None:  # every try would fail: refused here, not retried forever
            raise BadInput(f"--webhook {webhook!r} holds a control character or space ({bad!r})",
                           "percent-encode it (a space is %20)")
        url = urlsplit(webhook)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise BadInput(f"--webhook {webhook!r} is not an http:// or https:// URL",
                           "pass a URL such as https://hooks.example.com/vigil")
    if not 0 < timeout <= MAX_TIMEOUT:
        raise BadInput(f"--timeout {timeout:g} is out of range",
                       f"pass a number of seconds above 0 and at most {MAX_TIMEOUT:g}")
    return parsed


def add(s: Session, name: str, words: list[str], command: str | None, webhook: str | None,
        timeout: float) -> None:
    if s.get(Notifier, name) is not None:
        raise BadInput(f"notifier {name} exists", f"remove it first (vigil notify remove {name})"
                       " or pick another name")
    s.execute(insert(Notifier).values(name=name, exec=command, webhook=webhook,
                                      timeout=timeout, created_at=utcnow()))
    s.execute(insert(NotifyOn), [{"notifier": name, "word": w} for w in words])


def remove(s: Session, name: str) -> int:
    """Remove a notifier (its deliveries and their log go with it); how many were undelivered."""
    if s.get(Notifier, name) is None:
        raise NotFound(f"no notifier {name}", "see vigil notify list")
    owed = s.execute(select(func.count()).select_from(Delivery).where(
        Delivery.notifier == name, Delivery.delivered_at.is_(None))).scalar() or 0
    s.execute(delete(Notifier).where(Notifier.name == name))
    return int(owed)


def listing(s: Session) -> list[dict[str, Any]]:
    words: dict[str, list[str]] = {}
    for r in s.execute(select(NotifyOn.notifier, NotifyOn.word)):
        words.setdefault(r.notifier, []).append(r.word)
    owed = dict(s.execute(select(Delivery.notifier, func.count()).where(
        Delivery.delivered_at.is_(None)).group_by(Delivery.notifier)).tuples().all())
    order = list(WORDS)
    return [{"name": n.name, "on": sorted(words.get(n.name, []), key=order.index),
             "exec": n.exec, "webhook": n.webhook, "timeout": n.timeout,
             "undelivered": owed.get(n.name, 0)}
            for n in s.execute(select(Notifier).order_by(Notifier.name)).scalars()]


def log(s: Session, name: str | None, last: int) -> list[dict[str, Any]]:
    """The newest `last` tries (of one notifier, or all), oldest first."""
    q = (select(DeliveryTry, Delivery.notifier, Delivery.event_id, Delivery.payload,
                Delivery.delivered_at)
         .join(Delivery, Delivery.id == DeliveryTry.delivery_id)
         .order_by(DeliveryTry.id.desc()).limit(last))
    if name is not None:
        if s.get(Notifier, name) is None:
            raise NotFound(f"no notifier {name}", "see vigil notify list")
        q = q.where(Delivery.notifier == name)
    rows = []
    for t, notifier, event_id, payload, delivered_at in s.execute(q).tuples():
        event = json.loads(payload)
        rows.append({"try": t.id, "delivery": t.delivery_id, "notifier": notifier,
                     "event": event_id, "kind": event.get("kind"), "host": event.get("host"),
                     "started_at": t.started_at, "ended_at": t.ended_at,
                     "outcome": t.outcome.value if t.outcome is not None else None,
                     "status": t.status, "error": t.error,
                     "delivered": delivered_at is not None})
    return rows[::-1]
