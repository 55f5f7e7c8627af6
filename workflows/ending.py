"""Ending a generation: SIGTERM, its own drain up to a deadline, SIGKILL to everything in
its containment, then the termination proof. Shared by stop, failed wakes and members."""

from __future__ import annotations

import logging

from sqlalchemy.orm import Session

from models.states import GenState
from models.store import utcnow
from models.tables import Generation
from models.transition import Unfenced, move
from workflows.context import Context
from workflows.crash import crashpoint
from workflows.ports import ProcRef

log = logging.getLogger("vigil.proof")

# Moves that carry no lease fence, each with the reason it needs none.
BY_STATE = Unfenced("the generation's own state guards it; the step ending it holds the lease")


def ref_of(gen: Generation) -> ProcRef:
    return ProcRef(generation_uuid=gen.uuid, pid=gen.pid, create_time=gen.create_time,
                   cgroup=gen.cgroup)


def end_generation(ctx: Context, gen: Generation, *, drain_until: float | None,
                   points: tuple[str, str] | None = None, drain_rest: bool = False) -> str | None:
    """Drive the generation's processes to their end. `drain_until` (epoch seconds) is how
    long the leader may drain after SIGTERM; None means kill at once (a failed start).
    `points` names the crash points after the TERM and after the KILL. `drain_rest`: when
    the leader is already gone, what is left of the containment gets SIGTERM and the same
    drain before SIGKILL (a server's workers on a shared listener finish the requests they
    accepted instead of being killed in the middle of one).
    Returns None when proven terminated, else why not (the caller keeps its obligation)."""
    ref = ref_of(gen)
    if drain_until is not None and ctx.proc.leader_alive(ref):
        ctx.proc.terminate(ref)
        if points:
            crashpoint(points[0])
        remaining = max(0.0, drain_until - ctx.clock.now())
        ctx.wait_until(lambda: not ctx.proc.leader_alive(ref), remaining, interval=0.02)
    elif drain_until is not None and drain_rest and ctx.proc.live_members(ref):
        ctx.proc.terminate_all(ref)
        if points:
            crashpoint(points[0])
        remaining = max(0.0, drain_until - ctx.clock.now())
        ctx.wait_until(lambda: ctx.proc.proven(ref), remaining, interval=0.02)
    if not ctx.proc.proven(ref):
        ctx.proc.kill_all(ref)
        if points:
            crashpoint(points[1])
    if ctx.wait_until(lambda: ctx.proc.proven(ref), ctx.proof_wait, interval=0.02):
        return None
    ctx.on_proof_failed()
    left = ctx.proc.live_members(ref)
    leader = "leader alive" if ctx.proc.leader_alive(ref) else "leader exited"
    why = f"generation g{gen.id} not proven gone: {leader}, live pids {left}"
    log.warning("proof failed host=%s generation=g%d reason=%r", gen.host, gen.id, why)
    return why


def mark_proven(s: Session, gen_id: int, reason: str | None = None) -> None:
    values: dict[str, object] = {"state": GenState.proven, "ended_at": utcnow()}
    if reason:
        values["end_reason"] = reason
    move(s, Generation, gen_id, values,
         f"generation g{gen_id} retiring -> proven",
         fence=BY_STATE, col="state", frm=GenState.retiring)


def mark_retiring(s: Session, gen_id: int, expected: GenState, reason: str) -> None:
    move(s, Generation, gen_id,
         {"state": GenState.retiring, "end_reason": reason},
         f"generation g{gen_id} {expected.value} -> retiring",
         fence=BY_STATE, col="state", frm=expected)
