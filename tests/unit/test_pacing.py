"""Reconciler pacing: per-row exponential backoff persisted in the store,
one due row per host per round, a rotating first host, at most 8 hosts in flight, and a
host that never succeeds does not hold the others back.

Real store (SQLite file), real Context, real runners.agent.reconciler.Reconciler. The obligation kind
driven is the owed lease release (store-only: nothing is spawned); its drive is the real
drive_release wrapped by a probe that records who ran when, or a stand-in where a test
needs a drive that pokes or progresses on demand."""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from apscheduler.schedulers.background import BackgroundScheduler
from sqlalchemy import select, update
from sqlalchemy.orm import Session

import workflows.engine.obligations as obligations
from models import schema
from models.errors import LostRace
from models.statedir import prepare_state_dir
from models.states import HostKind
from models.store import Store, utcnow
from models.tables import Build, Event, Host, Lease, Release
from runners.agent.reconciler import Reconciler
from runners.backend.files import LocalFiles
from runners.backend.health import HttpHealth
from runners.backend.process import ProcessBackend
from tests.conftest import drop_db, new_db, wait_for
from workflows.base.context import Context, Poke, Result
from workflows.engine.obligations import Due, backoff, due, run_one
from workflows.leases.lease import drive_release, give_back

pytestmark = pytest.mark.backend("due rows claimed from the store")

AGENT = "agent-1"


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    return prepare_state_dir(tmp_path / "state")


@pytest.fixture
def store(state_dir: Path) -> Iterator[Store]:
    s = Store(new_db(state_dir))
    schema.upgrade(s.engine)
    try:
        yield s
    finally:
        s.dispose()
        drop_db(s.url)


def make_ctx(store: Store, state_dir: Path) -> Context:
    return Context(store=store, agent_id=AGENT, state_dir=state_dir,
                   proc=ProcessBackend(containment="marker"), health=HttpHealth(),
                   files=LocalFiles())


@pytest.fixture
def ctx(store: Store, state_dir: Path) -> Context:
    return make_ctx(store, state_dir)


def owe(store: Store, host: str, *, rows: int = 1, raised: bool = False,
        holder: str = AGENT, at: datetime | None = None) -> list[int]:
    """Host `host`, leased by `holder` at fence 1, owing `rows` releases due at `at`.
    `raised` keeps the lease needed (parent limit still raised): its release never goes."""

    def step(s: Session) -> list[int]:
        now = utcnow()
        build = s.execute(select(Build.id)).scalar()
        if build is None:
            b = Build(digest="0" * 64, path="/b/1", source="/s/1", created_at=now)
            s.add(b)
            s.flush()
            build = b.id
        s.add(Host(name=host, kind=HostKind.worker, build_id=build, raised=raised,
                   fence_seq=1, created_at=now))
        s.add(Lease(host=host, holder=holder, fence=1, acquired_at=now,
                    expires_at=now + timedelta(seconds=60)))
        s.flush()
        out = []
        for _ in range(rows):
            r = Release(host=host, holder=holder, fence=1, since=now,
                        next_attempt_at=at or now)
            s.add(r)
            s.flush()
            out.append(r.id)
        return out

    return store.write(step)


def release_row(store: Store, rid: int) -> Release | None:
    return store.read(lambda s: s.get(Release, rid))


def use_drive(monkeypatch: pytest.MonkeyPatch, drive: Callable[[Context, int], Result]) -> None:
    """The only obligation kind for this test: owed releases, driven by `drive` one row at a
    time (their group commit is off: test_batch_* below test it)."""
    kind = dataclasses.replace(obligations.KINDS["release"], drive=drive, batch=None,
                               batched=None)
    monkeypatch.setattr(obligations, "KINDS", {"release": kind})


# -- backoff --------------------------------------------------------------------------------

def test_backoff_doubles_from_100ms_to_5s() -> None:
    assert [backoff(n) for n in range(1, 9)] == pytest.approx(
        [0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 5.0, 5.0])
    assert backoff(0) == pytest.approx(0.1)
    assert backoff(1000) == pytest.approx(5.0)


# -- run_one: one row's pacing, persisted ------------------------------------------------------

