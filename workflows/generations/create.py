"""A generation's row and its exec, for a wake and a deploy's successor alike (their one
start is workflows/lifecycle/start.py): the row first (write-ahead of the exec), then the
spawn from the host's spec; and a generation's member row."""

from __future__ import annotations

import json
import os
import uuid as uuidlib
from datetime import UTC

from sqlalchemy import insert, select
from sqlalchemy.orm import Session

from models.statedir import private_dirs
from models.states import GenState, HostKind, MemberRole
from models.store import utcnow
from models.tables import Build, Generation, Host, JobRun, Listener, Member, Watchdog
from models.transition import Unfenced, move
from workflows.base.context import Context
from workflows.base.ports import Spawned, SpawnError, SpawnSpec
from workflows.generations.access import prepare_socket_dir
from workflows.generations.listeners import fds_for
from workflows.generations.readiness import mode, own_socket

_G = Generation.__table__
LIMITS = ("memory_max", "cpu_quota", "pids_max", "limit_nofile", "limit_core")  # host columns
_NEW = insert(_G).returning(_G.c.id)  # built once: an ORM add cost a unit-of-work flush
_NEW_WATCHDOG = insert(Watchdog.__table__)
NEW_ROW = Unfenced("the row is written in this same commit: nothing else can know it yet")


def intend(s: Session, ctx: Context, host: Host, build_id: int, fence: int | None, *,
           slot: int = 0) -> Generation:
    """The generation row, `spawning`, in the caller's transaction: its containment chosen
    and (an instance) its socket named before anything of it runs. Returns a copy of the
    row as written."""
    gen_uuid = str(uuidlib.uuid4())
    row = dict(uuid=gen_uuid, host=host.name, build_id=build_id, state=GenState.spawning,
               fence=fence, cgroup=ctx.proc.containment_for(gen_uuid), agent_id=ctx.agent_id,
               created_at=utcnow(), run_user=host.run_user, slot=slot)
    gid = s.execute(_NEW, row).scalar_one()
    socket = None
    if own_socket(host):  # named after the row's id
        socket = ctx.socket_for(host.name, gid)
        move(s, Generation, {"id": gid}, {"socket": socket}, f"generation g{gid} socket",
             fence=NEW_ROW)
    if host.watchdog:  # armed once it runs (workflows/lifecycle/watchdog.py)
        s.execute(_NEW_WATCHDOG, {"generation_id": gid, "host": host.name,
                                  "period": float(host.watchdog), "deadline": None})
    return Generation(id=gid, socket=socket, **row)


def launch(ctx: Context, host: Host, build: Build, gen: Generation,
           listeners: list[Listener] | None = None) -> Spawned:
    """Exec the build as `gen`: args, env and cwd from the host, output to its log, inside
    the containment the row names. Raises SpawnError when it did not start, whatever the
    port raised: a start that raises anything else would be retried forever, a new
    generation row each time. `listeners`: the host's rows, when the caller read them in
    the spawn's own intent (one transaction fewer before the exec)."""
    try:
        private_dirs(os.path.dirname(ctx.log_for(host.name, gen.id)))
        claim = ctx.claim_for(gen.uuid) if _is_run(host) else None  # its execution evidence
        if claim is not None:
            private_dirs(os.path.dirname(claim))
        if gen.socket:
            prepare_socket_dir(ctx, host, gen.socket)
        fds, names = (fds_for(ctx, host, gen.fence, listeners) if host.kind is HostKind.instance
                      else ((), ()))
        notify = None
        if (host.kind is HostKind.instance and mode(host) == "notify") or host.watchdog:
            if ctx.ready is None:
                raise SpawnError("this process cannot receive READY=1", build_fault=False)
            notify = ctx.notify_for(host.name, gen.id)
            prepare_socket_dir(ctx, host, notify)
            ctx.ready.open_notify(gen.uuid, notify, host.name, gen.id)
        spec = SpawnSpec(generation_uuid=gen.uuid, host=host.name,
                         argv=[build.path, *json.loads(host.args)],
                         env=_env(ctx, host, gen),
                         cwd=host.cwd, socket_path=gen.socket, log_path=ctx.log_for(host.name, gen.id),
                         cgroup=gen.cgroup, listen_fds=fds, listen_names=names,
                         notify_socket=notify, user=host.run_user, group=host.run_group,
                         env_files=tuple(json.loads(host.env_files or "[]")),
                         limits={k: v for k in LIMITS if (v := getattr(host, k)) is not None},
                         credentials=tuple(json.loads(host.credentials or "{}").items()),
                         memory_tier_mb=host.memory_tier_mb,
                         watchdog_usec=int(host.watchdog * 1e6) if host.watchdog else None,
                         exec_claim=claim)
        return ctx.proc.spawn(spec)
    except ValueError as exc:  # the host's args or env: no retry can succeed
        raise SpawnError(f"spawn {build.path}: {exc}") from exc
    except OSError as exc:  # the box's fault (log dir, fork), never the build's
        raise SpawnError(f"spawn {build.path}: {exc}", build_fault=False) from exc


def _is_run(host: Host) -> bool:
    """A job's host: its generations are runs (workflows/lifecycle/jobs.py is_job)."""
    return host.every is not None or host.schedule is not None


def _env(ctx: Context, host: Host, gen: Generation) -> dict[str, str]:
    """The host's environment; a job's run also gets its scheduled instant (ISO 8601, UTC),
    read from the run's row, which names this generation (workflows/lifecycle/jobs.py)."""
    env: dict[str, str] = json.loads(host.env)
    if _is_run(host):
        at = ctx.store.read(lambda s: s.execute(select(JobRun.scheduled_at).where(
            JobRun.generation_id == gen.id)).scalar())
        if at is not None:
            env["VIGIL_SCHEDULED_AT"] = at.replace(tzinfo=UTC).isoformat()
    return env


_NEW_MEMBER = insert(Member.__table__)  # built once, as _NEW


def join_set(s: Session, gen_id: int, host: str, role: MemberRole, fence: int, *,
             attempt_id: int | None = None, unproven: bool = False) -> None:
    """In the caller's transaction: the generation is a member of its host's operation set
    (due at once) until its termination is proven."""
    now = utcnow()
    s.execute(_NEW_MEMBER, {"generation_id": gen_id, "host": host, "role": role,
                            "attempt_id": attempt_id, "fence": fence, "unproven": unproven,
                            "since": now, "next_attempt_at": now})
