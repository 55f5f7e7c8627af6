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

import fnmatch
import math
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import partial
from typing import Any

from sqlalchemy import func, insert, select
from sqlalchemy.orm import Session

from models.errors import BadInput, BrokenInvariant, NotFound, Refused
from models.states import (
    IN_FLIGHT,
    AttemptStep,
    Cause,
    GenState,
    Mode,
    Outcome,
    RolloutOutcome,
    RolloutState,
    TargetState,
)
from models.store import emit, utcnow
from models.tables import Attempt, Build, Generation, Host, Rollout, RolloutTarget, Stop
from models.transition import Unfenced, move, move_many
from workflows.base.context import Context, Poke, Result, Until
from workflows.base.crash import crashpoint, define
from workflows.base.waivers import OPERATOR
from workflows.builds.book import held, held_line
from workflows.builds.staged import staged_problem
from workflows.deploys.request import request_deploy

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

# Moves that carry no lease fence, each with the reason it needs none.
BY_ROLLOUT = Unfenced("a rollout belongs to no host: its own state and wave counters (and each "
                      "target's state and attempt) guard it, and any agent may advance it")
NOT_STARTED = Unfenced("an attempt still queued: its own step guards it, nothing of it has run")

DEFAULT_WAVES = "1,25%,100%"
REISSUES = 3  # a target's attempts abandoned after running that are written again, at most
MAX_TRIES = 10  # attempts written for one target in its wave (or its revert), at most
MAX_STEPS = 64  # steps one drive takes before it lets the round go on
WAVES_FIX = "write cumulative wave sizes as host counts or percentages, e.g. --waves 1,25%,100%"

_REISSUE = "reissue"  # a verdict: the target's attempt is written again
_RECHECK = "recheck"  # a step not taken: read the build again before writing an attempt again


def label(rollout_id: int) -> str:
    return f"rollout #{rollout_id}"


# -- waves ------------------------------------------------------------------------------------


def parse_waves(spec: str) -> list[tuple[float, bool]]:
    """`1,25%,100%` -> [(1, False), (25, True), (100, True)]: cumulative sizes, each a host
    count (at least 1) or a percentage of the hosts (above 0, at most 100)."""
    parts = [p.strip() for p in spec.split(",")]
    if not spec.strip() or any(not p for p in parts):
        raise BadInput(f"--waves {spec!r} has an empty wave", WAVES_FIX)
    out: list[tuple[float, bool]] = []
    for p in parts:
        pct = p.endswith("%")
        text = p[:-1].strip() if pct else p
        try:
            value = float(text) if pct else int(text)
        except ValueError:
            raise BadInput(f"--waves {spec!r}: {p!r} is neither a host count nor a percentage",
                           WAVES_FIX) from None
        if pct and not (0 < value <= 100 and math.isfinite(value)):
            raise BadInput(f"--waves {spec!r}: {p!r} is not a percentage above 0 and at most 100",
                           WAVES_FIX)
        if not pct and value < 1:
            raise BadInput(f"--waves {spec!r}: {p!r} is not a host count of at least 1", WAVES_FIX)
        same = [v for v, was_pct in out if was_pct == pct]
        if same and value < same[-1]:
            raise BadInput(f"--waves {spec!r}: {p!r} is smaller than the wave before it: waves "
                           "are cumulative", WAVES_FIX)
        out.append((float(value), pct))
    return out


def wave_ends(spec: str, hosts: int) -> list[int]:
    """How many hosts have been reached once each wave is admitted: ascending, ending at
    `hosts` (the hosts past the last wave given form one more wave). A count and a
    percentage that come out smaller than the wave before (say 3,25% of 4 hosts) merge."""
    ends: list[int] = []
    for value, pct in parse_waves(spec):
        n = math.ceil(value * hosts / 100 - 1e-9) if pct else int(value)
        n = max(1, min(hosts, n))
        if not ends or n > ends[-1]:
            ends.append(n)
    if ends[-1] < hosts:
        ends.append(hosts)
    return ends


# -- the operator's intents (the CLI) ------------------------------------------------------------


@dataclass(frozen=True)
class Started:
    id: int
    waves: list[list[str]]
    skipped: list[tuple[str, str]]