def test_poke_backs_off_persistently_and_progress_resets(
        monkeypatch: pytest.MonkeyPatch, store: Store, state_dir: Path, ctx: Context) -> None:
    (rid,) = owe(store, "web")
    outcome: dict[str, Any] = {"poke": "peer not answering"}

    def drive(_ctx: Context, _rid: int) -> Result:
        if outcome.get("poke"):
            raise Poke(outcome["poke"])
        return Result.progress

    use_drive(monkeypatch, drive)
    item = Due("release", rid, "web", utcnow())
    for n in range(1, 5):
        before = utcnow()
        assert run_one(ctx, item) == (Result.poked, "peer not answering")
        after = utcnow()
        row = release_row(store, rid)
        assert row is not None
        assert row.attempts == n and row.last_error == "peer not answering"
        delay = timedelta(seconds=backoff(n))
        assert before + delay <= row.next_attempt_at <= after + delay

    # Survives a restart: a new Store on the same file reads the same pacing, and the row
    # is not due before it.
    store.dispose()
    reopened = Store(store.url)
    try:
        row2 = reopened.read(lambda s: s.get(Release, rid))
        assert row2 is not None and row.next_attempt_at is not None
        assert (row2.attempts, row2.last_error, row2.next_attempt_at) == (
            4, "peer not answering", row.next_attempt_at)
        ctx2 = make_ctx(reopened, state_dir)
        assert due(ctx2, row.next_attempt_at - timedelta(milliseconds=1)) == []
        assert [d.id for d in due(ctx2, row.next_attempt_at)] == [rid]

        # Progress: attempts back to 0, error cleared, due again at once.
        outcome.clear()
        before = utcnow()
        assert run_one(ctx2, item) == (Result.progress, None)
        row3 = reopened.read(lambda s: s.get(Release, rid))
        assert row3 is not None
        assert (row3.attempts, row3.last_error) == (0, None)
        assert before <= row3.next_attempt_at <= utcnow()

        # The next poke starts the ladder again from 100 ms.
        outcome["poke"] = "again"
        before = utcnow()
        run_one(ctx2, item)
        row4 = reopened.read(lambda s: s.get(Release, rid))
        assert row4 is not None and row4.attempts == 1
        assert row4.next_attempt_at <= utcnow() + timedelta(seconds=0.1)
        assert row4.next_attempt_at >= before + timedelta(seconds=0.1)
    finally:
        reopened.dispose()


def test_backoff_is_capped_at_5s(monkeypatch: pytest.MonkeyPatch, store: Store,
                                 ctx: Context) -> None:
    (rid,) = owe(store, "web")
    store.write(lambda s: s.execute(update(Release).values(attempts=11)))

    def drive(_ctx: Context, _rid: int) -> Result:
        raise Poke("still not")

    use_drive(monkeypatch, drive)
    before = utcnow()
    run_one(ctx, Due("release", rid, "web", before))
    row = release_row(store, rid)
    assert row is not None and row.attempts == 12
    assert before + timedelta(seconds=5) <= row.next_attempt_at <= utcnow() + timedelta(seconds=5)


def test_other_errors_poke_with_their_name(monkeypatch: pytest.MonkeyPatch, store: Store,
                                           ctx: Context) -> None:
    (rid,) = owe(store, "web")

    def drive(_ctx: Context, _rid: int) -> Result:
        raise LostRace("g7 running")

    use_drive(monkeypatch, drive)
    assert run_one(ctx, Due("release", rid, "web", utcnow())) == (
        Result.poked, "LostRace: g7 running")
    row = release_row(store, rid)
    assert row is not None and row.attempts == 1 and row.last_error == "LostRace: g7 running"


def test_real_release_poked_gone_and_progress(store: Store, ctx: Context) -> None:
    """The real drive: a needed lease pokes, an older incarnation is gone, a free lease goes."""
    (kept,) = owe(store, "kept", raised=True)
    result, error = run_one(ctx, Due("release", kept, "kept", utcnow()))
    assert result is Result.held and error and "parent limit is still raised" in error
    assert release_row(store, kept).attempts == 1  # type: ignore[union-attr]

    (stale,) = owe(store, "moved")
    store.write(lambda s: s.execute(update(Lease).where(Lease.host == "moved").values(fence=2)))
    assert run_one(ctx, Due("release", stale, "moved", utcnow())) == (Result.gone, None)
    assert release_row(store, stale) is None
    assert store.read(lambda s: s.get(Lease, "moved")) is not None  # not ours to give back

    (free,) = owe(store, "free")
    assert run_one(ctx, Due("release", free, "free", utcnow())) == (Result.progress, None)
    assert release_row(store, free) is None
    assert store.read(lambda s: s.get(Lease, "free")) is None


