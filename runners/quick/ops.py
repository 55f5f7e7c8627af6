"""The quick commands, implemented once. `vigil` calls these on the store itself when no
agent runs; a running agent calls the same functions for a client of its control socket
(runners/quick/control.py). Each takes the store (and the state dir where it stages builds),
returns plain JSON data (the same text either way: datetimes become strings), and raises
a VigilError carrying the line an operator reads."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from sqlalchemy import func, select

from models.errors import BadInput, NotFound, Refused
from models.states import Cause, HostKind, ListenerState, Mode, Outcome
from models.store import Store
from models.streaks import failed_slots
from models.tables import Attempt, Event, Generation, Host, Listener, Release, Stop, Wake
from runners.backend.files import stage_build
from runners.quick import client
from workflows.config.hostrows import status as host_rows
from workflows.config.hosts import record_build
from workflows.deploys.request import last_failed, no_longer_staged, request_deploy
from workflows.lifecycle.order import dependents_first, in_order, stored_graph
from workflows.lifecycle.scale import refuse_while_scaling
from workflows.lifecycle.stop import request_stop
from workflows.lifecycle.wake import request_wake

OBLIGATION_COLUMNS = ("kind", "host", "generation", "since", "attempts", "next_attempt_at",
                      "last_error")


def plain(data: Any) -> Any:
    """What a client of the control socket receives: JSON, datetimes as text."""
    return json.loads(json.dumps(data, default=str))


# -- intents --------------------------------------------------------------------------------

def refuse_unbindable(store: Store, name: str) -> None:
    """A lost listener is bound again at the host's next start; only one whose address
    cannot be bound now (taken by another process, no right to it) refuses, naming what
    holds it. Nothing else has the socket of a lost row, this agent included."""
    from runners.backend.listen import probe_address

    lost = store.read(lambda s: list(s.execute(select(Listener.address).where(
        Listener.host == name, Listener.state == ListenerState.lost)).scalars()))
    for address in lost:
        problem = probe_address(address)
        if problem is not None:
            cause, _, fix = problem.rpartition("; ")
            raise Refused(f"host {name}: its lost listener cannot be bound again: {cause}", fix)


def wake(store: Store, name: str) -> dict[str, Any]:
    refuse_unbindable(store, name)
    req = store.write(lambda s: request_wake(s, name))
    return {"id": req.id, "state": req.state}


def stop(store: Store, name: str, force: bool = False) -> dict[str, Any]:
    req = store.write(lambda s: request_stop(s, name, force))
    return {"id": req.id, "state": req.state}


def restart(store: Store, name: str, mode: str = "overlap") -> dict[str, Any]:
    from workflows.deploys.restart import request_restart_now

    refuse_unbindable(store, name)
    return store.write(lambda s: request_restart_now(s, name, Mode(mode)))


def deploy(store: Store, state_dir: Path, name: str, build_path: str, *, cwd: str,
           mode: str = "overlap", canary: bool = False, cause: str = "release",
           converge: bool = False) -> dict[str, Any]:
    """An attempt row for BUILD (staged first), or with `converge` only the worker's live
    build. `build_path` is as the operator typed it, relative to `cwd` (the client's)."""
    shown = build_path
    build_path = os.path.join(cwd, build_path)
    h = store.read(lambda s: s.get(Host, name))
    if h is None:
        raise NotFound(f"no host named {name!r}", "see `vigil host list`")
    if converge or h.every is not None or h.schedule is not None:  # a job's: its next runs
        from workflows.lifecycle.workers import stage_live

        if h.kind is not HostKind.worker:
            raise BadInput(f"host {name} is an instance: only workers converge",
                           f"drop --converge: `vigil deploy {name} {shown}`")
        path, digest = stage_build(build_path, state_dir, shown)
        store.write(lambda s: stage_live(s, name, record_build(
            s, path, digest, str(Path(build_path).absolute()))))
        return {"converge": digest, "grace": h.converge_grace,
                "job": h.every is not None or h.schedule is not None}
    refuse_unbindable(store, name)
    store.read(lambda s: refuse_while_scaling(s, name))  # before staging: nothing changed
    path, digest = stage_build(build_path, state_dir, shown)

    def intent(s):  # type: ignore[no-untyped-def]
        refuse_while_scaling(s, name)
        build = record_build(s, path, digest, str(Path(build_path).absolute()))
        from workflows.builds.book import deploying_held

        a = request_deploy(s, name, build, mode=Mode(mode), canary=canary, cause=Cause(cause))
        return a.id, deploying_held(s, a)

    attempt_id, held_down = store.write(intent)
    # The failure book: an operator's deploy of a held-down build still runs, and says so.
    return {"attempt": attempt_id, "held_down": held_down}


def retry(store: Store, name: str) -> dict[str, Any]:
    """A host failed at its start limit is woken again (its failed slots cleared); else the
    host's last failed build is re-armed by a new attempt."""
    def woken(s):  # type: ignore[no-untyped-def]
        if not failed_slots(s, [name]):
            return None
        w = request_wake(s, name, "retry")
        return {"wake": w.id, "state": w.state}

    again = store.write(woken)
    if again is not None:
        return again

    def intent(s):  # type: ignore[no-untyped-def]
        build, failed = last_failed(s, name)
        refuse_while_scaling(s, name, "retried")
        if not os.path.exists(build.path):  # removed behind the store's back
            raise no_longer_staged(name, build)
        from workflows.builds.book import lift

        lift(s, name, build.id, "vigil retry")  # the failure book lets it back on the host
        return request_deploy(s, name, build, mode=failed.mode, canary=failed.canary,
                              cause=Cause.retry).id

    return {"attempt": store.write(intent)}


# -- reads ------------------------------------------------------------------------------------

def status(store: Store, name: str | None = None) -> list[dict[str, Any]]:
    return plain(store.read(lambda s: host_rows(s, name)))


def names(store: Store) -> list[str]:
    """Every host's name, sorted: what a glob or --all of a command is matched against."""
    return list(store.read(lambda s: s.execute(select(Host.name).order_by(Host.name))
                           .scalars().all()))


def obligations(store: Store) -> list[dict[str, Any]]:
    with store.reading() as conn:
        rows = [dict(zip(OBLIGATION_COLUMNS, r, strict=True)) for r in conn.exec_driver_sql(
            f"SELECT {', '.join(OBLIGATION_COLUMNS)} FROM pending_obligations ORDER BY since")]
    return plain(rows)


def last_event(store: Store) -> int:
    """The newest event's id (0: none): where a --wait starts looking for its events."""
    return int(store.read(lambda s: s.execute(select(func.coalesce(func.max(Event.id), 0)))
                          .scalar_one()))


def row_progress(store: Store, kind: str, row_id: int) -> dict[str, Any]:
    """Where a wake or stop row is, whether its host still owes a lease release, what a
    queued wake waits on, and once a wake is done the pid of the generation it started."""
    model = {"wake": Wake, "stop": Stop}[kind]

    def read(s):  # type: ignore[no-untyped-def]
        row = s.get(model, row_id)
        owed = s.execute(select(Release.id).where(Release.host == row.host)).first() is not None
        out = {"id": row.id, "host": row.host, "state": row.state.value, "reason": row.reason,
               "last_error": row.last_error, "release_owed": owed}
        if kind == "wake":  # the hosts of its start order it waits on (None: it does not)
            out["waiting_on"] = row.waiting_on
        if kind == "wake" and row.generation_id is not None:
            g = s.get(Generation, row.generation_id)
            out.update(generation=g.id, pid=g.pid)
        return out

    return store.read(read)


def attempt_progress(store: Store, attempt_id: int, after_event: int) -> dict[str, Any]:
    """An attempt's step and outcome, followed through each abandoned one to the attempt that
    resumed it (a --wait across an agent restart reports the request's end). `resumed`: the
    attempts passed, oldest first, with why each ended. `switched`: a `switched` event of its
    host came after `after_event` (a fast attempt passes that step between two polls)."""
    def read(s):  # type: ignore[no-untyped-def]
        a = s.get(Attempt, attempt_id)
        passed = []
        # The abandonment and the new attempt are one commit: seeing one shows the other.
        while a.outcome is Outcome.abandoned:
            nxt = s.execute(select(Attempt).where(Attempt.resumed_from == a.id)).scalar()
            if nxt is None:
                break
            passed.append({"id": a.id, "reason": a.reason})
            a = nxt
        out = {"id": a.id, "host": a.host, "step": a.step.value,
               "outcome": a.outcome.value if a.outcome is not None else None,
               "effective_mode": a.effective_mode.value, "executed": a.executed,
               "drain_seconds": a.drain_seconds, "reason": a.reason, "last_error": a.last_error,
               "resumed": passed, "switched": False}
        if a.step.value in ("drained", "ended"):
            out["switched"] = s.execute(select(Event.id).where(
                Event.id > after_event, Event.host == a.host,
                Event.kind == "switched")).first() is not None
        return out

    return store.read(read)


# -- the agent ----------------------------------------------------------------------------------

def agent_acting(store: Store, state_dir: Path) -> bool:
    """Whether an agent will act on new intents: this state dir's agent holds its lock, or
    (several boxes on PostgreSQL) some box's agent beat its heartbeat in the last 10 s."""
    from runners.base.doorbell import running_agent_pid

    if running_agent_pid(state_dir) is not None:
        return True
    if store.dialect != "postgresql":
        return False
    from datetime import timedelta

    from models.store import utcnow
    from models.tables import Agent

    recent = utcnow() - timedelta(seconds=10)
    return store.read(lambda s: s.execute(select(Agent.id).where(
        Agent.stopped_at.is_(None), Agent.heartbeat_at >= recent)).first()) is not None


def open_obligations(store: Store) -> int:
    with store.reading() as conn:
        return conn.exec_driver_sql("SELECT count(*) FROM pending_obligations").scalar_one()


def agent_info(store: Store, state_dir: Path, live: dict[str, Any] | None = None) -> dict[str, Any]:
    """`vigil agent status`: what the lock, the agent-id file and the agents row say, or
    (`live`, from the running agent itself) what the agent says of itself."""
    from models.tables import Agent
    from runners.base.doorbell import box_of, running_agent_pid

    box = box_of(state_dir)
    row = store.read(lambda s: s.get(Agent, box)) if box else None
    pid = running_agent_pid(state_dir)
    info = {"running": pid is not None, "pid": pid, "box": box, "state_dir": str(state_dir),
            "version": None, "up_since": None, "last_round": None,
            "stopped_at": None, "open_obligations": open_obligations(store)}
    if row is not None:
        info["stopped_at"] = row.stopped_at.isoformat() + "Z" if row.stopped_at else None
        if pid is not None and row.pid == pid and row.started_at is not None:
            info["up_since"] = row.started_at.isoformat() + "Z"
    if live:
        info.update(live)
    return info


# -- one table for both paths ------------------------------------------------------------------

INTENTS = client.INTENTS  # rows the agent must act on: ring it


def run(store: Store, state_dir: Path, op: str, args: dict[str, Any]) -> Any:
    """Run one quick command by name (the control socket's request, or the CLI's own)."""
    if op == "wake":
        return wake(store, args["name"])
    if op == "stop":
        return stop(store, args["name"], bool(args.get("force")))
    if op == "deploy":
        return deploy(store, state_dir, args["name"], args["build"], cwd=args["cwd"],
                      mode=args.get("mode", "overlap"), canary=bool(args.get("canary")),
                      cause=args.get("cause", "release"), converge=bool(args.get("converge")))
    if op == "retry":
        return retry(store, args["name"])
    if op == "restart":
        return restart(store, args["name"], args.get("mode", "overlap"))
    if op == "status":
        return status(store, args.get("name"))
    if op == "obligations":
        return obligations(store)
    if op == "names":
        return names(store)
    if op == "order":
        given = [n for n in args["names"] if isinstance(n, str)]
        sort = dependents_first if args.get("stop") else in_order
        return store.read(lambda s: sort(given, stored_graph(s)))
    if op == "last_event":
        return last_event(store)
    if op == "progress":
        if args["kind"] == "attempt":
            return attempt_progress(store, int(args["id"]), int(args.get("after", 0)))
        return row_progress(store, args["kind"], int(args["id"]))
    if op == "agent":
        return agent_info(store, state_dir)
    raise BadInput(f"unknown request {op!r}", "use a vigil of the agent's version")
