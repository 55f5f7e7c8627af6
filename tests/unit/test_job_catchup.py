"""A job's catch-up policy (workflows/lifecycle/catchup.py): which instants the tick runs and
which it records missed, from the schedule, the last recorded instant and when this agent
began, alone; and the one missed row written at the last missed instant."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime, timedelta
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
from sqlalchemy import select

from models import schema
from models.errors import BadInput
from models.statedir import prepare_state_dir
from models.states import HostKind, RunState
from models.store import Store, utcnow
from models.tables import Build, Event, Host, JobRun
from tests.conftest import drop_db, new_db
from workflows.lifecycle.catchup import (
    CATCH_UP,
    CATCH_UP_CAP,
    SCHEDULED,
    Plan,
    backlog,
    check_catch_up,
    plan,
    write_missed,
)
from workflows.lifecycle.jobs import next_instant

T0 = datetime(2026, 12, 5, 9, 0, 0)
S = timedelta(seconds=1)


def job(catch_up: str = "one", window: float | None = None, every: float | None = 5.0,
        schedule: str | None = None, owed: tuple[str, ...] = ()) -> SimpleNamespace:
    return SimpleNamespace(every=every, schedule=schedule, timezone=None, catch_up=catch_up,
                           catch_up_window=window, runs_from=T0 - 3600 * S, owed=owed)


def plan_of(j: SimpleNamespace, last: datetime | None, now: datetime, up: datetime) -> Plan:
    return plan(j, partial(next_instant, j), last, now, up)


# An outage: the last instant recorded at T0, the agent back at T0+32 s (instants at
# +5 .. +30 passed with no agent), its first turn at +32.5 s.
LAST, UP, NOW = T0, T0 + 32 * S, T0 + 32.5 * S
OUTAGE = [T0 + k * 5 * S for k in range(1, 7)]


def test_none_runs_nothing_missed_and_writes_one_row_for_them() -> None:
    p = plan_of(job("none"), LAST, NOW, UP)
    assert p.run is None and p.missed is not None
    assert (p.missed.first, p.missed.last, p.missed.count) == (OUTAGE[0], OUTAGE[-1], 6)
    assert "6 instants missed" in p.missed.reason("none")
    # on time (the agent ran then): the instant due runs
    on_time = plan_of(job("none"), T0, T0 + 5.2 * S, T0 - 60 * S)
    assert on_time == Plan(None, T0 + 5 * S, SCHEDULED)


def test_one_runs_the_last_missed_and_records_the_others() -> None:
    p = plan_of(job("one"), LAST, NOW, UP)
    assert p.run == OUTAGE[-1] and p.cause == CATCH_UP
    assert p.missed is not None and (p.missed.last, p.missed.count) == (OUTAGE[-2], 5)
    # a window the last one is out of: nothing runs
    out = plan_of(job("one", window=2.0), LAST, NOW, UP)
    assert out.run is None and out.missed is not None and out.missed.count == 6


def test_all_runs_each_in_the_window_oldest_first_one_at_a_time() -> None:
    p = plan_of(job("all"), LAST, NOW, UP)
    assert p == Plan(None, OUTAGE[0], CATCH_UP)  # the oldest first, nothing missed
    # the next turn, that run written (the last recorded) and still owed: the next waits
    owed = plan_of(job("all", owed=(CATCH_UP,)), OUTAGE[0], NOW, UP)
    assert owed.run is None and owed.waits and owed.missed is None and not owed.writes
    assert plan_of(job("all"), OUTAGE[0], NOW, UP).run == OUTAGE[1]  # once it ended
    # a window of 15 s at +32.5: +20, +25, +30 run; +5 .. +15 are missed (one row, at +15)
    w = plan_of(job("all", window=15.0), LAST, NOW, UP)
    assert w.run == OUTAGE[3] and w.missed is not None
    assert (w.missed.first, w.missed.last, w.missed.count) == (OUTAGE[0], OUTAGE[2], 3)


def test_an_instant_on_time_waits_behind_a_catch_up_run_and_overlaps_a_run_on_time() -> None:
    at = T0 + 5 * S  # due now, the agent up long before
    behind = plan_of(job("all", owed=(CATCH_UP,)), T0, at + 0.1 * S, T0 - 60 * S)
    assert behind.run is None and behind.waits
    overlap = plan_of(job("all", owed=(SCHEDULED,)), T0, at + 0.1 * S, T0 - 60 * S)
    assert overlap.run == at and overlap.cause == SCHEDULED  # write_run's overlap policy decides


def test_all_is_capped_a_day_down_every_second_is_one_missed_row() -> None:
    j = job("all", every=1.0)
    now = T0 + 86400 * S + 0.5 * S
    p = plan_of(j, T0, now, now)
    assert p.missed is not None and p.missed.count == 86400 - CATCH_UP_CAP and p.missed.exact
    assert p.run == T0 + (86400 - CATCH_UP_CAP + 1) * S
    assert p.missed.last == p.run - S


def test_a_cron_line_far_behind_is_walked_within_a_bound() -> None:
    j = job("one", every=None, schedule="* * * * *")
    now = T0 + timedelta(days=30, seconds=30)
    p = plan_of(j, T0, now, now)
    assert p.run == T0 + timedelta(days=30) and p.missed is not None
    assert p.missed.last == p.run - timedelta(minutes=1)
    assert not p.missed.exact and p.missed.count >= 2000
    assert "at least" in p.missed.reason("one")
    b = backlog(None, partial(next_instant, j), T0, T0 + timedelta(minutes=3, seconds=1), 1)
    assert b.count == 3 and b.tail == [T0 + timedelta(minutes=2), T0 + timedelta(minutes=3)]


@pytest.mark.parametrize("kind, policy, window, says", [
    ("worker", "all", None, "--catch-up is for a job; this host is a worker"),
    ("instance", None, 60.0, "--catch-up-window is for a job"),
    ("job", "some", None, "--catch-up some: not a policy"),
    ("job", "none", 60.0, "none runs nothing missed"),
    ("job", "all", 0.5, "out of range"),
])
def test_bad_catch_up_is_refused(kind: str, policy: str | None, window: float | None,
                                 says: str) -> None:
    with pytest.raises(BadInput, match=says):
        check_catch_up(kind, policy, window)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store(new_db(prepare_state_dir(tmp_path / "state")))
    schema.upgrade(s.engine)

    def host(s: object) -> None:
        now = utcnow()
        b = Build(digest="0" * 64, path="/b/1", source="/s/1", created_at=now)
        s.add(b)  # type: ignore[attr-defined]
        s.flush()  # type: ignore[attr-defined]
        s.add(Host(name="tick", kind=HostKind.worker, build_id=b.id, every=5.0,  # type: ignore[attr-defined]
                   created_at=now))

    s.write(host)
    try:
        yield s
    finally:
        s.dispose()
        drop_db(s.url)


@pytest.mark.backend("a missed row is a run row: unique per (host, instant), in the store")
def test_the_missed_instants_are_one_row_and_one_event(store: Store) -> None:
    p = plan_of(job("none"), LAST, NOW, UP)
    assert p.missed is not None
    store.write(lambda s: write_missed(s, "tick", p.missed, "none"))  # type: ignore[arg-type]
    (row,) = store.read(lambda s: s.execute(select(JobRun)).scalars().all())
    assert (row.state, row.scheduled_at, row.cause, row.wake_id) == (
        RunState.missed, OUTAGE[-1], SCHEDULED, None)
    assert "6 instants missed" in (row.reason or "") and row.ended_at is not None
    (ev,) = store.read(lambda s: s.execute(select(Event).where(Event.kind == "run_missed"))
                       .scalars().all())
    assert '"count": 6' in ev.detail, ev.detail


def test_nothing_is_due_before_the_schedule_is_enabled_nor_twice() -> None:
    never = job("all")
    never.runs_from = None
    assert plan_of(never, None, NOW, UP) == Plan()
    assert plan_of(job("one"), OUTAGE[-1], NOW, UP) == Plan()  # recorded: not again
