"""Fault injection (issue 4 item 5), through the ports, in-process (tests/model/box.py): the
real store, process backend, health and files, with a double only where the fault cannot be
caused for real on this box (a kill refused with EPERM to root, a proof that lies, a
commit that fails). Each test asserts that the obligation stays open while the fault lasts,
with the per-row pacing (attempts 1, 2, 3 ... next try 0.1, 0.2, 0.4 ... s later,
never due before that), and that it finishes once the fault clears, leaving nothing behind.
"""

from __future__ import annotations

import errno
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil
import pytest
from sqlalchemy import event, select, update
from sqlalchemy.exc import OperationalError

from models.states import Cause, GenState, Mode, Outcome, StopState, WakeState
from models.store import utcnow
from models.tables import Attempt, Build, Event, Generation, Lease, Member, Release, Stop, Wake
from runners.base.pids import CTIME_TOLERANCE
from runners.cli.check import run_checks
from tests.conftest import pid_dead, wait_for
from tests.model.apps import write_app
from tests.model.box import Box
from workflows.base.context import Result
from workflows.base.ports import ProcessPort, ProcRef
from workflows.deploys.request import request_deploy
from workflows.engine.obligations import KINDS, Due, backoff, due
from workflows.lifecycle.stop import request_stop
from workflows.lifecycle.wake import request_wake

pytestmark = pytest.mark.timeout(120)

HOST = "app"
# Upper bounds on wall-clock time show that nothing hangs; CI runs two suites at once on two
# shared cores, so they leave room for a loaded box.
SLACK = 10.0


# -- harness --------------------------------------------------------------------------------


@pytest.fixture
def box(short_tmp: Path) -> Iterator[Box]:
    b = Box(short_tmp, agent_id="fault-agent", proof_wait=0.2)
    try:
        yield b
    finally:
        b.close()


@pytest.fixture
def apps(short_tmp: Path) -> dict[str, Path]:
    d = short_tmp / "src"
    d.mkdir()
    return {"good": write_app(d, "good", "good"), "next": write_app(d, "good", "next"),
            "bad": write_app(d, "bad_500", "bad"), "hang": write_app(d, "hang", "hang")}


def alive(gen: Generation) -> bool:
    """The generation's leader still runs (same pid and start time, not a zombie)."""
    try:
        p = psutil.Process(gen.pid)
        return abs(p.create_time() - (gen.create_time or 0)) <= CTIME_TOLERANCE and \
            p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wake(box: Box) -> Generation:
    box.store.write(lambda s: request_wake(s, HOST))
    box.quiesce()
    return box.currents()[HOST]


def deploy(box: Box, src: Path, mode: Mode = Mode.overlap) -> int:
    bid = box.stage(src)
    return box.store.write(lambda s: request_deploy(s, HOST, s.get(Build, bid), mode=mode,
                                                    canary=False, cause=Cause.release).id)


def row(box: Box, kind: str, key: int) -> Any:
    return box.store.read(lambda s: s.get(KINDS[kind].model, key))


def lease(box: Box) -> Lease | None:
    return box.store.read(lambda s: s.get(Lease, HOST))


def open_kinds(box: Box) -> list[tuple[str, str]]:
    return sorted((o["kind"], o["host"]) for o in box.open_rows())


def assert_clean(box: Box) -> None:
    """Quiescent, `vigil check` passes, and no process of the box outlives its generation."""
    assert box.open_rows() == []
    assert run_checks(box.store, box.state_dir) == []
    leaders = {g.pid for g in box.currents().values()}
    assert box.app_pids() == leaders


