"""The store on one box: SQLite pragmas from the connect hook, file and directory modes,
the transition primitive (compare-and-set, fence, legal transitions) and lock retries."""

from __future__ import annotations

import json
import os
import re
import sqlite3
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select, text, update
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError
from sqlalchemy.orm import Session

from models import schema
from models.errors import BadInput, IllegalTransition, LostRace, StoreNotReady
from models.statedir import prepare_state_dir, private_dirs
from models.states import (
    TRANSITIONS,
    AttemptStep,
    Cause,
    Desired,
    GenState,
    HostKind,
    ListenerState,
    MemberRole,
    Mode,
    ReloadState,
    RolloutState,
    RunState,
    StopState,
    TargetState,
    WakeState,
)
from models.store import (
    DB_FILE,
    Store,
    emit,
    emit_many,
    is_transient,
    normalize_url,
    sqlite_url,
    utcnow,
)
from models.tables import (
    Attempt,
    Build,
    Event,
    Generation,
    Host,
    JobRun,
    Lease,
    Listener,
    Member,
    Reload,
    Rollout,
    RolloutTarget,
    Stop,
    Wake,
)
from models.transition import Fence, Unfenced, move, move_many
from tests.conftest import drop_db, new_db, wait_for

pytestmark = pytest.mark.backend("the store: pragmas, isolation, retries, moves")

ROOT = Path(__file__).resolve().parent.parent.parent

AGENT = "agent-1"
FENCE = 3


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


@pytest.fixture
def gen_id(store: Store) -> int:
    """Host `web` leased by AGENT at FENCE, with one generation in state spawning."""

    def step(s: Session) -> int:
        now = utcnow()
        b = Build(digest="0" * 64, path="/b/1", source="/s/1", created_at=now)
        s.add(b)
        s.flush()
        s.add(Host(name="web", kind=HostKind.instance, build_id=b.id, fence_seq=FENCE,
                   created_at=now))
        s.add(Lease(host="web", holder=AGENT, fence=FENCE, acquired_at=now,
                    expires_at=now + timedelta(seconds=30)))
        s.flush()
        g = Generation(uuid="u-1", host="web", build_id=b.id, state=GenState.spawning,
                       fence=FENCE, agent_id=AGENT, created_at=now)
        s.add(g)
        s.flush()
        return g.id

    return store.write(step)


def gen_state(store: Store, gid: int) -> GenState:
    return store.read(lambda s: s.execute(
        select(Generation.state).where(Generation.id == gid)).scalar_one())


def pragma(store: Store, name: str) -> object:
    return store.read(lambda s: s.execute(text(f"PRAGMA {name}")).scalar())


# -- pragmas ----------------------------------------------------------------------------

@pytest.mark.sqlite_only("SQLite pragmas")
def test_pragmas_by_default(store: Store) -> None:
    assert pragma(store, "journal_mode") == "wal"
    assert pragma(store, "synchronous") == 2  # FULL
    assert pragma(store, "foreign_keys") == 1
    assert pragma(store, "busy_timeout") == 5000


@pytest.mark.sqlite_only("SQLite pragmas")
def test_pragmas_when_asked(state_dir: Path) -> None:
    s = Store(sqlite_url(state_dir), synchronous="NORMAL", busy_timeout_ms=1234)
    try:
        assert pragma(s, "synchronous") == 1  # NORMAL
        assert pragma(s, "busy_timeout") == 1234
        assert pragma(s, "journal_mode") == "wal"
        assert pragma(s, "foreign_keys") == 1
    finally:
        s.dispose()


@pytest.mark.sqlite_only("SQLite pragmas")
def test_pragmas_hold_on_every_pooled_connection(store: Store) -> None:
    ro = {"vigil_readonly": True}  # plain BEGIN: two open connections do not queue
    with store.engine.connect().execution_options(**ro) as a, \
            store.engine.connect().execution_options(**ro) as b:
        assert a.connection.dbapi_connection is not b.connection.dbapi_connection
        for conn in (a, b):
            assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
            assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == 2
            assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 5000


