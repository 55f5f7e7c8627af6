"""`vigil restart`: the operator's restart of a host, one short transaction.

A host that runs is moved onto the very build it runs now by a deploy attempt with cause
`restart` (overlap for an instance unless `--mode hold`; a worker is always stopped, then
started). A host that does not run is woken, as `systemctl restart` starts a stopped unit.
Refused, with nothing written, while the host is being stopped or an attempt is in flight
(a restart would supersede it: the operator should see that one end first)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from models.errors import Refused, present
from models.states import Cause, GenState, Mode
from models.tables import Build, Generation
from workflows.base.lookups import get_host, open_attempt, open_stop
from workflows.deploys.request import request_deploy
from workflows.lifecycle.scale import refuse_while_scaling
from workflows.lifecycle.wake import request_wake


def request_restart_now(s: Session, host: str, mode: Mode) -> dict[str, Any]:
    """{"attempt": id} for a host that runs, {"wake": id, "state": ...} for one that does not."""
    get_host(s, host)
    refuse_while_scaling(s, host, "restarted")
    stopping = open_stop(s, host)
    if stopping is not None:
        raise Refused(f"host {host} is being stopped (stop #{stopping})",
                      f"wait for the stop (`vigil stop {host} --wait`), then `vigil wake {host}`")
    busy = open_attempt(s, host)
    if busy is not None:
        raise Refused(f"host {host} is deploying (attempt #{busy}): a restart would supersede it",
                      f"let it end (`vigil events {host}`), then restart again")
    build_id = s.execute(select(Generation.build_id).where(
        Generation.host == host, Generation.state == GenState.current)).scalar()
    if build_id is None:
        w = request_wake(s, host)  # a plain wake: cause "restart" is a crash restart's
        return {"wake": w.id, "state": w.state}
    build = present(s.get(Build, build_id),
                    f"the build of host {host}'s current generation is missing")
    a = request_deploy(s, host, build, mode=mode, canary=False, cause=Cause.restart)
    return {"attempt": a.id, "mode": a.effective_mode.value}
