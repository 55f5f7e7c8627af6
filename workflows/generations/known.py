"""The descendants of a generation's leader that a walk saw, kept in `known_processes`
(see runners/backend/descendants.py for why, and for what no walk can catch). Walks run at spawn,
after the health check, at each ongoing probe and at the liveness backstop; the proof and
the kill path read what was recorded before they act.

A row is an observation, not a step: it has no state, is written in a short transaction
of its own after the walk (a walk changes nothing on the box), and a death before the write
loses only that sighting (the next walk records it again while the process has a parent in
the generation)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from sqlalchemy import insert, select
from sqlalchemy.orm import Session

from models.store import utcnow
from models.tables import KnownProcess
from workflows.base.context import Context
from workflows.base.ports import ProcRef

MARGIN = 1.05  # start times within this are one process (runners.base.pids.CTIME_TOLERANCE)
_K = KnownProcess.__table__
_NEW = insert(_K)


def known_of(s: Session, gen_id: int) -> tuple[tuple[int, float], ...]:
    rows = s.execute(select(_K.c.pid, _K.c.create_time).where(_K.c.generation_id == gen_id)).all()
    return tuple((r.pid, r.create_time) for r in rows)


def with_known(ctx: Context, ref: ProcRef, gen_id: int) -> ProcRef:
    """The ref with every descendant recorded for the generation: what the proof checks."""
    return replace(ref, known=ctx.store.read(lambda s: known_of(s, gen_id)))


def _new(known: list[tuple[int, float]], seen: list[tuple[int, float]]) -> list[tuple[int, float]]:
    out: list[tuple[int, float]] = []
    for pid, ctime in seen:
        if not any(p == pid and abs(c - ctime) <= MARGIN for p, c in [*known, *out]):
            out.append((pid, ctime))
    return out


def note(ctx: Context, refs: dict[int, ProcRef]) -> int:
    """Walk the leaders of `refs` (generation id -> ref) and record the descendants not yet
    known. Returns how many rows were written."""
    live = {gid: r for gid, r in refs.items() if r.pid is not None}
    if not live:
        return 0
    seen = ctx.proc.descendants(list(live.values()))
    by_id = {gid: seen[r.generation_uuid] for gid, r in live.items() if r.generation_uuid in seen}
    if not by_id:
        return 0

    def step(s: Session) -> int:
        rows: list[dict[str, Any]] = []
        now = utcnow()
        for gid, pairs in by_id.items():
            for pid, ctime in _new(list(known_of(s, gid)), pairs):
                rows.append({"generation_id": gid, "pid": pid, "create_time": ctime,
                             "seen_at": now})
        if rows:
            s.execute(_NEW, rows)
        return len(rows)

    return ctx.store.write(step)
