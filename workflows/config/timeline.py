"""The read model of the status page (`vigil ui`) beyond `top`'s rows (glance.py): the
timeline of deploys and rollouts, told by their events, and each host's restarts over
time, counted as `top` counts them (the agent's own wakes after an exit, a recycle or a
converge, and restart attempts)."""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import select, text
from sqlalchemy.orm import Session

from models.durations import iso
from models.states import Cause
from models.tables import Attempt, Event, RolloutTarget, Wake
from workflows.config.glance import RESTART_WAKES

# The events a deploy or a rollout writes as it goes, in the words the page shows.
TIMELINE = {
    "deploy_requested": "deploy requested",
    "switched": "switched",
    "swapped": "swapped",
    "deploy_failed": "deploy failed",
    "held_down": "build held down",
    "deploy_held_down": "deploy held down",
    "deployed_asleep": "deployed, asleep",
    "rollout_requested": "rollout requested",
    "rollout_wave_admitted": "wave admitted",
    "rollout_wave_settled": "wave settled",
    "rollout_halted": "rollout halted",
    "rollout_revert_started": "revert started",
    "rollout_revert_settled": "revert settled",
    "rollout_paused": "rollout paused",
    "rollout_resumed": "rollout resumed",
    "rollout_aborting": "rollout aborting",
    "rollout_ended": "rollout ended",
}
# What of an event's detail the page shows: ids, builds, modes, waves and reasons, never
# anything else an event may carry.
SHOWN = ("attempt", "build", "mode", "rollout", "wave", "of", "reason", "state", "outcome")


def timeline(s: Session, since: datetime, limit: int = 200) -> list[dict[str, Any]]:
    """The deploy and rollout events since `since`, oldest first (the newest `limit`). A
    rollout's event, which names no host, carries the hosts it is about: its wave's for a
    wave's event, else every host of the rollout."""
    rows = s.execute(select(Event).where(Event.kind.in_(list(TIMELINE)), Event.at >= since)
                     .order_by(Event.id.desc()).limit(limit)).scalars().all()
    details = [json.loads(e.detail or "{}") for e in reversed(rows)]
    targets = _targets(s, {d["rollout"] for d in details if isinstance(d.get("rollout"), int)})
    out = []
    for e, detail in zip(reversed(rows), details, strict=True):
        hosts = None
        if e.host is None and detail.get("rollout") in targets:
            waves = targets[detail["rollout"]]
            wave = detail.get("wave") if e.kind.startswith("rollout_wave") else None
            hosts = [h for w, h in waves if wave is None or w == wave]
        out.append({"at": iso(e.at), "kind": e.kind, "what": TIMELINE[e.kind],
                    "host": e.host, "hosts": hosts, "generation": e.generation_id,
                    "detail": {k: detail[k] for k in SHOWN if k in detail}})
    return out


def _targets(s: Session, rollouts: set[int]) -> dict[int, list[tuple[int, str]]]:
    """Each rollout's (wave, host) pairs, in the order its hosts were given."""
    out: dict[int, list[tuple[int, str]]] = {r: [] for r in rollouts}
    if rollouts:
        for rid, wave, host in s.execute(
                select(RolloutTarget.rollout_id, RolloutTarget.wave, RolloutTarget.host)
                .where(RolloutTarget.rollout_id.in_(rollouts))
                .order_by(RolloutTarget.rollout_id, RolloutTarget.position)):
            out[rid].append((wave, host))
    return out


def restarts_over_time(s: Session, since: datetime, until: datetime,
                       buckets: int) -> dict[str, list[int]]:
    """Per host with any, its restarts in each of `buckets` equal spans from since to until."""
    span = (until - since) / buckets
    out: dict[str, list[int]] = {}

    def count(host: str, at: datetime) -> None:
        i = min(buckets - 1, int((at - since) / span)) if span > timedelta(0) else 0
        out.setdefault(host, [0] * buckets)[i] += 1

    for host, at in s.execute(select(Wake.host, Wake.created_at).where(
            Wake.cause.in_(list(RESTART_WAKES)), Wake.created_at >= since)):
        count(host, at)
    for host, at in s.execute(select(Attempt.host, Attempt.created_at).where(
            Attempt.cause == Cause.restart, Attempt.created_at >= since)):
        count(host, at)
    return out


def _when(value: Any) -> str | None:
    if isinstance(value, str):  # SQLite hands a view's times back as text
        value = datetime.fromisoformat(value)
    return iso(value)


def open_obligations(s: Session) -> list[dict[str, Any]]:
    """Every row of the pending_obligations view, oldest first: what it is, since when, how
    many tries, when the next, and what it last waited for (its last_error)."""
    rows = s.execute(text("SELECT kind, host, generation, since, attempts, next_attempt_at, "
                          "last_error FROM pending_obligations ORDER BY since"))
    return [{"kind": kind, "host": host, "generation": gen, "since": _when(since),
             "attempts": attempts, "next_attempt_at": _when(due), "waiting_for": why}
            for kind, host, gen, since, attempts, due, why in rows]
