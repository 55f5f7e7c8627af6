"""Operation-set members: generations that are not current but not proven gone yet.

A current generation whose leader died becomes a `retiring` member; the sweep kills what is
left of it and proves it gone, and only then does it leave the set.
"""

from __future__ import annotations

from collections.abc import Collection
from contextlib import suppress
from datetime import UTC
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from models.errors import BrokenInvariant, LostRace
from models.states import OPEN_WAKE, Desired, GenState, HostKind, MemberRole
from models.store import emit, utcnow
from models.tables import Generation, Host, Lease, Listener, Member, Restore, Wake, Watchdog
from models.transition import Unfenced, move, move_many
from workflows.base.context import Context, Held, Poke, Result
from workflows.base.crash import crashpoint, define
from workflows.base.ports import ProcRef
from workflows.base.sanity import impossible_hosts
from workflows.base.waivers import BY_STATE
from workflows.generations.create import join_set
from workflows.generations.ending import end_generation, mark_proven, ref_of
from workflows.generations.known import note
from workflows.generations.stopway import stop_way
from workflows.leases.lease import owe_release, release_owed
from workflows.lifecycle.restarts import exit_code, exit_line, oom_line, schedule, uptime
from workflows.lifecycle.workers import worker_exited

# What a member's or a restore's write needs instead of the lease fence.
MEMBER_NOTE = Unfenced("a note on a member row (unproven, retried_at): it moves no state")
BY_RESTORE = Unfenced("the restore row guards it: deleted in the same commit, it is done once")

EXITED = define("member.exited", "a dead current generation is retiring and a member")
PROVEN = define("member.proven", "a member is proven gone and has left the set")
RESTORED = define("restore.done", "the parent limit is restored and the raised mark cleared")


def retire(s: Session, ctx: Context, gen: Generation, why: str, *, restart: bool,
           code: int | None = None, exited: bool = False) -> None:
    """current -> retiring member (one transaction); queue a restart wake if wanted.
    `exited`: its leader is gone, and `code` is its status when this agent knows it."""
    move(s, Generation, {"id": gen.id},
         {"state": GenState.retiring, "end_reason": why},
         f"generation g{gen.id} current -> retiring", fence=BY_STATE, col="state",
         frm=GenState.current)
    lease = s.get(Lease, gen.host)
    join_set(s, gen.id, gen.host, MemberRole.retiring,
             lease.fence if lease is not None else gen.fence, unproven=True)
    host = s.get(Host, gen.host)
    oom = oom_line(s, ctx, gen, code) if exited else None  # an OOM kill says so, everywhere
    how = {"exit_code": code, "status": "oom" if oom else exit_line(code)} if exited else {}
    one_shot = {"one_shot": True} if host is not None and host.one_shot else {}
    emit(s, "exited", gen.host, gen.id, pid=gen.pid, reason=why, **how, **one_shot)
    if not restart or host is None:
        return
    if host.kind is HostKind.worker:
        worker_exited(s, gen, host, code, oom)  # backoff, onto its captured build; one-shot: none
    elif host.desired is Desired.up and gen.slot < host.instances and s.execute(select(Wake.id).where(
            Wake.host == gen.host, Wake.slot == gen.slot, Wake.state.in_(OPEN_WAKE))).first() is None:
        schedule(s, host, uptime(gen), oom or why, slot=gen.slot, at_once=True)


def current_leaders(ctx: Context) -> dict[int, tuple[int, float]]:
    """Every current generation this agent owns: id -> (leader pid, create time)."""
    rows = ctx.store.read(lambda s: s.connection().execute(
        _currents_here(ctx, Generation.id, Generation.pid, Generation.create_time)).all())
    return {r.id: (r.pid, r.create_time) for r in rows}


def _currents_here(ctx: Context, *cols: Any) -> Any:
    return (select(*cols).join(Lease, Lease.host == Generation.host)
            .where(Generation.state == GenState.current, Lease.holder == ctx.agent_id,
                   Generation.pid.is_not(None), Generation.create_time.is_not(None)))


