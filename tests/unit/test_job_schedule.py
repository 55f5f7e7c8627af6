"""Jobs (workflows/lifecycle/jobs.py): which instant is due, computed from the schedule and
the last recorded instant alone; and the store's unique (host, instant), the one guard that
no instant is started twice whoever writes it."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace

import pytest
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from models import schema
from models.errors import BadInput
from models.statedir import prepare_state_dir
from models.states import HostKind, RunState
from models.store import Store, utcnow
from models.tables import Build, Host, JobRun, Wake
from tests.conftest import drop_db, new_db
from workflows.lifecycle.jobs import (
    SCHEDULED,
    check_job,
    next_instant,
    parse_every,
    write_run,
)


def job(every: float | None = None, schedule: str | None = None, tz: str | None = None,
        since: datetime | None = None) -> SimpleNamespace:
    return SimpleNamespace(every=every, schedule=schedule, timezone=tz, runs_from=since)


def test_every_instants_are_whole_multiples_since_the_epoch() -> None:
    h = job(every=600)
    assert next_instant(h, datetime(2026, 12, 5, 9, 0, 0)) == datetime(2026, 12, 5, 9, 10)
    assert next_instant(h, datetime(2026, 12, 5, 9, 3, 7)) == datetime(2026, 12, 5, 9, 10)
    assert next_instant(job(every=1), datetime(2026, 1, 1, 0, 0, 0, 999999)) == datetime(2026, 1, 1, 0, 0, 1)


def test_a_cron_line_is_read_in_its_timezone() -> None:
    h = job(schedule="30 4 * * *", tz="Europe/Paris")  # 04:30 in Paris is 03:30 UTC in winter
    assert next_instant(h, datetime(2026, 12, 5, 0, 0)) == datetime(2026, 12, 5, 3, 30)
    assert next_instant(h, datetime(2026, 12, 5, 3, 30)) == datetime(2026, 12, 6, 3, 30)


def test_a_period_is_seconds_or_a_number_with_a_unit() -> None:
    assert [parse_every(v) for v in (90, "90", "90s", "10m", "1.5h", "1d")] == [
        90, 90, 90, 600, 5400, 86400]
    with pytest.raises(BadInput, match="not a period"):
        parse_every("10x")


@pytest.mark.parametrize("kind, every, schedule, tz, says", [
    ("job", None, None, None, "give one of them"),
    ("job", 5.0, "* * * * *", None, "not both"),
    ("job", 0.5, None, None, "at most once a second"),
    ("job", None, "* * 31 2 *", None, "never fires"),
    ("job", None, "1 2 3", None, "is not a cron line"),
    ("job", 5.0, None, "Nowhere/Else", "no such time zone"),
    ("worker", None, "* * * * *", None, "--schedule is for a job"),
])
def test_bad_schedules_are_refused(kind: str, every: float | None, schedule: str | None,
                                   tz: str | None, says: str) -> None:
    with pytest.raises(BadInput, match=says):
        check_job(kind, every, schedule, tz)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store(new_db(prepare_state_dir(tmp_path / "state")))
    schema.upgrade(s.engine)

    def host(s: Session) -> None:
        now = utcnow()
        b = Build(digest="0" * 64, path="/b/1", source="/s/1", created_at=now)
        s.add(b)
        s.flush()
        s.add(Host(name="tick", kind=HostKind.worker, build_id=b.id, every=1.0, created_at=now))

    s.write(host)
    try:
        yield s
    finally:
        s.dispose()
        drop_db(s.url)


@pytest.mark.backend("the store's unique (host, scheduled instant): no instant written twice")
def test_an_instant_is_written_once_whoever_writes_it(store: Store) -> None:
    at = datetime(2026, 12, 5, 9, 0, 1)
    first = store.write(lambda s: write_run(s, "tick", at, SCHEDULED).state)
    assert first is RunState.due
    with pytest.raises(IntegrityError):  # a second writer (another box, a restarted agent)
        store.write(lambda s: write_run(s, "tick", at, SCHEDULED))
    runs = store.read(lambda s: s.execute(select(JobRun)).scalars().all())
    wakes = store.read(lambda s: s.execute(select(Wake)).scalars().all())
    assert len(runs) == 1 and len(wakes) == 1 and runs[0].wake_id == wakes[0].id  # nothing of the loser
    # A later instant while that run is open: recorded skipped, no wake.
    later = store.write(lambda s: write_run(s, "tick", datetime(2026, 12, 5, 9, 0, 2), SCHEDULED).state)
    assert later is RunState.skipped
    assert len(store.read(lambda s: s.execute(select(Wake)).scalars().all())) == 1
