"""The operator's intents (the CLI), each one transaction: start a rollout (its rows,
each host in its wave), pause, resume, abort."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from sqlalchemy import func, insert, select
from sqlalchemy.orm import Session

from models.errors import BadInput, Refused
from models.states import Mode, RolloutState, TargetState
from models.store import emit, utcnow
from models.tables import Attempt, Build, Host, Rollout, RolloutTarget, Stop
from models.transition import move
from workflows.base.lookups import get_host
from workflows.base.waivers import OPERATOR
from workflows.rollouts.rows import cancel_queued, get_rollout, skip_reason
from workflows.rollouts.waves import parse_waves, wave_ends


@dataclass(frozen=True)
class Started:
    id: int
    waves: list[list[str]]
    skipped: list[tuple[str, str]]


def select_hosts(s: Session, names: list[str], glob: str | None) -> list[str]:
    """The targets in order: the --host names as given, then the --hosts matches by name."""
    chosen: list[str] = []
    for n in names:
        get_host(s, n)
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
        why = skip_reason(s, h, build)
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


def _toggle(s: Session, rollout_id: int, frm: RolloutState, to: RolloutState, verb: str,
            event: str, done: str, **values: object) -> str:
    r = get_rollout(s, rollout_id)
    if r.state is to:
        return f"rollout #{r.id} is already {to.value}"
    if r.state is not frm:
        raise Refused(f"rollout #{r.id} is {r.state.value}: only a {frm.value} rollout {verb}",
                      f"see `vigil rollout status {r.id}`")
    move(s, Rollout, {"id": r.id}, {"state": to, **values}, f"rollout #{r.id} -> {to.value}",
         fence=OPERATOR, col="state", frm=frm)
    emit(s, event, None, rollout=r.id, wave=r.wave)
    return done.format(id=r.id)


def pause_rollout(s: Session, rollout_id: int) -> str:
    return _toggle(s, rollout_id, RolloutState.running, RolloutState.paused, "pauses", "rollout_paused",
                   "rollout #{id} paused: the wave in flight settles, no new wave starts until "
                   "`vigil rollout resume {id}`")


def resume_rollout(s: Session, rollout_id: int) -> str:
    return _toggle(s, rollout_id, RolloutState.paused, RolloutState.running, "resumes", "rollout_resumed",
                   "rollout #{id} resumed", next_attempt_at=utcnow(), attempts=0)


def abort_rollout(s: Session, rollout_id: int) -> str:
    """No new wave and no revert: attempts of it not started yet are cancelled, those
    running finish, then it ends `aborted`."""
    r = get_rollout(s, rollout_id)
    if r.state is RolloutState.ended:
        raise Refused(f"rollout #{r.id} has already ended ({r.outcome.value if r.outcome else '?'})",
                      f"see `vigil rollout status {r.id}`")
    if r.state is RolloutState.aborting:
        return f"rollout #{r.id} is already aborting"
    move(s, Rollout, {"id": r.id}, {"state": RolloutState.aborting,
                                    "reason": "aborted by the operator",
                                    "next_attempt_at": utcnow(), "attempts": 0},
         f"rollout #{r.id} -> aborting", fence=OPERATOR, col="state", frm=r.state)
    cancelled = cancel_queued(s, r, "was aborted")
    emit(s, "rollout_aborting", None, rollout=r.id, wave=r.wave, cancelled=cancelled)
    return (f"rollout #{r.id} aborting: {cancelled} attempt(s) not started were cancelled; "
            "attempts running finish, nothing is reverted")
