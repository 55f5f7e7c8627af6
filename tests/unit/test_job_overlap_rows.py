"""A job's overlap policy on the store alone (workflows/lifecycle/job_overlap.py): what
write_run writes for a run due while one is open, under each policy, and what follow_one
does with a queued run once the open one ended or the job was stopped. Real store, no agent
(the runs on a real agent: tests/integration/test_job_overlap.py)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import datetime, timedelta
from functools import partial
from pathlib import Path

import pytest
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from models import schema
from models.errors import BadInput
from models.statedir import prepare_state_dir
from models.states import Desired, HostKind, RunState
from models.store import Store, utcnow
from models.tables import Build, Host, JobRun, Wake
from tests.conftest import drop_db, new_db, wait_for
from workflows.lifecycle.job_overlap import DEQUEUED, check_overlap, follow_one, write_run
from workflows.lifecycle.jobs import SCHEDULED

T0 = datetime(2026, 12, 5, 9, 0, 0)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store(new_db(prepare_state_dir(tmp_path / "state")))
    schema.upgrade(s.engine)

    def host(s: Session) -> None:
        now = utcnow()
        b = Build(digest="0" * 64, path="/b/1", source="/s/1", created_at=now)
        s.add(b)
        s.flush()
        s.add(Host(name="tick", kind=HostKind.worker, build_id=b.id, every=1.0, created_at=now,
                   desired=Desired.up))

    s.write(host)
    try:
        yield s
    finally:
        s.dispose()
        drop_db(s.url)


def policy(store: Store, overlap: str) -> None:
    store.write(lambda s: s.execute(update(Host).where(Host.name == "tick").values(overlap=overlap)))


def run_at(store: Store, k: int) -> JobRun:
    return store.write(lambda s: write_run(s, "tick", T0 + timedelta(seconds=k), SCHEDULED))


def rows(store: Store) -> list[JobRun]:
    return store.read(lambda s: s.execute(select(JobRun).order_by(JobRun.id)).scalars().all())


def wakes(store: Store) -> list[Wake]:
    return store.read(lambda s: s.execute(select(Wake).order_by(Wake.id)).scalars().all())


def end(store: Store, run_id: int) -> None:
    store.write(lambda s: s.execute(update(JobRun).where(JobRun.id == run_id).values(
        state=RunState.done, ended_at=utcnow())))


@pytest.mark.backend("the overlap's decision under the host's row lock (FOR UPDATE)")
def test_queue_keeps_one_waiting_then_makes_it_due_once_the_last_ended(store: Store) -> None:
    policy(store, "queue")
    first, second, third = run_at(store, 0), run_at(store, 1), run_at(store, 2)
    assert (first.state, second.state, third.state) == (
        RunState.due, RunState.queued, RunState.skipped)
    assert second.wake_id is None and second.reason == f"behind run #{first.id}: overlap queue"
    assert f"run #{second.id} already waits" in (third.reason or "")
    assert store.write(partial(follow_one, host="tick")) is None  # the first still open
    end(store, first.id)
    assert store.write(partial(follow_one, host="tick")) == DEQUEUED
    made = rows(store)[1]
    assert made.state is RunState.due and made.wake_id == wakes(store)[-1].id
    assert len(wakes(store)) == 2 and wakes(store)[-1].slot == 0


def test_replace_marks_the_run_it_replaces(store: Store) -> None:
    policy(store, "replace")
    first, second = run_at(store, 0), run_at(store, 1)
    assert second.state is RunState.queued and second.reason == f"replaces run #{first.id}: overlap replace"
    assert rows(store)[0].reason == f"replaced by run #{second.id}"
    # Its generation not current yet: no stop is written (once it is: a stop of its slot).
    assert store.write(partial(follow_one, host="tick")) is None


def test_allow_runs_each_in_a_free_slot(store: Store) -> None:
    policy(store, "allow")
    runs = [run_at(store, k) for k in range(3)]
    assert [r.state for r in runs] == [RunState.due] * 3
    assert [w.slot for w in wakes(store)] == [0, 1, 2]


def test_skip_and_a_stopped_jobs_queued_run(store: Store) -> None:
    assert run_at(store, 0).state is RunState.due
    assert run_at(store, 1).state is RunState.skipped  # the default: skip
    policy(store, "queue")
    queued = run_at(store, 2)
    assert queued.state is RunState.queued
    store.write(lambda s: s.execute(update(Host).where(Host.name == "tick").values(
        desired=Desired.down)))
    assert store.write(partial(follow_one, host="tick")) == DEQUEUED
    (row,) = [r for r in rows(store) if r.id == queued.id]
    assert row.state is RunState.interrupted and "not run" in (row.reason or "")


def test_overlap_is_a_jobs_only() -> None:
    assert check_overlap("job", None) == {} and check_overlap("job", "allow") == {"overlap": "allow"}
    with pytest.raises(BadInput, match="--overlap is for a job; this host is a worker"):
        check_overlap("worker", "queue")
    with pytest.raises(BadInput, match="not a policy"):
        check_overlap("job", "twice")


@pytest.mark.postgresql_only("SQLite serializes its writers: no read can race a commit")
def test_two_writers_of_one_job_decide_one_after_the_other(store: Store) -> None:
    """READ COMMITTED: without the host's row lock the second writer, started while the
    first's run is not committed, would see no open run and write a second due run (two
    wakes of slot 0). With it, it waits for the first's commit and queues behind it."""
    policy(store, "queue")
    holding = threading.Event()
    second: list[JobRun] = []

    def first(s: Session) -> None:
        write_run(s, "tick", T0, SCHEDULED)
        holding.set()
        wait_for(lambda: waiting_on_a_lock(store), 5, what="the second writer waiting on the lock")

    other = threading.Thread(target=lambda: (holding.wait(20), second.append(run_at(store, 1))))
    other.start()
    store.write(first)
    other.join(30)
    assert [r.state for r in second] == [RunState.queued], second
    assert [r.state for r in rows(store)] == [RunState.due, RunState.queued]


def waiting_on_a_lock(store: Store) -> bool:
    with store.engine.connect() as conn:
        return bool(conn.exec_driver_sql(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock'").scalar())
