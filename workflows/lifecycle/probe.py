"""The ongoing health probe of an instance (`vigil host add --health-interval S`): once a
generation is current, `GET /` on its socket every S seconds, or what `--health` asks
(http:PATH, tcp, exec:CMD: workflows/generations/probes.py; a command is bounded by the
health timeout, at most the interval, and runs as the app's user). `--unhealthy-after N` failures
in a row make it unhealthy: an `unhealthy` event, `vigil status` says so, `vigil check`
fails and the metrics count it; one answer below 500 makes it healthy again (an event too).
With `--unhealthy-restart` an unhealthy generation is retired through the ordinary member
and wake obligations (the stop signal, drain, proof, then a restart with the host's backoff), as
an exited one is.

The failures in a row are kept on the generation row (a restarted agent goes on counting);
a probe that passes writes nothing unless it ends a run of failures. What is probed is read
in one query every REREAD seconds (sooner after a drive made progress), so an agent with
no probed host pays one cheap read every few seconds."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from models.durations import check_seconds
from models.errors import BadInput, LostRace
from models.states import GenState, HostKind
from models.store import emit, utcnow
from models.tables import Generation, Host, Lease
from models.transition import Unfenced, move
from workflows.base.context import Context
from workflows.base.ports import ProcRef, SpawnSpec
from workflows.generations.known import note
from workflows.generations.probes import EXEC, HEALTH_KINDS, TCP, Probe, parse_probe, probe_of
from workflows.generations.readiness import command_spec
from workflows.lifecycle.members import retire

REREAD = 5.0  # seconds between reads of what is probed
TICK = 0.5  # seconds between looks at which probes are due, while any host is probed
PROBE_TIMEOUT = 2.0  # one probe's bound (and at most the interval)
MAX_AFTER = 1000
# A probe's counters: written only while the generation is current (its state guards them).
PROBED = Unfenced("the generation's health counters, only while it is current")
PARALLEL = 8  # probes at once (a hung app costs its own timeout, not the others' turn)


def check_probe(kind: HostKind, interval: float | None, after: int | None,
                restart: bool, health: str | None = None) -> dict[str, Any]:
    """Validate `vigil host add`'s probe options; returns the columns to write."""
    given = interval is not None or after is not None or restart or health is not None
    if given and kind is not HostKind.instance:
        raise BadInput("--health-interval, --unhealthy-after, --unhealthy-restart and --health "
                       "probe an instance; a worker serves none", "drop them, or use --kind instance")
    if health is not None:
        health = parse_probe(health, "--health ", HEALTH_KINDS)
        if interval is None:
            raise BadInput(f"--health {health} needs a probe interval",
                           "add --health-interval SECONDS")
    if interval is not None:
        check_seconds(interval, "--health-interval", "5")
    if after is not None and not (isinstance(after, int) and 1 <= after <= MAX_AFTER):
        raise BadInput(f"--unhealthy-after {after!r} is not a count from 1 to {MAX_AFTER}",
                       "pass e.g. --unhealthy-after 3")
    if (after is not None or restart) and interval is None:
        raise BadInput("--unhealthy-after and --unhealthy-restart need a probe",
                       "add --health-interval SECONDS")
    return {"health_interval": interval, "unhealthy_after": after or 3,
            "unhealthy_restart": bool(restart), "health": None if health == "http" else health}


@dataclass(frozen=True)
class Command:
    """What an exec:CMD probe runs, as whom and where (the generation's containment)."""

    spec: SpawnSpec
    bound: float  # the health timeout, at most the interval


@dataclass
class Probed:
    gen_id: int
    host: str
    socket: str | None  # None: a command probe of a generation without its own socket
    how: Probe
    command: Command | None
    interval: float
    after: int
    restart: bool
    failures: int
    next_at: float = 0.0
    ref: ProcRef | None = None  # whose descendants each probe walks