def select_hosts(s: Session, names: list[str], glob: str | None) -> list[str]:
    """The targets in order: the --host names as given, then the --hosts matches by name."""
    chosen: list[str] = []
    for n in names:
        if s.get(Host, n) is None:
            raise NotFound(f"no host named {n!r}", "see `vigil host list`")
        if n not in chosen:
            chosen.append(n)
    if glob is not None:
        every = s.execute(select(Host.name).order_by(Host.name)).scalars().all()
        matched = [h for h in every if fnmatch.fnmatchcase(h, glob)]
        if not matched:
            raise BadInput(f"--hosts {glob!r} matches no host", "see `vigil host list`")
        chosen += [h for h in matched if h not in chosen]
    if not chosen:
        raise BadInput("a rollout needs hosts", "name them with --host NAME (repeatable) or "
                       "--hosts GLOB")
    return chosen


def request_rollout(s: Session, build: Build, hosts: list[str], *, waves: str, mode: Mode,
                    canary: bool, pause: float | None, max_failures: int,
                    auto_revert: bool) -> Started:
    """The CLI's intent (one transaction): the rollout row and one target row per host, each
    in its wave; a host the build is held down on, or already on the build, is skipped."""
    parse_waves(waves)  # its syntax before anything else
    if max_failures < 0:
        raise BadInput(f"--max-failures {max_failures} is negative", "give 0 or more")
    skipped: list[tuple[str, str]] = []
    eligible: list[str] = []
    for h in hosts:
        why = _skip_reason(s, h, build)
        if why is None:
            eligible.append(h)
        else:
            skipped.append((h, why))
    if not eligible:
        raise Refused("nothing to roll out: " + "; ".join(f"{h}: {w}" for h, w in skipped),
                      "name other hosts, or lift a hold with `vigil retry HOST`")
    ends = wave_ends(waves, len(eligible))
    now = utcnow()
    r = Rollout(build_id=build.id, digest=build.digest, mode=mode, canary=canary, waves=waves,
                wave_count=len(ends), wave=0, settled=0, pause=pause, wave_due_at=None,
                max_failures=max_failures, auto_revert=auto_revert,
                after_attempt=s.execute(select(func.coalesce(func.max(Attempt.id), 0))).scalar(),
                after_stop=s.execute(select(func.coalesce(func.max(Stop.id), 0))).scalar(),
                state=RolloutState.running, attempts=0, since=now, next_attempt_at=now,
                created_at=now)
    s.add(r)
    s.flush()
    rows, grouped = [], [[] for _ in ends]  # type: ignore[var-annotated]
    for i, h in enumerate(eligible):
        k = next(w for w, end in enumerate(ends) if i < end)
        grouped[k].append(h)
        rows.append({"rollout_id": r.id, "host": h, "position": i, "wave": k + 1,
                     "state": TargetState.pending, "tries": 0, "spent": 0, "reason": None})
    for j, (h, why) in enumerate(skipped):
        rows.append({"rollout_id": r.id, "host": h, "position": len(eligible) + j, "wave": 0,
                     "state": TargetState.skipped, "tries": 0, "spent": 0, "reason": why})
    s.execute(insert(RolloutTarget.__table__), rows)
    emit(s, "rollout_requested", None, rollout=r.id, build=build.digest[:12], mode=mode.value,
         waves=[len(g) for g in grouped], hosts=len(eligible),
         skipped={h: w for h, w in skipped}, max_failures=max_failures, auto_revert=auto_revert,
         pause=pause)
    return Started(r.id, grouped, skipped)


def _get(s: Session, rollout_id: int) -> Rollout:
    r = s.get(Rollout, rollout_id)
    if r is None:
        raise NotFound(f"no rollout #{rollout_id}", "see `vigil rollout list`")
    return r


def pause_rollout(s: Session, rollout_id: int) -> str:
    r = _get(s, rollout_id)
    if r.state is RolloutState.paused:
        return f"rollout #{r.id} is already paused"
    if r.state is not RolloutState.running:
        raise Refused(f"rollout #{r.id} is {r.state.value}: only a running rollout pauses",
                      f"see `vigil rollout status {r.id}`")
    move(s, Rollout, {"id": r.id}, {"state": RolloutState.paused}, f"rollout #{r.id} -> paused",
         fence=OPERATOR, col="state", frm=RolloutState.running)
    emit(s, "rollout_paused", None, rollout=r.id, wave=r.wave)
    return (f"rollout #{r.id} paused: the wave in flight settles, no new wave starts until "
            f"`vigil rollout resume {r.id}`")


