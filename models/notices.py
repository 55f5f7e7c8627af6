"""Which events a notifier's --on words match, and the delivery rows an event owes, written
by emit() (models/store.py) in the event's own transaction."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from sqlalchemy import bindparam, insert, literal, select
from sqlalchemy.orm import Session

from models.states import CRASHLOOP_STREAK
from models.tables import Delivery, NotifyOn

# --on word -> the event kinds it stands for (crashloop: see word_of).
WORDS: dict[str, tuple[str, ...]] = {
    # a build failed to start or to deploy, or a host gave up at its start limit
    "failed": ("deploy_failed", "wake_failed", "failed"),
    "down": ("down",),  # a hold deploy whose new build failed: the host serves nothing
    "oom": ("oom_killed",),
    "crashloop": ("restart_scheduled",),  # only the restart that makes it a crashloop
    "unhealthy": ("unhealthy",),
    "listener_lost": ("listener_lost",),
    "rollout_halted": ("rollout_halted",),
    "exited": ("exited",),  # a current generation's leader ended by itself (not stopped)
    "restarted": ("restarted",),  # a restart after an exit is current again
    "reload_failed": ("reload_failed",),  # a reload not back ready (restarted or kept)
    "run_failed": ("run_ended",),  # a job's run ended failed or interrupted (not done)
    "run_missed": ("run_missed",),  # an instant passed while no agent ran, not run
    "run_late": ("run_late",),  # a run started past its late bound (jobs.late_bound)
}
_BY_KIND = {kind: word for word, kinds in WORDS.items() for kind in kinds}


def word_of(kind: str, detail: dict[str, Any]) -> str | None:
    """The --on word an event answers to, or None: most events notify nobody."""
    word = _BY_KIND.get(kind)
    if word == "crashloop" and detail.get("streak") != CRASHLOOP_STREAK:
        return None  # once per crashloop, as it begins (`vigil status` says crashloop from here)
    if word == "exited" and ("status" not in detail or detail.get("one_shot")):
        return None  # retired by vigil (unhealthy, not adopted), or a one-shot run's end
    if word == "run_failed" and detail.get("result") not in ("failed", "interrupted"):
        return None  # a run done (exited 0) is no news
    return word


def payload(event_id: int, at: datetime, kind: str, host: str | None, generation: int | None,
            word: str, detail: dict[str, Any]) -> str:
    """The event as a receiver gets it: its id is the key to deduplicate on."""
    return json.dumps({"id": event_id, "at": at.isoformat() + "Z", "kind": kind, "on": word,
                       "host": host, "generation": generation, "detail": detail},
                      default=str, sort_keys=True)


# One statement, built once: a delivery row for every notifier that asked for the word.
_OWED = insert(Delivery.__table__).from_select(
    ["notifier", "event_id", "word", "host", "generation_id", "payload", "created_at",
     "delivered_at", "attempts", "next_attempt_at", "last_error", "since"],
    select(NotifyOn.notifier, bindparam("event_id"), NotifyOn.word, bindparam("host"),
           bindparam("generation_id"), bindparam("payload"), bindparam("at"), literal(None),
           literal(0), bindparam("at"), literal(None), bindparam("at"))
    .where(NotifyOn.word == bindparam("word")))


def owe(session: Session, event_id: int, at: datetime, kind: str, host: str | None,
        generation: int | None, word: str, detail: dict[str, Any]) -> None:
    session.execute(_OWED, {"event_id": event_id, "host": host, "generation_id": generation,
                            "word": word, "at": at,
                            "payload": payload(event_id, at, kind, host, generation, word,
                                               detail)})
