"""What one firing of a scheduled restart writes, and when it writes nothing (with a
`restart_skipped` event saying why). Real database (the selected one), in-process."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from models import schema
from models.statedir import prepare_state_dir
from models.states import GenState, HostKind
from models.store import Store, utcnow
from models.tables import Attempt, Event, Generation
from tests.conftest import drop_db, new_db
from workflows.config.hosts import add_host
from workflows.deploys.schedules import request_restart


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store(new_db(prepare_state_dir(tmp_path / "state")))
    schema.upgrade(s.engine)
    s.write(lambda x: add_host(x, "web", kind=HostKind.instance, build_path="/b/app",
                               digest="ab" * 32, source="/src/app", args=[], env={}, cwd=None,
                               drain_timeout=5, health_timeout=5))
    try:
        yield s
    finally:
        s.dispose()
        drop_db(s.url)


def run(store: Store) -> Attempt | None:
    return store.write(lambda s: request_restart(s, "web"))


def skipped(store: Store) -> list[str]:
    return [json.loads(e.detail)["reason"] for e in store.read(lambda s: s.execute(
        select(Event).where(Event.kind == "restart_skipped").order_by(Event.id)).scalars().all())]


def make_current(s: Session) -> None:
    s.add(Generation(uuid=str(uuid.uuid4()), host="web", build_id=1, state=GenState.current,
                     fence=1, pid=1, agent_id="a", created_at=utcnow(), current_at=utcnow()))


def test_restart_of_the_running_build_then_skips(store: Store) -> None:
    assert run(store) is None  # asleep: nothing to restart
    store.write(make_current)
    a = run(store)
    assert a is not None
    assert (a.cause.value, a.mode.value, a.build_id, a.canary) == ("restart", "overlap", 1, False)
    assert run(store) is None  # the first is still in flight
    store.write(lambda s: s.execute(Attempt.__table__.update().values(outcome="done")))
    assert run(store) is None  # a repeat firing moments later (crash before the store noted it)
    assert skipped(store) == ["the host is not running", f"attempt #{a.id} is in flight",
                              f"restart attempt #{a.id} was written moments ago"]
