"""`vigil host show NAME`: every setting of one host as it is stored, the build it runs
(file name and digest) and the one its next start runs, its listeners, and its last attempt
with its outcome. A read, plain data; env values are left out (they may be secrets), as
`vigil apply` leaves them out of its plan, and env files and credentials are shown by path."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from models.states import GenState, HostKind
from models.store import utcnow
from models.tables import Attempt, Build, Generation
from workflows.base.lookups import get_host
from workflows.config.hostrows import host_state
from workflows.config.jobview import JobFacts, job_status
from workflows.generations.listeners import note, stored
from workflows.lifecycle.jobs import is_job, kind_of

SETTINGS = ("drain_timeout", "health_timeout", "memory_tier_mb", "socket_group",
            "restart_floor", "restart_cap", "restart_reset", "start_limit", "on_store_loss", "stop_signal",
            "stop_command")
PROBE = ("health_interval", "unhealthy_after", "unhealthy_restart", "health")
WORKER = ("one_shot", "max_run", "converge_grace")
LIMITS = ("memory_max", "cpu_quota", "pids_max", "limit_nofile", "limit_core")


def _build(b: Build | None) -> dict[str, Any] | None:
    if b is None:
        return None
    return {"file": Path(b.source).name, "digest": b.digest, "source": b.source,
            "staged": b.path}


def describe(s: Session, name: str) -> dict[str, Any]:
    h = get_host(s, name)
    gen = s.execute(select(Generation).where(Generation.host == name,
                                             Generation.state == GenState.current)
                    .order_by(Generation.slot).limit(1)).scalar()
    out: dict[str, Any] = {
        "host": name, "kind": kind_of(h), "state": host_state(s, name),
        "desired": h.desired.value,
        "build": _build(s.get(Build, h.build_id)),
        "running": _build(s.get(Build, gen.build_id)) if gen is not None else None,
        "generation": gen.id if gen else None, "pid": gen.pid if gen else None,
        "args": json.loads(h.args), "env": sorted(json.loads(h.env)), "cwd": h.cwd,
        "boxes": h.box.split(",") if h.box else [],
        "socket_mode": f"0{h.socket_mode:o}" if h.socket_mode is not None else None,
        "ready": h.ready or "http",
        "after": json.loads(h.start_after),  # the hosts its wake waits for, awake and ready
        "instances": h.instances,
    }
    out.update({c: getattr(h, c) for c in SETTINGS})
    out["watchdog"] = h.watchdog  # seconds between WATCHDOG=1 at most (None: no watchdog)
    if is_job(h):  # its schedule (workflows/lifecycle/jobs.py)
        out.update(every=h.every, schedule=h.schedule, timezone=h.timezone or "UTC")
        out["overlap"] = h.overlap  # a run due while the last runs (job_overlap.py)
        out.update(timeout=h.run_timeout, retries=h.run_retries)  # workflows/lifecycle/runpolicy.py
        out.update(catch_up=h.catch_up, catch_up_window=h.catch_up_window)  # catchup.py
        out.update(job_status(JobFacts.read(s, [h]), h, utcnow()))  # as `vigil status` says
    out.update(reload_signal=h.reload_signal, on_reload_fail=h.on_reload_fail)  # vigil reload
    # How it runs, under the hosts file's keys: paths and names only, never an env file's
    # values or a credential's contents (read at each start, never stored).
    out.update({"user": h.run_user, "group": h.run_group,
                "env_file": json.loads(h.env_files), "credentials": json.loads(h.credentials)})
    out.update({c: getattr(h, c)
                for c in LIMITS + (PROBE if h.kind is HostKind.instance else WORKER)})
    if h.kind is HostKind.instance:
        out["health"] = h.health or "http"  # NULL: GET / below 500, as `ready`'s
    out["listeners"] = [{"name": r.name, "address": r.address, "fd": 3 + r.position,
                         "state": r.state.value, "note": note(r)} for r in stored(s, name)]
    a = s.execute(select(Attempt).where(Attempt.host == name).order_by(Attempt.id.desc())
                  .limit(1)).scalar()
    out["last_attempt"] = None if a is None else {
        "id": a.id, "cause": a.cause.value, "mode": a.effective_mode.value,
        "step": a.step.value, "outcome": a.outcome.value if a.outcome else None,
        "reason": a.reason, "build": a.digest[:12],
        "at": a.created_at.isoformat(timespec="seconds") + "Z"}
    return out
