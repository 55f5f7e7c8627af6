"""`running = true|false` in a hosts file: the state `vigil apply` wakes or stops a host to
(after its settings are applied, each in a transaction of its own). Left out, apply leaves
the host as it is, as before: a new host is added asleep.

`true` wakes a host that does not run (asleep, down, being stopped); `false` stops one that
runs or is starting. A host whose failed wake is not proven gone is refused as `vigil wake`
refuses it. The plan and its application are the same function, so a dry run shows what
the run will do."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from sqlalchemy import select
from sqlalchemy.orm import Session

from models.states import Desired
from models.tables import Host
from workflows.config.apply import Change
from workflows.config.hostrows import host_state, host_states
from workflows.lifecycle.order import stop_refusal
from workflows.lifecycle.stop import request_stop
from workflows.lifecycle.wake import refuse_if_unproven, request_wake

WAKE_FROM = ("asleep", "down", "stopping")
STOP_FROM = ("awake", "unhealthy", "waking", "waiting", "crashloop", "deploying", "retiring", "unproven",
             "running", "scheduled")  # a job's run in flight, its schedule enabled


@dataclass(frozen=True)
class FileOrder:
    """The start order a hosts file sets, and the hosts it wakes and stops: a stop of a
    host that a host left up starts after is refused before anything is written."""

    graph: Mapping[str, list[str]] = field(default_factory=dict)
    waking: frozenset[str] = frozenset()
    stopping: frozenset[str] = frozenset()

    def refuse_stop(self, s: Session, name: str) -> None:
        named = [h for h, after in self.graph.items() if name in after and h not in self.stopping]
        up = set(s.execute(select(Host.name).where(Host.name.in_(named),
                                                   Host.desired == Desired.up)).scalars())
        left_up = sorted(h for h in named if h in up or h in self.waking)
        if left_up:
            raise stop_refusal(name, left_up, fix="add running = false to them too, or keep "
                               f"{name} running")


def run_change(s: Session, name: str, running: bool, order: FileOrder | None = None,
               state: str | None = None) -> Change | None:
    """What `running` asks of the host now: a wake, a stop, or nothing (reads only).
    A host not stored yet is one this apply adds: asleep. `state`: the host's, read by
    the caller for many hosts at once."""
    if state is None:
        state = host_state(s, name) if s.get(Host, name) is not None else "asleep"
    if running and state == "unproven":
        refuse_if_unproven(s, name)
    if running and state in WAKE_FROM:
        return Change("wake", name, note="running = true")
    if not running and state in STOP_FROM:
        if order is not None:
            order.refuse_stop(s, name)
        return Change("stop", name, note="running = false")
    return None


def check_running(s: Session, running: dict[str, bool], order: FileOrder) -> None:
    """Each `running` a file asks for can be done now (reads only; raises the first
    refusal): the hosts' states read at once."""
    states = host_states(s, list(running))
    for name, up in running.items():
        run_change(s, name, up, order, states.get(name, "asleep"))


def apply_running(s: Session, name: str, running: bool) -> Change | None:
    """The same change, written: the wake or stop row (one transaction)."""
    change = run_change(s, name, running)
    if change is None:
        return None
    if change.action == "wake":
        req = request_wake(s, name, cause="apply")
        if req.id is not None:
            change.note += f"; wake #{req.id}"
    else:
        change.note += f"; stop #{request_stop(s, name).id}"
    return change