def test_batch_gives_back_free_drops_stale_keeps_needed(store: Store, ctx: Context) -> None:
    """One transaction for many rows, each guarded on its own: free leases go (with their
    `released` event), an older incarnation's row is dropped without touching the lease,
    a needed lease keeps its row, backed off with the reason, and another holder's rows
    are not this agent's batch at all."""
    free = [rid for h in ("f1", "f2", "f3") for rid in owe(store, h)]
    (kept,) = owe(store, "kept", raised=True)
    (stale,) = owe(store, "moved")
    store.write(lambda s: s.execute(update(Lease).where(Lease.host == "moved").values(fence=2)))
    (theirs,) = owe(store, "theirs", holder="agent-2")
    (later,) = owe(store, "later", at=utcnow() + timedelta(hours=1))

    before = utcnow()
    assert give_back(ctx, limit=256) == 5  # 3 free, kept, stale; not theirs, not later
    for rid in [*free, stale]:
        assert release_row(store, rid) is None
    assert {h for h in ("f1", "f2", "f3", "kept", "moved", "theirs", "later")
            if store.read(lambda s, h=h: s.get(Lease, h)) is not None} == {
        "kept", "moved", "theirs", "later"}
    row = release_row(store, kept)
    assert row is not None and row.attempts == 1
    assert "parent limit is still raised" in (row.last_error or "")
    assert row.next_attempt_at >= before + timedelta(seconds=backoff(1))
    assert release_row(store, theirs) is not None and release_row(store, later) is not None
    released = store.read(lambda s: s.execute(select(Event.host).where(
        Event.kind == "released")).scalars().all())
    assert sorted(released) == ["f1", "f2", "f3"]
    # kept is backed off (0.1 s), nothing else is due; on a loaded box the 0.1 s may have
    # passed by now, and then kept is rightly due again.
    again = give_back(ctx, limit=256)
    assert again == 0 or (again == 1 and utcnow() >= row.next_attempt_at), again


def test_batch_takes_at_most_its_limit_and_the_round_drains_the_rest(
        store: Store, ctx: Context, reconciler: Any) -> None:
    for i in range(7):
        owe(store, f"h{i}")
    assert give_back(ctx, limit=3) == 3
    assert len(open_releases(store)) == 4
    # The per-host query leaves this agent's releases to the batch.
    assert due(ctx, utcnow()) == []
    rec = reconciler(FakeScheduler())
    rec.round()
    settle(rec)
    assert open_releases(store) == set()


def test_a_capped_drain_asks_for_another_round(monkeypatch: pytest.MonkeyPatch, store: Store,
                                               ctx: Context, reconciler: Any) -> None:
    """A round drains at most its cap of batches (the per-host rows must not wait behind
    them); when rows are still due it asks for the next round at once, not at the scan."""
    import functools

    import runners.agent.reconciler

    for i in range(5):
        owe(store, f"h{i}")
    assert obligations.drain_batches(ctx, limit=2, rounds=1) == (2, True)
    assert obligations.drain_batches(ctx, limit=2, rounds=2) == (3, False)
    for i in range(5, 10):
        owe(store, f"h{i}")
    monkeypatch.setattr(runners.agent.reconciler, "drain_batches",
                        functools.partial(obligations.drain_batches, limit=2, rounds=2))
    sched = FakeScheduler()
    rec = reconciler(sched)
    rec.round()
    assert len(open_releases(store)) == 1
    assert [kw for trigger, kw in sched.jobs if trigger is None and kw.get("kwargs") == {"fresh": True}]
    rec.round()
    assert open_releases(store) == set()


# -- the Reconciler ---------------------------------------------------------------------------

