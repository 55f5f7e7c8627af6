"""How a generation says it is ready, by the host's `ready` setting (the grammar:
workflows/generations/probes.py):

- http (the default without a shared listener): `GET /` on the generation's own
  `$VIGIL_SOCKET` answers below 500; http:PATH: `GET PATH` there answers 2xx/3xx;
- tcp: a connect to its own `$VIGIL_SOCKET` is accepted;
- notify (the default with one): `READY=1` arrives on the generation's own `$NOTIFY_SOCKET`
  from one of its processes (`STOPPING=1` and `STATUS=` lines become events);
- exec:CMD: CMD, run with the generation's environment as the app's user, inside its
  containment, exits 0.

Never a request through a shared listener: the old generation may be the one answering.
Each is bounded by the host's health timeout and ends early when the leader exits."""

from __future__ import annotations

import json
from collections.abc import Callable

from models.states import HostKind
from models.tables import Generation, Host
from workflows.base.context import Context
from workflows.base.ports import SpawnSpec
from workflows.generations.ending import ref_of
from workflows.generations.known import note
from workflows.generations.probes import NOTIFY, OWN_SOCKET, TCP, probe_of

ADOPT_BOUND = 5.0  # seconds each adoption on start may take to answer
WATCH_EVERY = 0.5  # seconds between two calls of a wait's watch (one store read each)
Watch = Callable[[], None]  # raises to end a readiness wait early


def mode(host: Host) -> str:
    """http, tcp, notify or exec."""
    return probe_of(host.ready).kind


def own_socket(host: Host) -> bool:
    """An instance gets its own $VIGIL_SOCKET (and canonical link) unless it is on a
    shared listener and signals readiness some other way."""
    return host.kind is HostKind.instance and mode(host) in OWN_SOCKET


def probe_spec(host: Host, gen: Generation, command: str) -> SpawnSpec:
    return command_spec(command, host=host.name, uuid=gen.uuid, env_json=host.env,
                        env_files_json=host.env_files, cwd=host.cwd, user=host.run_user,
                        group=host.run_group, pid=gen.pid, socket=gen.socket, cgroup=gen.cgroup)


def command_spec(command: str, *, host: str, uuid: str, env_json: str,
                 env_files_json: str | None, cwd: str | None, user: str | None,
                 group: str | None, pid: int | None, socket: str | None,
                 cgroup: str | None) -> SpawnSpec:
    """A probe command's process: `/bin/sh -c CMD` with the host's env (its files read when
    it starts) and `VIGIL_PID`, its leader, in the generation's containment (its cgroup and
    marker: the stop's drain and proof end a probe an agent left running), as its user."""
    env = {**json.loads(env_json), "VIGIL_PID": str(pid or "")}
    return SpawnSpec(generation_uuid=uuid, host=host, argv=["/bin/sh", "-c", command], env=env,
                     cwd=cwd, socket_path=socket, cgroup=cgroup, user=user, group=group,
                     env_files=tuple(json.loads(env_files_json or "[]")))


def ready_problem(ctx: Context, host: Host, gen: Generation, timeout: float | None = None, *,
                  walk: bool = True, watch: Watch | None = None) -> str | None:
    """None once the generation is ready, else why not (the build's own failure). Its
    leader's descendants are walked and recorded after the check, either way (`walk`
    False: the caller walks, e.g. an overlap deploy after its switch's commit). `watch`
    is called every WATCH_EVERY seconds of the wait; what it raises ends the wait (a
    deploy's gate: a stop or a newer attempt need not wait out the health timeout)."""
    try:
        return _ready_problem(ctx, host, gen, timeout, watch)
    finally:
        if walk:
            note(ctx, {gen.id: ref_of(gen)})


def _ready_problem(ctx: Context, host: Host, gen: Generation, timeout: float | None,
                   watch: Watch | None) -> str | None:
    ref = ref_of(gen)
    bound = host.health_timeout if timeout is None else timeout
    watched_at = [ctx.clock.now()]

    def alive() -> bool:
        if watch is not None and ctx.clock.now() - watched_at[0] >= WATCH_EVERY:
            watched_at[0] = ctx.clock.now()
            watch()
        return ctx.proc.leader_alive(ref)

    how = probe_of(host.ready)
    if how.kind in OWN_SOCKET:
        if not gen.socket:
            return f"generation g{gen.id} has no socket to probe"
        if how.kind == TCP:
            return ctx.health.reach(gen.socket, bound, alive=alive)
        if how.path is not None:
            return ctx.health.check(gen.socket, bound, alive=alive, path=how.path)
        return ctx.health.check(gen.socket, bound, alive=alive)
    if ctx.ready is None:
        return f"this process cannot check readiness by {how.kind}"
    if how.kind == NOTIFY:
        return ctx.ready.wait_notify(gen.uuid, bound, alive)
    return ctx.ready.run_probe(probe_spec(host, gen, how.command), bound, alive)


def adopt_problem(ctx: Context, host: Host, gen: Generation) -> str | None:
    """On start, for a current generation whose leader lives: may it be adopted? A notify
    one has said READY=1 already (it was made current on it): its socket is bound again for
    what it says next."""
    if host.watchdog and ctx.ready is not None and (
            host.kind is not HostKind.instance or mode(host) != "notify"):
        try:  # its watchdog's pings (a notify instance's socket is bound below)
            ctx.ready.open_notify(gen.uuid, ctx.notify_for(host.name, gen.id), host.name, gen.id)
        except OSError:
            pass  # no ping is heard: its watchdog fires a period on, and restarts it
    if host.kind is not HostKind.instance:
        return None
    if mode(host) == NOTIFY:
        if ctx.ready is not None:
            try:
                ctx.ready.open_notify(gen.uuid, ctx.notify_for(host.name, gen.id), host.name, gen.id)
            except OSError:
                pass  # readiness was proven; only its later STATUS lines are missed
        return None
    return ready_problem(ctx, host, gen, min(host.health_timeout, ADOPT_BOUND))