def resume_rollout(s: Session, rollout_id: int) -> str:
    r = _get(s, rollout_id)
    if r.state is RolloutState.running:
        return f"rollout #{r.id} is already running"
    if r.state is not RolloutState.paused:
        raise Refused(f"rollout #{r.id} is {r.state.value}: only a paused rollout resumes",
                      f"see `vigil rollout status {r.id}`")
    move(s, Rollout, {"id": r.id}, {"state": RolloutState.running, "next_attempt_at": utcnow(),
                                    "attempts": 0},
         f"rollout #{r.id} -> running", fence=OPERATOR, col="state", frm=RolloutState.paused)
    emit(s, "rollout_resumed", None, rollout=r.id, wave=r.wave)
    return f"rollout #{r.id} resumed"


def abort_rollout(s: Session, rollout_id: int) -> str:
    """No new wave and no revert: attempts of it not started yet are cancelled, those
    running finish, then it ends `aborted`."""
    r = _get(s, rollout_id)
    if r.state is RolloutState.ended:
        raise Refused(f"rollout #{r.id} has already ended ({r.outcome.value if r.outcome else '?'})",
                      f"see `vigil rollout status {r.id}`")
    if r.state is RolloutState.aborting:
        return f"rollout #{r.id} is already aborting"
    move(s, Rollout, {"id": r.id}, {"state": RolloutState.aborting,
                                    "reason": "aborted by the operator",
                                    "next_attempt_at": utcnow(), "attempts": 0},
         f"rollout #{r.id} -> aborting", fence=OPERATOR, col="state", frm=r.state)
    cancelled = _cancel_queued(s, r, "was aborted")
    emit(s, "rollout_aborting", None, rollout=r.id, wave=r.wave, cancelled=cancelled)
    return (f"rollout #{r.id} aborting: {cancelled} attempt(s) not started were cancelled; "
            "attempts running finish, nothing is reverted")


# -- the driver ---------------------------------------------------------------------------------


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
            raise Poke(step.why)
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
    return _halt_for(s, r, f"build {r.digest[:12]} cannot be deployed: {problem}", [])


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
    attempts = _attempts(s, [_attempt_of(t) for t in flying])
    ended = [(t, attempts.get(_attempt_of(t))) for t in flying
             if _attempt_of(t) not in attempts or attempts[_attempt_of(t)].outcome is not None]
    settled = {t.host for t, _ in ended}
    waiting = [t for t in flying if t.host not in settled]
    verdicts = {t.host: _verdict(s, r, t, a) for t, a in ended}

    if r.state in (RolloutState.running, RolloutState.paused):
        failed = [(t.host, t.reason) for t in targets if t.state is TargetState.failed]
        failed += [(t.host, verdicts[t.host][1]) for t, _ in ended
                   if verdicts[t.host][0] is TargetState.failed]
        if len(failed) > r.max_failures:
            return _halt(s, r, failed)
    again = [(t, a) for t, a in ended if verdicts[t.host][0] == _REISSUE]
    if checked is not None and any(t.state is TargetState.deploying and a is not None
                                   and a.id not in checked for t, a in again):
        return _RECHECK
    if again:
        return _reissue(s, r, again)
    if waiting:
        hosts = ", ".join(t.host for t in waiting[:5]) + (" ..." if len(waiting) > 5 else "")
        phase = "the revert" if waiting[0].state is TargetState.reverting else f"wave {r.wave}"
        return Wait(f"{phase}: waiting for {len(waiting)} attempt(s) to end ({hosts})")
    if r.wave > r.settled:
        return _settle_wave(s, r, ended, verdicts)
    if ended:
        return _settle_revert(s, r, ended, verdicts)
    if r.state is RolloutState.halted:
        return _revert_or_end(s, r, targets)
    if r.state is RolloutState.aborting:
        return _end(s, r, targets, RolloutOutcome.aborted, r.reason or "aborted by the operator")
    if r.state is RolloutState.reverting:
        return _end(s, r, targets, RolloutOutcome.reverted, f"{r.reason}; {_revert_summary(targets)}")
    if r.settled >= r.wave_count:
        return _end(s, r, targets, RolloutOutcome.done, _summary(targets))
    if r.state is RolloutState.paused:
        return Wait(f"paused by the operator before wave {r.wave + 1} (`vigil rollout resume {r.id}`)")
    if r.wave_due_at is not None and r.wave_due_at > utcnow():
        return Wait(f"pausing before wave {r.wave + 1} until {r.wave_due_at.isoformat()}Z",
                    until=r.wave_due_at)
    return _admit(s, r, targets)


