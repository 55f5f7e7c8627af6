"""`vigil check`: the invariants that hold after recovery and quiescence, read from the
store and the box. Changes nothing."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import func, or_, select

from models.states import (
    IN_FLIGHT,
    LIVE_GEN,
    OPEN_STOP,
    OPEN_WAKE,
    GenState,
    ListenerState,
    RolloutState,
    TargetState,
)
from models.store import Store
from models.tables import (
    Attempt,
    Build,
    Generation,
    Host,
    KnownProcess,
    Lease,
    Listener,
    Member,
    Release,
    Rollout,
    RolloutTarget,
    Stop,
    Wake,
)
from runners.backend.files import LocalFiles
from runners.backend.process import ProcessBackend
from runners.base.doorbell import box_of
from runners.base.pids import CTIME_TOLERANCE, carriers, live_status
from runners.quick.ops import agent_acting
from workflows.engine.obligations import KINDS
from workflows.generations.ending import ref_of
from workflows.leases.lease import still_needed

if TYPE_CHECKING:
    from sqlalchemy.orm import Session


@dataclass(frozen=True)
class Violation:
    name: str
    message: str


def escaped_processes(store: Store) -> list[tuple[int, Generation]]:
    """Recorded descendants (known_processes) still alive as the same process, with their
    generation: an escaped one is in neither its cgroup nor the marker scan."""
    rows = store.read(lambda s: s.execute(select(KnownProcess.pid, KnownProcess.create_time,
                                                 Generation).join(
        Generation, Generation.id == KnownProcess.generation_id)).all())
    out, seen = [], set()
    for pid, ctime, gen in rows:
        st = live_status(pid)
        if st is None or abs(st[0] - ctime) > CTIME_TOLERANCE or pid in seen:
            continue
        seen.add(pid)
        out.append((pid, gen))
    return out


def _agent_uid(state_dir: Path) -> int:
    """The generations' uid: today the agent's, the owner of its state dir."""
    try:
        return state_dir.stat().st_uid
    except OSError:
        return os.getuid()


@dataclass
class Seen:
    """What the checks look at: the store read once (in one transaction), and the box."""

    store: Store
    state_dir: Path
    halted: str | None  # the agent runs but no longer acts on this store (its line)
    proc: ProcessBackend
    files: LocalFiles
    view_count: int  # rows of the pending_obligations view
    hosts: list[Host]
    gens: list[Generation]  # live generations
    leases: dict[str, Lease]
    open_rows: int  # open obligations
    needed: dict[str, str | None]  # per host: why it still needs its lease
    owed: set[str]  # hosts owed a release
    members: set[int]  # generation ids in an operation set
    tracked: set[int]  # generation ids an open wake, stop or attempt names
    known: dict[str, Generation]  # every generation by uuid
    builds: list[Build]
    pinned: set[int]  # builds a pending restart names
    loose: list[tuple[int, str, TargetState, RolloutState]]

    @functools.cached_property
    def box(self) -> str | None:
        return box_of(self.state_dir)

    @functools.cached_property
    def currents(self) -> dict[str, list[Generation]]:
        out: dict[str, list[Generation]] = {}
        for g in self.gens:
            if g.state is GenState.current:
                out.setdefault(g.host, []).append(g)
        return out

    @functools.cached_property
    def marked(self) -> dict[int, str]:
        """Read when first asked: live processes carrying a generation's marker."""
        found = carriers(set(self.known), {_agent_uid(self.state_dir)})
        return {pid: uuid for pid, (uuid, _) in found.items()}

    def untracked(self, g: Generation) -> bool:
        return g.state is not GenState.current and g.id not in self.members and g.id not in self.tracked


def look(store: Store, state_dir: Path) -> Seen:
    from runners.base.doorbell import halted_line

    halted = halted_line(state_dir)
    proc = ProcessBackend(containment=os.environ.get("VIGIL_CONTAINMENT", "auto"))
    files = LocalFiles()
    with store.reading() as conn:
        view_count = conn.exec_driver_sql("SELECT count(*) FROM pending_obligations").scalar_one()
    return Seen(store, state_dir, halted, proc, files, view_count, *store.read(_read))