class FakeScheduler:
    """What the Reconciler asks of APScheduler, recorded; the test runs rounds itself."""

    def __init__(self) -> None:
        self.jobs: list[tuple[str | None, dict[str, Any]]] = []
        self._lock = threading.Lock()

    def add_job(self, func: Callable[[], None], trigger: str | None = None, **kw: Any) -> None:
        with self._lock:
            self.jobs.append((trigger, kw))

    def dated(self) -> list[datetime]:
        with self._lock:
            return [kw["run_date"] for trigger, kw in self.jobs if trigger == "date"]


class Probe:
    """Wraps a drive: who ran, when, how many at once."""

    def __init__(self, hosts: dict[int, str], inner: Callable[[Context, int], Result]) -> None:
        self.hosts = hosts  # release id -> host
        self.inner = inner
        self.calls: list[tuple[str, float]] = []
        self.in_flight: set[str] = set()
        self.peak = 0
        self.overlap: list[str] = []  # a host driven while it was already in flight
        self._lock = threading.Lock()

    def __call__(self, ctx: Context, rid: int) -> Result:
        host = self.hosts[rid]
        with self._lock:
            if host in self.in_flight:
                self.overlap.append(host)
            self.in_flight.add(host)
            self.peak = max(self.peak, len(self.in_flight))
            self.calls.append((host, time.monotonic()))
        try:
            return self.inner(ctx, rid)
        finally:
            with self._lock:
                self.in_flight.discard(host)

    def starts(self, host: str) -> list[float]:
        with self._lock:
            return [t for h, t in self.calls if h == host]


class RecordingPool:
    """The Reconciler's own pool, noting what each round submits."""

    def __init__(self, rec: Reconciler) -> None:
        self.rec = rec
        self.pool = rec.pool
        self.rounds: dict[int, list[str]] = {}

    def submit(self, fn: Callable[[list[Due]], None], work: list[Due]) -> Any:
        """`work`: one drive's rows (one, or a group of worker wakes)."""
        self.rounds.setdefault(self.rec.rounds, []).extend(d.host for d in work)
        return self.pool.submit(fn, work)

    def shutdown(self, **kw: Any) -> None:
        self.pool.shutdown(**kw)


@pytest.fixture
def reconciler(ctx: Context) -> Iterator[Callable[[Any], Reconciler]]:
    made: list[Reconciler] = []

    def make(scheduler: Any) -> Reconciler:
        rec = Reconciler(ctx, scheduler)
        rec.pool = RecordingPool(rec)  # type: ignore[assignment]
        made.append(rec)
        return rec

    yield make
    ctx.shutting_down.set()
    for rec in made:
        rec.shutdown()


def settle(rec: Reconciler) -> None:
    wait_for(lambda: not rec.inflight, 20, interval=0.005, what="drives in flight to finish")


def open_releases(store: Store) -> set[str]:
    return set(store.read(lambda s: s.execute(select(Release.host)).scalars().all()))


