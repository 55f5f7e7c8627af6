"""Host definitions and the read model operators see (`vigil status`)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from models.durations import check_seconds
from models.errors import BadInput, NotFound, Refused
from models.states import (
    CRASHLOOP_STREAK,
    LIVE_GEN,
    OPEN_STOP,
    OPEN_WAKE,
    AttemptStep,
    GenState,
    HostKind,
    ListenerState,
    Outcome,
    WakeState,
)
from models.store import emit, utcnow
from models.tables import Attempt, Build, Event, Generation, Host, Lease, Listener, Stop, Wake
from workflows.base.paths import CONTROL
from workflows.generations.listeners import Listen, check_set, note, reopened, stored, write_set
from workflows.generations.slots import check_instances
from workflows.leases.lease import still_needed
from workflows.leases.placement import FENCE, check_store_loss
from workflows.lifecycle.order import check_graph, dependents, stored_graph
from workflows.lifecycle.workers import check_policy

NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")


def check_name(name: str) -> None:
    if not NAME.fullmatch(name):
        raise BadInput(f"invalid host name {name!r}",
                       "use 1-63 characters: lowercase letters, digits and '-', not starting with '-'")


def check_env(env: dict[str, str], label: str = "env: ") -> None:
    """Names and values execve can take: a bad one would fail every start of the host."""
    for k, v in env.items():
        if not k:
            raise BadInput(f"{label}a name is empty", "give every entry a name: NAME=value")
        if "=" in k:
            raise BadInput(f"{label}name {k!r} contains '='", "rename it: a name cannot hold '='")
        if "\0" in k or "\0" in v:
            raise BadInput(f"{label}{k!r} contains a NUL byte", "remove the NUL (\\0) character")


def check_args(args: list[str], label: str = "args: ") -> None:
    """Arguments execve can take (`label` starts the message; the caller names the field)."""
    for a in args:
        if "\0" in a:
            raise BadInput(f"{label}{a!r} contains a NUL byte", "remove the NUL (\\0) character")


SUN_PATH_MAX = 107  # bytes in a unix socket's path (sockaddr_un.sun_path, less its NUL)
GEN_DIGITS = 7  # room for generation numbers up to 9,999,999 in `g<n>.sock`


def check_socket_room(state_dir: Path, host: str | None = None) -> None:
    """The longest socket path vigil binds fits the kernel's limit: an instance's
    `run/<host>/g<n>.sock`, or (no host) the agent's own sockets (the control socket's
    name is the longer)."""
    path = (state_dir / "run" / host / f"g{'9' * GEN_DIGITS}.sock" if host is not None
            else state_dir / CONTROL)
    size = len(os.fsencode(str(path)))
    if size > SUN_PATH_MAX:
        what = f"host {host}'s" if host is not None else "the agent's"
        raise BadInput(f"{what} socket path {path} would be {size} bytes; unix sockets take "
                       f"at most {SUN_PATH_MAX} bytes",
                       "use a shorter state dir (--state-dir / VIGIL_HOME)"
                       + (" or a shorter host name" if host is not None else ""))


def record_build(s: Session, path: str, digest: str, source: str) -> Build:
    b = s.execute(select(Build).where(Build.path == path)).scalar_one_or_none()
    if b is None:
        b = Build(path=path, digest=digest, source=source, created_at=utcnow())
        s.add(b)
        s.flush()
    elif b.deleted_at is not None:
        s.execute(Build.__table__.update().where(Build.id == b.id).values(deleted_at=None))
    return b


def refuse_taken(s: Session, name: str) -> None:
    """`host add` of a name the store has: said first, before its port or build is looked
    at (the port it holds is in use by vigil itself, which misled)."""
    if s.get(Host, name) is not None:
        raise BadInput(f"host {name} already exists",
                       f"change it with `vigil host set {name} ...`, or remove it first with "
                       f"`vigil host rm {name}`")


def add_host(s: Session, name: str, *, kind: HostKind, build_path: str, digest: str, source: str,
             args: list[str], env: dict[str, str], cwd: str | None, drain_timeout: float,
             health_timeout: float, memory_tier_mb: int | None = None, box: str | None = None,
             policy: dict[str, Any] | None = None, socket_group: str | None = None,
             socket_mode: int | None = None, listeners: list[Listen] | None = None,
             ready: str | None = None, probe: dict[str, Any] | None = None,
             run: dict[str, Any] | None = None, after: list[str] | None = None,
             on_store_loss: str = FENCE, instances: int = 1) -> None:
    check_name(name)
    check_store_loss(on_store_loss)
    listens = listeners or []
    check_set(listens, kind, ready)
    check_instances(instances, listens, kind, tier=memory_tier_mb)
    check_args(args)
    check_env(env)
    check_seconds(drain_timeout, "--drain-timeout")
    check_seconds(health_timeout, "--health-timeout")
    refuse_taken(s, name)
    after = list(dict.fromkeys(after or []))
    if after:
        check_graph({**stored_graph(s), name: after})  # no unknown name, no cycle
    worker = check_policy(kind, policy or {})  # restart policy, max-run, one-shot, converge
    build = record_build(s, build_path, digest, source)
    s.add(Host(name=name, kind=kind, build_id=build.id, args=json.dumps(args), env=json.dumps(env),
               cwd=cwd, drain_timeout=drain_timeout, health_timeout=health_timeout,
               memory_tier_mb=memory_tier_mb, box=box, socket_group=socket_group,
               socket_mode=socket_mode, ready=ready, created_at=utcnow(), **worker,
               start_after=json.dumps(after), on_store_loss=on_store_loss,
               instances=instances,
               **(probe or {}), **(run or {})))
    s.flush()
    write_set(s, name, listens, box)
    emit(s, "host_added", name, build=digest[:12], kind=kind.value,
         **({"listen": [a.address for a in listens]} if listens else {}))


def remove_host(s: Session, name: str) -> list[Listener]:
    """Removes the host; returns its listeners (their sockets are closed after the commit)."""
    if s.get(Host, name) is None:
        raise NotFound(f"no host named {name!r}", "see `vigil host list`")
    why = still_needed(s, name)
    if why is not None or s.get(Lease, name) is not None:
        raise Refused(f"host {name} cannot be removed: {why or 'it still holds its lease'}",
                      f"stop it first with `vigil stop {name} --wait`")
    named_by = [h for h in dependents(s, name) if h != name]
    if named_by:
        raise Refused(f"host {name} cannot be removed: {', '.join(named_by)} start after it",
                      f"drop it from their after first (`vigil host set {named_by[0]} --unset "
                      f"after`), or remove them first")
    rows = stored(s, name)
    s.execute(Host.__table__.delete().where(Host.name == name))
    emit(s, "host_removed", name)
    return rows



def host_state(s: Session, name: str) -> str:
    def has(model: Any, *where: Any) -> bool:
        return s.execute(select(model.id).where(model.host == name, *where).limit(1)).first() is not None

    if has(Wake, Wake.state == WakeState.unproven):
        return "unproven"
    if has(Stop, Stop.state.in_(OPEN_STOP)):
        return "stopping"
    if has(Attempt, Attempt.outcome.is_(None), Attempt.step != AttemptStep.queued):
        return "deploying"
    if has(Generation, Generation.state == GenState.current):
        if has(Generation, Generation.state == GenState.current,
               Generation.unhealthy_since.is_not(None)):
            return "unhealthy"  # it runs, but has failed its probe --unhealthy-after times
        return "awake"
    if has(Wake, Wake.state.in_(OPEN_WAKE)):
        if has(Wake, Wake.state == WakeState.queued, Wake.waiting_on.is_not(None)):
            return "waiting"  # on hosts it starts after (workflows/lifecycle/order.py)
        host = s.get(Host, name)
        if host is not None and host.restart_streak >= CRASHLOOP_STREAK and has(
                Wake, Wake.state == WakeState.queued, Wake.cause == "restart",
                Wake.next_attempt_at > utcnow()):
            return "crashloop"  # quick exits in a row: the next start waits out a backoff
        return "waking"
    if has(Generation, Generation.state.in_(LIVE_GEN)):
        return "retiring"
    last = s.execute(select(Attempt.outcome).where(Attempt.host == name, Attempt.outcome.is_not(None))
                     .order_by(Attempt.id.desc()).limit(1)).scalar()
    if last is Outcome.down:
        return "down"
    return "asleep"


def status(s: Session, name: str | None = None) -> list[dict[str, Any]]:
    q = select(Host).order_by(Host.name)
    if name is not None:
        if s.get(Host, name) is None:
            raise NotFound(f"no host named {name!r}", "see `vigil host list`")
        q = q.where(Host.name == name)
    out = []
    for h in s.execute(q).scalars():
        currents = list(s.execute(select(Generation).where(
            Generation.host == h.name, Generation.state == GenState.current)
            .order_by(Generation.slot)).scalars())
        gen = currents[0] if currents else None  # a host of instances: its lowest slot's
        build = s.get(Build, gen.build_id if gen else h.build_id)
        lease = s.get(Lease, h.name)
        out.append({
            "host": h.name,
            "kind": h.kind.value,
            "state": host_state(s, h.name),
            "desired": h.desired.value,
            "generation": gen.id if gen else None,
            "pid": gen.pid if gen else None,
            "build_digest": build.digest if build else None,
            "build_file": os.path.basename(build.source) if build else None,
            "socket": gen.socket if gen else None,
            "since": (gen.current_at.isoformat() + "Z") if gen and gen.current_at else None,
            "lease": {"holder": lease.holder, "fence": lease.fence} if lease else None,
            **_deploy_status(s, h),
            **_probe_status(h, gen),
            **_listen_status(s, h),
            **_worker_status(s, h, gen),
            **_exit_status(s, h),
            **_instance_status(h, currents),
        })
    return out


def _instance_status(h: Host, currents: list[Generation]) -> dict[str, Any]:
    """A host of instances: each slot, with its current generation and pid (none: down)."""
    if h.instances == 1 and all(g.slot == 0 for g in currents):
        return {}
    by_slot = {g.slot: g for g in currents}
    return {"instances": h.instances, "slots": [
        {"slot": n, "generation": g.id if g else None, "pid": g.pid if g else None,
         "build_id": g.build_id if g else None,
         "since": (g.current_at.isoformat() + "Z") if g and g.current_at else None}
        for n in sorted(set(range(h.instances)) | set(by_slot)) for g in [by_slot.get(n)]]}


def _exit_status(s: Session, h: Host) -> dict[str, Any]:
    """How the host's last leader to end by itself ended (`exited 3`, `killed by SIGKILL`),
    and when: the newest `exited` event with a status, of this host since it was added."""
    e = s.execute(select(Event.at, Event.generation_id, Event.detail).where(
        Event.host == h.name, Event.kind == "exited", Event.at >= h.created_at,
        Event.detail.contains('"status": ')).order_by(Event.id.desc()).limit(1)).first()
    if e is None:
        return {}
    return {"last_exit": {"status": json.loads(e.detail)["status"], "generation": e.generation_id,
                          "at": e.at.isoformat() + "Z"}}


def _deploy_status(s: Session, h: Host) -> dict[str, Any]:
    """The host's newest attempt and the line that says where it is: `deploying #12
    (resumed from #11)`, `last deploy #12 done`, or why it ended otherwise."""
    a = s.execute(select(Attempt).where(Attempt.host == h.name).order_by(Attempt.id.desc())
                  .limit(1)).scalar_one_or_none()
    if a is None:
        return {}
    outcome = a.outcome.value if a.outcome is not None else None
    line = (f"last deploy #{a.id} {outcome}" if outcome is not None
            else f"deploy #{a.id} queued" if a.step is AttemptStep.queued
            else f"deploying #{a.id}")
    if a.resumed_from is not None:
        line += f" (resumed from #{a.resumed_from})"
    if outcome not in (None, Outcome.done.value) and a.reason:
        line += f": {a.reason}"
    return {"last_attempt": {"id": a.id, "step": a.step.value, "outcome": outcome,
                             "cause": a.cause.value, "resumed_from": a.resumed_from,
                             "reason": a.reason}, "deploy": line}


def _probe_status(h: Host, gen: Generation | None) -> dict[str, Any]:
    """An instance under the ongoing probe: its failures in a row, since when unhealthy."""
    if h.health_interval is None:
        return {}
    out: dict[str, Any] = {"health_interval": h.health_interval,
                           "unhealthy_after": h.unhealthy_after}
    if gen is not None:
        out["health_failures"] = gen.health_failures
        out["unhealthy_since"] = (gen.unhealthy_since.isoformat() + "Z"
                                  if gen.unhealthy_since else None)
    return out


def _listen_status(s: Session, h: Host) -> dict[str, Any]:
    """A host on shared listeners: each one, and what became of one that was lost (it is
    bound again at the host's next start; then it says it was reopened, and why)."""
    rows = stored(s, h.name)
    if not rows:
        return {}
    return {"ready": h.ready or "http", "listeners": [
        {"name": r.name, "address": r.address, "state": r.state.value, "inode": r.inode,
         "reopened": r.state is ListenerState.held and reopened(r), "note": note(r)}
        for r in rows]}


def _worker_status(s: Session, h: Host, gen: Generation | None) -> dict[str, Any]:
    """A host's restart state (its streak of quick exits, when the next start is due); a
    worker's build, and why it is not running when a start failed or was refused."""
    out: dict[str, Any] = {"restart_streak": h.restart_streak}
    w = s.execute(select(Wake).where(Wake.host == h.name).order_by(Wake.id.desc()).limit(1)
                  ).scalar_one_or_none()
    if w is not None and w.state in OPEN_WAKE and w.cause == "restart":
        out["restart_at"] = w.next_attempt_at.isoformat() + "Z"
    if w is not None and w.state is WakeState.queued and w.waiting_on:
        out["waiting_on"] = w.waiting_on.split(", ")  # the hosts it starts after, not ready
    if gen is None and w is not None and w.state is WakeState.failed:
        out["problem"] = w.reason  # e.g. its env file has a bad line: named with file:line
    if h.kind is not HostKind.worker:
        return out
    out.update({"one_shot": h.one_shot, "live_build_id": h.build_id,
                "build_id": gen.build_id if gen else None,
                "drift_since": (h.drift_since.isoformat() + "Z") if h.drift_since else None})
    return out