def _read(s: Session) -> tuple[Any, ...]:
    hosts = s.execute(select(Host)).scalars().all()
    gens = s.execute(select(Generation).where(Generation.state.in_(LIVE_GEN))).scalars().all()
    leases = {lease.host: lease for lease in s.execute(select(Lease)).scalars()}
    # Every kind the reconciler drives (one list of them: workflows/engine/obligations.py).
    open_rows = sum(s.execute(select(func.count()).select_from(k.model).where(
        *([k.open] if k.open is not None else []))).scalar_one() for k in KINDS.values())
    needed = {h.name: still_needed(s, h.name) for h in hosts}
    owed = {r.host for r in s.execute(select(Release)).scalars()}
    members = {m.generation_id for m in s.execute(select(Member)).scalars()}
    wake_gens = {w.generation_id for w in s.execute(select(Wake).where(Wake.state.in_(OPEN_WAKE))).scalars()}
    stop_gens = {st.generation_id for st in s.execute(select(Stop).where(Stop.state.in_(OPEN_STOP))).scalars()}
    att_gens = set()
    for a in s.execute(select(Attempt).where(Attempt.outcome.is_(None))).scalars():
        att_gens |= {a.successor_id, a.retiring_id}
    known = {g.uuid: g for g in s.execute(select(Generation)).scalars()}
    builds = s.execute(select(Build)).scalars().all()
    pinned = set(s.execute(select(Wake.build_id).where(  # a worker's pending restart
        Wake.state.in_(OPEN_WAKE), Wake.build_id.is_not(None))).scalars())
    # Targets of an ended rollout still in flight, or of an open one naming no attempt.
    loose = s.execute(select(RolloutTarget.rollout_id, RolloutTarget.host, RolloutTarget.state,
                             Rollout.state).join(Rollout, Rollout.id == RolloutTarget.rollout_id)
                      .where(or_(
                          (Rollout.state == RolloutState.ended)
                          & RolloutTarget.state.in_((*IN_FLIGHT, TargetState.pending)),
                          (RolloutTarget.state == TargetState.deploying)
                          & RolloutTarget.attempt_id.is_(None),
                          (RolloutTarget.state == TargetState.reverting)
                          & RolloutTarget.revert_attempt_id.is_(None)))).all()
    return (hosts, gens, leases, open_rows, needed, owed, members, wake_gens | stop_gens | att_gens,
            known, builds, pinned, loose)


# -- the checks, in the order `vigil check` reports them ----------------------------------------

def agent_halted(seen: Seen) -> Iterator[Violation]:
    if seen.halted is not None:
        yield Violation("agent_halted", f"the agent has stopped acting: {seen.halted}")


def rollout_targets(seen: Seen) -> Iterator[Violation]:
    for rid, host, target, rollout in seen.loose:
        yield Violation("rollout_target", f"target {host} of rollout #{rid} is "
                        f"{target.value} while the rollout is {rollout.value}")


def one_current(seen: Seen) -> Iterator[Violation]:
    """At most one current generation per host and slot, and no more than its instances
    (a job whose overlap is allow: no more than MAX_AT_ONCE runs, each in its slot)."""
    from workflows.lifecycle.job_overlap import MAX_AT_ONCE
    from workflows.lifecycle.jobs import is_job

    instances = {h.name: MAX_AT_ONCE if is_job(h) and h.overlap == "allow" else h.instances
                 for h in seen.hosts}
    for host, cur in seen.currents.items():
        if len(cur) > 1 and (len({g.slot for g in cur}) < len(cur)
                             or len(cur) > instances.get(host, 1)):
            yield Violation("one_current", f"host {host} has {len(cur)} current generations: "
                            + ", ".join(f"g{g.id}" for g in cur))


def current_generations(seen: Seen) -> Iterator[Violation]:
    """Each host's current generation runs, is healthy and is what its link points at."""
    for h in seen.hosts:
        currents = seen.currents.get(h.name, [])
        for g in currents[:1] if h.instances == 1 else currents:
            if not seen.proc.leader_alive(ref_of(g)):
                yield Violation("current_alive", f"host {h.name}: current generation g{g.id} "
                                f"(pid {g.pid}) is not running")
            if g.unhealthy_since is not None:
                yield Violation("healthy", f"host {h.name}: current generation g{g.id} has "
                                f"failed {g.health_failures} probes in a row (unhealthy "
                                "since " + g.unhealthy_since.isoformat() + "Z)")
            link = str(seen.state_dir / "run" / f"{h.name}.sock")
            here = seen.box is None or g.agent_id == seen.box  # the link is on its own box
            if g.socket and here and seen.files.read_link(link) not in {c.socket for c in currents}:
                yield Violation("canonical_link", f"host {h.name}: run/{h.name}.sock does not "
                                f"point at g{g.id}'s socket {g.socket}")


def untracked_generations(seen: Seen) -> Iterator[Violation]:
    for g in seen.gens:
        if seen.untracked(g):
            yield Violation("untracked_generation", f"generation g{g.id} of {g.host} is "
                            f"{g.state.value} but no open obligation tracks it")


