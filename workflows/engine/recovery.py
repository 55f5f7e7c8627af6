"""What the agent does on start, before it takes new work: adopt the current generations
that still run and serve (never restart them), retire the ones that do not. Everything
else in flight is finished by the ordinary obligation drivers, which read each row's last
written step (a wake found mid-spawn is reaped and retried; a stop re-signals and proves)."""

from __future__ import annotations

import os
from functools import partial

from sqlalchemy import select
from sqlalchemy.orm import Session

from models.states import GenState
from models.store import emit, emit_many
from models.tables import Generation, Host, Lease
from workflows.base.context import Context
from workflows.base.crash import crashpoint, define
from workflows.base.paths import CLAIMS
from workflows.base.sanity import impossible, impossible_hosts
from workflows.engine.claim import release_claims
from workflows.generations.access import reopen_adopted
from workflows.generations.ending import ref_of
from workflows.generations.listeners import recover_listeners
from workflows.generations.readiness import adopt_problem
from workflows.leases.lease import renew
from workflows.lifecycle.members import retire
from workflows.lifecycle.takeover import take_over
from workflows.lifecycle.watchdog import rearm

ADOPTED = define("recover.adopted", "the current generations were adopted or retired on start")


def _refused(s: Session, name: str) -> None:
    emit(s, "refused", name, reason=impossible(s, name))


def release_leftovers(ctx: Context) -> int:
    """Release the cgroups of proven generations still on disk: every proof commits, then
    releases, and a death in between leaves the (empty) dir. Bounded by the dirs present,
    not by the history; a dir of a generation this store does not know is left alone. Run
    once after start, beside the work (runners/agent/sweep.py), not before ready. The same
    for a job run's exec claim (<state>/claims/<uuid>), which its release drops."""
    dirs = ctx.proc.containments()
    claims = _claims(ctx)
    if not dirs and not claims:
        return 0
    gens = ctx.store.read(lambda s: s.execute(select(Generation).where(
        Generation.cgroup.in_(dirs) | Generation.uuid.in_(claims),
        Generation.state == GenState.proven)).scalars().all())
    for g in gens:
        ctx.proc.release(ref_of(g))
    return len(gens)


def _claims(ctx: Context) -> list[str]:
    try:
        return os.listdir(ctx.state_dir / CLAIMS)
    except OSError:  # none yet: no job has run on this box
        return []


def recover(ctx: Context) -> dict[str, int]:
    renew(ctx)
    release_claims(ctx)  # rows claimed by this box before it died are due again
    rows = ctx.store.read(lambda s: s.execute(
        select(Generation, Host).join(Host, Host.name == Generation.host)
        .join(Lease, Lease.host == Generation.host)
        .where(Generation.state == GenState.current, Lease.holder == ctx.agent_id)).all())
    refused = ctx.store.read(impossible_hosts)
    for name in sorted(refused):  # not acted on: neither adopted nor retired
        ctx.store.write(partial(_refused, name=name))
    # Decide first (probes only read), then write every adoption and retirement in one
    # transaction: a thousand adoptions cost one commit, not a thousand.
    adopt: list[tuple[Generation, dict[str, str]]] = []
    drop: list[tuple[Generation, str]] = []
    for gen, host in rows:
        if gen.host in refused:
            continue
        ref = ref_of(gen)
        alive = ctx.proc.leader_alive(ref)
        problem = None if alive else "leader is gone"
        if alive:
            problem = adopt_problem(ctx, host, gen)
        if problem is None:
            # The agent's socket group may have changed since the spawn: apply it now
            # (without restarting the app); a failure is reported, never a reason to kill.
            denied = reopen_adopted(ctx, host, gen.socket) if gen.socket else None
            adopt.append((gen, {"socket_access": denied} if denied else {}))
        else:
            drop.append((gen, problem))

    def step(s: Session) -> None:
        emit_many(s, "adopted", [(g.host, g.id, {"pid": g.pid, **extra}) for g, extra in adopt])
        for g, problem in drop:
            retire(s, ctx, g, f"not adopted on start: {problem}", restart=True)
        rearm(s, [g.id for g, _ in adopt])  # no ping reached a dead agent: a full period

    if adopt or drop:
        ctx.store.write(step)
        for g, _ in adopt:
            if g.socket:  # the link may not have been repointed before the crash
                ctx.files.point_link(ctx.link_for(g.host), g.socket)
        for g, _ in drop:
            if g.socket:
                ctx.files.remove_link(ctx.link_for(g.host), only_if_target=g.socket)
        crashpoint(ADOPTED)
    adopted, retired = len(adopt), len(drop)
    # After the adoptions: a socket the holder lost is copied from a live generation.
    recover_listeners(ctx)
    # Hosts placed here whose owner's lease expired; not yet the `keep` ones (the sweep
    # takes them once this agent has reached the store for a lease's length).
    taken = take_over(ctx, keep_too=False)
    counts = {"adopted": adopted, "retired": retired, "refused": len(refused), "taken": taken}
    ctx.store.write(lambda s: emit(s, "recovered", None, agent=ctx.agent_id, **counts))
    return counts