def count_current_leaders(ctx: Context) -> int:
    """How many current generations this agent owns (what current_leaders would return),
    counted in the store: the backstop's check that the exit watcher watches them all."""
    return ctx.store.read(lambda s: s.connection().execute(
        _currents_here(ctx, func.count(Generation.id))).scalar_one())


def leaders_after(ctx: Context, after: int, limit: int) -> dict[int, ProcRef]:
    """The next `limit` current generations this agent owns after id `after`, by id: one
    slice of the backstop's walk of the leaders' descendants."""
    G = Generation.__table__.c
    rows = ctx.store.read(lambda s: s.connection().execute(
        _currents_here(ctx, G.id, G.uuid, G.pid, G.create_time, G.cgroup)
        .where(G.id > after).order_by(G.id).limit(limit)).all())
    return {r.id: ProcRef(generation_uuid=r.uuid, pid=r.pid, create_time=r.create_time,
                          cgroup=r.cgroup) for r in rows}


def retire_dead_currents(ctx: Context, only: Collection[int] | None = None,
                         skip: Collection[int] = ()) -> int:
    """The liveness check: every current generation this agent owns (or those of `only`,
    the ones whose exit was just reported) whose leader is gone. Those of `skip` are not
    checked (their exit is reported as it happens: the exit watcher holds their pidfds)."""
    G = Generation.__table__.c

    def read(s: Session) -> tuple[list[Any], set[str]]:
        # Plain rows on the connection: the 30 s backstop reads every current generation;
        # an ORM object for each was most of an idle agent's cost at 1,000 hosts, and the
        # session's row loading still a third of the backstop at 9,000.
        q = select(G.id, G.host, G.uuid, G.pid, G.create_time, G.cgroup).join(
            Lease, Lease.host == G.host).where(G.state == GenState.current,
                                               Lease.holder == ctx.agent_id)
        if only is not None:
            q = q.where(G.id.in_(list(only)))
        rows = s.connection().execute(q).all()
        # Checked among this box's hosts only: a store-wide check read every current
        # generation of the fleet (each box's backstop, every 30 s).
        return rows, impossible_hosts(s, {r.host for r in rows})  # type: ignore[return-value]

    rows, refused = ctx.store.read(read)
    refs = {r.id: ProcRef(generation_uuid=r.uuid, pid=r.pid, create_time=r.create_time,
                          cgroup=r.cgroup) for r in rows}
    # A host in an impossible state is not acted on (its obligations say why).
    dead = [r.id for r in rows if r.host not in refused and r.id not in skip
            and not ctx.proc.leader_alive(refs[r.id])]
    if only is None:  # the backstop: one walk of every live leader's descendants
        note(ctx, {gid: ref for gid, ref in refs.items() if gid not in dead})
    retired = 0
    for gen_id in dead:
        code = exit_code(ctx, refs[gen_id].pid)  # reaped before the transaction opens

        def step(s: Session, gen_id: int = gen_id, code: int | None = code) -> Generation:
            gen = s.get(Generation, gen_id)
            if gen is None:
                raise LostRace(f"generation g{gen_id} is gone")
            retire(s, ctx, gen, exit_reason(s, gen_id, code), restart=True, code=code,
                   exited=True)
            return gen

        try:
            gen = ctx.store.write(step)
        except LostRace:  # retired meanwhile (the scan and an exit event met): nothing to do
            continue
        retired += 1
        crashpoint(EXITED)
        if gen.socket:
            ctx.files.remove_link(ctx.link_for(gen.host), only_if_target=gen.socket)
    return retired


def exit_reason(s: Session, gen_id: int, code: int | None) -> str:
    """Why a leader that ended is retired: a fired watchdog's words when its fire was
    written (its SIGABRT's exit can be heard before the watchdog's own retirement commits),
    else how it ended."""
    how = f"leader {exit_line(code)}"
    fired = s.execute(select(Watchdog.reason).where(Watchdog.generation_id == gen_id,
                                                    Watchdog.fired_at.is_not(None))
                      ).scalar_one_or_none()
    return how if fired is None else f"watchdog: {fired} ({how})"