def poke_until_cleared(box: Box, kind: str, key: int, tries: int,
                       during: Callable[[Any, str | None], None]) -> list[tuple[int, float]]:
    """Drive the row `tries` times while the fault lasts, as the reconciler does: each try
    must be poked, written with its error and the next backoff, and the row must not fall
    due before that. Returns [(attempts, delay)] as read back from the row."""
    seen = []
    for n in range(1, tries + 1):
        r = row(box, kind, key)
        # The scheduler would not take it before its time; at its time it is due.
        assert not [d for d in due(box.ctx, r.next_attempt_at - timedelta(milliseconds=5))
                    if (d.kind, d.id) == (kind, key)], "due before its backoff ran out"
        (item,) = [d for d in due(box.ctx, max(utcnow(), r.next_attempt_at))
                   if (d.kind, d.id) == (kind, key)]
        before = utcnow()
        result, error = box.drive(item)
        after = utcnow()
        r = row(box, kind, key)
        assert result is Result.poked, (result, error)
        assert r.attempts == n and r.last_error == error, (r.attempts, r.last_error, error)
        wanted = backoff(n)
        assert before + timedelta(seconds=wanted) <= r.next_attempt_at <= \
            after + timedelta(seconds=wanted), (n, r.next_attempt_at, before, after)
        seen.append((r.attempts, wanted))
        view = [o for o in box.open_rows()
                if o["kind"] in (kind, f"unproven_{kind}") and o["host"] == HOST]
        assert view and view[0]["attempts"] == n and view[0]["last_error"] == error, view
        during(r, error)
    return seen


def drive_now(box: Box, kind: str, key: int) -> tuple[Result, str | None]:
    r = row(box, kind, key)
    return box.drive(Due(kind, key, r.host, r.next_attempt_at))


# -- the kill that does not kill ------------------------------------------------------------


@dataclass
class KillRefused:
    """ProcessPort double: the real backend, but while `active` SIGTERM and SIGKILL are
    refused with EPERM (SilentKill: return having done nothing). Root cannot be
    refused a kill for real, hence the double."""

    real: ProcessPort
    active: bool = True
    refused: int = 0

    def terminate(self, ref: ProcRef, sig: int = signal.SIGTERM) -> None:
        self._refuse()
        self.real.terminate(ref, sig)

    def kill_all(self, ref: ProcRef) -> None:
        self._refuse()
        self.real.kill_all(ref)

    def _refuse(self) -> None:
        if self.active:
            self.refused += 1
            raise PermissionError(errno.EPERM, "Operation not permitted (injected)")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


@dataclass
class SilentKill(KillRefused):
    def terminate(self, ref: ProcRef, sig: int = signal.SIGTERM) -> None:
        if self.active:
            self.refused += 1
            return
        self.real.terminate(ref, sig)

    def kill_all(self, ref: ProcRef) -> None:
        if self.active:
            self.refused += 1
            return
        self.real.kill_all(ref)


@pytest.mark.parametrize("mode", ["eperm", "silent"])
def test_stop_whose_kill_does_not_kill_stays_pending_then_finishes(
        box: Box, apps: dict[str, Path], mode: str) -> None:
    box.add_host(HOST, apps["good"], drain_timeout=0.2)
    gen = wake(box)
    held = lease(box)
    assert held is not None
    fault = KillRefused(box.ctx.proc) if mode == "eperm" else SilentKill(box.ctx.proc)
    box.ctx.proc = fault
    sid = box.store.write(lambda s: request_stop(s, HOST)).id

    def during(r: Stop, error: str | None) -> None:
        assert r.state is StopState.signalled and r.generation_id == gen.id
        assert ("Operation not permitted" if mode == "eperm" else "not proven gone: leader alive") \
            in (error or ""), error
        assert alive(gen), "the fault must really have spared the process"
        assert lease(box) is not None and lease(box).fence == held.fence, "the stop keeps its lease"
        assert open_kinds(box) == [("stop", HOST)]
        box.sweep()  # the liveness sweep leaves a retiring generation alone
        assert open_kinds(box) == [("stop", HOST)]

    pacing = poke_until_cleared(box, "stop", sid, 5, during)
    assert pacing == [(1, 0.1), (2, 0.2), (3, 0.4), (4, 0.8), (5, 1.6)], pacing
    assert fault.refused >= 5

    fault.active = False
    result, error = drive_now(box, "stop", sid)
    assert result is Result.progress, error
    st = row(box, "stop", sid)
    assert st.state is StopState.done and st.attempts == 0 and st.last_error is None
    wait_for(lambda: not alive(gen), 5, what="the stopped leader to be gone")
    assert lease(box) is None, "the lease is given back once the stop is proven"
    assert box.store.read(lambda s: s.get(Generation, gen.id)).state is GenState.proven
    assert_clean(box)


