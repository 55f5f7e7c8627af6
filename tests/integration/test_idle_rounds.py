"""An idle agent on SQLite does not start a round over every host for each of its own
commits (its heartbeat, every TTL/3, changes `PRAGMA data_version` for the wake-up poll's
connection: runners/base/wakeup.py), and an intent written by a writer that did not ring
the doorbell is still picked up by that poll within seconds (the safety scan set to 60 s
here, so nothing else could)."""

from __future__ import annotations

import pytest
from sqlalchemy import func, select

from models.tables import Agent, Generation
from tests.conftest import Vigil, wait_for
from workflows.lifecycle.wake import request_wake

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.sqlite_only("the data_version poll is SQLite's wake-up")]


def rounds(vigil: Vigil) -> int:
    return int(vigil.json("agent", "status")["rounds"])


def beats(vigil: Vigil, seen: list[object]) -> int:
    """Heartbeats seen so far (each poll adds the row's heartbeat_at when it moved)."""
    at = vigil.store.read(lambda s: s.execute(select(Agent.heartbeat_at)).scalar_one())
    if not seen or seen[-1] != at:
        seen.append(at)
    return len(seen)


def test_own_heartbeats_start_no_round_and_an_unrung_intent_still_wakes(vigil: Vigil) -> None:
    vigil.add_host("hello")
    agent = vigil.start_agent(None, "--lease-ttl", "3", "--safety-interval", "60")  # a beat a second
    vigil.wait_ready(agent)
    wait_for(lambda: vigil.obligations() == [], 20, what="the first rounds done")
    before = rounds(vigil)
    seen: list[object] = []
    wait_for(lambda: beats(vigil, seen) >= 5, 30, what="four heartbeats after the first look")
    assert rounds(vigil) == before, "the agent's own heartbeats started rounds"

    vigil.store.write(lambda s: request_wake(s, "hello"))  # written here: nothing rings
    wait_for(lambda: vigil.store.read(lambda s: s.execute(
        select(func.count()).select_from(Generation).where(
            Generation.host == "hello", Generation.state == "current")).scalar_one()) == 1,
        20, what="the unrung wake picked up by the data_version poll")
    assert rounds(vigil) > before
