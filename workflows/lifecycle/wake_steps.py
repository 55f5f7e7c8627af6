"""The wake's commits after the spawn (workflows/lifecycle/wake.py, wake_group.py): the pid
recorded, the generation current, the wake done; each move guarded by its expected state
and the start's lease fence."""

from __future__ import annotations

from sqlalchemy.orm import Session

from models.states import GenState, HostKind, WakeState
from models.store import emit, utcnow
from models.tables import Build, Generation, Host, Wake
from models.transition import Fence, move
from workflows.base.ports import Spawned
from workflows.generations.create import record
from workflows.lifecycle.order import wake_waiters


def recorded(s: Session, w: Wake, gen: Generation, spawned: Spawned, ours: Fence) -> None:
    record(s, gen, spawned, ours)
    move(s, Wake, w.id,
         {"state": WakeState.checking}, f"wake #{w.id} spawning -> checking",
         fence=ours, col="state", frm=WakeState.spawning)


def current(s: Session, w: Wake, gen: Generation, build: Build, spawned: Spawned,
            ours: Fence) -> None:
    move(s, Generation, gen.id,
         {"state": GenState.current, "current_at": utcnow()},
         f"generation g{gen.id} running -> current", fence=ours, col="state",
         frm=GenState.running)
    move(s, Wake, w.id,
         {"state": WakeState.done, "ended_at": utcnow()},
         f"wake #{w.id} checking -> done", fence=ours, col="state",
         frm=WakeState.checking)
    emit(s, "woke", w.host, gen.id, pid=spawned.pid, build=build.digest[:12])
    wake_waiters(s)


def recorded_current(s: Session, w: Wake, gen: Generation, build: Build, spawned: Spawned,
                     ours: Fence) -> None:
    """A worker has no health check: its pid and its being current go in one commit, one
    move each for the generation and the wake. The caller wakes the waiters (wake_waiters),
    once per commit however many wakes it holds."""
    move(s, Generation, gen.id,
         {"state": GenState.current, "pid": spawned.pid, "create_time": spawned.create_time,
          "current_at": utcnow()},
         f"generation g{gen.id} spawning -> current", fence=ours, col="state",
         frm=GenState.spawning)
    move(s, Wake, w.id, {"state": WakeState.done, "ended_at": utcnow()},
         f"wake #{w.id} spawning -> done", fence=ours, col="state", frm=WakeState.spawning)
    emit(s, "woke", w.host, gen.id, pid=spawned.pid, build=build.digest[:12])


def always_on(host: Host, gen: Generation) -> bool:
    """A worker that is not a one-shot: nothing to check beyond its leader being alive."""
    return host.kind is HostKind.worker and not host.one_shot