def _attempt_of(t: RolloutTarget) -> int | None:
    return t.revert_attempt_id if t.state is TargetState.reverting else t.attempt_id


def _attempts(s: Session, ids: list[int | None]) -> dict[int | None, Attempt]:
    wanted = [i for i in ids if i is not None]
    if not wanted:
        return {}
    return {a.id: a for a in s.execute(select(Attempt).where(Attempt.id.in_(wanted))).scalars()}


def _mark(r: Rollout) -> str:
    """How the reason of an attempt this rollout cancelled begins."""
    return f"{label(r.id)} "


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
    if (a.reason or "").startswith(_mark(r)):  # cancelled by this rollout's halt or abort
        return (TargetState.abandoned if back else TargetState.skipped), a.reason
    newer = _superseded(s, r, t.host, a.id)
    if newer is not None:
        return TargetState.abandoned, newer
    if a.outcome is Outcome.cancelled:
        return TargetState.abandoned, f"stopped: attempt #{a.id} {a.reason}"
    want = t.from_build_id if back else r.build_id
    if want is not None and _on_build(s, t.host, want):
        return done, f"on the build (attempt #{a.id} was abandoned: {a.reason})"
    may = r.state is RolloutState.reverting if back else r.state in (RolloutState.running,
                                                                    RolloutState.paused)
    spent = t.spent + (1 if a.executed is not False else 0)
    if may and spent <= REISSUES and t.tries < MAX_TRIES:
        return _REISSUE, a.reason
    why = f"the rollout is {r.state.value}" if not may else f"given up after {t.tries} attempt(s)"
    return TargetState.abandoned, f"attempt #{a.id} abandoned ({a.reason}); {why}"


def _superseded(s: Session, r: Rollout, host: str, after: int) -> str | None:
    """What took the host from this rollout after attempt id `after`: a newer deploy, retry
    or rollout's attempt (an older rollout's does not count, nor a scheduled restart)."""
    newer = s.execute(select(Attempt.id, Attempt.cause).where(
        Attempt.host == host, Attempt.id > after, Attempt.cause != Cause.restart)
        .order_by(Attempt.id)).all()
    if not newer:
        return None
    older = set()
    for a_id, rev_id in s.execute(select(RolloutTarget.attempt_id, RolloutTarget.revert_attempt_id)
                                  .where(RolloutTarget.host == host,
                                         RolloutTarget.rollout_id < r.id)):
        older |= {a_id, rev_id}
    for a_id, cause in newer:
        if a_id not in older:
            return f"superseded by attempt #{a_id} (cause {cause.value})"
    return None


def _on_build(s: Session, host: str, build_id: int) -> bool:
    """The host is on the build: its live build, and its current generation's if it runs."""
    h = s.get(Host, host)
    if h is None or h.build_id != build_id:
        return False
    running = s.execute(select(Generation.build_id).where(
        Generation.host == host, Generation.state == GenState.current)).scalar()
    return running is None or running == build_id


def _running_build(s: Session, host: str) -> int | None:
    running = s.execute(select(Generation.build_id).where(
        Generation.host == host, Generation.state == GenState.current)).scalar()
    if running is not None:
        return int(running)
    h = s.get(Host, host)
    return h.build_id if h is not None else None


def _skip_reason(s: Session, host: str, build: Build) -> str | None:
    """Why a rollout of `build` does not deploy to `host` (at its start and at its wave)."""
    h = held(s, host, build.id)
    if h is not None:
        return held_line(h)
    if _on_build(s, host, build.id):
        return f"already on build {build.digest[:12]}"
    return None


def _move_rollout(s: Session, r: Rollout, values: dict[str, Any], what: str) -> None:
    """The rollout row, only while it is where this step read it (state, wave, settled)."""
    move(s, Rollout, {"id": r.id, "wave": r.wave, "settled": r.settled}, values,
         f"rollout #{r.id} {what}", fence=BY_ROLLOUT, col="state", frm=r.state)


def _move_target(s: Session, r: Rollout, t: RolloutTarget, values: dict[str, Any],
                 what: str) -> None:
    """A target, only while it is where this step read it (state and its attempt)."""
    col = "revert_attempt_id" if t.state is TargetState.reverting else "attempt_id"
    move(s, RolloutTarget, {"rollout_id": r.id, "host": t.host, col: getattr(t, col)}, values,
         f"target {t.host} of rollout #{r.id} {what}", fence=BY_ROLLOUT, col="state",
         frm=t.state)


