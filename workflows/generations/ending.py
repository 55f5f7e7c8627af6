"""Ending a generation: its host's stop signal (SIGTERM unless set) or stop command, its own
drain up to a deadline, SIGKILL to everything in its containment, then the termination
proof. Shared by stop, failed wakes and members."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from sqlalchemy.orm import Session

from models.states import GenState
from models.store import emit, utcnow
from models.tables import Generation
from models.transition import move
from workflows.base.context import Context, Until
from workflows.base.crash import crashpoint, define
from workflows.base.ports import ProcRef, SpawnError
from workflows.base.waivers import BY_STATE
from workflows.generations.known import note, with_known
from workflows.generations.stopway import TERM, StopWay

log = logging.getLogger("vigil.proof")

HOLD = 2.0  # seconds a drive may wait for a drain before it gives its slot back
RECHECK = 1.0  # seconds between looks at a drain that goes on past the hold
WAITING = define("obligation.waiting", "a drain outlasted the hold: the row gives its drive "
                 "slot back and is due again shortly; the stop signal was sent, nothing else changed")


def ref_of(gen: Generation) -> ProcRef:
    return ProcRef(generation_uuid=gen.uuid, pid=gen.pid, create_time=gen.create_time,
                   cgroup=gen.cgroup, user=gen.run_user, socket=gen.socket)


def _drain(ctx: Context, gen: Generation, drain_until: float, done: Callable[[], bool]) -> None:
    """Wait for the drain, at most HOLD seconds in this drive: a longer one gives the drive
    slot back (Until) and the row is looked at again every RECHECK seconds until `done()` or
    the deadline, so apps that drain for long never starve the other hosts' drives."""
    remaining = max(0.0, drain_until - ctx.clock.now())
    if ctx.wait_until(done, min(remaining, HOLD), interval=0.02) or remaining <= HOLD:
        return
    at = utcnow() + timedelta(seconds=min(RECHECK, max(0.0, drain_until - ctx.clock.now())))
    crashpoint(WAITING)
    raise Until(at, f"g{gen.id} draining, SIGKILL at "
                    f"{datetime.fromtimestamp(drain_until, UTC).strftime('%H:%M:%S')} UTC")


def end_generation(ctx: Context, gen: Generation, *, drain_until: float | None,
                   points: tuple[str | None, str] | None = None, drain_rest: bool = False,
                   way: StopWay = TERM) -> str | None:
    """Drive the generation's processes to their end. `drain_until` (epoch seconds) is how
    long the leader may drain after it is asked to stop, the host's `way` (its stop signal,
    SIGTERM unless set, or its stop command); None means kill at once (a failed start).
    `points` names the crash points after the TERM and after the KILL. `drain_rest`: when
    the leader is already gone, what is left of the containment gets the stop signal and the same
    drain before SIGKILL (a server's workers on a shared listener finish the requests they
    accepted instead of being killed in the middle of one).
    Returns None when proven terminated, else why not (the caller keeps its obligation)."""
    # A last walk while the leader lives, then every descendant ever recorded: one that
    # left the cgroup and dropped the marker is still signalled and still blocks the proof.
    note(ctx, {gen.id: ref_of(gen)})
    ref = with_known(ctx, ref_of(gen), gen.id)
    leader = drain_until is not None and ctx.proc.leader_alive(ref)
    if drain_until is not None and (leader or drain_rest and ctx.proc.live_members(ref)):
        if gen.uuid not in ctx.termed:
            _ask_to_stop(ctx, gen, ref, way, leader)
            ctx.termed.add(gen.uuid)
            if points and points[0]:
                crashpoint(points[0])
        _drain(ctx, gen, drain_until, (lambda: not ctx.proc.leader_alive(ref) and not (
            way.command and ctx.proc.stop_command_running(gen.uuid))) if leader
            else (lambda: ctx.proc.proven(ref)))
        if way.command:
            _say_stop_command(ctx, gen, ctx.proc.stop_command_outcome(gen.uuid))
    if not ctx.proc.proven(ref):
        ctx.proc.kill_all(ref)
        if points:
            crashpoint(points[1])
    if ctx.wait_until(lambda: ctx.proc.proven(ref), ctx.proof_wait, interval=0.02):
        ctx.termed.discard(gen.uuid)
        return None
    ctx.on_proof_failed()
    left = ctx.proc.live_members(ref)
    said = "leader alive" if ctx.proc.leader_alive(ref) else "leader exited"
    why = f"generation g{gen.id} not proven gone: {said}, live pids {left}"
    log.warning("proof failed host=%s generation=g%d reason=%r", gen.host, gen.id, why)
    return why


def _ask_to_stop(ctx: Context, gen: Generation, ref: ProcRef, way: StopWay, leader: bool) -> None:
    """The host's stop signal to the leader (or, the leader gone, to what is left of it), or
    its stop command instead. A command that cannot start is said in an event; the drain
    deadline's SIGKILL ends the generation all the same."""
    if way.command and way.spec is not None and leader:
        try:
            ctx.proc.run_stop_command(way.spec)
        except SpawnError as exc:
            _say_stop_command(ctx, gen, f"could not start: {exc}")
        return
    (ctx.proc.terminate if leader else ctx.proc.terminate_all)(ref, way.signum)


def _say_stop_command(ctx: Context, gen: Generation, outcome: str | None) -> None:
    """An event of what the stop command did (None: it was started by an agent before this
    one, whose handle on it died with it). Advisory: a failed write changes no step."""
    if outcome is None:
        return
    try:
        ctx.store.write(lambda s: emit(s, "stop_command", gen.host, gen.id, outcome=outcome))
    except Exception:  # noqa: BLE001 - the drain goes on; the log keeps what happened
        log.exception("stop_command event not written host=%s generation=g%d outcome=%r",
                      gen.host, gen.id, outcome)
    log.info("stop command host=%s generation=g%d outcome=%r", gen.host, gen.id, outcome)


def mark_proven(s: Session, gen_id: int, reason: str | None = None) -> None:
    values: dict[str, object] = {"state": GenState.proven, "ended_at": utcnow()}
    if reason:
        values["end_reason"] = reason
    move(s, Generation, {"id": gen_id}, values,
         f"generation g{gen_id} retiring -> proven",
         fence=BY_STATE, col="state", frm=GenState.retiring)


def mark_retiring(s: Session, gen_id: int, expected: GenState, reason: str) -> None:
    move(s, Generation, {"id": gen_id},
         {"state": GenState.retiring, "end_reason": reason},
         f"generation g{gen_id} {expected.value} -> retiring",
         fence=BY_STATE, col="state", frm=expected)
