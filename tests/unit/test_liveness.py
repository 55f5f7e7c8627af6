"""The liveness backstop (every 30 s when exits arrive by pidfd): a leader whose exit the
watcher reports is not read again; any other dead leader still is; the leaders'
descendants are walked a slice a turn."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select

from models.store import utcnow
from models.tables import Event, Watchdog
from runners.agent import sweep
from tests.conftest import pid_dead, wait_for
from tests.model.apps import write_app
from tests.model.box import Box
from workflows.lifecycle.members import count_current_leaders, leaders_after, retire_dead_currents
from workflows.lifecycle.wake import request_wake


@pytest.fixture
def box(short_tmp: Path) -> Iterator[Box]:
    b = Box(short_tmp, agent_id="liveness-agent", proof_wait=0.2)
    try:
        yield b
    finally:
        b.close()


def test_backstop_skips_watched_leaders_and_retires_the_others(box: Box, short_tmp: Path) -> None:
    src = short_tmp / "src"
    src.mkdir()
    app = write_app(src, "good", "good")
    for h in ("watched", "unwatched"):
        box.add_host(h, app)
        box.store.write(lambda s, h=h: request_wake(s, h))
    box.quiesce()
    gens = box.currents()
    for g in gens.values():
        os.kill(g.pid, signal.SIGKILL)
        wait_for(lambda g=g: pid_dead(g.pid), 10, what=f"leader {g.pid} gone")
    # The watcher holds a pidfd for `watched`: its exit is its event, not the backstop's.
    assert retire_dead_currents(box.ctx, skip={gens["watched"].id}) == 1
    assert set(box.currents()) == {"watched"}
    assert retire_dead_currents(box.ctx) == 1  # once not watched, the backstop finds it
    assert box.currents() == {}


def test_the_backstop_walks_a_slice_a_turn_and_skips_a_cycle_when_nothing_forked(
        box: Box, short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 42 item 1: an idle backstop's walk of the leaders' descendants costs a slice,
    not every leader; every leader is walked once a cycle; a cycle is skipped only when the
    box's fork count has not moved since the last whole cycle began."""
    src = short_tmp / "src"
    src.mkdir()
    app = write_app(src, "good", "good")
    for h in ("a", "b", "c"):
        box.add_host(h, app)
        box.store.write(lambda s, h=h: request_wake(s, h))
    box.quiesce()
    ids = sorted(g.id for g in box.currents().values())
    assert count_current_leaders(box.ctx) == 3
    assert list(leaders_after(box.ctx, ids[0], 5)) == ids[1:]
    forks = [100]
    monkeypatch.setattr(sweep, "forks_since_boot", lambda: forks[0])
    walks = sweep.Walks(box.ctx, size=2)
    walks.turn()
    assert (walks.walked, walks.after) == (2, ids[1])  # a slice of two
    walks.turn()
    assert (walks.walked, walks.after) == (3, 0)  # the third: the cycle is whole
    walks.turn()
    assert walks.walked == 3  # nothing forked since the cycle began: skipped
    forks[0] += 1
    walks.turn()
    walks.turn()
    assert walks.walked == 6  # something forked: a whole cycle again


def test_an_exit_heard_after_a_watchdog_fired_is_recorded_as_the_watchdogs(
        box: Box, short_tmp: Path) -> None:
    """The watchdog writes its fire, sends SIGABRT, then retires the generation; the exit
    of the aborted leader can be heard between the two (the clean-clone .ci/run at 1fbc8aa
    recorded `leader killed by SIGABRT`). Whichever commits first, the exit's reason is
    the watchdog's."""
    src = short_tmp / "src"
    src.mkdir()
    box.add_host("pinger", write_app(src, "good", "good"))
    box.store.write(lambda s: request_wake(s, "pinger"))
    box.quiesce()
    gen = box.currents()["pinger"]
    box.store.write(lambda s: s.add(Watchdog(generation_id=gen.id, host="pinger", period=2.0,
                                             fired_at=utcnow(),
                                             reason="no WATCHDOG=1 within 2s")))
    os.kill(gen.pid, signal.SIGABRT)
    wait_for(lambda: pid_dead(gen.pid), 10, what=f"leader {gen.pid} gone")
    assert retire_dead_currents(box.ctx) == 1
    (exited,) = box.store.read(lambda s: s.execute(select(Event.detail).where(
        Event.kind == "exited", Event.generation_id == gen.id)).scalars().all())
    assert json.loads(exited)["reason"].startswith("watchdog: no WATCHDOG=1 within 2s"), exited
