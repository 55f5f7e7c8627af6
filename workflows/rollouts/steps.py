"""The steps of a rollout, each taken in the driver's transaction and named by the crash
point that follows it: admit a wave, reissue, halt, settle a wave or the revert, start
the revert, end."""

from __future__ import annotations

from collections import Counter
from datetime import timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from models.errors import present
from models.states import Cause, Outcome, RolloutOutcome, RolloutState, TargetState
from models.store import emit, utcnow
from models.tables import Attempt, Build, Rollout, RolloutTarget, Stop
from models.transition import move_many
from workflows.base.crash import define
from workflows.deploys.request import request_deploy
from workflows.rollouts.rows import (
    BY_ROLLOUT,
    cancel_queued,
    move_rollout,
    move_target,
    running_build,
    skip_reason,
    superseded,
)

WAVE_ADMITTED = define("rollout.wave_admitted", "a wave's attempts are written (cause rollout) "
                       "and its targets deploying; none of them driven yet")
REISSUED = define("rollout.reissued", "an attempt of a target abandoned without being "
                  "superseded (a restart, a lost lease) is written again")
HALTED = define("rollout.halted", "the rollout is halted with its reason; the wave's attempts "
                "that had not started are cancelled")
WAVE_SETTLED = define("rollout.wave_settled", "every attempt of a wave has ended and each of its "
                      "targets is done, failed, abandoned or skipped")
REVERT_STARTED = define("rollout.revert_started", "each moved host of the halted rollout has an "
                        "attempt back to the build it ran before")
REVERT_SETTLED = define("rollout.revert_settled", "every revert attempt has ended; each target is "
                        "reverted or not")
ENDED = define("rollout.ended", "the rollout's outcome is written: no longer an obligation")


def admit_wave(s: Session, r: Rollout, targets: list[RolloutTarget]) -> str:
    k = r.wave + 1
    build = present(s.get(Build, r.build_id), f"build #{r.build_id} of rollout #{r.id} is missing")
    admitted: dict[str, int] = {}
    passed: dict[str, str] = {}
    for t in targets:
        if t.wave != k or t.state is not TargetState.pending:
            continue
        gone = superseded(s, r, t.host, r.after_attempt)
        stop = s.execute(select(Stop.id).where(Stop.host == t.host, Stop.id > r.after_stop)
                         .limit(1)).scalar()
        if gone is None and stop is not None:
            gone = f"stopped (stop #{stop}) after the rollout started"
        skip = None if gone is not None else skip_reason(s, t.host, build)
        if gone is not None or skip is not None:
            move_target(s, r, t, {"state": TargetState.abandoned if gone else TargetState.skipped,
                                   "reason": gone or skip}, "passed over")
            passed[t.host] = gone or skip  # type: ignore[assignment]
            continue
        before = running_build(s, t.host)
        a = request_deploy(s, t.host, build, mode=r.mode, canary=r.canary, cause=Cause.rollout)
        move_target(s, r, t, {"state": TargetState.deploying, "attempt_id": a.id,
                               "from_build_id": before, "tries": 1, "spent": 0, "reason": None},
                     "deploying")
        admitted[t.host] = a.id
    move_rollout(s, r, {"wave": k, "wave_due_at": None}, f"wave {k} admitted")
    emit(s, "rollout_wave_admitted", None, rollout=r.id, wave=k, of=r.wave_count,
         attempts=admitted, passed=passed)
    return WAVE_ADMITTED


def reissue(s: Session, r: Rollout, again: list[tuple[RolloutTarget, Attempt | None]]) -> str:
    for t, maybe in again:
        a = present(maybe, "a reissued target has no attempt")
        back = t.state is TargetState.reverting
        build = present(s.get(Build, t.from_build_id if back else r.build_id),
                        f"the build of target {t.host} of rollout #{r.id} is missing")
        new = request_deploy(s, t.host, build, mode=r.mode, canary=r.canary and not back,
                             cause=Cause.rollout)
        col = "revert_attempt_id" if back else "attempt_id"
        move_target(s, r, t, {col: new.id, "tries": t.tries + 1,
                               "spent": t.spent + (1 if a.executed is not False else 0),
                               "reason": f"attempt #{a.id} abandoned ({a.reason}): written again"},
                     "reissued")
        emit(s, "rollout_reissued", t.host, rollout=r.id, wave=t.wave, attempt=new.id,
             abandoned=a.id, executed=a.executed, reason=a.reason, revert=back)
    return REISSUED


def halt(s: Session, r: Rollout, failed: list[tuple[str, str | None]]) -> str:
    if len(failed) == 1:
        reason = f"host {failed[0][0]} failed: {failed[0][1]}"
    else:
        reason = (f"{len(failed)} hosts failed (at most {r.max_failures} allowed): "
                  + "; ".join(f"{h}: {w}" for h, w in failed))
    return halt_for(s, r, reason, [h for h, _ in failed])


def halt_for(s: Session, r: Rollout, reason: str, failed: list[str]) -> str:
    """Halt the rollout for `reason` (the hosts that failed, if any)."""
    move_rollout(s, r, {"state": RolloutState.halted, "reason": reason}, "-> halted")
    cancelled = cancel_queued(s, r, "halted")
    emit(s, "rollout_halted", None, rollout=r.id, wave=r.wave, reason=reason,
         failed=failed, cancelled=cancelled)
    return HALTED


