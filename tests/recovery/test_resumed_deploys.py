"""The operator's deploy outlives the agent (issue 24 item 7).

An overlap deploy whose agent is SIGKILLed before the switch is abandoned by the next
agent (its successor killed; never a build failure) and, in the same transaction, written
again as a new attempt (cause `resumed`, naming the one it replaces), which runs: with no
second command the host ends on the new build. At most 3 times for one request. A hold
deploy interrupted the same way is finished by its own attempt. `vigil deploy --wait`
across the restart follows the request to its end.

Each test drives a real agent with `VIGIL_CRASH_AT` (tests/recovery/test_crashpoints.py's
harness), then a clean agent, and checks the same invariants as the crash suite, plus the
chain of attempts, the events and `vigil status`."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from models.states import Cause, Outcome
from models.tables import Attempt, Event
from tests.conftest import HELLO, ROOT, Vigil, wait_for
from tests.recovery.test_crashpoints import (
    CANARY,
    HOLD,
    OVERLAP_RESUMED,
    TARGET,
    Flow,
    add_host,
    assert_serving,
    expect_sigkill,
    new_build,
    ready,
    rows,
    run_scenario,
    start,
    vigil,  # noqa: F401  (the fixture)
)
from workflows.deploys.request import MAX_RESUMES

pytestmark = pytest.mark.timeout(240)

# Every crash point an overlap deploy reaches before its switch. Without a canary,
# "healthy" is written in the switch's own commit, so swap.healthy is past the switch;
# with one, healthy and settled are their own commits before it.
OVERLAP_BEFORE_SWITCH = ["swap.admitted", "swap.raised", "swap.published", "swap.spawning",
                         "swap.execd", "swap.spawned"]
CANARY_BEFORE_SWITCH = ["swap.healthy", "swap.settled"]
# A hold deploy's points before its switch (the old generation is stopped first).
HOLD_BEFORE_SWITCH = ["swap.admitted", "swap.old_stopping", "swap.old_stopped", "swap.successor",
                      "swap.spawning", "swap.execd", "swap.spawned", "swap.healthy"]
NOT_EXECUTED = {"swap.admitted", "swap.raised", "swap.published"}  # nothing exec'd yet


def attempts(v: Vigil) -> list[Attempt]:
    return sorted(rows(v, Attempt, Attempt.host == TARGET), key=lambda a: a.id)


def events(v: Vigil, kind: str) -> list[Event]:
    return rows(v, Event, Event.host == TARGET, Event.kind == kind)


def overlap_flow(point: str) -> Flow:
    if point in CANARY_BEFORE_SWITCH:
        return CANARY.but(attempt=("abandoned", True))
    return OVERLAP_RESUMED.but(attempt=("abandoned", point not in NOT_EXECUTED))


@pytest.mark.parametrize("point", OVERLAP_BEFORE_SWITCH + CANARY_BEFORE_SWITCH)
def test_overlap_interrupted_before_switch_is_resumed(vigil: Vigil, point: str) -> None:  # noqa: F811
    """Killed at `point`, then a clean agent and nothing else: the host serves the NEW
    build on its canonical link; attempt #1 abandoned (never failed), #2 resumed from it
    and done; the events and `vigil status` say so."""
    run_scenario(vigil, overlap_flow(point), (point,))  # serving the new build, chain checked
    first, second = attempts(vigil)
    assert first.outcome is Outcome.abandoned and f"resumed as attempt #{second.id}" in first.reason
    assert (second.cause, second.resumed_from, second.outcome) == (
        Cause.resumed, first.id, Outcome.done), second
    assert not events(vigil, "deploy_failed")
    (resumed,) = events(vigil, "deploy_resumed")
    assert json.loads(resumed.detail)["resumed_from"] == first.id, resumed.detail
    st = vigil.status(TARGET)
    assert st["deploy"] == f"last deploy #{second.id} done (resumed from #{first.id})", st
    assert st["last_attempt"]["id"] == second.id


@pytest.mark.parametrize("point", HOLD_BEFORE_SWITCH)
def test_hold_interrupted_before_switch_is_finished(vigil: Vigil, point: str) -> None:  # noqa: F811
    """A hold deploy killed at `point` ends on the new build too, with no second command:
    its own attempt is finished (the old generation was stopped first, so nothing is
    abandoned and nothing written again)."""
    run_scenario(vigil, HOLD, (point,))
    (a,) = attempts(vigil)
    assert a.outcome is Outcome.done and a.resumed_from is None, (a.outcome, a.reason)
    assert vigil.status(TARGET)["deploy"] == f"last deploy #{a.id} done"


def test_resumed_at_most_three_times(vigil: Vigil) -> None:  # noqa: F811
    """Killed at the spawn of the request and of each of its 3 resumptions: the 4th agent
    to find it abandons it for good, saying why (events and status); the old generation
    served throughout and still does."""
    chain = ("swap.spawned",) * (MAX_RESUMES + 1)
    flow = OVERLAP_RESUMED.but(target_fate="kept", resumed=("abandoned", True))
    run_scenario(vigil, flow, chain)
    found = attempts(vigil)
    assert len(found) == MAX_RESUMES + 1, [(a.id, a.reason) for a in found]
    last = found[-1]
    assert last.outcome is Outcome.abandoned and "not resumed: already resumed 3 times" in last.reason
    (given_up,) = events(vigil, "deploy_not_resumed")
    assert "already resumed 3 times" in json.loads(given_up.detail)["reason"], given_up.detail
    st = vigil.status(TARGET)
    assert st["deploy"].startswith(f"last deploy #{last.id} abandoned (resumed from #{found[-2].id})")
    assert "not resumed: already resumed 3 times" in st["deploy"], st["deploy"]


def test_deploy_wait_follows_the_resumed_attempt(vigil: Vigil) -> None:  # noqa: F811
    """`vigil deploy --wait` sent to an agent that is SIGKILLed at the spawn and started
    again at once: the wait reports the abandoned attempt, goes on with the resumed one and
    exits 0 once it is done."""
    from workflows.lifecycle.wake import request_wake

    vigil.env["VIGIL_SETTLE_SECONDS"] = "0.5"
    add_host(vigil, TARGET, HELLO)
    vigil.store.write(lambda s: request_wake(s, TARGET))
    agent, off = start(vigil, crash_at="swap.spawned")
    ready(vigil, agent, off)
    wait_for(lambda: vigil.status(TARGET)["state"] == "awake", 20, what="target awake")
    build = new_build(vigil)
    cli = subprocess.Popen([sys.executable, "-m", "runners.cli", "deploy", TARGET, str(build),
                            "--wait", "--timeout", "120"], env=vigil.env, cwd=ROOT,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        expect_sigkill(vigil, agent, "swap.spawned", off)
        clean, off = start(vigil)  # at once: what `vigil agent start` does
        out, err = cli.communicate(timeout=180)
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait(10)
    ready(vigil, clean, off)
    first, second = attempts(vigil)
    assert cli.returncode == 0, f"exit {cli.returncode}:\n{out}{err}"
    assert f"attempt #{first.id} abandoned: interrupted at step spawned" in out, out
    assert f"resumed as attempt #{second.id}" in out, out
    assert f"attempt #{second.id} done" in out, out
    assert second.outcome is Outcome.done and second.resumed_from == first.id
    vigil.quiesce(30)
    assert_serving(vigil, TARGET)
    assert vigil.stop_agent(clean, signal.SIGTERM) == 0