# -- a proof that fails N times, then holds -------------------------------------------------


@dataclass
class LyingProof:
    """ProcessPort double: the real backend (signals are really sent), but the termination
    proof answers False while `active` -- a process that will not die under SIGKILL (a
    D-state task, a cgroup that never empties) cannot be made on purpose."""

    real: ProcessPort
    active: bool = True
    asked: int = 0

    def proven(self, ref: ProcRef) -> bool:
        self.asked += 1
        return False if self.active else self.real.proven(ref)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


N = 3


def test_stop_whose_proof_fails_n_times_keeps_its_lease_then_finishes(
        box: Box, apps: dict[str, Path]) -> None:
    box.add_host(HOST, apps["good"], drain_timeout=0.2)
    gen = wake(box)
    fence = lease(box).fence
    proof = LyingProof(box.ctx.proc)
    box.ctx.proc = proof
    sid = box.store.write(lambda s: request_stop(s, HOST)).id

    def during(r: Stop, error: str | None) -> None:
        assert r.state is StopState.signalled
        assert f"generation g{gen.id} not proven gone" in (error or ""), error
        assert lease(box).fence == fence
        assert box.store.read(lambda s: s.get(Generation, gen.id)).state is GenState.retiring
        assert open_kinds(box) == [("stop", HOST)]

    assert poke_until_cleared(box, "stop", sid, N, during) == [(1, 0.1), (2, 0.2), (3, 0.4)]
    assert not alive(gen), "the signals were real: only the proof disagreed"
    proof.active = False
    result, error = drive_now(box, "stop", sid)
    assert result is Result.progress, error
    assert row(box, "stop", sid).state is StopState.done
    assert lease(box) is None
    assert_clean(box)


def test_retiring_member_whose_proof_fails_blocks_the_restart_then_leaves(
        box: Box, apps: dict[str, Path]) -> None:
    """A current whose leader died becomes a retiring member and a restart wake is queued;
    while the member is unproven, the restart must not spawn anything."""
    box.add_host(HOST, apps["good"], drain_timeout=0.2)
    gen = wake(box)
    os.kill(gen.pid, 9)
    wait_for(lambda: not alive(gen), 5, what="the leader to die")
    proof = LyingProof(box.ctx.proc)
    box.ctx.proc = proof
    box.sweep()
    assert open_kinds(box) == [("unproven_member", HOST), ("wake", HOST)]
    (restart,) = box.store.read(lambda s: s.execute(select(Wake).where(
        Wake.state == WakeState.queued)).scalars().all())
    assert restart.cause == "restart"

    def during(m: Member, error: str | None) -> None:
        assert f"generation g{gen.id} not proven gone" in (error or ""), error
        assert m.unproven and m.retried_at is not None
        # The restart is refused while the old generation is not proven gone.
        result, werr = drive_now(box, "wake", restart.id)
        assert result is Result.poked and f"g{gen.id}" in (werr or ""), (result, werr)
        assert box.store.read(lambda s: s.execute(select(Generation).where(
            Generation.host == HOST, Generation.id != gen.id)).first()) is None, "nothing spawned"
        assert lease(box) is not None

    assert poke_until_cleared(box, "member", gen.id, N, during) == [(1, 0.1), (2, 0.2), (3, 0.4)]
    proof.active = False
    result, error = drive_now(box, "member", gen.id)
    assert result is Result.progress, error
    assert row(box, "member", gen.id) is None
    box.quiesce()
    new = box.currents()[HOST]
    assert new.id != gen.id and alive(new)
    assert_clean(box)