def stray_processes(seen: Seen) -> Iterator[Violation]:
    for pid, uuid in seen.marked.items():
        g = seen.known[uuid]
        if g.state is GenState.proven:
            yield Violation("stray_process", f"pid {pid} belongs to g{g.id} of {g.host}, "
                            "which the store says is proven gone")
        elif seen.untracked(g):
            yield Violation("stray_process", f"pid {pid} belongs to g{g.id} of {g.host} "
                            f"({g.state.value}), neither current nor an open obligation")


def escaped_descendants(seen: Seen) -> Iterator[Violation]:
    for pid, g in escaped_processes(seen.store):
        if pid in seen.marked:
            continue  # reported by stray_processes
        if g.state is GenState.proven:
            yield Violation("escaped_process", f"pid {pid}, a descendant of g{g.id} of "
                            f"{g.host}, is alive, yet the store says g{g.id} is proven "
                            "gone (it left the generation's containment)")
        elif seen.untracked(g):
            yield Violation("escaped_process", f"pid {pid}, a descendant of g{g.id} of "
                            f"{g.host} ({g.state.value}), is alive, and no open "
                            "obligation tracks its generation")


def agent_alive(seen: Seen) -> Iterator[Violation]:
    if seen.open_rows and not agent_acting(seen.store, seen.state_dir):
        yield Violation("agent_alive", f"{seen.open_rows} obligation(s) are open and no agent "
                        f"runs on {seen.state_dir} to act on them; start one with "
                        "`vigil agent start`")


def obligations_visible(seen: Seen) -> Iterator[Violation]:
    if seen.view_count != seen.open_rows:
        yield Violation("obligations_visible", f"pending_obligations lists {seen.view_count} "
                        f"rows but {seen.open_rows} obligations are open")


def leases(seen: Seen) -> Iterator[Violation]:
    """A lease exactly where something needs one."""
    for h in seen.hosts:
        has_lease = h.name in seen.leases
        needs = seen.needed[h.name] is not None or h.name in seen.owed
        if has_lease and not needs:
            yield Violation("lease_without_cause", f"host {h.name} holds lease fence "
                            f"{seen.leases[h.name].fence} with no live generation or open "
                            "obligation")
        if not has_lease and seen.needed[h.name] is not None:
            yield Violation("cause_without_lease", f"host {h.name}: {seen.needed[h.name]} but "
                            "it holds no lease")


def held_listeners(seen: Seen) -> Iterator[Violation]:
    yield from listener_violations(seen.store, seen.state_dir)


def referenced_builds(seen: Seen) -> Iterator[Violation]:
    referenced = {h.build_id for h in seen.hosts} | {g.build_id for g in seen.gens} | seen.pinned
    for b in seen.builds:
        if b.id in referenced and (b.deleted_at is not None or not os.path.exists(b.path)):
            yield Violation("referenced_build", f"build {b.digest[:12]} ({b.path}) is "
                            "referenced but its staged file is gone")


CHECKS: tuple[Callable[[Seen], Iterable[Violation]], ...] = (
    agent_halted, rollout_targets, one_current, current_generations, untracked_generations,
    stray_processes, escaped_descendants, agent_alive, obligations_visible, leases,
    held_listeners, referenced_builds)


def run_checks(store: Store, state_dir: Path) -> list[Violation]:
    seen = look(store, state_dir)
    return [v for check in CHECKS for v in check(seen)]


def listener_violations(store: Store, state_dir: Path) -> list[Violation]:
    """A held listener (on this box, this boot) that the fd holder lacks. A lost one is no
    violation: the host's next start binds it again (listener_notes says so)."""
    from runners.backend.listen import Listeners, boot_id
    from workflows.generations.listeners import key_of

    rows = store.read(lambda s: s.execute(select(Listener).order_by(
        Listener.host, Listener.position)).scalars().all())
    if not rows:
        return []
    bad = []
    me = box_of(state_dir)
    held = [r for r in rows if r.state is ListenerState.held and r.agent_id == me
            and r.boot_id == boot_id()]
    if held:
        try:
            with Listeners(state_dir) as holder:
                keys = holder.listed()
        except OSError as exc:
            keys = None
            bad.append(Violation("listener_holder", f"the fd holder does not answer ({exc})"))
        if keys is None:
            bad.append(Violation("listener_holder", "no fd holder runs, yet the store says "
                                 f"{held[0].address} of host {held[0].host} is held"))
        else:
            for r in held:
                if keys.get(key_of(r)) != r.inode:
                    bad.append(Violation("listener_holder", f"host {r.host}: the fd holder "
                                         f"does not keep {r.address} (inode {r.inode})"))
    return bad


def listener_notes(store: Store) -> list[str]:
    """Listeners that were lost: reopened (and why), or bound again at the next start."""
    from workflows.generations.listeners import note

    rows = store.read(lambda s: s.execute(select(Listener).order_by(
        Listener.host, Listener.position)).scalars().all())
    return [line for line in map(note, rows) if line is not None]
