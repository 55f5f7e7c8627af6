"""An in-process agent on a private state dir, for tests that need many workflow runs fast.

What the agent does, without its scheduler threads: the real SQLite store, the real process
backend, health and files (`runners.wiring.make_context`), `recover` on start, and a sweep
that mirrors the reconciler (drain the batches, take `due()` rows, `run_one` each, run the liveness sweep)
until no obligation is open.

A SIGKILL of the agent is modelled in-process: `crash()` forgets the Context, the backend
and its Popen handles without any cleanup (the children stay unreaped, as they do under a
PID 1 that never reaps), and builds a fresh Context that recovers as a restarted agent
does. A crash in the middle of a step is a `Crash` raised from a crash point (`CrashTrap`):
it unwinds the drive at exactly that point, like SIGKILL, leaving the store as written (a
transaction that was open is rolled back, as the kernel would drop it).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil
from sqlalchemy import select, text, update

from models import schema
from models.statedir import prepare_state_dir
from models.states import GenState, HostKind
from models.store import Store, utcnow
from models.tables import Attempt, Event, Generation, Member, Release, Restore, Rollout, Stop, Wake
from runners.backend.files import stage_build
from runners.backend.process import ProcessBackend
from runners.wiring import make_context
from tests.conftest import drop_db, end_holder, marked_pids, new_db, pid_dead
from workflows.base import crash as crash_mod
from workflows.base.context import Context, Result
from workflows.config.hosts import add_host, record_build
from workflows.engine.obligations import (
    KINDS,
    Due,
    drain_batches,
    due,
    next_due,
    run_one,
)
from workflows.engine.recovery import recover, release_leftovers
from workflows.generations.ending import ref_of
from workflows.leases.lease import renew
from workflows.lifecycle.members import retire_dead_currents

OBLIGATION_TABLES = (Wake, Stop, Release, Restore, Attempt, Member, Rollout)


def open_count(ctx: Context) -> int:
    """Every open obligation, as an operator counts them: the rows of pending_obligations."""
    return int(ctx.store.read(lambda s: s.execute(
        text("SELECT count(*) FROM pending_obligations")).scalar_one()))


class Crash(BaseException):
    """The agent died here (SIGKILL): nothing below this frame runs, no handler cleans up."""


class CrashTrap:
    """Replaces `crashpoint` in every workflow module: a name armed with `arm()` raises
    `Crash` the next time it is reached (once). Records every point reached."""

    def __init__(self) -> None:
        self.armed: str | None = None
        self.fired: list[str] = []
        self.reached: set[str] = set()

    def arm(self, name: str | None) -> None:
        assert name is None or name in crash_mod.REGISTERED, name
        self.armed = name

    def __call__(self, name: str) -> None:
        assert name in crash_mod.REGISTERED, f"crash point {name} is not defined"
        self.reached.add(name)
        if self.armed == name:
            self.armed = None
            self.fired.append(name)
            raise Crash(name)

    @contextmanager
    def installed(self) -> Iterator[CrashTrap]:
        import workflows.engine.obligations  # noqa: F401  (imports every workflow module)
        import workflows.engine.recovery  # noqa: F401

        real = crash_mod.crashpoint
        patched = [mod for mod in list(sys.modules.values())
                   if (getattr(mod, "__name__", "") or "").startswith("workflows.")
                   and mod is not crash_mod and getattr(mod, "crashpoint", None) is real]
        assert len(patched) >= 6, patched
        for mod in patched:
            mod.crashpoint = self  # type: ignore[attr-defined]
        try:
            yield self
        finally:
            for mod in patched:
                mod.crashpoint = real  # type: ignore[attr-defined]


@dataclass
class HookedHealth:
    """The real health check; `before` (one shot) runs when a check starts, as an operator
    acting while a generation is being checked would."""

    inner: Any
    before: Callable[[str], bool] | None = None  # returns True when it acted (then disarmed)

    def check(self, socket_path: str, timeout: float, alive: Callable[[], bool]) -> str | None:
        if self.before is not None and self.before(socket_path):
            self.before = None
        return self.inner.check(socket_path, timeout, alive)


def template_db(directory: Path) -> str:
    """The URL of an upgraded, empty database to copy (an Alembic upgrade per box is slow);
    drop it with drop_db."""
    url = new_db(prepare_state_dir(directory / "template"))
    store = Store(url)
    try:
        schema.upgrade(store.engine)
    finally:
        store.dispose()
    return url


@dataclass
class Box:
    root: Path
    template: str | None = None  # template_db's URL
    agent_id: str = "model-agent"
    synchronous: str = "FULL"
    busy_timeout_ms: int = 5000
    proof_wait: float = 0.5
    settle_seconds: float = 0.1  # canary settle window
    ctx: Context = field(init=False)
    backends: list[ProcessBackend] = field(default_factory=list)
    stores: list[Store] = field(default_factory=list)
    restarts: int = 0
    drives: int = 0
    pokes: list[tuple[str, str | None]] = field(default_factory=list)
    skipped_backoff: int = 0

    def __post_init__(self) -> None:
        self.state_dir = prepare_state_dir(self.root / "state")
        self.db_url = new_db(self.state_dir, self.template)
        self.ctx = self._context()
        if self.template is None:
            schema.upgrade(self.ctx.store.engine)

    def _context(self) -> Context:
        store = Store(self.db_url, synchronous=self.synchronous,
                      busy_timeout_ms=self.busy_timeout_ms)
        ctx = make_context(self.state_dir, store, self.agent_id, proof_wait=self.proof_wait)
        ctx.health = HookedHealth(ctx.health)
        ctx.settle_seconds = self.settle_seconds
        assert isinstance(ctx.proc, ProcessBackend)
        self.backends.append(ctx.proc)
        self.stores.append(store)
        return ctx

    @property
    def store(self) -> Store:
        return self.ctx.store

    @property
    def health(self) -> HookedHealth:
        assert isinstance(self.ctx.health, HookedHealth)
        return self.ctx.health

    # -- setup ---------------------------------------------------------------------------
    def stage(self, src: Path) -> int:
        path, digest = stage_build(str(src), self.state_dir)
        return self.store.write(lambda s: record_build(s, path, digest, str(src)).id)

    def add_host(self, name: str, build: Path, *, health_timeout: float = 1.0,
                 drain_timeout: float = 0.5, kind: HostKind = HostKind.instance) -> None:
        path, digest = stage_build(str(build), self.state_dir)
        self.store.write(lambda s: add_host(
            s, name, kind=kind, build_path=path, digest=digest, source=str(build), args=[],
            env={}, cwd=None, drain_timeout=drain_timeout, health_timeout=health_timeout))

    # -- the agent -----------------------------------------------------------------------
    def crash(self) -> None:
        """SIGKILL and restart: drop everything without cleanup, then recover. A crash
        armed in recovery itself crashes it again (and recovery starts over)."""
        while True:
            self.restarts += 1
            self.ctx = self._context()
            try:
                recover(self.ctx)
                release_leftovers(self.ctx)  # the agent's job once after ready
                return
            except Crash:
                continue

    def sweep(self) -> None:
        """The agent's liveness sweep: reap its own children, retire dead currents, renew."""
        self.ctx.proc.reap()  # type: ignore[attr-defined]
        retire_dead_currents(self.ctx)
        renew(self.ctx)

    def drive(self, d: Due) -> tuple[Result, str | None]:
        self.drives += 1
        result, error = run_one(self.ctx, d)
        if result in (Result.poked, Result.held):
            self.pokes.append((d.kind, error))
        return result, error

    def quiesce(self, *, bound: float = 30.0, max_drives: int = 400) -> None:
        """Run rounds until no obligation is open, with the liveness sweep before the first
        round and after the last. A `Crash` restarts the agent and goes on. When nothing is
        due but rows are open, time is advanced (their backoff skipped)."""
        deadline = time.monotonic() + bound
        start = self.drives
        swept = False
        while True:
            try:
                if not swept:
                    self.sweep()
                    swept = True
                drain_batches(self.ctx)  # the reconciler's group commits, then per host
                rows = sorted(due(self.ctx, utcnow()), key=lambda d: d.host)
                for d in rows:
                    self.drive(d)
                if rows:
                    pass
                elif open_count(self.ctx) == 0:
                    self.sweep()  # a current that died while we drove: more rounds
                    if open_count(self.ctx) == 0:
                        return
                else:
                    time.sleep(0.01)
                    self.skipped_backoff += 1
                    self.advance_time()
            except Crash:
                self.crash()
                swept = False
            if time.monotonic() > deadline or self.drives - start > max_drives:
                raise AssertionError(f"not quiescent after {bound}s / {self.drives - start} drives; "
                                     f"open: {self.open_rows()}; last pokes: {self.pokes[-5:]}")

    def advance_time(self) -> int:
        """Every open row falls due now (its backoff is skipped). Returns how many moved."""
        now = utcnow()
        moved = 0

        def step(s: Any) -> None:
            nonlocal moved
            for k in KINDS.values():
                q = update(k.model).where(k.model.next_attempt_at > now)
                if k.open is not None:
                    q = q.where(k.open)
                moved += int(s.execute(q.values(next_attempt_at=now)).rowcount)  # type: ignore[attr-defined]

        self.store.write(step)
        return moved

    def next_due(self) -> datetime | None:
        return next_due(self.ctx, set())

    def open_rows(self) -> list[dict[str, Any]]:
        with self.store.engine.connect() as conn:
            return [dict(r._mapping) for r in conn.exec_driver_sql("SELECT * FROM pending_obligations")]

    def currents(self) -> dict[str, Generation]:
        gens = self.store.read(lambda s: s.execute(select(Generation).where(
            Generation.state == GenState.current)).scalars().all())
        out: dict[str, Generation] = {}
        for g in gens:
            assert g.host not in out, f"host {g.host} has two current generations"
            out[g.host] = g
        return out

    def history(self, host: str, last: int = 15) -> list[str]:
        """The host's last events, oldest first: what a failed invariant is explained by."""
        rows = self.store.read(lambda s: s.execute(
            select(Event.kind, Event.generation_id, Event.detail).where(Event.host == host)
            .order_by(Event.id.desc()).limit(last)).all())
        return [f"{kind} g{gen} {detail}" for kind, gen, detail in reversed(rows)]

    def app_pids(self) -> set[int]:
        return set(marked_pids(self.state_dir, self.db_url))

    # -- teardown ------------------------------------------------------------------------
    def close(self) -> None:
        """End every process this box spawned (by the generations' containment, then by
        the state dir's marker), reap every child, drop the cgroups and the stores."""
        proc = ProcessBackend(containment=os.environ.get("VIGIL_CONTAINMENT", "auto"))
        try:
            gens = self.stores[-1].read(lambda s: s.execute(select(Generation)).scalars().all())
        except Exception:
            gens = []
        for g in gens:
            if g.state is not GenState.proven:
                proc.kill_all(ref_of(g))
        for pid in marked_pids(self.state_dir, self.db_url):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for b in self.backends:
            for h in list(b._handles.values()):
                if h.poll() is None:
                    try:
                        os.killpg(h.pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
                try:
                    h.wait(10)
                except subprocess.TimeoutExpired:
                    pass
        deadline = time.monotonic() + 10
        while (left := [p for p in marked_pids(self.state_dir, self.db_url) if not pid_dead(p)]) and \
                time.monotonic() < deadline:
            time.sleep(0.02)
        assert not left, f"teardown left processes {left}"
        end_holder(self.state_dir)  # the log keeper its spawns started, and its standby
        for g in gens:
            proc.release(ref_of(g))  # empty cgroup dirs
        for st in self.stores:
            st.dispose()
        drop_db(self.db_url)


def proc_status(pid: int) -> str | None:
    try:
        return psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        return None


__all__ = ["Box", "Crash", "CrashTrap", "HookedHealth", "OBLIGATION_TABLES", "template_db",
           "proc_status"]