def _cancel_queued(s: Session, r: Rollout, why: str) -> int:
    """The rollout's attempts in flight that have not started: ended, cancelled, nothing of
    them ran. (One the host's driver admitted meanwhile is left to finish.)"""
    ids = [_attempt_of(t) for t in s.execute(select(RolloutTarget).where(
        RolloutTarget.rollout_id == r.id, RolloutTarget.state.in_(IN_FLIGHT))).scalars()]
    ids = [i for i in ids if i is not None]
    if not ids:
        return 0
    return move_many(s, Attempt, [Attempt.id.in_(ids), Attempt.outcome.is_(None)],
                     {"step": AttemptStep.ended, "outcome": Outcome.cancelled, "executed": False,
                      "reason": f"{_mark(r)}{why} before this attempt started",
                      "ended_at": utcnow()},
                     f"queued attempts of rollout #{r.id} cancelled", fence=NOT_STARTED,
                     col="step", frm=AttemptStep.queued)


def _admit(s: Session, r: Rollout, targets: list[RolloutTarget]) -> str:
    k = r.wave + 1
    build = s.get(Build, r.build_id)
    if build is None:
        raise BrokenInvariant(f"build #{r.build_id} of rollout #{r.id} is missing")
    admitted: dict[str, int] = {}
    passed: dict[str, str] = {}
    for t in targets:
        if t.wave != k or t.state is not TargetState.pending:
            continue
        gone = _superseded(s, r, t.host, r.after_attempt)
        stop = s.execute(select(Stop.id).where(Stop.host == t.host, Stop.id > r.after_stop)
                         .limit(1)).scalar()
        if gone is None and stop is not None:
            gone = f"stopped (stop #{stop}) after the rollout started"
        skip = None if gone is not None else _skip_reason(s, t.host, build)
        if gone is not None or skip is not None:
            _move_target(s, r, t, {"state": TargetState.abandoned if gone else TargetState.skipped,
                                   "reason": gone or skip}, "passed over")
            passed[t.host] = gone or skip  # type: ignore[assignment]
            continue
        before = _running_build(s, t.host)
        a = request_deploy(s, t.host, build, mode=r.mode, canary=r.canary, cause=Cause.rollout)
        _move_target(s, r, t, {"state": TargetState.deploying, "attempt_id": a.id,
                               "from_build_id": before, "tries": 1, "spent": 0, "reason": None},
                     "deploying")
        admitted[t.host] = a.id
    _move_rollout(s, r, {"wave": k, "wave_due_at": None}, f"wave {k} admitted")
    emit(s, "rollout_wave_admitted", None, rollout=r.id, wave=k, of=r.wave_count,
         attempts=admitted, passed=passed)
    return WAVE_ADMITTED


def _reissue(s: Session, r: Rollout, again: list[tuple[RolloutTarget, Attempt | None]]) -> str:
    for t, a in again:
        if a is None:
            raise BrokenInvariant("a reissued target has no attempt")
        back = t.state is TargetState.reverting
        build = s.get(Build, t.from_build_id if back else r.build_id)
        if build is None:
            raise BrokenInvariant(f"the build of target {t.host} of rollout #{r.id} is missing")
        new = request_deploy(s, t.host, build, mode=r.mode, canary=r.canary and not back,
                             cause=Cause.rollout)
        col = "revert_attempt_id" if back else "attempt_id"
        _move_target(s, r, t, {col: new.id, "tries": t.tries + 1,
                               "spent": t.spent + (1 if a.executed is not False else 0),
                               "reason": f"attempt #{a.id} abandoned ({a.reason}): written again"},
                     "reissued")
        emit(s, "rollout_reissued", t.host, rollout=r.id, wave=t.wave, attempt=new.id,
             abandoned=a.id, executed=a.executed, reason=a.reason, revert=back)
    return REISSUED


def _halt(s: Session, r: Rollout, failed: list[tuple[str, str | None]]) -> str:
    if len(failed) == 1:
        reason = f"host {failed[0][0]} failed: {failed[0][1]}"
    else:
        reason = (f"{len(failed)} hosts failed (at most {r.max_failures} allowed): "
                  + "; ".join(f"{h}: {w}" for h, w in failed))
    return _halt_for(s, r, reason, [h for h, _ in failed])


