"""A writer frozen inside a transaction (an agent SIGSTOPped, its VM paused) must not hold
its row locks for ever: PostgreSQL ends its transaction after vigil's idle bound, so the
box that takes its leases over is not blocked behind it (the flake of
test_multibox.py's stopped agent: SIGSTOP landed while the agent's transaction held a row
the other box had to write, and the takeover waited until the test gave up)."""

from __future__ import annotations

import threading

import pytest
from sqlalchemy import text, update

from models.store import IDLE_IN_TRANSACTION_MS
from models.tables import Host
from tests.conftest import Vigil, wait_for

pytestmark = pytest.mark.postgresql_only("SQLite has no row locks: its writer lock ends with the process")


def test_a_frozen_transaction_releases_its_row_locks(vigil: Vigil) -> None:
    vigil.add_host("web")
    frozen = vigil.store.engine.connect()  # the engine every agent and command uses
    frozen.execute(text("UPDATE hosts SET fence_seq = fence_seq + 1 WHERE name = 'web'"))
    done: list[int] = []  # ... and then nothing more: idle in its transaction

    def other_box() -> None:
        done.append(vigil.store.write(lambda s: s.execute(
            update(Host).where(Host.name == "web").values(fence_seq=Host.fence_seq + 1)).rowcount))

    writer = threading.Thread(target=other_box, daemon=True)
    writer.start()
    try:
        wait_for(lambda: done, IDLE_IN_TRANSACTION_MS / 1000 + 20, what="the other box's write")
    finally:
        frozen.invalidate()
    assert done == [1]
    fence = vigil.store.read(lambda s: s.get(Host, "web").fence_seq)  # type: ignore[union-attr]
    assert fence == 1, "the frozen transaction's write must not have committed"
