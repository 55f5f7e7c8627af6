"""The connection budget of one agent on PostgreSQL (models/store.py, docs/guides/several-
boxes.md): every connection named vigil-<box>-<purpose>, and an idle agent, after a busy
wake, holds no more than the budget says."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from sqlalchemy import text

from models.states import HostKind
from models.store import IDLE_CONNECTIONS, POOL_SIZE
from runners.backend.files import stage_build
from runners.base.wakeup import notify_boxes
from tests.conftest import wait_for
from workflows.config.hosts import add_host
from workflows.lifecycle.wake import request_wake

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.postgresql_only("connections of an agent to a PostgreSQL store")]

HOSTS = 12  # more than the drive threads (8): the wake runs every one of them at once


def named(box, url_db: str) -> dict[str, int]:  # type: ignore[no-untyped-def]
    """Connections to the test's database by application_name (this reader's own left out)."""
    return dict(box.store.read(lambda s: s.execute(text(
        "SELECT application_name, count(*) FROM pg_stat_activity WHERE datname = :db "
        "AND pid <> pg_backend_pid() GROUP BY 1"), {"db": url_db}).all()))


def test_idle_agent_holds_at_most_its_budget(boxes, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    a = boxes("a")
    a.start()
    build = tmp_path / "worker.sh"
    build.write_text("#!/bin/sh\nexec sleep 100000\n")
    build.chmod(0o755)
    path, digest = stage_build(str(build), a.state_dir)
    names = [f"w{i}" for i in range(HOSTS)]

    def add(s):  # type: ignore[no-untyped-def]
        for n in names:
            add_host(s, n, kind=HostKind.worker, build_path=path, digest=digest, source=str(build),
                     args=[], env={}, cwd=None, drain_timeout=2.0, health_timeout=5.0, box="a")
            request_wake(s, n)

    a.store.write(add)
    notify_boxes(a.store)
    db = a.store.engine.url.database
    busiest = 0

    def quiet() -> bool:
        nonlocal busiest
        busiest = max(busiest, named(a, db).get("vigil-a-store", 0))
        return a.store.read(lambda s: s.execute(text(
            "SELECT (SELECT count(*) FROM generations WHERE state = 'current') = :n AND "
            "NOT EXISTS (SELECT 1 FROM pending_obligations)"), {"n": HOSTS}).scalar())

    wait_for(quiet, 90, what=f"{HOSTS} workers up and nothing open")

    def mine() -> dict[str, int]:
        return {k: v for k, v in named(a, db).items() if k.startswith("vigil-a-")}

    # The round that saw the last row end may still hold a burst connection; then idle
    # (with 10 + 10, the pool kept every connection the wake opened: this never came).
    wait_for(lambda: sum(mine().values()) <= IDLE_CONNECTIONS, 10, what="the agent idle")
    # Idle now: sampled over two sweeps and a lease renewal (TTL 6: one a second).
    seen: list[dict[str, int]] = []
    until = time.monotonic() + 2.5
    while time.monotonic() < until:
        seen.append(named(a, db))
        time.sleep(0.05)
    for sample in seen:
        assert all(k.startswith("vigil-") for k in sample), f"an unnamed connection: {sample}"
        held = {k: v for k, v in sample.items() if k.startswith("vigil-a-")}
        assert sum(held.values()) <= IDLE_CONNECTIONS, f"idle agent holds {held}"
        assert held.get("vigil-a-store", 0) <= POOL_SIZE, held
        assert held.get("vigil-a-listen") == 1 and held.get("vigil-a-jobs") == 1, held
    print(f"busiest store connections while waking {HOSTS}: {busiest}; idle: {seen[-1]}")