class Prober:
    """Probes the current instances this agent owns whose host asks for it. `round()` is
    called every tick by the agent's scheduler; `refresh()` asks for a re-read soon."""

    def __init__(self, ctx: Context, kick: Any) -> None:
        self.ctx = ctx
        self.kick = kick  # the reconciler: a retired generation's obligations are due
        self.targets: dict[int, Probed] = {}
        self.read_at = 0.0
        self.pool: ThreadPoolExecutor | None = None
        self.wake = threading.Event()  # set by refresh() and at the agent's stop
        self.dirty = False
        self.last_read = -TICK

    def refresh(self) -> None:
        """What is probed may have changed (a drive made progress): read it again soon, at
        most once a TICK however many drives report (a wake storm is one read a tick)."""
        self.dirty = True
        self.wake.set()

    def pause(self) -> float:
        """Seconds until the next look: the tick while something is probed or a re-read is
        asked for, else until the next read."""
        now = time.monotonic()
        if self.targets:
            return TICK
        if self.dirty:
            return max(0.0, self.last_read + TICK - now)
        return max(TICK, self.read_at - now)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)

    def _read(self) -> None:
        rows = self.ctx.store.read(lambda s: s.execute(
            select(Generation.id, Generation.host, Generation.socket, Generation.health_failures,
                   Generation.uuid, Generation.pid, Generation.create_time, Generation.cgroup,
                   Host.health_interval, Host.unhealthy_after, Host.unhealthy_restart,
                   Host.health, Host.health_timeout, Host.env, Host.env_files, Host.cwd,
                   Host.run_user, Host.run_group)
            .join(Host, Host.name == Generation.host).join(Lease, Lease.host == Generation.host)
            .where(Generation.state == GenState.current, Host.health_interval.is_not(None),
                   Host.kind == HostKind.instance,
                   or_(Generation.socket.is_not(None), Host.health.like(EXEC + ":%")),
                   Lease.holder == self.ctx.agent_id)).all())
        now = time.monotonic()
        old, self.targets = self.targets, {}
        for r in rows:
            t = old.get(r.id)
            how = probe_of(r.health)
            command = None if how.kind != EXEC else Command(
                command_spec(how.command, host=r.host, uuid=r.uuid, env_json=r.env,
                             env_files_json=r.env_files, cwd=r.cwd, user=r.run_user,
                             group=r.run_group, pid=r.pid, socket=r.socket, cgroup=r.cgroup),
                min(float(r.health_timeout), float(r.health_interval)))
            self.targets[r.id] = Probed(
                r.id, r.host, r.socket, how, command, float(r.health_interval), int(r.unhealthy_after),
                bool(r.unhealthy_restart), int(r.health_failures),
                t.next_at if t is not None else now + float(r.health_interval),
                ProcRef(r.uuid, r.pid, r.create_time, r.cgroup))

    def round(self) -> int:
        """Probe what is due; returns how many were probed."""
        now = time.monotonic()
        if now >= self.read_at or (self.dirty and now - self.last_read >= TICK):
            self.dirty = False
            self._read()
            self.last_read, self.read_at = now, now + REREAD
        due = [t for t in self.targets.values() if t.next_at <= now]
        if not due:
            return 0
        if self.pool is None:
            self.pool = ThreadPoolExecutor(PARALLEL, thread_name_prefix="probe")
        problems = list(self.pool.map(self._probe, due))
        note(self.ctx, {t.gen_id: t.ref for t in due if t.ref is not None})
        for t, problem in zip(due, problems, strict=True):
            t.next_at = time.monotonic() + t.interval
            if problem is None and t.failures == 0:
                continue  # healthy, as it was: nothing written
            self._record(t, problem)
        return len(due)

    def _probe(self, t: Probed) -> str | None:
        """One probe of what the host's `health` asks: None when it passes, else why not."""
        bound = min(PROBE_TIMEOUT, t.interval)
        if t.command is not None:
            if self.ctx.ready is None:
                return "probe: this process cannot run probe commands"
            return self.ctx.ready.run_once(t.command.spec, t.command.bound)
        if t.socket is None:
            return f"probe: generation g{t.gen_id} has no socket to probe"
        if t.how.kind == TCP:
            return self.ctx.health.knock(t.socket, bound)
        if t.how.path is not None:
            return self.ctx.health.probe(t.socket, bound, path=t.how.path)
        return self.ctx.health.probe(t.socket, bound)

    def _record(self, t: Probed, problem: str | None) -> None:
        failures = 0 if problem is None else t.failures + 1

        def step(s: Session) -> bool:
            values: dict[str, Any] = {"health_failures": failures}
            if problem is None:
                values["unhealthy_since"] = None
            elif failures == t.after:
                values["unhealthy_since"] = utcnow()
            try:
                move(s, Generation, {"id": t.gen_id}, values, f"g{t.gen_id} health", fence=PROBED,
                     col="state", frm=GenState.current)
            except LostRace:
                return False  # no longer current: the next read drops it
            if problem is None and t.failures >= t.after:
                emit(s, "healthy", t.host, t.gen_id, after=t.failures)
            elif problem is not None and failures == t.after:
                emit(s, "unhealthy", t.host, t.gen_id, failures=failures, reason=problem)
                if t.restart:
                    gen = s.get(Generation, t.gen_id)
                    if gen is None:
                        return False
                    retire(s, self.ctx, gen, f"unhealthy: {problem}", restart=True)
                    return True
            return False

        retired = self.ctx.store.write(step)
        t.failures = failures
        if retired:
            self.targets.pop(t.gen_id, None)
            self.kick()