def test_swap_drain_whose_proof_fails_stays_switched_then_finishes(
        box: Box, apps: dict[str, Path]) -> None:
    """An overlap swap past its switch: the new generation serves at once, the old one is a
    retiring member whose proof fails; the attempt stays open (switched) until it holds."""
    box.add_host(HOST, apps["good"], drain_timeout=0.2)
    old = wake(box)
    proof = LyingProof(box.ctx.proc)
    box.ctx.proc = proof
    proof.active = False
    aid = deploy(box, apps["next"])

    # Let the swap run up to its drain with an honest proof, then lie from the drain on.
    real_terminate = proof.real.terminate

    def terminate(ref: ProcRef, sig: int = signal.SIGTERM) -> None:
        proof.active = True
        real_terminate(ref, sig)

    proof.terminate = terminate  # type: ignore[method-assign]
    result, error = drive_now(box, "attempt", aid)
    assert result is Result.poked and f"g{old.id} not proven gone" in (error or ""), (result, error)
    a = row(box, "attempt", aid)
    assert a.step.value == "switched" and a.outcome is None
    new = box.currents()[HOST]
    assert new.id == a.successor_id and alive(new)

    def during(r: Attempt, err: str | None) -> None:
        assert r.step.value == "switched" and r.outcome is None
        assert f"g{old.id} not proven gone" in (err or ""), err
        assert row(box, "member", old.id) is not None and lease(box) is not None

    # The drive above was the first poke; the sweep's next tries follow the same pacing.
    r = row(box, "attempt", aid)
    assert (r.attempts, r.last_error) == (1, error)
    for n in (2, 3):
        before = utcnow()
        res, err = drive_now(box, "attempt", aid)
        r = row(box, "attempt", aid)
        assert res is Result.poked and r.attempts == n, (res, err)
        assert before + timedelta(seconds=backoff(n)) <= r.next_attempt_at <= \
            utcnow() + timedelta(seconds=backoff(n))
        during(r, err)
    proof.active = False
    proof.terminate = real_terminate  # type: ignore[method-assign]
    # The member row of the old generation may be driven by the sweep as well; either way
    # the attempt must end done (it switched: finish, never abandon).
    box.quiesce()
    a = row(box, "attempt", aid)
    assert (a.outcome, a.executed) == (Outcome.done, True), a.reason
    assert box.currents()[HOST].id == new.id and not alive(old)
    assert_clean(box)


# -- a health check that hangs --------------------------------------------------------------


@dataclass
class HangingHealth:
    """HealthPort double: never gets an answer; blocks until its timeout, then fails (as a
    check stuck on a socket that never answers would)."""

    calls: list[float] = field(default_factory=list)

    def check(self, socket_path: str, timeout: float, alive: Callable[[], bool]) -> str | None:
        self.calls.append(timeout)
        time.sleep(timeout)
        return f"health: no answer on {socket_path} within {timeout}s (hung)"


@pytest.mark.parametrize("where", ["app", "port"])
def test_wake_whose_health_check_hangs_fails_by_its_timeout_leaving_nothing(
        box: Box, apps: dict[str, Path], where: str) -> None:
    """`app`: the real check against an app that accepts and never answers; `port`: a
    HealthPort double that blocks until its timeout (in front of a healthy app)."""
    timeout = 0.5
    box.add_host(HOST, apps["hang" if where == "app" else "good"], health_timeout=timeout)
    if where == "port":
        box.ctx.health = HangingHealth()
    wid = box.store.write(lambda s: request_wake(s, HOST)).id
    t0 = time.monotonic()
    result, error = drive_now(box, "wake", wid)
    took = time.monotonic() - t0
    assert result is Result.progress, error
    assert timeout <= took < timeout + SLACK, took
    w = row(box, "wake", wid)
    assert w.state is WakeState.failed and "health" in (w.reason or ""), (w.state, w.reason)
    g = box.store.read(lambda s: s.get(Generation, w.generation_id))
    assert g.state is GenState.proven and pid_dead(g.pid)
    assert lease(box) is None
    assert_clean(box)


