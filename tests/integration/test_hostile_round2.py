"""Issue 20, round two: false outcomes and messages found by attacking a running agent (a
SIGSTOPped agent, a build deleted mid-rollout, a build replaced while it is staged, a full
disk, non-UTF-8 paths, leftovers of removed hosts). Real agent, real processes."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sqlalchemy import select

from models.tables import Attempt, Generation
from runners.backend.health import get_status
from tests.conftest import HELLO, ROOT, Vigil, wait_for

pytestmark = pytest.mark.timeout(180)
GATED = Path(__file__).parents[1] / "multibox" / "gated.py"


def _newest(vigil: Vigil, host: str) -> Generation | None:
    return vigil.store.read(lambda s: s.execute(
        select(Generation).where(Generation.host == host).order_by(Generation.id.desc())
        .limit(1)).scalar_one_or_none())


def _attempt(vigil: Vigil, attempt_id: int) -> Attempt:
    return vigil.store.read(lambda s: s.get(Attempt, attempt_id))


def _answers(path: str) -> bool:
    try:
        return get_status(path, 1.0) < 500
    except (OSError, ValueError):
        return False


# -- 9. time the agent did not run is not counted against an app ----------------------------

def test_a_paused_agent_does_not_fail_a_good_deploy(vigil: Vigil, short_tmp: Path) -> None:
    """The agent is SIGSTOPped while it waits for a successor's health; the successor starts
    answering meanwhile and the pause outlasts the health timeout: after SIGCONT the deploy
    is done, not failed and held down."""
    gate = short_tmp / "gate"
    vigil.add_host("app", HELLO, "--env", f"GATE={gate}", "--env", f"THEN={HELLO}",
                   "--health-timeout", "2")
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", "app", "--wait")
    first = _newest(vigil, "app")
    assert first is not None
    out = vigil.run("deploy", "app", str(GATED)).stdout
    attempt_id = int(next(w for w in out.split() if w.startswith("#"))[1:])
    wait_for(lambda: (g := _newest(vigil, "app")) is not None and g.id != first.id and g.pid,
             20, what="the successor spawned")
    successor = _newest(vigil, "app")
    assert successor is not None and successor.socket
    os.kill(agent.pid, signal.SIGSTOP)
    try:
        stopped = time.monotonic()
        gate.touch()
        wait_for(lambda: _answers(str(successor.socket)), 20, what="the successor answering")
        wait_for(lambda: time.monotonic() - stopped > 2 + 1.5, 10, what="the health timeout passed")
    finally:
        os.kill(agent.pid, signal.SIGCONT)
    wait_for(lambda: _attempt(vigil, attempt_id).outcome is not None, 30, what="the attempt ended")
    a = _attempt(vigil, attempt_id)
    assert a.outcome.value == "done", (a.outcome, a.reason)
    assert vigil.status("app")["pid"] == successor.pid
    vigil.quiesce(20)
    vigil.check()


# -- 10. a rollout whose build cannot be read halts ------------------------------------------

def test_a_rollout_whose_build_is_deleted_halts_with_that_reason(vigil: Vigil,
                                                                 short_tmp: Path) -> None:
    """The staged build is deleted between wave 1 and wave 2: the rollout halts, naming the
    build that cannot be read, `rollout start --wait` exits non-zero, and no host is tried
    again and again (at most one attempt each)."""
    from models.states import Cause, RolloutOutcome
    from models.tables import Rollout
    from tests.integration.test_rollouts import HOSTS, build_variant, digest, fleet, started_id

    fleet(vigil)
    new = build_variant(short_tmp / "hello-next.py")
    p = subprocess.Popen([sys.executable, "-m", "runners.cli", "rollout", "start", str(new),
                          "--hosts", "web*", "--waves", "1,100%", "--pause", "3", "--wait",
                          "--timeout", "120"], env=vigil.env, cwd=ROOT, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: vigil.store.read(lambda s: s.execute(
            select(Rollout.settled)).scalar()) == 1, 60, what="wave 1 settled")
        shutil.rmtree(vigil.state_dir / "builds" / digest(new))
        out, err = p.communicate(timeout=150)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    rid = started_id(out)
    r = vigil.store.read(lambda s: s.get(Rollout, rid))
    assert p.returncode == 1, out + err
    assert r.outcome is RolloutOutcome.halted, (r.outcome, r.reason)
    assert "cannot be read" in (r.reason or "") and digest(new)[:12] in (r.reason or ""), r.reason
    assert "cannot be read" in err, err
    counts = vigil.store.read(lambda s: [len(s.execute(select(Attempt.id).where(
        Attempt.host == h, Attempt.cause == Cause.rollout)).all()) for h in HOSTS])
    assert counts[0] == 1 and max(counts) <= 1, counts
    vigil.quiesce(30)
    cp = vigil.run("check", check=False)  # web1 runs the deleted build: that, and nothing else
    assert cp.returncode == 1 and cp.stdout.splitlines() == [
        line for line in cp.stdout.splitlines() if line.startswith("referenced_build: ")], cp.stdout