def _halt_for(s: Session, r: Rollout, reason: str, failed: list[str]) -> str:
    _move_rollout(s, r, {"state": RolloutState.halted, "reason": reason}, "-> halted")
    cancelled = _cancel_queued(s, r, "halted")
    emit(s, "rollout_halted", None, rollout=r.id, wave=r.wave, reason=reason,
         failed=failed, cancelled=cancelled)
    return HALTED


def _settle(s: Session, r: Rollout, ended: list[tuple[RolloutTarget, Attempt | None]],
            verdicts: dict[str, tuple[Any, str | None]]) -> Counter[str]:
    counts: Counter[str] = Counter()
    for t, _ in ended:
        state, why = verdicts[t.host]
        _move_target(s, r, t, {"state": state, "reason": why}, f"-> {state.value}")
        counts[state.value] += 1
    return counts


def _settle_wave(s: Session, r: Rollout, ended: list[tuple[RolloutTarget, Attempt | None]],
                 verdicts: dict[str, tuple[Any, str | None]]) -> str:
    counts = _settle(s, r, ended, verdicts)
    more = r.wave < r.wave_count and r.state is not RolloutState.halted
    due = utcnow() + timedelta(seconds=r.pause) if more and r.pause else None
    _move_rollout(s, r, {"settled": r.wave, "wave_due_at": due}, f"wave {r.wave} settled")
    emit(s, "rollout_wave_settled", None, rollout=r.id, wave=r.wave, of=r.wave_count,
         next_wave_at=due, **counts)
    return WAVE_SETTLED


def _settle_revert(s: Session, r: Rollout, ended: list[tuple[RolloutTarget, Attempt | None]],
                   verdicts: dict[str, tuple[Any, str | None]]) -> str:
    counts = _settle(s, r, ended, verdicts)
    emit(s, "rollout_revert_settled", None, rollout=r.id, **counts)
    return REVERT_SETTLED


def _revert_or_end(s: Session, r: Rollout, targets: list[RolloutTarget]) -> str:
    """Halted with nothing in flight: the moved hosts go back (--auto-revert), or it ends."""
    if not r.auto_revert:
        return _end(s, r, targets, RolloutOutcome.halted, r.reason or "halted")
    moved = [t for t in targets if t.state is TargetState.done]
    down = [t for t in targets if t.state is TargetState.failed and t.attempt_id is not None]
    for t in down:  # a hold that failed left the host down: it goes back up on its build
        a = s.get(Attempt, t.attempt_id)
        if a is not None and a.outcome is Outcome.down:
            moved.append(t)
    if not moved:
        return _end(s, r, targets, RolloutOutcome.halted, f"{r.reason}; no host had moved")
    _move_rollout(s, r, {"state": RolloutState.reverting}, "-> reverting")
    written: dict[str, int] = {}
    left: dict[str, str] = {}
    for t in moved:
        newer = _superseded(s, r, t.host, t.attempt_id or 0)
        back = s.get(Build, t.from_build_id) if t.from_build_id is not None else None
        if newer is not None or back is None:
            why = f"not reverted: {newer}" if newer else "not reverted: its build before is unknown"
            if t.state is TargetState.done:
                _move_target(s, r, t, {"state": TargetState.abandoned, "reason": why}, "left")
            left[t.host] = why
            continue
        a = request_deploy(s, t.host, back, mode=r.mode, canary=False, cause=Cause.rollout)
        _move_target(s, r, t, {"state": TargetState.reverting, "revert_attempt_id": a.id,
                               "tries": 1, "spent": 0,
                               "reason": f"back to build {back.digest[:12]}"}, "-> reverting")
        written[t.host] = a.id
    emit(s, "rollout_revert_started", None, rollout=r.id, attempts=written, left=left)
    return REVERT_STARTED


def _end(s: Session, r: Rollout, targets: list[RolloutTarget], outcome: RolloutOutcome,
         reason: str) -> str:
    skipped = move_many(s, RolloutTarget, [RolloutTarget.rollout_id == r.id],
                        {"state": TargetState.skipped,
                         "reason": f"the rollout ended ({outcome.value}) before its wave"},
                        f"pending targets of rollout #{r.id} skipped", fence=BY_ROLLOUT,
                        col="state", frm=TargetState.pending)
    _move_rollout(s, r, {"state": RolloutState.ended, "outcome": outcome, "reason": reason,
                         "wave_due_at": None, "ended_at": utcnow()}, f"-> ended ({outcome.value})")
    counts = Counter(t.state.value for t in targets if t.state is not TargetState.pending)
    if skipped:
        counts["skipped"] += skipped
    emit(s, "rollout_ended", None, rollout=r.id, outcome=outcome.value, reason=reason, **counts)
    return ENDED


