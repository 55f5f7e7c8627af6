"""Host definitions: adding, checking and removing a host."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from models.durations import check_seconds
from models.errors import BadInput, Refused
from models.states import HostKind
from models.store import emit, utcnow
from models.tables import Build, Host, Lease, Listener
from models.transition import move
from workflows.base.lookups import get_host
from workflows.base.paths import CONTROL
from workflows.base.waivers import OPERATOR
from workflows.generations.listeners import Listen, check_set, stored, write_set
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
        move(s, Build, {"id": b.id}, {"deleted_at": None}, f"build {b.id} staged again",
             fence=OPERATOR)
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
             on_store_loss: str = FENCE, instances: int = 1,
             job: dict[str, Any] | None = None) -> None:
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
    if job:  # its schedule (checked by workflows/lifecycle/jobs.py check_job); never a one-shot
        if worker.get("one_shot"):
            raise BadInput("a job is not --one-shot: each of its runs is one", "drop --one-shot")
        worker = {**worker, **job}
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
    emit(s, "host_added", name, build=digest[:12], kind="job" if job else kind.value,
         **({"listen": [a.address for a in listens]} if listens else {}))


def remove_host(s: Session, name: str) -> list[Listener]:
    """Removes the host; returns its listeners (their sockets are closed after the commit)."""
    get_host(s, name)
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