def _settle(s: Session, r: Rollout, ended: list[tuple[RolloutTarget, Attempt | None]],
            verdicts: dict[str, tuple[Any, str | None]]) -> Counter[str]:
    counts: Counter[str] = Counter()
    for t, _ in ended:
        state, why = verdicts[t.host]
        move_target(s, r, t, {"state": state, "reason": why}, f"-> {state.value}")
        counts[state.value] += 1
    return counts


def settle_wave(s: Session, r: Rollout, ended: list[tuple[RolloutTarget, Attempt | None]],
                verdicts: dict[str, tuple[Any, str | None]]) -> str:
    counts = _settle(s, r, ended, verdicts)
    more = r.wave < r.wave_count and r.state is not RolloutState.halted
    due = utcnow() + timedelta(seconds=r.pause) if more and r.pause else None
    move_rollout(s, r, {"settled": r.wave, "wave_due_at": due}, f"wave {r.wave} settled")
    emit(s, "rollout_wave_settled", None, rollout=r.id, wave=r.wave, of=r.wave_count,
         next_wave_at=due, **counts)
    return WAVE_SETTLED


def settle_revert(s: Session, r: Rollout, ended: list[tuple[RolloutTarget, Attempt | None]],
                  verdicts: dict[str, tuple[Any, str | None]]) -> str:
    counts = _settle(s, r, ended, verdicts)
    emit(s, "rollout_revert_settled", None, rollout=r.id, **counts)
    return REVERT_SETTLED


def revert_or_end(s: Session, r: Rollout, targets: list[RolloutTarget]) -> str:
    """Halted with nothing in flight: the moved hosts go back (--auto-revert), or it ends."""
    if not r.auto_revert:
        return end(s, r, targets, RolloutOutcome.halted, r.reason or "halted")
    moved = [t for t in targets if t.state is TargetState.done]
    down = [t for t in targets if t.state is TargetState.failed and t.attempt_id is not None]
    for t in down:  # a hold that failed left the host down: it goes back up on its build
        a = s.get(Attempt, t.attempt_id)
        if a is not None and a.outcome is Outcome.down:
            moved.append(t)
    if not moved:
        return end(s, r, targets, RolloutOutcome.halted, f"{r.reason}; no host had moved")
    move_rollout(s, r, {"state": RolloutState.reverting}, "-> reverting")
    written: dict[str, int] = {}
    left: dict[str, str] = {}
    for t in moved:
        newer = superseded(s, r, t.host, t.attempt_id or 0)
        back = s.get(Build, t.from_build_id) if t.from_build_id is not None else None
        if newer is not None or back is None:
            why = f"not reverted: {newer}" if newer else "not reverted: its build before is unknown"
            if t.state is TargetState.done:
                move_target(s, r, t, {"state": TargetState.abandoned, "reason": why}, "left")
            left[t.host] = why
            continue
        a = request_deploy(s, t.host, back, mode=r.mode, canary=False, cause=Cause.rollout)
        move_target(s, r, t, {"state": TargetState.reverting, "revert_attempt_id": a.id,
                               "tries": 1, "spent": 0,
                               "reason": f"back to build {back.digest[:12]}"}, "-> reverting")
        written[t.host] = a.id
    emit(s, "rollout_revert_started", None, rollout=r.id, attempts=written, left=left)
    return REVERT_STARTED


def end(s: Session, r: Rollout, targets: list[RolloutTarget], outcome: RolloutOutcome,
        reason: str) -> str:
    skipped = move_many(s, RolloutTarget, [RolloutTarget.rollout_id == r.id],
                        {"state": TargetState.skipped,
                         "reason": f"the rollout ended ({outcome.value}) before its wave"},
                        f"pending targets of rollout #{r.id} skipped", fence=BY_ROLLOUT,
                        col="state", frm=TargetState.pending)
    move_rollout(s, r, {"state": RolloutState.ended, "outcome": outcome, "reason": reason,
                         "wave_due_at": None, "ended_at": utcnow()}, f"-> ended ({outcome.value})")
    counts = Counter(t.state.value for t in targets if t.state is not TargetState.pending)
    if skipped:
        counts["skipped"] += skipped
    emit(s, "rollout_ended", None, rollout=r.id, outcome=outcome.value, reason=reason, **counts)
    return ENDED


def summary(targets: list[RolloutTarget]) -> str:
    c = Counter(t.state for t in targets)
    parts = [f"{c[TargetState.done]} of {len(targets)} host(s) moved"]
    for st in (TargetState.failed, TargetState.abandoned, TargetState.skipped):
        if c[st]:
            parts.append(f"{c[st]} {st.value}")
    return ", ".join(parts)


def revert_summary(targets: list[RolloutTarget]) -> str:
    c = Counter(t.state for t in targets)
    return (f"{c[TargetState.reverted]} host(s) reverted"
            + (f", {c[TargetState.revert_failed]} revert(s) failed" if c[TargetState.revert_failed]
               else ""))