def test_foreign_keys_are_enforced(store: Store) -> None:
    def orphan(s: Session) -> None:
        s.add(Lease(host="nobody", holder=AGENT, fence=1, acquired_at=utcnow(),
                    expires_at=utcnow()))

    with pytest.raises(IntegrityError, match="(?i)foreign key"):
        store.write(orphan)


@pytest.mark.postgresql_only("idle_in_transaction_session_timeout is PostgreSQL's")
def test_a_glance_holds_no_transaction_open_between_its_statements(store: Store) -> None:
    """A read repeated during a wait: a freeze between two statements (SIGSTOP, a paused
    VM) must not leave the session idle in a transaction, which PostgreSQL ends after
    10 s. Each statement of a glance is its own transaction; a read's share one."""
    def two(s: Session) -> tuple[object, object]:
        first = s.execute(text("SELECT pg_current_xact_id()")).scalar()
        return first, s.execute(text("SELECT pg_current_xact_id()")).scalar()

    a, b = store.read(two)
    assert a == b  # one transaction (what a frozen read would hold open)
    a, b = store.glance(two)
    assert a != b, (a, b)


@pytest.mark.postgresql_only("synchronous_commit is PostgreSQL's")
def test_synchronous_off_maps_to_synchronous_commit_off(store: Store) -> None:
    def sync(s: Session) -> object:
        return s.execute(text("SHOW synchronous_commit")).scalar()

    assert store.read(sync) == "on"
    off = Store(store.url, synchronous="OFF")
    try:
        assert off.read(sync) == "off"
        assert off.write(sync) == "off"
    finally:
        off.dispose()


@pytest.mark.sqlite_only("a corrupt SQLite file")
def test_a_file_that_is_not_a_database_is_named(state_dir: Path) -> None:
    (state_dir / DB_FILE).write_bytes(b"not a database, not even close " * 64)
    s = Store(sqlite_url(state_dir))
    try:
        with pytest.raises(StoreNotReady, match="is not a vigil database"):
            s.read(lambda x: x.execute(text("SELECT 1")).scalar())
    finally:
        s.dispose()


def test_database_urls_are_sqlite_or_postgresql_through_psycopg() -> None:
    assert normalize_url("sqlite:////s/vigil.db") == "sqlite:////s/vigil.db"
    for bare in ("postgresql://u:pw@h:5433/db", "postgres://u:pw@h:5433/db",
                 "postgresql+psycopg://u:pw@h:5433/db"):
        assert normalize_url(bare) == "postgresql+psycopg://u:pw@h:5433/db"
    for other in ("mysql://u@h/db", "postgresql+psycopg2://u@h/db", "not a url"):
        with pytest.raises(BadInput, match="sqlite:///PATH or postgresql[+]psycopg://"):
            normalize_url(other)


# -- files and directories ----------------------------------------------------------------

def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def open_umask() -> Iterator[None]:
    """The worst umask an operator might have: modes must not depend on it."""
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


@pytest.mark.sqlite_only("file modes of the SQLite file and its -wal/-shm")
def test_state_dir_and_db_file_modes(tmp_path: Path, open_umask: None) -> None:
    d = prepare_state_dir(tmp_path / "a" / "state")
    assert d.is_dir() and mode(d) == 0o700
    url = sqlite_url(d)
    db = d / DB_FILE
    assert url == f"sqlite:///{db}"
    assert db.exists() and mode(db) == 0o600
    s = Store(url)
    try:
        schema.upgrade(s.engine)  # writes: the -wal and -shm files exist while it is open
        s.write(lambda x: emit(x, "probe", None))
        for suffix in ("-wal", "-shm"):
            side = d / (DB_FILE + suffix)
            assert side.exists(), side
            assert mode(side) & 0o077 == 0, f"{side} is {oct(mode(side))}"
    finally:
        s.dispose()
    assert mode(db) == 0o600