def _summary(targets: list[RolloutTarget]) -> str:
    c = Counter(t.state for t in targets)
    parts = [f"{c[TargetState.done]} of {len(targets)} host(s) moved"]
    for st in (TargetState.failed, TargetState.abandoned, TargetState.skipped):
        if c[st]:
            parts.append(f"{c[st]} {st.value}")
    return ", ".join(parts)


def _revert_summary(targets: list[RolloutTarget]) -> str:
    c = Counter(t.state for t in targets)
    return (f"{c[TargetState.reverted]} host(s) reverted"
            + (f", {c[TargetState.revert_failed]} revert(s) failed" if c[TargetState.revert_failed]
               else ""))


# -- what operators read --------------------------------------------------------------------------


def _iso(d: datetime | None) -> str | None:
    return d.isoformat() + "Z" if d is not None else None


def _attempt_row(a: Attempt | None) -> dict[str, Any] | None:
    if a is None:
        return None
    return {"id": a.id, "step": a.step.value, "outcome": a.outcome.value if a.outcome else None,
            "executed": a.executed, "drain_seconds": a.drain_seconds, "reason": a.reason,
            "mode": a.effective_mode.value}


def rollout_status(s: Session, rollout_id: int | None = None) -> dict[str, Any]:
    """One rollout (the newest without an id): its state, progress, and every target with
    its attempt and revert attempt."""
    if rollout_id is None:
        newest = s.execute(select(func.max(Rollout.id))).scalar()
        if newest is None:
            raise NotFound("no rollout yet", "start one with `vigil rollout start BUILD --hosts GLOB`")
        rollout_id = int(newest)
    r = _get(s, rollout_id)
    targets = list(s.execute(select(RolloutTarget).where(RolloutTarget.rollout_id == r.id)
                             .order_by(RolloutTarget.wave == 0, RolloutTarget.position)).scalars())
    attempts = _attempts(s, [t.attempt_id for t in targets] + [t.revert_attempt_id for t in targets])
    counts = Counter(t.state.value for t in targets)
    return {
        **_summary_row(r, counts, len(targets)),
        "canary": r.canary, "pause": r.pause, "max_failures": r.max_failures,
        "auto_revert": r.auto_revert, "reason": r.reason,
        "next_wave_at": _iso(r.wave_due_at), "ended_at": _iso(r.ended_at),
        "last_error": r.last_error if r.state is not RolloutState.ended else None,
        "targets": [{"host": t.host, "wave": t.wave, "state": t.state.value, "reason": t.reason,
                     "tries": t.tries,
                     "attempt": _attempt_row(attempts.get(t.attempt_id)) if t.attempt_id else None,
                     "revert_attempt": _attempt_row(attempts.get(t.revert_attempt_id))
                     if t.revert_attempt_id else None}
                    for t in targets],
    }


def _summary_row(r: Rollout, counts: Counter[str], hosts: int) -> dict[str, Any]:
    return {"id": r.id, "build": r.digest, "mode": r.mode.value, "waves": r.waves,
            "wave": r.wave, "settled": r.settled, "wave_count": r.wave_count,
            "state": r.state.value, "outcome": r.outcome.value if r.outcome else None,
            "hosts": hosts, "moved": counts.get("done", 0), "counts": dict(counts),
            "created_at": _iso(r.created_at)}


def rollout_list(s: Session) -> list[dict[str, Any]]:
    rows = s.execute(select(Rollout).order_by(Rollout.id)).scalars().all()
    counts: dict[int, Counter[str]] = {r.id: Counter() for r in rows}
    for rid, state, n in s.execute(select(RolloutTarget.rollout_id, RolloutTarget.state,
                                          func.count()).group_by(RolloutTarget.rollout_id,
                                                                 RolloutTarget.state)):
        counts[rid][state.value] += n
    return [{**_summary_row(r, counts[r.id], sum(counts[r.id].values())), "reason": r.reason}
            for r in rows]

