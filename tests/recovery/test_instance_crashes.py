"""Recovery of a host of instances (three processes of hello on one held TCP listener):
the agent is SIGKILLed at a step boundary of each workflow that handles several slots,
mid-way through them (`point#k`: its k-th hit, so a later slot than the first), then a
clean agent finishes the work. After it: `vigil check` passes, every slot is current on
the build the workflow was taking it to (a deploy cut before a switch is written again
as a resumed attempt, which replaces every slot), each current one holds the very socket,
and no process of a generation that is not current is left."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy import select

from models.states import GenState, Outcome
from models.tables import Attempt, Generation, Host
from tests.conftest import Vigil, pid_dead, wait_for
from tests.integration.test_instances import holds, serve_builds_hello, slots_up
from tests.listening import free_port, store_inode
from tests.recovery.test_crashpoints import adoptions

pytestmark = pytest.mark.timeout(120)
N = 3


@dataclass(frozen=True)
class Case:
    drive: Callable[[Vigil, Path], None]
    end: str  # "new": every slot on the deployed build; "same": on the first; "asleep";
    # "more", "fewer": scaled to N + 2 or to 1, the slots that stay keeping their pids


def deploy(mode: str) -> Callable[[Vigil, Path], None]:
    def drive(v: Vigil, build: Path) -> None:
        v.run("deploy", "web", str(build), "--mode", mode)
    return drive


def stop(v: Vigil, _: Path) -> None:
    v.run("stop", "web")


def scale(n: int) -> Callable[[Vigil, Path], None]:
    def drive(v: Vigil, _: Path) -> None:
        v.run("scale", "web", str(n))
    return drive


def kill_slot_1(v: Vigil, _: Path) -> None:
    os.kill(v.status("web")["slots"][1]["pid"], signal.SIGKILL)


CASES = {
    # overlap: one slot at a time; the points of the second and third slots
    "swap.admitted#2": Case(deploy("overlap"), "new"),
    "swap.spawned#2": Case(deploy("overlap"), "new"),
    "swap.switched#2": Case(deploy("overlap"), "new"),
    "swap.drain_termed#3": Case(deploy("overlap"), "new"),
    "swap.drained#1": Case(deploy("overlap"), "new"),  # slot 0 drained, slot 1 admitted
    # hold: every slot stopped and proven, then each started
    "swap.old_stopped": Case(deploy("hold"), "new"),
    "swap.successor#2": Case(deploy("hold"), "new"),
    "swap.switched#1": Case(deploy("hold"), "new"),  # slot 0 current, slot 1 not written
    "swap.spawned#3": Case(deploy("hold"), "new"),
    # a stop retires every slot at once; an exit restarts its slot alone
    "stop.intent": Case(stop, "asleep"),
    "member.exited": Case(kill_slot_1, "same"),
    # scale: up is a wake of each new slot, down a stop of each slot removed
    "wake.current#1": Case(scale(N + 2), "more"),
    "wake.spawned#2": Case(scale(N + 2), "more"),
    "stop.termed#2": Case(scale(1), "fewer"),
    "stop.proven#1": Case(scale(1), "fewer"),
}


def arrange(v: Vigil, short_tmp: Path) -> tuple[list[Path], list[dict]]:
    """The host of N instances awake on the first build, its agent stopped: the builds, and
    the slots as they served."""
    builds = serve_builds_hello(short_tmp)
    v.run("host", "add", "web", "--build", str(builds[0]), "--listen",
          f"http=tcp:127.0.0.1:{free_port()}", "--instances", str(N), "--drain-timeout", "3")
    setup = v.start_agent()
    v.wait_ready(setup)
    v.run("wake", "web", "--wait")
    first = slots_up(v, "web", N)
    v.stop_agent(setup)
    return builds, first


def crash_at(v: Vigil, point: str, drive: Callable[[], None] | None = None) -> bool:
    """An agent armed at `point`, `drive` run once it is ready; True when it died there by
    SIGKILL, False when it finished (ready, nothing open) without reaching it."""
    before = len(v.agent_log())
    crash = v.start_agent(point)
    wait_for(lambda: crash.poll() is not None
             or b"logger=vigil.agent ready" in v.agent_log()[before:], 30,
             what="crash agent ready")
    if drive is not None:
        drive()
    else:
        wait_for(lambda: crash.poll() is not None or not v.obligations(), 30,
                 what="the armed agent dead or done")
        if crash.poll() is None:
            v.stop_agent(crash)
            return False
    assert crash.wait(30) == -signal.SIGKILL, v.agent_log()[before:].decode()[-3000:]
    assert f"crash point={point.partition('#')[0]}".encode() in v.agent_log()[before:] \
        or point.startswith("*")
    return True


def finish_and_check(v: Vigil, case: Case, first: list[dict]) -> None:
    """A clean agent finishes; then the end the case names holds (see the module's doc)."""
    v.wait_ready_after(v.start_agent(), v.ready_count())
    if case.end == "asleep":
        wait_for(lambda: v.status("web")["state"] in ("asleep", "down"), 60, what="web asleep")
    v.quiesce(60)
    v.check()
    want = {"asleep": 0, "more": N + 2, "fewer": 1}.get(case.end, N)
    now = [] if case.end == "asleep" else (
        slots_up(v, "web", want) if want > 1 else [v.status("web")])
    gens = v.store.read(lambda s: s.execute(select(Generation).where(
        Generation.host == "web")).scalars().all())
    for g in gens:
        if g.state is not GenState.current and g.pid:
            assert pid_dead(g.pid), f"g{g.id} ({g.state.value}) pid {g.pid} is alive"
    if case.end == "asleep":
        assert not [g for g in gens if g.state is GenState.current]
        return
    inode = store_inode(v, "web")
    assert inode and all(holds(x["pid"], inode) for x in now), now
    currents = [g for g in gens if g.state is GenState.current]
    assert sorted(g.slot for g in currents) == list(range(want))
    if case.end in ("more", "fewer"):  # the slots kept serve with the pids they had
        kept = min(want, N)
        assert [x["pid"] for x in now[:kept]] == [x["pid"] for x in first[:kept]], now
        return
    check_builds(v, case, currents, first, now)


def check_builds(v: Vigil, case: Case, currents: list[Generation], first: list[dict],
                 now: list[dict]) -> None:
    live = v.store.read(lambda s: s.get(Host, "web").build_id)
    assert all(g.build_id == live for g in currents), [(g.id, g.build_id, live) for g in currents]
    newest = v.store.read(lambda s: s.execute(select(Attempt).order_by(
        Attempt.id.desc()).limit(1)).scalar())
    if case.end == "new":
        assert newest is not None and newest.outcome is Outcome.done, newest and newest.reason
        assert not {g.id for g in currents} & {x["generation"] for x in first}
    else:  # an exit restarts its slot alone: the others kept their pids
        assert [x["pid"] for x in now][0::2] == [x["pid"] for x in first][0::2]
        assert now[1]["pid"] != first[1]["pid"]


@pytest.mark.parametrize("point", sorted(CASES))
def test_crash_mid_instances(vigil: Vigil, short_tmp: Path, point: str) -> None:
    case = CASES[point]
    builds, first = arrange(vigil, short_tmp)
    assert crash_at(vigil, point, lambda: case.drive(vigil, builds[1]))
    finish_and_check(vigil, case, first)


SCALING = sorted(p for p, c in CASES.items() if c.end in ("more", "fewer"))


@pytest.mark.parametrize("point", SCALING)
def test_double_crash_mid_scaling(vigil: Vigil, short_tmp: Path, point: str) -> None:
    """Scaling cut at `point`, then the agent recovering from it cut again at the first
    crash point it reaches past adopting the slots (`*#k`, k past the adoption's point),
    then a clean agent: the same end as one crash. Scaling up always has slots left to
    start past the adoption; a scale-down's termed slots may have ended by the time the
    recovering agent looks, and its adoption retires them: nothing is left to crash at."""
    case = CASES[point]
    builds, first = arrange(vigil, short_tmp)
    assert crash_at(vigil, point, lambda: case.drive(vigil, builds[1]))
    second = crash_at(vigil, f"*#{adoptions(vigil) + 1}")
    assert second or point.startswith("stop."), "recovery reached no point past adoption"
    finish_and_check(vigil, case, first)
