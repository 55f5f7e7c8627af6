"""The liveness backstop (the 30 s full check when exits arrive by pidfd): a leader whose
exit the watcher reports is not read again; any other dead leader still is."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import pid_dead, wait_for
from tests.model.apps import write_app
from tests.model.box import Box
from workflows.lifecycle.members import retire_dead_currents
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