def drive_member(ctx: Context, gen_id: int) -> Result:
    m = ctx.store.read(lambda s: s.get(Member, gen_id))
    if m is None:
        return Result.gone
    gen = ctx.store.read(lambda s: s.get(Generation, gen_id))
    host = ctx.store.read(lambda s: s.get(Host, m.host))
    if gen is None or host is None:
        raise BrokenInvariant("gen or host is missing")
    if m.role is not MemberRole.retiring:
        raise Poke(f"member g{gen_id} is {m.role.value}: its attempt drives it")
    if gen.state is GenState.retiring:
        since = m.since.replace(tzinfo=UTC).timestamp()
        shared = ctx.store.read(lambda s: s.execute(select(Listener.position).where(
            Listener.host == m.host).limit(1)).first()) is not None
        problem = end_generation(ctx, gen, drain_until=since + host.drain_timeout,
                                 drain_rest=shared, way=stop_way(host, gen))
        if problem is not None:
            ctx.store.write(lambda s: move_many(
                s, Member, [Member.generation_id == gen_id],
                {"unproven": True, "retried_at": utcnow()}, f"member g{gen_id} unproven",
                fence=MEMBER_NOTE))
            raise Poke(problem)

    def step(s: Session) -> None:
        if s.get(Generation, gen_id).state is GenState.retiring:  # type: ignore[union-attr]
            mark_proven(s, gen_id)
        leave_set(s, ctx, m.host, gen_id)
        emit(s, "proven", m.host, gen_id, after="member left the set")

    ctx.store.write(step)
    ctx.proc.release(ref_of(gen))
    crashpoint(PROVEN)
    run_restores(ctx, m.host)
    release_owed(ctx, m.host)
    return Result.progress


def leave_set(s: Session, ctx: Context, host: str, gen_id: int) -> None:
    """A proven member leaves. The last one out owes the parent-limit restore (if raised);
    with nothing left to retain it, the lease release is owed too."""
    s.execute(Member.__table__.delete().where(Member.generation_id == gen_id))
    h = s.get(Host, host)
    others = s.execute(select(Member.generation_id).where(Member.host == host)).first()
    pending = s.execute(select(Restore.id).where(Restore.host == host)).first()
    if h is not None and h.raised and others is None and pending is None:
        lease = s.get(Lease, host)
        now = utcnow()
        s.add(Restore(host=host, fence=lease.fence if lease is not None else 0, since=now,
                      next_attempt_at=now))
    owe_release(s, ctx, host)


def drive_restore(ctx: Context, restore_id: int) -> Result:
    """Put the parent limit back to the current generation's tier; only a restore that
    succeeded clears the `raised` mark. A failure keeps the row for the sweep."""
    r = ctx.store.read(lambda s: s.get(Restore, restore_id))
    if r is None:
        return Result.gone
    host = ctx.store.read(lambda s: s.get(Host, r.host))
    if host is None:
        return Result.gone
    if ctx.store.read(lambda s: s.execute(select(Member.generation_id).where(
            Member.host == r.host)).first()) is not None:
        raise Held(f"members of {r.host} are still in the set; the last one out restores")
    if host.raised and host.memory_tier_mb and ctx.limits is not None:
        try:
            ctx.limits.set_limit(r.host, host.memory_tier_mb)
        except OSError as exc:
            raise Poke(f"parent limit restore of {r.host} failed: {exc}") from None

    def step(s: Session) -> None:
        move_many(s, Host, [Host.name == r.host], {"raised": False},
                  f"parent limit of {r.host} restored", fence=BY_RESTORE)
        s.execute(Restore.__table__.delete().where(Restore.id == restore_id))
        emit(s, "restored", r.host, tier_mb=host.memory_tier_mb)
        owe_release(s, ctx, r.host)

    ctx.store.write(step)
    crashpoint(RESTORED)
    release_owed(ctx, r.host)
    return Result.progress


def run_restores(ctx: Context, host: str) -> None:
    """Try the host's pending restores now; the sweep retries any that fail."""
    ids = ctx.store.read(lambda s: s.execute(select(Restore.id).where(Restore.host == host))
                         .scalars().all())
    for rid in ids:
        with suppress(Poke):
            drive_restore(ctx, rid)