def test_deploy_whose_health_check_hangs_fails_and_keeps_the_old_one(
        box: Box, apps: dict[str, Path]) -> None:
    box.add_host(HOST, apps["good"], health_timeout=0.5)
    old = wake(box)
    aid = deploy(box, apps["hang"])
    t0 = time.monotonic()
    result, error = drive_now(box, "attempt", aid)
    assert result is Result.progress, error
    assert 0.5 <= time.monotonic() - t0 < 0.5 + SLACK
    a = row(box, "attempt", aid)
    assert (a.outcome, a.executed) == (Outcome.failed, True) and "health" in a.reason, a.reason
    box.quiesce()
    assert box.currents()[HOST].id == old.id and alive(old)
    assert_clean(box)


# -- `database is locked` storms from a second writer process -------------------------------

STORM = r"""
import os, random, sqlite3, sys, time
db, stop = sys.argv[1], sys.argv[2]
con = sqlite3.connect(db, timeout=60, isolation_level=None)
held = 0
while not os.path.exists(stop):
    con.execute("BEGIN IMMEDIATE")
    if not held:
        open(stop + ".started", "w").close()
    held += 1
    time.sleep(random.uniform(0.02, 0.12))
    con.execute("COMMIT")
    time.sleep(random.uniform(0.005, 0.03))
print(held)
"""


@pytest.mark.sqlite_only("SQLite's `database is locked` from a second writer of the file")
def test_lock_storm_from_another_writer_surfaces_nothing(box: Box, apps: dict[str, Path],
                                                         short_tmp: Path) -> None:
    """Another process takes the write lock again and again for 20-120 ms. The store's
    busy timeout is cut to 10 ms here so that the storm really raises `database is locked`
    inside the workflows' transactions (with the default 5 s it would only wait): every one
    must be retried by the store (tenacity), none may reach an obligation as an error."""
    box.stores[-1].dispose()
    box.busy_timeout_ms = 10
    box.ctx = box._context()
    locked: list[str] = []

    @event.listens_for(box.store.engine, "handle_error")
    def _seen(ctx: Any) -> None:
        if "locked" in str(ctx.original_exception):
            locked.append(str(ctx.original_exception))

    box.add_host(HOST, apps["good"], drain_timeout=0.2)
    box.add_host("other", apps["good"], drain_timeout=0.2)
    stop_file = short_tmp / "storm.stop"
    storm = subprocess.Popen([sys.executable, "-c", STORM, str(box.state_dir / "vigil.db"),
                              str(stop_file)], stdout=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: os.path.exists(f"{stop_file}.started") or storm.poll() is not None, 10,
                 what="the storm to start")
        for h in (HOST, "other"):
            box.store.write(lambda s, h=h: request_wake(s, h))
        box.quiesce()
        first = box.currents()
        deploy(box, apps["next"])
        os.kill(first["other"].pid, 9)
        box.quiesce()
        box.store.write(lambda s: request_stop(s, "other"))
        box.quiesce()
        assert storm.poll() is None, "the storm must outlive the drives"
    finally:
        stop_file.touch()
        out, _ = storm.communicate(timeout=30)
    print(f"storm: {int(out)} exclusive holds; {len(locked)} `database is locked` errors retried")
    assert int(out) > 10, out
    assert locked, "the storm never made a transaction see `database is locked`"
    assert not [p for p in box.pokes if "locked" in (p[1] or "")], box.pokes
    ends = box.store.read(lambda s: s.execute(select(Event.kind)).scalars().all())
    assert not {"wake_failed", "deploy_abandoned", "deploy_failed"} & set(ends), ends
    attempts = box.store.read(lambda s: s.execute(select(Attempt)).scalars().all())
    assert [(a.outcome, a.executed) for a in attempts] == [(Outcome.done, True)]
    wakes = box.store.read(lambda s: s.execute(select(Wake)).scalars().all())
    assert {w.state for w in wakes} == {WakeState.done}, [(w.id, w.state, w.reason) for w in wakes]
    assert set(box.currents()) == {HOST}
    assert box.currents()[HOST].build_id == attempts[0].build_id
    assert_clean(box)


