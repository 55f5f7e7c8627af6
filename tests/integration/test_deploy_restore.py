"""The parent memory limit around an overlap swap, driven in-process:
the real process backend, health and files, a real SQLite store, and a LimitPort test double
for the faults a real controller cannot be made to produce (a failing restore, a half-done
raise); the limit on a real memory cgroup is tests/integration/test_parent_limit.py. The agent is not running; the test drives the workflow steps and the sweep itself."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import pytest
from sqlalchemy import select, update

from models.states import Cause, GenState, Mode, Outcome
from models.store import Store, utcnow
from models.tables import Attempt, Event, Generation, Host, Member, Restore
from runners.backend.files import LocalFiles, stage_build
from runners.backend.health import HttpHealth
from runners.backend.process import ProcessBackend
from runners.wiring import open_store
from tests.conftest import HELLO, Vigil, pid_dead
from workflows.base.context import Context, Result
from workflows.config.hosts import record_build
from workflows.deploys.driver import drive_attempt
from workflows.deploys.request import request_deploy
from workflows.engine.obligations import Due, run_one
from workflows.lifecycle.stop import drive_stop, request_stop
from workflows.lifecycle.wake import drive_wake, request_wake

TIER = 64  # MB


@dataclass
class FlakyLimit:
    """LimitPort double: records every ask with the host's `raised` mark as stored at that
    moment; the raise (2x tier) always succeeds, the first `fail_restores` restores fail."""

    store: Store
    is_available: bool = True
    fail_restores: int = 0
    fail_raise: bool = False
    calls: list[tuple[int, bool, bool]] = field(default_factory=list)  # (mb, raised, ok)

    def available(self) -> bool:
        return self.is_available

    def set_limit(self, host: str, megabytes: int) -> None:
        raised = self.store.read(lambda s: s.get(Host, host).raised)
        if megabytes == 2 * TIER and self.fail_raise:
            self.calls.append((megabytes, raised, False))
            raise OSError(16, "injected: raise half-done")
        if megabytes != 2 * TIER and self.fail_restores > 0:
            self.fail_restores -= 1
            self.calls.append((megabytes, raised, False))
            raise OSError(5, "injected: memory.max not writable")
        self.calls.append((megabytes, raised, True))


@dataclass
class SeeingHealth:
    """The real health check, noting the host's `raised` mark each time a successor is
    checked (that is, in the middle of a swap)."""

    store: Store
    inner: HttpHealth = field(default_factory=HttpHealth)
    raised_seen: list[bool] = field(default_factory=list)

    def check(self, socket_path: str, timeout: float, alive: Callable[[], bool]) -> str | None:
        self.raised_seen.append(self.store.read(lambda s: s.get(Host, "hello").raised))
        return self.inner.check(socket_path, timeout, alive)


@dataclass
class Box:
    ctx: Context
    store: Store
    limits: FlakyLimit
    health: SeeingHealth
    state_dir: Path

    def host(self) -> Host:
        return self.store.read(lambda s: s.get(Host, "hello"))

    def restores(self) -> list[Restore]:
        return self.store.read(lambda s: list(s.execute(select(Restore)).scalars()))

    def attempt(self, aid: int) -> Attempt:
        return self.store.read(lambda s: s.get(Attempt, aid))

    def current(self) -> Generation | None:
        return self.store.read(lambda s: s.execute(select(Generation).where(
            Generation.host == "hello", Generation.state == GenState.current)).scalar_one_or_none())

    def deploy(self, src: Path) -> int:
        path, digest = stage_build(str(src), self.state_dir)
        return self.store.write(lambda s: request_deploy(
            s, "hello", record_build(s, path, digest, str(src)), mode=Mode.overlap, canary=False,
            cause=Cause.release).id)

    def run(self, kind: str, row_id: int) -> tuple[Result, str | None]:
        """One sweep try at an obligation, with its pacing written (the agent's path)."""
        return run_one(self.ctx, Due(kind, row_id, "hello", utcnow()))


def make_box(vigil: Vigil, *, available: bool, fail_restores: int) -> Box:
    vigil.add_host("hello", HELLO)
    store = open_store(vigil.state_dir, vigil.db_url)
    store.write(lambda s: s.execute(update(Host).where(Host.name == "hello")
                                    .values(memory_tier_mb=TIER)))
    limits = FlakyLimit(store, available, fail_restores)
    health = SeeingHealth(store)
    ctx = Context(store=store, agent_id="test-agent", state_dir=vigil.state_dir, proc=ProcessBackend(
        containment=os.environ.get("VIGIL_CONTAINMENT", "auto")), health=health, files=LocalFiles(),
        limits=limits, settle_seconds=1)
    return Box(ctx, store, limits, health, vigil.state_dir)


@pytest.fixture
def boxes(vigil: Vigil) -> Iterator[list[Box]]:
    made: list[Box] = []
    yield made
    for box in made:  # end every child this process spawned, and reap it
        proc = box.ctx.proc
        assert isinstance(proc, ProcessBackend)
        for h in list(proc._handles.values()):
            if h.poll() is None:
                os.killpg(h.pid, signal.SIGKILL)
                h.wait(10)
        box.store.dispose()


def wake(box: Box) -> Generation:
    wid = box.store.write(lambda s: request_wake(s, "hello")).id
    assert drive_wake(box.ctx, wid) is Result.progress
    gen = box.current()
    assert gen is not None
    return gen


def stop(box: Box) -> None:
    sid = box.store.write(lambda s: request_stop(s, "hello")).id
    assert drive_stop(box.ctx, sid) is Result.progress


def variant(tmp: Path, name: str) -> Path:
    p = tmp / f"{name}.py"
    p.write_bytes(HELLO.read_bytes() + f"# {name}\n".encode())
    p.chmod(0o755)
    return p


def pacing(box: Box, rid: int) -> tuple[int, str | None, datetime]:
    r = box.store.read(lambda s: s.get(Restore, rid))
    return r.attempts, r.last_error, r.next_attempt_at


def test_failed_restore_is_pending_retried_with_backoff_and_blocks_overlap(
        vigil: Vigil, boxes: list[Box], short_tmp: Path) -> None:
    box = make_box(vigil, available=True, fail_restores=3)
    boxes.append(box)
    old = wake(box)
    assert box.limits.calls == [] and box.host().raised is False

    aid = box.deploy(variant(short_tmp, "b"))
    assert drive_attempt(box.ctx, aid) is Result.progress
    a = box.attempt(aid)
    assert (a.outcome, a.executed) == (Outcome.done, True), a.reason
    assert pid_dead(old.pid)
    # The raise: asked with twice the tier, after `raised` was written; raised mid-swap.
    assert box.limits.calls[0] == (2 * TIER, True, True)
    assert box.health.raised_seen[-1] is True
    # The restore (the last member left): asked with the tier, failed -> a pending row.
    assert box.limits.calls[1:] == [(TIER, True, False)]
    assert box.host().raised is True
    (r,) = box.restores()
    pending = [o for o in vigil.obligations() if o["kind"] == "restore"]
    assert len(pending) == 1 and pending[0]["host"] == "hello", vigil.obligations()
    assert [o["kind"] for o in vigil.obligations()] == ["restore"]  # nothing else is open

    # The sweep retries it: each failure is written with its error and a growing backoff.
    delays = []
    for tries in (1, 2):
        before = utcnow()
        result, error = box.run("restore", r.id)
        assert result is Result.poked and "injected" in (error or ""), error
        attempts, last_error, next_at = pacing(box, r.id)
        assert attempts == tries and "injected" in (last_error or "")
        delays.append((next_at - before).total_seconds())
        (view,) = [o for o in vigil.obligations() if o["kind"] == "restore"]
        assert view["attempts"] == tries and "injected" in view["last_error"], view
    assert 0.05 <= delays[0] < delays[1], delays
    assert box.host().raised is True

    # While raised with no member, no overlap is admitted: the attempt waits (held: paced as poked).
    assert box.store.read(lambda s: list(s.execute(select(Member)).scalars())) == []
    gens_before = box.store.read(lambda s: len(s.execute(select(Generation)).all()))
    blocked = box.deploy(variant(short_tmp, "c"))
    calls_before = len(box.limits.calls)
    result, error = box.run("attempt", blocked)
    assert result is Result.held and "raised" in (error or ""), error
    b = box.attempt(blocked)
    assert b.outcome is None and b.step.value == "queued" and b.successor_id is None
    assert "raised" in (b.last_error or "")
    assert box.store.read(lambda s: len(s.execute(select(Generation)).all())) == gens_before
    assert len(box.limits.calls) == calls_before  # not even the raise was asked

    # The double stops failing: the restore succeeds, clears the mark, puts the tier back.
    result, error = box.run("restore", r.id)
    assert result is Result.progress, error
    assert box.limits.calls[-1] == (TIER, True, True)
    assert box.host().raised is False and box.restores() == []
    assert box.store.read(lambda s: s.execute(select(Event).where(Event.kind == "restored")).first())
    assert "restore" not in [o["kind"] for o in vigil.obligations()]

    # Now the waiting deploy is admitted and runs the whole cycle again.
    result, error = box.run("attempt", blocked)
    assert result is Result.progress, error
    b = box.attempt(blocked)
    assert b.outcome is Outcome.done, b.reason
    assert box.limits.calls[-2:] == [(2 * TIER, True, True), (TIER, True, True)]
    assert box.host().raised is False and box.restores() == []
    assert vigil.obligations() == []
    vigil.check()

    stop(box)
    assert vigil.obligations() == [] and vigil.app_pids() == []
    vigil.check()


def test_box_without_memory_controller_never_raises(vigil: Vigil, boxes: list[Box],
                                                    short_tmp: Path) -> None:
    box = make_box(vigil, available=False, fail_restores=3)
    boxes.append(box)
    old = wake(box)
    aid = box.deploy(variant(short_tmp, "b"))
    assert drive_attempt(box.ctx, aid) is Result.progress
    a = box.attempt(aid)
    assert (a.outcome, a.executed) == (Outcome.done, True), a.reason
    assert pid_dead(old.pid)
    assert box.limits.calls == []  # refused before any write: nothing to restore
    assert box.health.raised_seen and not any(box.health.raised_seen)
    assert box.host().raised is False and box.restores() == []
    assert vigil.obligations() == []
    vigil.check()
    stop(box)
    assert vigil.app_pids() == []
    vigil.check()


def test_failed_raise_abandons_unexecuted_and_still_restores(vigil: Vigil, boxes: list[Box],
                                                            short_tmp: Path) -> None:
    """A raise that failed may have changed the limit: it was marked before it was asked,
    so the attempt is abandoned (nothing of the build ran) and the limit is put back."""
    box = make_box(vigil, available=True, fail_restores=0)
    box.limits.fail_raise = True
    boxes.append(box)
    old = wake(box)
    aid = box.deploy(variant(short_tmp, "b"))
    assert drive_attempt(box.ctx, aid) is Result.progress
    a = box.attempt(aid)
    assert (a.outcome, a.executed) == (Outcome.abandoned, False), a.reason
    assert "raise" in a.reason, a.reason
    assert box.limits.calls == [(2 * TIER, True, False), (TIER, True, True)]
    assert box.host().raised is False and box.restores() == []
    successor = box.store.read(lambda s: s.get(Generation, a.successor_id))
    assert successor.pid is None and successor.state is GenState.proven  # never exec'd
    assert box.current().id == old.id and not pid_dead(old.pid)
    assert vigil.obligations() == []
    vigil.check()
    stop(box)
    assert vigil.app_pids() == []
    vigil.check()