def test_failing_host_does_not_delay_the_others(monkeypatch: pytest.MonkeyPatch, store: Store,
                                                 ctx: Context, reconciler: Any) -> None:
    """Under the real APScheduler: host a never gives its lease back, and its first try
    stays in flight until b..e are all released (were they queued behind it, that try
    would wait in vain and the test time out); then a keeps failing with growing backoff."""
    ids = {rid: h for h in "abcde" for rid in owe(store, h, raised=h == "a")}
    held = {"first": True, "others_done_meanwhile": False}

    def drive(c: Context, rid: int) -> Result:
        if ids[rid] == "a" and held["first"]:
            held["first"] = False
            wait_for(lambda: open_releases(store) == {"a"}, 15, interval=0.01,
                     what="b..e released while a's first try is in flight")
            held["others_done_meanwhile"] = True
        return drive_release(c, rid)

    probe = Probe(ids, drive)
    use_drive(monkeypatch, probe)
    scheduler = BackgroundScheduler(timezone=UTC, job_defaults={
        "coalesce": True, "max_instances": 1, "misfire_grace_time": None})
    rec = reconciler(scheduler)
    scheduler.start()
    rec.start()  # rounds on the Reconciler's own thread, as in the agent
    try:
        rec.kick()
        wait_for(lambda: len(probe.starts("a")) >= 4, 20, interval=0.01,
                 what="a retried three times")
    finally:
        # As AgentDaemon does: wait=True could deadlock, APScheduler 3 holding its job
        # store lock while it joins a round that is adding its next wake-up job.
        ctx.shutting_down.set()
        scheduler.shutdown(wait=False)
        wait_for(lambda: not rec._running, 20, interval=0.01, what="the last round to end")
    rec.shutdown()

    assert held["others_done_meanwhile"]
    assert open_releases(store) == {"a"}
    assert store.read(lambda s: s.execute(select(Lease.host)).scalars().all()) == ["a"]
    for h in "bcde":
        assert len(probe.starts(h)) == 1, f"{h} was driven {len(probe.starts(h))} times"
    # a's retries: the k-th try comes only after backoff(k - 1) (0.2, 0.4 s ... from the
    # second try on; the first was held), scheduled by the Reconciler's own wake-up.
    starts = probe.starts("a")
    gaps = [b - a for a, b in zip(starts[1:], starts[2:], strict=False)]
    for k, gap in enumerate(gaps, start=2):
        assert backoff(k) - 0.02 <= gap <= backoff(k) + 1.0, f"retry {k + 1}: {gaps}"
    row = store.read(lambda s: s.execute(select(Release).where(Release.host == "a")).scalar_one())
    assert row.attempts == len(starts) and "parent limit is still raised" in (row.last_error or "")
    assert not probe.overlap


def test_at_most_eight_hosts_in_flight_one_row_per_host_per_round(
        monkeypatch: pytest.MonkeyPatch, store: Store, reconciler: Any) -> None:
    """12 hosts owe 2 releases each; every drive blocks until the gate opens."""
    ids = {rid: f"h{i:02}" for i in range(12) for rid in owe(store, f"h{i:02}", rows=2)}
    gate = threading.Event()

    def drive(c: Context, rid: int) -> Result:
        assert gate.wait(5), "gate never opened"
        return drive_release(c, rid)

    probe = Probe(ids, drive)
    use_drive(monkeypatch, probe)
    sched = FakeScheduler()
    rec = reconciler(sched)

    rec.round()
    wait_for(lambda: len(probe.in_flight) == 8, 10, interval=0.005, what="8 drives in flight")
    rec.round()  # a round while the window is full admits nobody
    rec.round()
    time.sleep(0.05)
    assert len(probe.calls) == 8 and len(rec.inflight) == 8
    gate.set()
    for _ in range(10):
        settle(rec)
        if not open_releases(store):
            break
        rec.round()
    settle(rec)

    assert open_releases(store) == set()
    assert probe.peak == 8
    assert not probe.overlap
    assert sorted({h for h, _ in probe.calls}) == sorted(set(ids.values()))
    pool: RecordingPool = rec.pool  # type: ignore[assignment]
    for n, hosts in pool.rounds.items():
        assert len(hosts) == len(set(hosts)), f"round {n} took two rows of a host: {hosts}"
    # Each host's first row resolved (progress), its second was gone: two drives each.
    assert sorted(h for h, _ in probe.calls) == sorted([*ids.values()])


def test_rotating_cursor(monkeypatch: pytest.MonkeyPatch, store: Store, reconciler: Any) -> None:
    """12 hosts always due, 8 slots, each drive in flight until its round has ended: which
    host goes first changes every round, and the window moves past the hosts it admitted,
    so every host gets a slot within ceil(12 / 8) = 2 rounds."""
    hosts = [f"h{i:02}" for i in range(12)]
    ids = {rid: h for h in hosts for rid in owe(store, h)}
    gate = threading.Event()

    def drive(_c: Context, _rid: int) -> Result:
        assert gate.wait(5), "gate never opened"
        return Result.progress  # moved on: due again at once

    probe = Probe(ids, drive)
    use_drive(monkeypatch, probe)
    rec = reconciler(FakeScheduler())
    pool: RecordingPool = rec.pool  # type: ignore[assignment]

    for _ in range(6):
        gate.clear()
        rec.round()
        wait_for(lambda: len(probe.in_flight) == 8, 10, interval=0.005, what="8 drives in flight")
        gate.set()
        settle(rec)
    rounds = [pool.rounds[n] for n in sorted(pool.rounds)]
    assert [len(r) for r in rounds] == [8] * 6, rounds
    assert all(len(set(r)) == 8 for r in rounds)
    firsts = [r[0] for r in rounds]
    assert all(a != b for a, b in zip(firsts, firsts[1:], strict=False)), firsts
    per = math.ceil(len(hosts) / 8)
    for k in range(len(rounds) - per + 1):
        window = {h for r in rounds[k:k + per] for h in r}
        assert window == set(hosts), f"rounds {k}..{k + per - 1} left out {set(hosts) - window}"
    assert probe.peak == 8 and not probe.overlap