# -- a store that raises on one commit --------------------------------------------------------


def _functions(fn: Any, depth: int = 3) -> list[Any]:
    """`fn` and the functions its closure holds (a step runner's commit wraps the caller's
    step function in a lambda of its own)."""
    found = [fn]
    for cell in getattr(fn, "__closure__", None) or ():
        inner = cell.cell_contents
        if depth and callable(inner) and hasattr(inner, "__code__"):
            found += _functions(inner, depth - 1)
    return found


def _matched(fn: Callable[[Any], Any], out: Any, target: str) -> bool:
    """Whether `target` names this transaction: `point NAME` for a commit of the step
    runner (workflows/lifecycle/start.py) that reaches crash point NAME, `calls NAME` for a
    step function that calls NAME, else part of a step function's qualified name."""
    kind, _, name = target.partition(" ")
    if kind == "point":
        steps = out[1] if isinstance(out, tuple) and len(out) == 2 else ()
        return isinstance(steps, list | tuple) and any(
            getattr(st, "point", None) == name for st in steps)
    for f in _functions(fn):
        if kind == "calls" and name in getattr(getattr(f, "__code__", None), "co_names", ()):
            return True
        if kind != "calls" and target in getattr(f, "__qualname__", ""):
            return True
    return False


@dataclass
class CommitFails:
    """Wraps Store.write: the first transaction `target` names (_matched) runs its
    statements, then fails to commit with a non-transient OperationalError ('disk I/O
    error'): rolled back, raised to the workflow. Once."""

    target: str
    fired: list[str] = field(default_factory=list)

    def install(self, box: Box) -> None:
        store = box.store
        real = store.write

        def write(fn: Callable[[Any], Any]) -> Any:
            if self.fired:
                return real(fn)

            def failing(s: Any) -> Any:
                out = fn(s)
                if not self.fired and _matched(fn, out, self.target):
                    self.fired.append(self.target)
                    s.flush()
                    raise OperationalError("COMMIT", {}, sqlite3.OperationalError("disk I/O error"))
                return out

            return real(failing)

        store.write = write  # type: ignore[method-assign]


# (scenario, the step whose commit fails, what the obligation does after it)
COMMITS = [
    ("wake", "calls intent"),  # a queued wake: its lease and the intent, one commit
    ("wake", "point wake.recorded"),
    ("wake", "point wake.current"),
    ("wake", "pace.<locals>.<lambda>"),
    ("wake_bad", "fail_start.<locals>.step"),
    ("wake_bad", "prove_failed.<locals>.step"),
    ("stop", "_signal.<locals>.step"),
    ("stop", "_finish.<locals>.step"),
    ("stop", "drive_release.<locals>.step"),
    ("dead_leader", "retire_dead_currents.<locals>.step"),
    ("dead_leader", "drive_member.<locals>.step"),
    ("overlap", "point swap.admitted"),
    ("overlap", "point swap.spawned"),
    ("overlap", "point swap.switched"),
    ("overlap", "point swap.drained"),
    ("hold", "_stop_old.<locals>.stop"),
    ("hold", "point swap.old_stopped"),
    ("hold", "calls _new_successor"),
    ("hold", "point swap.switched"),
]
# Before the switch (overlap) or before the old generation is stopped (hold), an attempt
# that meets an unexpected store error is abandoned (never blamed on the build): the host
# keeps its build and its link. From there on it stays open and is finished by the sweep.
ABANDONS = {("overlap", "point swap.admitted"), ("overlap", "point swap.spawned"),
            ("overlap", "point swap.switched"), ("hold", "_stop_old.<locals>.stop")}


