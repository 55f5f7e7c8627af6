"""Rollouts: one build to many hosts in waves, halted (and, if asked, reverted) on failure.

A rollout is an obligation like any other: a `rollouts` row (kind `rollout` in
pending_obligations while it is open) and one `rollout_targets` row per host. Whichever
agent claims the row advances it, one guarded step per transaction, each followed by its
crash point:

  admit wave k    the wave's attempts are written (ordinary attempts, cause `rollout`) and
                  its targets are deploying; a host held down, already on the build, or
                  superseded since the start (a stop, a newer deploy or rollout) is not
  reissue         an attempt abandoned without being superseded (the agent restarted
                  mid-swap, the box lost the host's lease) is written again
  halt            more hosts failed than --max-failures allows: no wave starts again, and
                  the wave's attempts that have not started are cancelled
  settle wave k   every attempt of the wave has ended: each target is done, failed,
                  abandoned or skipped, and the next wave is due (after --pause)
  start revert    (halted, --auto-revert) each moved host gets an attempt back to the
                  build it ran before the rollout
  settle revert   every revert attempt has ended
  end             the outcome: done, halted, reverted or aborted

The attempts themselves are driven by the box holding each host's lease, as every attempt
is, and the failure book (workflows/builds/book.py) holds a failed build down on its host. An
attempt that ends makes its rollout due at once, so the next wave does not wait out a
backoff. Every step re-reads the rows and moves them by compare-and-set (the rollout's
state and wave counters, each target's state and attempt), so two agents racing for one
step (PostgreSQL) cannot both take it, and a step taken again after a crash finds it done.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from functools import partial
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from models.states import IN_FLIGHT, Outcome, RolloutOutcome, RolloutState, TargetState
from models.store import utcnow
from models.tables import Attempt, Build, Rollout, RolloutTarget
from workflows.base.context import Context, Held, Result, Until
from workflows.base.crash import crashpoint
from workflows.builds.staged import staged_problem
from workflows.rollouts.rows import attempt_of, load_attempts, mark, on_build, superseded
from workflows.rollouts.steps import (
    ENDED,
    admit_wave,
    end,
    halt,
    halt_for,
    reissue,
    revert_or_end,
    revert_summary,
    settle_revert,
    settle_wave,
    summary,
)

REISSUES = 3  # a target's attempts abandoned after running that are written again, at most
MAX_TRIES = 10  # attempts written for one target in its wave (or its revert), at most
MAX_STEPS = 64  # steps one drive takes before it lets the round go on

_REISSUE = "reissue"  # a verdict: the target's attempt is written again
_RECHECK = "recheck"  # a step not taken: read the build again before writing an attempt again


@dataclass(frozen=True)
class Wait:
    """Nothing to do now: why, and (a pause between waves) until when."""

    why: str
    until: datetime | None = None


def drive_rollout(ctx: Context, rollout_id: int) -> Result:
    """Take every step the rollout can take now, each one transaction and its crash point."""
    moved = False
    for _ in range(MAX_STEPS):
        problem, checked = _unreadable(ctx, rollout_id)
        step = ctx.store.write(partial(_step, rollout_id=rollout_id, problem=problem,
                                       checked=checked))
        if step == _RECHECK:
            continue
        if isinstance(step, Wait):
            if moved:
                return Result.progress  # due again at once: the next drive says why it waits
            if step.until is not None:
                raise Until(step.until, step.why)
            raise Held(step.why)
        if step is None:
            return Result.progress if moved else Result.gone
        moved = True
        crashpoint(step)
        if step == ENDED:
            break
    return Result.progress


def _unreadable(ctx: Context, rollout_id: int) -> tuple[str | None, frozenset[int]]:
    """Why the rollout's build cannot be deployed (or None), and the abandoned attempts of
    its targets this answer covers. The bytes are read (hashed, outside any transaction)
    only while such an attempt exists: an attempt refused for its bytes is abandoned, never
    failed, and writing it again cannot help."""
    rows = ctx.store.read(lambda s: s.execute(
        select(Attempt.id, Build.path, Rollout.digest).join(Build, Build.id == Rollout.build_id)
        .join(RolloutTarget, RolloutTarget.rollout_id == Rollout.id)
        .join(Attempt, Attempt.id == RolloutTarget.attempt_id)
        .where(Rollout.id == rollout_id, Rollout.state.in_((RolloutState.running, RolloutState.paused)),
               RolloutTarget.state == TargetState.deploying, Attempt.outcome == Outcome.abandoned)
    ).all())
    if not rows:
        return None, frozenset()
    # Any box may drive a rollout: the staging root is not this one's to check.
    return (staged_problem(ctx, rows[0].path, rows[0].digest, executable=False, in_root=False),
            frozenset(r.id for r in rows))


def _step(s: Session, rollout_id: int, problem: str | None,
          checked: frozenset[int]) -> str | Wait | None:
    return (problem and halt_unreadable(s, rollout_id, problem)) or advance(s, rollout_id, checked)


def halt_unreadable(s: Session, rollout_id: int, problem: str) -> str | None:
    r = s.get(Rollout, rollout_id)
    if r is None or r.state not in (RolloutState.running, RolloutState.paused):
        return None
    return halt_for(s, r, f"build {r.digest[:12]} cannot be deployed: {problem}", [])


def advance(s: Session, rollout_id: int, checked: frozenset[int] | None = None) -> str | Wait | None:
    """One step of the rollout, in the caller's transaction: the crash point it reached, a
    Wait, or None (no such rollout, or it has ended). With `checked`, an abandoned attempt
    is written again only if it is in it (the build was read after it was abandoned); else
    _RECHECK."""
    r = s.get(Rollout, rollout_id)
    if r is None or r.state is RolloutState.ended:
        return None
    targets = list(s.execute(select(RolloutTarget).where(RolloutTarget.rollout_id == r.id)
                             .order_by(RolloutTarget.position)).scalars())
    flying = [t for t in targets if t.state in IN_FLIGHT]
    attempts = load_attempts(s, [attempt_of(t) for t in flying])
    ended = [(t, attempts.get(attempt_of(t))) for t in flying
             if attempt_of(t) not in attempts or attempts[attempt_of(t)].outcome is not None]
    settled = {t.host for t, _ in ended}
    waiting = [t for t in flying if t.host not in settled]
    verdicts = {t.host: _verdict(s, r, t, a) for t, a in ended}

    if r.state in (RolloutState.running, RolloutState.paused):
        failed = [(t.host, t.reason) for t in targets if t.state is TargetState.failed]
        failed += [(t.host, verdicts[t.host][1]) for t, _ in ended
                   if verdicts[t.host][0] is TargetState.failed]
        if len(failed) > r.max_failures:
            return halt(s, r, failed)
    again = [(t, a) for t, a in ended if verdicts[t.host][0] == _REISSUE]
    if checked is not None and any(t.state is TargetState.deploying and a is not None
                                   and a.id not in checked for t, a in again):
        return _RECHECK
    if again:
        return reissue(s, r, again)
    if waiting:
        hosts = ", ".join(t.host for t in waiting[:5]) + (" ..." if len(waiting) > 5 else "")
        phase = "the revert" if waiting[0].state is TargetState.reverting else f"wave {r.wave}"
        return Wait(f"{phase}: waiting for {len(waiting)} attempt(s) to end ({hosts})")
    if r.wave > r.settled:
        return settle_wave(s, r, ended, verdicts)
    if ended:
        return settle_revert(s, r, ended, verdicts)
    if r.state is RolloutState.halted:
        return revert_or_end(s, r, targets)
    if r.state is RolloutState.aborting:
        return end(s, r, targets, RolloutOutcome.aborted, r.reason or "aborted by the operator")
    if r.state is RolloutState.reverting:
        return end(s, r, targets, RolloutOutcome.reverted, f"{r.reason}; {revert_summary(targets)}")
    if r.settled >= r.wave_count:
        return end(s, r, targets, RolloutOutcome.done, summary(targets))
    if r.state is RolloutState.paused:
        return Wait(f"paused by the operator before wave {r.wave + 1} (`vigil rollout resume {r.id}`)")
    if r.wave_due_at is not None and r.wave_due_at > utcnow():
        return Wait(f"pausing before wave {r.wave + 1} until {r.wave_due_at.isoformat()}Z",
                    until=r.wave_due_at)
    return admit_wave(s, r, targets)


def _verdict(s: Session, r: Rollout, t: RolloutTarget, a: Attempt | None) -> tuple[Any, str | None]:
    """Where a target goes now that its attempt has ended: a TargetState, or _REISSUE."""
    back = t.state is TargetState.reverting
    done, failed = ((TargetState.reverted, TargetState.revert_failed) if back
                    else (TargetState.done, TargetState.failed))
    if a is None:
        return TargetState.abandoned, "its attempt is gone"
    if a.outcome is Outcome.done:
        return done, a.reason
    if a.outcome in (Outcome.failed, Outcome.down):
        return failed, f"attempt #{a.id} {a.outcome.value}: {a.reason}"
    if (a.reason or "").startswith(mark(r)):  # cancelled by this rollout's halt or abort
        return (TargetState.abandoned if back else TargetState.skipped), a.reason
    newer = superseded(s, r, t.host, a.id)
    if newer is not None:
        return TargetState.abandoned, newer
    if a.outcome is Outcome.cancelled:
        return TargetState.abandoned, f"stopped: attempt #{a.id} {a.reason}"
    want = t.from_build_id if back else r.build_id
    if want is not None and on_build(s, t.host, want):
        return done, f"on the build (attempt #{a.id} was abandoned: {a.reason})"
    may = r.state is RolloutState.reverting if back else r.state in (RolloutState.running,
                                                                    RolloutState.paused)
    spent = t.spent + (1 if a.executed is not False else 0)
    if may and spent <= REISSUES and t.tries < MAX_TRIES:
        return _REISSUE, a.reason
    why = f"the rollout is {r.state.value}" if not may else f"given up after {t.tries} attempt(s)"
    return TargetState.abandoned, f"attempt #{a.id} abandoned ({a.reason}); {why}"