def test_next_wakeup_ignores_rows_of_hosts_leased_elsewhere(
        monkeypatch: pytest.MonkeyPatch, store: Store, reconciler: Any) -> None:
    """Another agent's host with an overdue row must not hide our own row's retry time
    from the scheduler (the round would otherwise wait for the safety scan)."""
    owe(store, "elsewhere", holder="agent-2", at=utcnow() - timedelta(seconds=10))
    ids = {rid: "a" for rid in owe(store, "a", raised=True)}
    store.write(lambda s: s.execute(update(Release).where(Release.host == "a")
                                    .values(attempts=5)))  # its next wait: 3.2 s
    probe = Probe(ids, drive_release)
    use_drive(monkeypatch, probe)
    sched = FakeScheduler()
    rec = reconciler(sched)

    rec.round()
    settle(rec)
    assert [h for h, _ in probe.calls] == ["a"]  # never the other agent's host
    row = store.read(lambda s: s.execute(select(Release).where(Release.host == "a")).scalar_one())
    assert row.attempts == 6
    rec.round()  # the kick after a's drive: nothing due, a's retry is 3.2 s away
    assert sched.dated(), "no wake-up scheduled for a's retry"
    assert sched.dated()[-1] == row.next_attempt_at.replace(tzinfo=UTC)


@pytest.mark.postgresql_only("READ COMMITTED: another writer commits between the drive's reads and its delete")
def test_a_release_given_back_meanwhile_is_gone_not_released_twice(
        monkeypatch: pytest.MonkeyPatch, store: Store, ctx: Context) -> None:
    """The per-host release and the batch race for one row: the batch gives the lease back
    after the drive has read it. The drive's delete then matches nothing: the row is gone,
    with no second `released` event (and no ORM warning of a delete that matched 0 rows)."""
    import workflows.leases.lease as lease_mod

    (rid,) = owe(store, "raced")
    real = lease_mod.still_needed
    other = Store(store.url)

    def batch_first(s: Session, host: str) -> str | None:
        why = real(s, host)
        assert give_back(make_ctx(other, ctx.state_dir)) == 1  # commits on its own connection
        return why

    monkeypatch.setattr(lease_mod, "still_needed", batch_first)
    try:
        assert drive_release(ctx, rid) is Result.gone
    finally:
        other.dispose()
    assert release_row(store, rid) is None and store.read(lambda s: s.get(Lease, "raced")) is None
    released = store.read(lambda s: s.execute(select(Event.id).where(
        Event.kind == "released", Event.host == "raced")).all())
    assert len(released) == 1


def test_a_group_drive_tells_its_progress_once(monkeypatch: pytest.MonkeyPatch,
                                               ctx: Context) -> None:
    """A group of worker wakes that moved rows is one on_progress (the watched sets re-read
    and the jobs' timer poked once), not one a wake; a group that moved nothing, none."""
    import runners.agent.reconciler as reconciler

    told: list[int] = []
    r = Reconciler(ctx, BackgroundScheduler(), 8, on_progress=lambda: told.append(1))
    work = [Due("wake", i, f"w{i}", utcnow(), grouped=True) for i in range(16)]
    moved = [(Result.progress, None)] * 15 + [(Result.waiting, None)]
    for results, want in ((moved, 1), ([(Result.waiting, None)] * 16, 0)):
        told.clear()
        monkeypatch.setattr(reconciler, "run_group", lambda _c, _w, _g, out=results: out)
        r.drives += 1  # as _hand_out counts the drive it submits
        r._drive(work)
        assert len(told) == want, results
    assert r.drives == 0