@pytest.mark.backend("a commit that fails: the store's retry and rollback")
@pytest.mark.parametrize(("scenario", "target"), COMMITS, ids=[f"{s}:{t.split('.')[0]}.{t.split('.')[-1]}" for s, t in COMMITS])
def test_one_failed_commit_is_retried_and_nothing_is_lost(
        box: Box, apps: dict[str, Path], scenario: str, target: str) -> None:
    box.add_host(HOST, apps["bad" if scenario == "wake_bad" else "good"], health_timeout=0.5,
                 drain_timeout=0.2)
    fault = CommitFails(target)
    old = None
    if scenario in ("stop", "dead_leader", "overlap", "hold"):
        old = wake(box)
    fault.install(box)
    aid = None
    if scenario in ("wake", "wake_bad"):
        wid = box.store.write(lambda s: request_wake(s, HOST)).id
        if target == "pace.<locals>.<lambda>":
            # Pacing is written when there is something to write: a retried row's progress
            # resets its attempts (a first try that progresses leaves the row as it is).
            box.store.write(lambda s: s.execute(update(Wake).where(Wake.id == wid).values(
                attempts=1, last_error="an earlier try")))
    elif scenario == "stop":
        box.store.write(lambda s: request_stop(s, HOST))
    elif scenario == "dead_leader":
        assert old is not None
        os.kill(old.pid, 9)
        wait_for(lambda: not alive(old), 5, what="the leader to die")
    else:
        aid = deploy(box, apps["next"], Mode.overlap if scenario == "overlap" else Mode.hold)

    # Drive round by round until the fault has fired; the obligation it hit must still be
    # open right after (or, for a deploy before its switch, ended abandoned).
    for _ in range(50):
        if fault.fired:
            break
        try:
            box.sweep()
        except OperationalError as exc:
            assert "disk I/O error" in str(exc)
            continue
        for d in due(box.ctx, utcnow()):
            box.drive(d)
    assert len(fault.fired) == 1 and fault.fired[0].endswith(target), fault.fired
    if (scenario, target) in ABANDONS:
        a = row(box, "attempt", aid)
        assert a.outcome is Outcome.abandoned, (a.outcome, a.reason)
        # The old generation still serves, and the canonical link names it again.
        assert box.currents()[HOST].id == old.id and alive(old)
        assert box.ctx.files.read_link(box.ctx.link_for(HOST)) == old.socket
    elif target == "retire_dead_currents.<locals>.step":
        # Nothing was written: the dead leader's generation is still current; the next
        # sweep retires it.
        assert box.currents()[HOST].id == old.id and not alive(old)
    elif target != "pace.<locals>.<lambda>":
        assert box.open_rows(), "the obligation the failed commit hit must stay open"
        if aid is not None:
            a = row(box, "attempt", aid)
            assert a.outcome is None and "disk I/O error" in (a.last_error or ""), \
                (a.outcome, a.last_error)
    box.quiesce()

    gens = box.currents()
    if scenario == "wake":
        assert set(gens) == {HOST}
    elif scenario in ("wake_bad", "stop"):
        assert gens == {}
        assert lease(box) is None
    elif scenario == "dead_leader":
        assert gens[HOST].id != old.id
    else:
        a = row(box, "attempt", aid)
        if (scenario, target) in ABANDONS:
            assert (a.outcome, a.executed is not None) == (Outcome.abandoned, True), a.reason
            assert "disk I/O error" in a.reason, a.reason
            assert gens[HOST].id == old.id and alive(old), "the old generation keeps serving"
        else:
            assert a.outcome is Outcome.done, (a.outcome, a.reason)
            assert gens[HOST].id == a.successor_id and not alive(old)
    assert box.store.read(lambda s: s.execute(select(Release)).first()) is None
    assert_clean(box)
