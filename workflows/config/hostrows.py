"""`vigil status`'s rows and each host's one-word state, read for many hosts at once.

`Facts` reads what the rows need for the hosts named (or all) in a fixed number of grouped
queries, whatever the number of hosts: one host costs as many queries as a thousand (a
status at 1,000 hosts once ran 14 queries a host; the status page asked it every 2 s).
The rows and the state are then pure functions of those facts, so `vigil status`, `top`,
the page, `show` and the metrics all say the same thing of a host."""

from __future__ import annotations

import json
import os
from collections import defaultdict
from typing import Any

from sqlalchemy import func, select, true
from sqlalchemy.orm import Session

from models.durations import iso
from models.errors import NotFound
from models.states import (
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
from models.store import utcnow
from models.streaks import failed_slots, streaks
from models.tables import Attempt, Build, Event, Generation, Host, Lease, Listener, Stop, Wake
from workflows.config.jobview import JobFacts, enabled, job_status
from workflows.generations.listeners import note, reopened
from workflows.generations.shutdown import closed
from workflows.lifecycle.jobs import is_job, kind_of
from workflows.lifecycle.restarts import crashloop


class Facts:
    """What the rows and states of `names` (None: every host) are made of, read at once."""

    def __init__(self, s: Session, names: list[str] | None = None) -> None:
        def of(col: Any) -> Any:  # the hosts asked for: all, or those named
            return col.in_(names) if names is not None else true()

        self.now = utcnow()
        self.hosts = list(s.execute(select(Host).where(of(Host.name)).order_by(Host.name))
                          .scalars())
        self.open_wakes: dict[str, list[Wake]] = defaultdict(list)
        for w in s.execute(select(Wake).where(of(Wake.host), Wake.state.in_(OPEN_WAKE))).scalars():
            self.open_wakes[w.host].append(w)
        self.last_wake = self._newest(s, Wake, of(Wake.host))
        self.last_attempt = self._newest(s, Attempt, of(Attempt.host))
        self.last_ended = self._newest(s, Attempt, of(Attempt.host), Attempt.outcome.is_not(None))
        self.stopping = set(s.execute(select(Stop.host).where(
            of(Stop.host), Stop.state.in_(OPEN_STOP)).distinct()).scalars())
        self.deploying = set(s.execute(select(Attempt.host).where(
            of(Attempt.host), Attempt.outcome.is_(None), Attempt.step != AttemptStep.queued)
            .distinct()).scalars())
        self.live: dict[str, list[Generation]] = defaultdict(list)
        for g in s.execute(select(Generation).where(of(Generation.host),
                                                    Generation.state.in_(LIVE_GEN))
                           .order_by(Generation.slot, Generation.id)).scalars():
            self.live[g.host].append(g)
        self.leases = {x.host: x for x in s.execute(select(Lease).where(of(Lease.host))).scalars()}
        self.listeners: dict[str, list[Listener]] = defaultdict(list)
        for r in s.execute(select(Listener).where(of(Listener.host))
                           .order_by(Listener.host, Listener.position)).scalars():
            self.listeners[r.host].append(r)
        self.exits = self._exits(s, of(Event.host))
        self.streaks = streaks(s, names)
        self.failed = failed_slots(s, names)  # slots given up at their start limit
        ids = {g.build_id for gs in self.live.values() for g in gs} | {h.build_id for h in self.hosts}
        self.builds = {b.id: b for b in s.execute(select(Build).where(Build.id.in_(ids))).scalars()}
        self.jobs = JobFacts.read(s, self.hosts)  # the jobs' runs: next run, last result

    @staticmethod
    def _newest(s: Session, model: Any, *where: Any) -> dict[str, Any]:
        """Per host, its row of `model` with the highest id among those `where` holds."""
        newest = select(func.max(model.id)).where(*where).group_by(model.host).scalar_subquery()
        return {r.host: r for r in s.execute(select(model).where(model.id.in_(newest))).scalars()}

    @staticmethod
    def _exits(s: Session, asked: Any) -> dict[str, Event]:
        """Per host, its newest `exited` event with a status since the host was added."""
        newest = (select(func.max(Event.id)).join(Host, Host.name == Event.host)
                  .where(asked, Event.kind == "exited", Event.at >= Host.created_at,
                         Event.detail.contains('"status": '))
                  .group_by(Event.host).scalar_subquery())
        return {e.host: e for e in s.execute(select(Event).where(Event.id.in_(newest))).scalars()
                if e.host is not None}

    def currents(self, host: str) -> list[Generation]:
        return [g for g in self.live.get(host, []) if g.state is GenState.current]


def state_of(f: Facts, h: Host) -> str:
    """The host's one word, by the first that holds: an unproven start, a stop, a deploy,
    current (healthy or not; a job's run: running), a start in flight (waiting, in a crash
    loop), retiring, a job's schedule enabled (scheduled), or how its last deploy ended."""
    wakes, name = f.open_wakes.get(h.name, []), h.name
    if any(w.state is WakeState.unproven for w in wakes):
        return "unproven"
    if name in f.stopping:
        return "stopping"
    if name in f.deploying:
        return "deploying"
    currents = f.currents(name)
    if currents:
        if any(g.unhealthy_since is not None for g in currents):
            return "unhealthy"  # it runs, but has failed its probe --unhealthy-after times
        return "running" if is_job(h) else "awake"
    if not wakes and any(host == name for host, _ in f.failed):
        return "failed"  # its start limit was reached: nothing restarts it until asked
    if wakes:
        queued = [w for w in wakes if w.state is WakeState.queued]
        if any(w.waiting_on is not None for w in queued):
            return "waiting"  # on hosts it starts after (workflows/lifecycle/order.py)
        if crashloop(f.streaks.get((name, 0), 0), queued, f.now):
            return "crashloop"
        return "waking"
    if f.live.get(name):
        return "retiring"
    if enabled(h):
        return "scheduled"  # between runs: `next_run` says when
    last = f.last_ended.get(name)
    return "down" if last is not None and last.outcome is Outcome.down else "asleep"


def host_state(s: Session, name: str) -> str:
    return host_states(s, [name]).get(name, "asleep")  # removed meanwhile: nothing runs


def host_states(s: Session, names: list[str]) -> dict[str, str]:
    """The one word of each host named and stored, read at once (a file of 1,000 hosts
    read a host at a time cost 15 queries each)."""
    f = Facts(s, names)
    return {h.name: state_of(f, h) for h in f.hosts}


def status(s: Session, name: str | None = None) -> list[dict[str, Any]]:
    """`vigil status`'s row of the host named, or of every host."""
    f = Facts(s, [name] if name is not None else None)
    if name is not None and not f.hosts:
        raise NotFound(f"no host named {name!r}", "see `vigil host list`")
    return [row(f, h) for h in f.hosts]


def rows_of(s: Session, names: list[str]) -> list[dict[str, Any]]:
    """The rows of the hosts named, in the order given (one removed meanwhile left out)."""
    f = Facts(s, names)
    by_name = {h.name: h for h in f.hosts}
    return [row(f, by_name[n]) for n in names if n in by_name]


def row(f: Facts, h: Host) -> dict[str, Any]:
    currents = f.currents(h.name)
    gen = currents[0] if currents else None  # a host of instances: its lowest slot's
    build = f.builds.get(gen.build_id if gen else h.build_id)
    lease = f.leases.get(h.name)
    return {
        "host": h.name,
        "kind": kind_of(h),
        "state": state_of(f, h),
        "desired": h.desired.value,
        "generation": gen.id if gen else None,
        "pid": gen.pid if gen else None,
        "build_digest": build.digest if build else None,
        "build_file": os.path.basename(build.source) if build else None,
        "socket": gen.socket if gen else None,
        "since": iso(gen.current_at) if gen else None,
        "lease": {"holder": lease.holder, "fence": lease.fence} if lease else None,
        **_deploy_status(f.last_attempt.get(h.name)),
        **_probe_status(h, gen),
        **_listen_status(h, f.listeners.get(h.name, [])),
        "restart_streak": f.streaks.get((h.name, 0), 0),  # slot 0's
        **_worker_status(h, gen, f.last_wake.get(h.name)),
        **_exit_status(f.exits.get(h.name)),
        **instance_status(f, h, currents),
        **job_status(f.jobs, h, f.now),
    }


def instance_status(f: Facts, h: Host, currents: list[Generation]) -> dict[str, Any]:
    """A host of instances: each slot, with its current generation and pid (none: down),
    its own restart streak, and its word: up, crashloop, waking, or down."""
    if h.instances == 1 and all(g.slot == 0 for g in currents):
        return {}
    by_slot = {g.slot: g for g in currents}
    wakes = f.open_wakes.get(h.name, [])

    def slot(n: int, g: Generation | None) -> dict[str, Any]:
        streak = f.streaks.get((h.name, n), 0)
        mine = [w for w in wakes if w.slot == n]
        word = "up" if g is not None else "crashloop" if crashloop(streak, mine, f.now) \
            else "waking" if mine else "failed" if (h.name, n) in f.failed else "down"
        return {"slot": n, "state": word, "generation": g.id if g else None,
                "pid": g.pid if g else None, "build_id": g.build_id if g else None,
                "since": iso(g.current_at) if g else None, "restart_streak": streak}

    return {"instances": h.instances, "slots": [
        slot(n, by_slot.get(n)) for n in sorted(set(range(h.instances)) | set(by_slot))]}


def _exit_status(e: Event | None) -> dict[str, Any]:
    """How the host's last leader to end by itself ended (`exited 3`, `killed by SIGKILL`),
    and when."""
    if e is None:
        return {}
    return {"last_exit": {"status": json.loads(e.detail)["status"], "generation": e.generation_id,
                          "at": iso(e.at)}}


def _deploy_status(a: Attempt | None) -> dict[str, Any]:
    """The host's newest attempt and the line that says where it is: `deploying #12
    (resumed from #11)`, `last deploy #12 done`, or why it ended otherwise."""
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
        out["unhealthy_since"] = iso(gen.unhealthy_since)
    return out


def _listen_status(h: Host, rows: list[Listener]) -> dict[str, Any]:
    """A host on shared listeners: each one, and what became of one that was lost (it is
    bound again at the host's next start; then it says it was reopened, and why)."""
    if not rows:
        return {}
    return {"ready": h.ready or "http", "listeners": [
        {"name": r.name, "address": r.address, "state": r.state.value, "inode": r.inode,
         "reopened": r.state is ListenerState.held and reopened(r), "closed": closed(r),
         "note": note(r)}
        for r in rows]}


def _worker_status(h: Host, gen: Generation | None, w: Wake | None) -> dict[str, Any]:
    """When a host's next restart is due; a worker's build, and why it is not running when
    a start failed or was refused."""
    out: dict[str, Any] = {}
    if w is not None and w.state in OPEN_WAKE and w.cause == "restart":
        out["restart_at"] = iso(w.next_attempt_at)
    if w is not None and w.state is WakeState.queued and w.waiting_on:
        out["waiting_on"] = w.waiting_on.split(", ")  # the hosts it starts after, not ready
    if gen is None and w is not None and w.state is WakeState.failed:
        out["problem"] = w.reason  # e.g. its env file has a bad line: named with file:line
    if h.kind is not HostKind.worker:
        return out
    out.update({"one_shot": h.one_shot, "live_build_id": h.build_id,
                "build_id": gen.build_id if gen else None,
                "drift_since": iso(h.drift_since)})
    return out
