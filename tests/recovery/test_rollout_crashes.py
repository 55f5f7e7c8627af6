"""kill -9 of the agent at each rollout crash point of a three-wave rollout (the second
wave's, where a point is reached once per wave), then a clean agent; and a double crash,
the recovering agent SIGKILLed again at the first crash point its recovery reaches past
its adoptions. The rollout finishes exactly once, no host is deployed twice for one wave,
every host ends on the build it should, `vigil check` is clean.

(tests/recovery/test_crashpoints.py crashes at every point with a one-host rollout; this is
the same with several hosts and waves, and a failing host for the halt and the revert.)"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select

from models import schema
from models.states import Cause, Outcome, RolloutOutcome, RolloutState
from models.tables import Attempt, Event, Rollout
from runners.wiring import open_store
from tests.conftest import HELLO, Vigil, wait_for
from tests.integration.test_rollouts import build_variant, digest, serving
from tests.recovery.test_crashpoints import expect_sigkill, ready, start, tail

pytestmark = pytest.mark.timeout(180)

HOSTS = ["web1", "web2", "web3"]
# point (as VIGIL_CRASH_AT), whether web2 (wave 2) fails and the rollout reverts, the outcome
CASES = [
    ("rollout.wave_admitted#2", False, "done"),
    ("rollout.wave_settled#2", False, "done"),
    ("rollout.ended", False, "done"),
    ("rollout.halted", True, "reverted"),
    ("rollout.revert_started", True, "reverted"),
    ("rollout.revert_settled", True, "reverted"),
    ("rollout.ended", True, "reverted"),
]


@pytest.fixture
def vigil(short_tmp: Path) -> Iterator[Vigil]:
    v = Vigil(short_tmp / "state", {"VIGIL_SETTLE_SECONDS": "0.5"})
    store = open_store(v.state_dir, v.db_url, create=True)
    try:
        schema.upgrade(store.engine)
    finally:
        store.dispose()
    try:
        yield v
    finally:
        v.cleanup()


def run(v: Vigil, short_tmp: Path, point: str, failing: bool, double: bool) -> Rollout:
    flags = short_tmp / "flags"
    flags.mkdir()
    if failing:
        (flags / "fail-web2").touch()
    for h in HOSTS:
        v.run("host", "add", h, "--build", str(HELLO), "--health-timeout", "5",
              "--drain-timeout", "2")
    setup, off = start(v)
    ready(v, setup, off)
    for h in HOSTS:
        v.run("wake", h)
    try:
        wait_for(lambda: all(v.status(h)["state"] == "awake" for h in HOSTS), 60, what="awake")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {[v.status(h) for h in HOSTS]}\n{tail(v, off)}") from None
    assert v.stop_agent(setup) == 0
    new = build_variant(short_tmp / "hello-next.py", flags)

    agent, off = start(v, crash_at=point)
    ready(v, agent, off)
    v.run("rollout", "start", str(new), "--hosts", "web*", "--waves", "1,2",
          *(["--auto-revert"] if failing else []))
    died = expect_sigkill(v, agent, point, off)
    print(f"died at {died}")
    if double:
        agent, off = start(v, crash_at="*#2")  # past recover.adopted, which comes first
        print(f"recovering agent died at {expect_sigkill(v, agent, '*#2', off)}")
    agent, off = start(v)
    ready(v, agent, off)
    try:
        wait_for(lambda: v.store.read(lambda s: s.execute(select(Rollout.state)).scalar())
                 is RolloutState.ended, 90, what="the rollout to end")
        v.quiesce(30)
        v.check()
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n--- agent log ---\n{tail(v)}") from None
    (r,) = v.store.read(lambda s: s.execute(select(Rollout)).scalars().all())
    return r


def check(v: Vigil, r: Rollout, failing: bool, outcome: str) -> None:
    assert r.outcome is RolloutOutcome(outcome), (r.outcome, r.reason)
    assert len(v.store.read(lambda s: s.execute(select(Event.id).where(
        Event.kind == "rollout_ended")).all())) == 1, "the rollout ended more than once"
    waves = [e for e in v.store.read(lambda s: s.execute(select(Event.kind).where(
        Event.kind == "rollout_wave_admitted")).scalars().all())]
    assert len(waves) == (2 if failing else 3), waves
    old, new = digest(HELLO)[:12], None
    for h in HOSTS:
        ours = v.store.read(lambda s, h=h: s.execute(select(Attempt).where(
            Attempt.host == h, Attempt.cause == Cause.rollout).order_by(Attempt.id)).scalars().all())
        forward = [a for a in ours if a.build_id == r.build_id and a.outcome is Outcome.done]
        assert len(forward) <= 1, f"{h} deployed {len(forward)} times in its wave"
        new = r.digest[:12]
        if failing:
            assert serving(v, h).build == old, f"{h} is not back on the old build"
        else:
            assert len(forward) == 1 and serving(v, h).build == new, (h, [(a.id, a.outcome) for a in ours])


@pytest.mark.parametrize("point,failing,outcome", CASES,
                         ids=[f"{p.replace('#', '-')}{'-revert' if f else ''}" for p, f, _ in CASES])
def test_kill9_at_a_rollout_point(vigil: Vigil, short_tmp: Path, point: str, failing: bool,
                                  outcome: str) -> None:
    check(vigil, run(vigil, short_tmp, point, failing, double=False), failing, outcome)


@pytest.mark.parametrize("point,failing,outcome", [c for c in CASES if c[0] != "rollout.ended"],
                         ids=[f"{p.replace('#', '-')}{'-revert' if f else ''}" for p, f, _ in CASES
                              if p != "rollout.ended"])
def test_double_kill9_at_a_rollout_point(vigil: Vigil, short_tmp: Path, point: str,
                                         failing: bool, outcome: str) -> None:
    check(vigil, run(vigil, short_tmp, point, failing, double=True), failing, outcome)


def test_the_agent_stopping_mid_wave_abandons_nothing_twice(vigil: Vigil, short_tmp: Path) -> None:
    """SIGTERM (not a crash) while a wave runs: the next agent finishes the rollout; an
    attempt the stop cut short (abandoned, 'shutting down') is written again, once."""
    vigil.env["VIGIL_SETTLE_SECONDS"] = "3"  # the canary's settle: the stop lands inside it
    for h in HOSTS:
        vigil.run("host", "add", h, "--build", str(HELLO), "--health-timeout", "5")
    agent, off = start(vigil)
    ready(vigil, agent, off)
    for h in HOSTS:
        vigil.run("wake", h)
    wait_for(lambda: all(vigil.status(h)["state"] == "awake" for h in HOSTS), 60, what="awake")
    new = build_variant(short_tmp / "hello-next.py")
    vigil.run("rollout", "start", str(new), "--hosts", "web*", "--waves", "100%", "--canary")
    wait_for(lambda: vigil.store.read(lambda s: s.execute(select(Attempt.id).where(
        Attempt.step == "healthy")).first()), 30, what="a canary settling")
    assert vigil.stop_agent(agent, signal.SIGTERM) == 0
    agent, off = start(vigil)
    ready(vigil, agent, off)
    wait_for(lambda: vigil.store.read(lambda s: s.execute(select(Rollout.state)).scalar())
             is RolloutState.ended, 90, what="the rollout to end")
    (r,) = vigil.store.read(lambda s: s.execute(select(Rollout)).scalars().all())
    assert r.outcome is RolloutOutcome.done, r.reason
    cut = [a for a in vigil.store.read(lambda s: s.execute(select(Attempt)).scalars().all())
           if a.outcome is Outcome.abandoned]
    assert cut and all("shutting down" in (a.reason or "") for a in cut), [
        (a.id, a.outcome, a.reason) for a in cut]
    reissued = vigil.store.read(lambda s: s.execute(select(Event.host).where(
        Event.kind == "rollout_reissued")).scalars().all())
    assert sorted(reissued) == sorted(a.host for a in cut)
    for h in HOSTS:
        assert serving(vigil, h).build == r.digest[:12]
        done = vigil.store.read(lambda s, h=h: s.execute(select(Attempt.id).where(
            Attempt.host == h, Attempt.outcome == Outcome.done)).all())
        assert len(done) == 1, f"{h} deployed {len(done)} times"
    vigil.quiesce(30)
    vigil.check()
