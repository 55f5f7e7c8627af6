"""An overlap's switch racing the old generation's exit on PostgreSQL (chaos seed 9 on
PostgreSQL: the old leader was killed as its successor became healthy; the exit's commit
landed between the switch's read of the current generation and its move of it, the move
matched no row, LostRace, and the deploy was abandoned with nothing after it). The
switch's read locks the row: it waits for the exit's commit, then finds no current one."""

from __future__ import annotations

import threading

import pytest
from sqlalchemy import text

from models.tables import Generation
from tests.conftest import Vigil, wait_for
from workflows.deploys.overlap import current_locked

pytestmark = pytest.mark.postgresql_only("SQLite serializes its writers: no read can race a commit")


def test_the_switch_read_waits_for_an_exit_in_flight_and_sees_it(vigil: Vigil) -> None:
    vigil.add_host("web")
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", "web", "--wait")
    vigil.run("stop", "web", "--wait")  # its generation ends: a row to put back
    vigil.stop_agent(agent)
    gen = vigil.store.read(lambda s: s.query(Generation).filter_by(host="web").one())
    with vigil.store.engine.connect() as conn:  # put the generation back as current
        conn.execute(text("UPDATE generations SET state = 'current' WHERE id = :g"), {"g": gen.id})
        conn.commit()

    exit_in_flight = vigil.store.engine.connect()
    exit_in_flight.execute(text("UPDATE generations SET state = 'retiring' WHERE id = :g"),
                           {"g": gen.id})  # the exit's step, not committed yet
    seen: list[object] = []
    reader = threading.Thread(target=lambda: seen.append(vigil.store.write(
        lambda s: (g.id if (g := current_locked(s, "web")) is not None else None))))
    reader.start()
    try:
        reader.join(1.0)
        assert reader.is_alive(), f"the switch's read did not wait for the exit in flight: {seen}"
    finally:
        exit_in_flight.commit()
        exit_in_flight.close()
    reader.join(20)
    wait_for(lambda: seen, 20, what="the switch's read")
    assert seen == [None], f"the switch saw g{seen[0]} current after its exit committed"
