"""Staged builds: which ones something still references, and garbage collection."""

from __future__ import annotations

import os

from sqlalchemy import select, union_all
from sqlalchemy.orm import Session

from models import facts
from models.states import OPEN_ROLLOUT, OPEN_WAKE, GenState
from models.store import emit, utcnow
from models.tables import Attempt, Build, Generation, Host, Rollout, RolloutTarget, Wake
from models.transition import Unfenced, move
from workflows.base.context import Context

# The caller's step holds the host's lease; a build's times are written once (facts.stamp).
BY_CALLER = Unfenced("the step writing it holds the host's lease (its gate checked it)")


def mark_published(s: Session, build_id: int, seen: Build | None = None) -> None:
    """In the caller's transaction, before anything of the build is exec'd: it is written
    as referenced (gc keeps it). Once: a build published earlier keeps its time, and one
    `seen` published in this transaction needs no write (nothing unpublishes a build)."""
    if seen is not None and seen.published_at is not None:
        return
    facts.stamp(s, Build, {"id": build_id}, "published_at", utcnow())


def set_build(s: Session, host: str, build_id: int) -> None:
    """In the caller's transaction: the host's live build, the one its next start execs
    (a deploy that switched or found it asleep, a worker's converge)."""
    move(s, Host, {"name": host}, {"build_id": build_id}, f"host {host} build", fence=BY_CALLER)


def referenced_ids(s: Session) -> set[int]:
    """A host's configured build, any generation not proven gone, any open attempt, any
    open wake's pinned build."""
    ids: set[int | None] = set(s.execute(union_all(
        select(Host.build_id),
        select(Generation.build_id).where(Generation.state != GenState.proven),
        select(Attempt.build_id).where(Attempt.outcome.is_(None)),
        # A worker's pending restart names its captured build: it will exec it again.
        select(Wake.build_id).where(Wake.state.in_(OPEN_WAKE)),
        # An open rollout's build, and the builds its hosts ran before it (a revert deploys them).
        select(Rollout.build_id).where(Rollout.state.in_(OPEN_ROLLOUT)),
        select(RolloutTarget.from_build_id).join(Rollout, Rollout.id == RolloutTarget.rollout_id)
        .where(Rollout.state.in_(OPEN_ROLLOUT)))).scalars())
    return {i for i in ids if i is not None}


def unreferenced(s: Session) -> list[Build]:
    """Staged builds (not yet deleted) that nothing references."""
    keep = referenced_ids(s)
    q = select(Build).where(Build.deleted_at.is_(None))
    if keep:
        q = q.where(Build.id.not_in(keep))
    return list(s.execute(q).scalars())


def collect(s: Session) -> list[Build]:
    """Mark every unreferenced staged build deleted (in this transaction) and return them;
    the caller removes their files. A referenced build is never returned."""
    doomed = unreferenced(s)
    now = utcnow()
    for b in doomed:
        facts.stamp(s, Build, {"id": b.id}, "deleted_at", now)
        emit(s, "build_deleted", None, build=b.digest[:12], path=b.path)
    return doomed


def staged_problem(ctx: Context, path: str, digest: str, *, executable: bool,
                   in_root: bool = True) -> str | None:
    """Why a staged build must not be exec'd (nothing of it runs), or None: it can be read,
    its bytes match the digest chosen, and (`executable`: a build vigil execs itself) it may
    be executed; with `in_root`, it lies under this box's staging root. The one check before
    every spawn of a build. An instance's wake skips the root: with several boxes on one
    store a host's build may have been staged by another box (its digest still holds)."""
    fix = "stage it again with `vigil deploy HOST BUILD`"
    root = os.path.realpath(ctx.state_dir / "builds") + os.sep
    if in_root and not os.path.realpath(path).startswith(root):
        return f"staged build {path} is outside the staging root {root}: {fix}"
    try:
        found = ctx.files.digest(path)
    except OSError as exc:
        return f"staged build {path} cannot be read ({exc.strerror}): {fix}"
    if found != digest:
        return f"staged build {path} does not match its digest ({found[:16]} != {digest[:16]}): {fix}"
    if executable and not os.access(path, os.X_OK):
        return f"staged build {path} is not executable: run `chmod +x {path}`"
    return None
