"""`running = true|false` in a hosts file: the state `vigil apply` wakes or stops a host to
(after its settings are applied, each in a transaction of its own). Left out, apply leaves
the host as it is, as before: a new host is added asleep.

`true` wakes a host that does not run (asleep, down, being stopped); `false` stops one that
runs or is starting. A host whose failed wake is not proven gone is refused as `vigil wake`
refuses it. The plan and its application are the same function, so a dry run shows what
the run will do."""

from __future__ import annotations

from sqlalchemy.orm import Session

from models.tables import Host
from workflows.config.apply import Change
from workflows.config.hosts import host_state
from workflows.lifecycle.stop import request_stop
from workflows.lifecycle.wake import refuse_if_unproven, request_wake

WAKE_FROM = ("asleep", "down", "stopping")
STOP_FROM = ("awake", "unhealthy", "waking", "crashloop", "deploying", "retiring", "unproven")


def run_change(s: Session, name: str, running: bool) -> Change | None:
    """What `running` asks of the host now: a wake, a stop, or nothing (reads only).
    A host not stored yet is one this apply adds: asleep."""
    state = host_state(s, name) if s.get(Host, name) is not None else "asleep"
    if running and state == "unproven":
        refuse_if_unproven(s, name)
    if running and state in WAKE_FROM:
        return Change("wake", name, note="running = true")
    if not running and state in STOP_FROM:
        return Change("stop", name, note="running = false")
    return None


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