def test_private_dirs_is_mkdir_p_at_0700(tmp_path: Path, open_umask: None,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every directory made is 0700 whatever the umask, the missing parents too; one that
    is there is left as it is; a file in the way is said (NotADirectoryError); a relative
    path is under the working dir."""
    private_dirs(tmp_path / "a" / "b" / "c")
    assert [mode(tmp_path / p) for p in ("a", "a/b", "a/b/c")] == [0o700] * 3
    (tmp_path / "open").mkdir(mode=0o755)
    os.chmod(tmp_path / "open", 0o755)
    private_dirs(tmp_path / "open")
    private_dirs(str(tmp_path / "open" / "d"))
    assert mode(tmp_path / "open") == 0o755 and mode(tmp_path / "open" / "d") == 0o700
    (tmp_path / "f").write_text("")
    private_dirs(tmp_path / "f")  # there: nothing to make
    with pytest.raises(NotADirectoryError):
        private_dirs(tmp_path / "f" / "x")
    monkeypatch.chdir(tmp_path)
    private_dirs("r/s")
    assert mode(tmp_path / "r") == mode(tmp_path / "r" / "s") == 0o700


def test_existing_state_dir_is_tightened(tmp_path: Path) -> None:
    d = tmp_path / "state"
    d.mkdir(mode=0o755)
    os.chmod(d, 0o755)
    assert prepare_state_dir(d) == d
    assert mode(d) == 0o700


@pytest.mark.sqlite_only("the SQLite file in the state dir")
def test_sqlite_url_keeps_an_existing_database(store: Store, gen_id: int, state_dir: Path) -> None:
    assert sqlite_url(state_dir) == store.url
    assert gen_state(store, gen_id) is GenState.spawning


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_state_dir_owned_by_someone_else_is_refused(tmp_path: Path) -> None:
    d = tmp_path / "state"
    d.mkdir(mode=0o700)
    os.chown(d, 65534, 65534)
    with pytest.raises(StoreNotReady) as err:
        prepare_state_dir(d)
    assert "owned by uid 65534" in err.value.cause
    assert err.value.fix and "--state-dir" in err.value.fix
    assert mode(d) == 0o700 and d.stat().st_uid == 65534  # refused without touching it


def test_state_dir_that_is_a_file_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "state"
    f.write_text("")
    with pytest.raises(StoreNotReady, match="not a directory"):
        prepare_state_dir(f)


# -- the transition primitive (models/transition.py) ----------------------------------------

TEST_WAIVER = Unfenced("a unit test")


def to_running(gid: int, fence: Fence | Unfenced = TEST_WAIVER) -> object:
    def step(s: Session) -> None:
        move(s, Generation, {"id": gid}, {"state": GenState.running, "pid": 4242},
             f"g{gid} running", fence=fence, col="state", frm=GenState.spawning)

    return step


def test_move_moves_a_matching_row(store: Store, gen_id: int) -> None:
    store.write(to_running(gen_id, Fence("web", AGENT, FENCE)))
    assert gen_state(store, gen_id) is GenState.running


def test_move_lost_race_on_state(store: Store, gen_id: int) -> None:
    store.write(to_running(gen_id))
    with pytest.raises(LostRace) as err:
        store.write(to_running(gen_id))  # expects spawning, the row is running now
    assert err.value.what == f"g{gen_id} running"
    assert gen_state(store, gen_id) is GenState.running


@pytest.mark.parametrize("holder,fence", [(AGENT, FENCE + 1), (AGENT, FENCE - 1),
                                          ("agent-2", FENCE)])
def test_move_lost_race_on_fence(store: Store, gen_id: int, holder: str, fence: int) -> None:
    with pytest.raises(LostRace):
        store.write(to_running(gen_id, Fence("web", holder, fence)))
    assert gen_state(store, gen_id) is GenState.spawning


def test_a_move_by_key_updates_the_copy_the_session_holds(store: Store, gen_id: int) -> None:
    """The cached form runs Core SQL; like the ORM form it leaves no stale copy behind."""
    def step(s: Session) -> tuple[Any, Any]:
        g = s.get(Generation, gen_id)
        move(s, Generation, {"id": gen_id}, {"state": GenState.running, "pid": 4242}, "probe",
             fence=Unfenced("test"), col="state", frm=GenState.spawning)
        return s.get(Generation, gen_id).state, g.pid  # type: ignore[union-attr]

    assert store.write(step) == (GenState.running, 4242)


def test_a_move_by_column_values_compares_none_as_is_null(store: Store, gen_id: int) -> None:
    """{"pid": None} means `pid IS NULL` (`pid = NULL` would match no row, ever)."""
    def set_pid(s: Session) -> None:
        move(s, Generation, {"id": gen_id, "pid": None}, {"pid": 7}, "probe",
             fence=Unfenced("test"))

    store.write(set_pid)
    assert store.read(lambda s: s.get(Generation, gen_id).pid) == 7  # type: ignore[union-attr]
    with pytest.raises(LostRace):
        store.write(set_pid)  # pid is set now: the guard fails


def test_a_move_names_its_fence_or_its_waiver(store: Store, gen_id: int) -> None:
    with pytest.raises(TypeError, match="fence must be"):
        store.write(lambda s: move(s, Generation, {"id": gen_id},
                                   {"state": GenState.running}, "probe", fence=None,  # type: ignore[arg-type]
                                   col="state", frm=GenState.spawning))


def test_lost_race_rolls_back_the_whole_step(store: Store, gen_id: int) -> None:
    def step(s: Session) -> None:
        emit(s, "probe", "web", gen_id)
        to_running(gen_id, Fence("web", AGENT, FENCE + 1))(s)  # type: ignore[operator]

    with pytest.raises(LostRace):
        store.write(step)
    assert store.read(lambda s: s.execute(select(Event.id)).all()) == []


# Every Enum with a transition table: the model, the column it guards and the row's key.
STATE_MODELS = {GenState: (Generation, "state", Generation.id),
                WakeState: (Wake, "state", Wake.id),
                StopState: (Stop, "state", Stop.id),
                AttemptStep: (Attempt, "step", Attempt.id),
                MemberRole: (Member, "role", Member.generation_id),
                Desired: (Host, "desired", Host.name),
                ListenerState: (Listener, "state", Listener.position),
                RolloutState: (Rollout, "state", Rollout.id),
                TargetState: (RolloutTarget, "state", RolloutTarget.rollout_id),
                ReloadState: (Reload, "state", Reload.id),
                RunState: (JobRun, "state", JobRun.id)}


def one_of_each(s: Session, gid: int) -> dict[type, Any]:
    """A row of every kind with a state on host `web`, each one legal move from its state:
    model -> (key value, from, to)."""
    now = utcnow()
    w = Wake(host="web", state=WakeState.queued, since=now, next_attempt_at=now, created_at=now)
    st = Stop(host="web", state=StopState.queued, since=now, next_attempt_at=now, created_at=now)
    a = Attempt(host="web", build_id=1, digest="0" * 64, cause=Cause.release, mode=Mode.overlap,
                effective_mode=Mode.overlap, revision=1, step=AttemptStep.queued, since=now,
                next_attempt_at=now, created_at=now)
    m = Member(generation_id=gid, host="web", role=MemberRole.spawning, fence=FENCE, since=now,
               next_attempt_at=now)
    lst = Listener(host="web", position=0, name="http", address="tcp:127.0.0.1:1",
                   state=ListenerState.new)
    r = Rollout(build_id=1, digest="0" * 64, mode=Mode.overlap, canary=False, waves="100%",
                wave_count=1, wave=0, settled=0, max_failures=0, auto_revert=False,
                after_attempt=0, after_stop=0, state=RolloutState.running, since=now,
                next_attempt_at=now, created_at=now)
    rl = Reload(host="web", state=ReloadState.queued, signal="HUP", since=now,
                next_attempt_at=now, created_at=now)
    jr = JobRun(host="web", scheduled_at=now, state=RunState.due, cause="schedule", since=now,
                next_attempt_at=now)
    s.add_all([w, st, a, m, lst, r, rl, jr])
    s.flush()
    s.add(RolloutTarget(rollout_id=r.id, host="web", position=0, wave=1,
                        state=TargetState.pending, tries=0, spent=0))
    s.flush()
    return {Listener: ({"host": "web", "position": 0}, ListenerState.new, ListenerState.opening),
            Generation: (gid, GenState.spawning, GenState.running),
            Wake: (w.id, WakeState.queued, WakeState.leased),
            Stop: (st.id, StopState.queued, StopState.signalled),
            Attempt: (a.id, AttemptStep.queued, AttemptStep.admitted),
            Member: (gid, MemberRole.spawning, MemberRole.successor),
            Host: ("web", Desired.down, Desired.up),
            Rollout: (r.id, RolloutState.running, RolloutState.paused),
            RolloutTarget: ({"rollout_id": r.id, "host": "web"}, TargetState.pending,
                            TargetState.deploying),
            Reload: (rl.id, ReloadState.queued, ReloadState.signalled),
            JobRun: (jr.id, RunState.due, RunState.running)}


@pytest.mark.parametrize("holder,fence", [(AGENT, FENCE + 1), ("agent-2", FENCE)])
def test_a_stale_fence_is_refused_for_every_kind_of_row(store: Store, gen_id: int, holder: str,
                                                         fence: int) -> None:
    """Each kind of row with a state, one legal move each: with a stale fence (or another
    holder's) nothing moves and LostRace names the row; with the live fence it moves."""
    rows = store.write(lambda s: one_of_each(s, gen_id))
    store.write(lambda s: s.execute(update(Host).where(Host.name == "web").values(desired=Desired.down)))
    kinds = {model: (col, key) for model, col, key in STATE_MODELS.values()}
    assert set(rows) == set(kinds), "a kind of row with a state is missing here"
    for model, (keyval, frm, to) in rows.items():
        col, key = kinds[model]

        # A composite key (listeners) is given as a dict of its columns.
        conds = ([getattr(model, k) == v for k, v in keyval.items()]
                 if isinstance(keyval, dict) else [key == keyval])

        def state(model: Any = model, col: str = col, conds: Any = conds) -> Any:
            return store.read(lambda s: s.execute(
                select(getattr(model, col)).where(*conds)).scalar_one())

        def step(s: Session, f: Fence, model: Any = model, col: str = col, key: Any = key,
                 keyval: Any = keyval, frm: Any = frm, to: Any = to) -> None:
            move(s, model, keyval if isinstance(keyval, dict) else {key.name: keyval}, {col: to},
                 f"{model.__name__} {keyval}", fence=f, col=col, frm=frm)

        with pytest.raises(LostRace):
            store.write(lambda s, step=step: step(s, Fence("web", holder, fence)))
        assert state() == frm
        store.write(lambda s, step=step: step(s, Fence("web", AGENT, FENCE)))
        assert state() == to


def test_move_many_moves_only_rows_whose_guards_hold(store: Store, gen_id: int) -> None:
    """The bulk form: one statement; each row fenced by its own host; the others stay."""
    def seed(s: Session) -> list[int]:
        now = utcnow()
        s.add(Host(name="api", kind=HostKind.instance, build_id=1, fence_seq=1, created_at=now))
        s.add(Lease(host="api", holder="agent-2", fence=1, acquired_at=now, expires_at=now))
        s.flush()
        ws = [Wake(host=h, state=st, since=now, next_attempt_at=now, created_at=now)
              for h, st in (("web", WakeState.queued), ("web", WakeState.leased),
                            ("api", WakeState.queued), ("web", WakeState.done))]
        s.add_all(ws)
        s.flush()
        return [w.id for w in ws]

    ids = store.write(seed)
    moved = store.write(lambda s: move_many(
        s, Wake, [Wake.id.in_(ids)], {"state": WakeState.cancelled}, "cancel",
        fence=Fence(Wake.host, AGENT, FENCE), col="state",
        frm=(WakeState.queued, WakeState.leased)))
    assert moved == 2
    states = dict(store.read(lambda s: s.execute(select(Wake.id, Wake.state).where(
        Wake.id.in_(ids))).all()))
    assert [states[i] for i in ids] == [WakeState.cancelled, WakeState.cancelled,
                                        WakeState.queued, WakeState.done]
    with pytest.raises(IllegalTransition):
        store.write(lambda s: move_many(s, Wake, [Wake.id.in_(ids)], {"state": WakeState.queued},
                                        "back", fence=Unfenced("test"), col="state",
                                        frm=WakeState.done))


def test_every_state_enum_has_a_transition_table() -> None:
    assert set(TRANSITIONS) == set(STATE_MODELS), "name the column a new table guards here"
    for cls, table in TRANSITIONS.items():
        assert set(table) == set(cls), f"{cls.__name__}: states missing from TRANSITIONS"
        for old, news in table.items():
            assert all(isinstance(n, cls) for n in news)
            assert old not in news, f"{cls.__name__}.{old.name} -> itself"


def test_illegal_transitions_are_refused(store: Store) -> None:
    """Every pair of distinct states: legal ones reach the UPDATE (no row matches: LostRace);
    illegal ones are refused before any SQL runs."""
    seen = {"legal": 0, "illegal": 0}

    def step(s: Session) -> None:
        for cls, (model, col, key) in STATE_MODELS.items():
            for old in cls:
                for new in cls:
                    if old is new:
                        continue
                    legal = new in TRANSITIONS[cls][old]
                    exc = LostRace if legal else IllegalTransition
                    with pytest.raises(exc) as err:
                        move(s, model, {key.name: -1 if key is not Host.name else "-"},
                             {col: new}, "probe", fence=Unfenced("probe"), col=col, frm=old)
                    if not legal:
                        assert f"illegal transition {old} -> {new}" in str(err.value)
                    seen["legal" if legal else "illegal"] += 1

    store.write(step)
    assert seen["legal"] > 0 and seen["illegal"] > 0


def test_no_state_column_is_written_outside_the_primitive() -> None:
    """grep: no raw UPDATE sets a state column (state, step, role, desired, outcome) in
    the product code; models/transition.py is the one place that does."""
    cols = re.compile(r"\.values\([^)]*\b(state|step|role|desired|outcome)=")
    hits = []
    scanned = set()
    for d in ("models", "workflows", "runners"):
        for path in sorted((ROOT / d).rglob("*.py")):  # every subfolder (the rooms)
            scanned.add(path.parent.relative_to(ROOT).as_posix())
            text = path.read_text()
            for m in re.finditer(r"update\(", text):
                window = text[m.start():m.start() + 400]
                end = window.find("\n\n")
                if cols.search(window[:end if end > 0 else None]):
                    hits.append(f"{path.relative_to(ROOT)}:{text[:m.start()].count(chr(10)) + 1}")
    # The walk reaches the rooms the moves made: a glob of the tops alone would check nothing.
    assert {"workflows/lifecycle", "workflows/deploys", "runners/backend"} <= scanned
    assert hits == [], f"state columns written outside models/transition.py: {hits}"


def test_illegal_transition_leaves_the_row(store: Store, gen_id: int) -> None:
    def step(s: Session) -> None:
        move(s, Generation, {"id": gen_id}, {"state": GenState.spawning},
             "back to spawning", fence=Unfenced("test"), col="state",
             frm=(GenState.spawning, GenState.current))

    with pytest.raises(IllegalTransition, match="illegal transition"):
        store.write(step)
    assert gen_state(store, gen_id) is GenState.spawning


def test_illegal_transition_is_refused_under_python_O() -> None:
    """`python -O` strips asserts; the transition check is not one."""
    probe = ("from models.transition import Unfenced, move\n"
             "from models.states import GenState\n"
             "from models.tables import Generation\n"
             "assert False, 'asserts are on: not running under -O'\n")
    cp = subprocess.run([sys.executable, "-O", "-c", probe + (
        "move(None, Generation, {'id': 1}, {'state': GenState.current}, 'probe',\n"
        "     fence=Unfenced('probe'), col='state', frm=GenState.proven)\n")],
        cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert cp.returncode != 0, cp.stdout
    assert "IllegalTransition: illegal transition" in cp.stderr, cp.stderr


# -- lock contention --------------------------------------------------------------------------

class WriteLock:
    """A second, plain sqlite3 connection holding the write lock (BEGIN IMMEDIATE) in a
    thread, until `release` is set or `seconds` pass; `released_at` is when it let go."""

    def __init__(self, db: Path, seconds: float) -> None:
        self.release = threading.Event()
        self.released_at = 0.0
        held = threading.Event()

        def run() -> None:
            conn = sqlite3.connect(db, isolation_level=None)
            try:
                conn.execute("BEGIN IMMEDIATE")
                held.set()
                self.release.wait(seconds)
                self.released_at = time.monotonic()
                conn.execute("COMMIT")
            finally:
                conn.close()

        self.thread = threading.Thread(target=run, name="lock-holder")
        self.thread.start()
        assert held.wait(5), "the lock holder never took the lock"

    def join(self) -> None:
        self.release.set()
        self.thread.join(5)


@pytest.mark.sqlite_only("SQLite's `database is locked`")
def test_write_retries_database_is_locked(store: Store, state_dir: Path) -> None:
    fast = Store(store.url, busy_timeout_ms=50)
    fast.read(lambda s: s.execute(text("SELECT 1")).scalar())  # connected before the lock
    calls = 0

    def step(s: Session) -> str:
        nonlocal calls
        calls += 1
        emit(s, "probe", None)
        return "written"

    try:
        lock = WriteLock(state_dir / DB_FILE, 0.3)
        assert fast.write(step) == "written"  # no exception surfaces
        done_at = time.monotonic()
        lock.join()
        assert lock.released_at and done_at >= lock.released_at
        assert calls > 1, "the write never met the lock: nothing was retried"
        assert fast.read(lambda s: s.execute(select(Event.kind)).scalars().all()) == ["probe"]
    finally:
        fast.dispose()


@pytest.mark.sqlite_only("SQLite WAL readers vs a BEGIN IMMEDIATE writer")
def test_reads_are_not_blocked_by_a_writer(store: Store, gen_id: int, state_dir: Path) -> None:
    lock = WriteLock(state_dir / DB_FILE, 10)
    try:
        assert gen_state(store, gen_id) is GenState.spawning  # WAL: readers never wait
        assert not lock.released_at, "the read waited for the writer"
    finally:
        lock.join()


@pytest.mark.postgresql_only("a real deadlock, detected by PostgreSQL (SQLSTATE 40P01)")
def test_write_retries_a_real_deadlock(store: Store, gen_id: int) -> None:
    """Another session locks the host row, then waits for the generation row a step holds;
    the step then wants the host row. PostgreSQL aborts the step's transaction (the other
    session's deadlock_timeout is far longer), and the store runs the step again."""
    step_has_gen, other_has_host = threading.Event(), threading.Event()
    other_pid: list[int] = []
    gen, host = "UPDATE generations SET pid = :p WHERE id = :g", "UPDATE hosts SET fence_seq = :f"

    def other() -> None:
        with store.engine.begin() as conn:
            conn.exec_driver_sql("SET LOCAL deadlock_timeout = '30s'")
            other_pid.append(conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one())
            conn.execute(text(host), {"f": FENCE})
            other_has_host.set()
            assert step_has_gen.wait(30)
            conn.execute(text(gen), {"p": 7, "g": gen_id})  # waits for the step's lock

    def other_waits() -> bool:
        with store.engine.connect() as conn:
            return bool(conn.execute(text("SELECT count(*) FROM pg_stat_activity WHERE pid = :p "
                                          "AND wait_event_type = 'Lock'"), {"p": other_pid[0]})
                        .scalar_one())

    calls = 0

    def step(s: Session) -> None:
        nonlocal calls
        calls += 1
        s.execute(text(gen), {"p": 1, "g": gen_id})
        if calls == 1:
            step_has_gen.set()
            wait_for(other_waits, 30, what="the other session to wait for the generation row")
        s.execute(text(host), {"f": FENCE})

    thread = threading.Thread(target=other, name="deadlocker")
    thread.start()
    try:
        assert other_has_host.wait(30)
        store.write(step)
    finally:
        step_has_gen.set()
        thread.join(60)
    assert calls == 2, "the deadlock was not retried"
    assert store.read(lambda s: s.get(Generation, gen_id)).pid == 1  # the retry wrote last


def test_other_errors_are_not_retried(store: Store, gen_id: int) -> None:
    calls = 0

    def step(s: Session) -> None:
        nonlocal calls
        calls += 1
        s.execute(text("INSERT INTO leases (host, holder, fence, acquired_at, expires_at) "
                       "VALUES ('web', 'x', 1, '2026-01-01', '2026-01-01')"))

    with pytest.raises(IntegrityError):
        store.write(step)
    assert calls == 1


class _PgError(Exception):
    def __init__(self, sqlstate: str) -> None:
        super().__init__(sqlstate)
        self.sqlstate = sqlstate


def test_transient_errors() -> None:
    assert is_transient(OperationalError("BEGIN", {}, sqlite3.OperationalError("database is locked")))
    assert is_transient(OperationalError("BEGIN", {}, sqlite3.OperationalError("database is busy")))
    assert is_transient(DBAPIError("UPDATE", {}, _PgError("40001")))  # serialization failure
    assert is_transient(DBAPIError("UPDATE", {}, _PgError("40P01")))  # deadlock detected
    assert not is_transient(OperationalError("x", {}, sqlite3.OperationalError("disk I/O error")))
    assert not is_transient(DBAPIError("UPDATE", {}, _PgError("23505")))
    assert not is_transient(LostRace("g1"))


def test_emit_many_writes_each_event_as_emit_would(store: Store) -> None:
    """Recovery's 1,000 `adopted` events in one INSERT (issue 42 item 4): the same rows, in
    order, as one emit each; an event that notifies goes through emit (its deliveries)."""
    seen: list[Any] = []

    def step(s: Session) -> None:
        emit_many(s, "adopted", [(None, None, {"pid": 7}), (None, None, {"pid": 8})])
        emit_many(s, "exited", [(None, None, {"status": "exited 1", "pid": 9})])
        seen.extend(s.info["events"])

    store.write(step)
    rows = store.read(lambda s: s.execute(select(Event.kind, Event.detail).order_by(Event.id)).all())
    assert [(k, json.loads(d)) for k, d in rows] == [
        ("adopted", {"pid": 7}), ("adopted", {"pid": 8}), ("exited", {"status": "exited 1", "pid": 9})]
    assert [e[0] for e in seen] == ["adopted", "adopted", "exited"]
