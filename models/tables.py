"""The schema, as typed SQLAlchemy models. They describe tables and serve reads; state
changes go through guarded UPDATEs (see models/store.py), never load-mutate-flush.

No `from __future__ import annotations` here: SQLAlchemy reads each `Mapped[...]` annotation
as an object, not a string it must evaluate (about a tenth of this module's import, which
every process that opens the store pays)."""

import enum
from datetime import datetime
from typing import ClassVar

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    DateTime,
    Enum,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    Unicode,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from models.durations import DURATIONS, sql_check
from models.states import (
    AttemptStep,
    Cause,
    Desired,
    GenState,
    HostKind,
    ListenerState,
    MemberRole,
    Mode,
    Outcome,
    ReloadState,
    RolloutOutcome,
    RolloutState,
    RunState,
    StopState,
    TargetState,
    TryOutcome,
    WakeState,
)

NAMING = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def state_enum(cls: type[enum.Enum], name: str) -> Enum:
    """Stored as text with a CHECK constraint listing the Enum's values."""
    return Enum(
        cls,
        name=name,
        native_enum=False,
        create_constraint=True,
        length=16,
        values_callable=lambda e: [m.value for m in e],
        validate_strings=True,
    )


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)
    __table__: ClassVar[Table]  # every model here maps one Table (for Core statements on it)


class RetryColumns:
    """Every obligation table carries these, so backoff survives restarts."""

    attempts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    next_attempt_at: Mapped[datetime] = mapped_column(DateTime, index=True)
    last_error: Mapped[str | None] = mapped_column(Text)
    since: Mapped[datetime] = mapped_column(DateTime)


class Agent(Base):
    __tablename__ = "agents"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    box: Mapped[str] = mapped_column(String(255))
    pid: Mapped[int | None] = mapped_column(Integer)
    create_time: Mapped[float | None] = mapped_column(Float)
    state_dir: Mapped[str] = mapped_column(Text)
    started_at: Mapped[datetime | None] = mapped_column(DateTime)
    heartbeat_at: Mapped[datetime | None] = mapped_column(DateTime)
    stopped_at: Mapped[datetime | None] = mapped_column(DateTime)


class Build(Base):
    __tablename__ = "builds"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    digest: Mapped[str] = mapped_column(String(64))
    path: Mapped[str] = mapped_column(Text, unique=True)  # staged copy under <state>/builds
    source: Mapped[str] = mapped_column(Text)  # where the operator staged it from
    published_at: Mapped[datetime | None] = mapped_column(DateTime)  # referenced before exec
    created_at: Mapped[datetime] = mapped_column(DateTime)
    good_at: Mapped[datetime | None] = mapped_column(DateTime)  # a one-shot run exited 0
    deleted_at: Mapped[datetime | None] = mapped_column(DateTime)  # file removed by gc


ORDERED = "start_after <> '[]'"  # a host with a start order (ix_hosts_ordered's predicate)


class Host(Base):
    __tablename__ = "hosts"
    name: Mapped[str] = mapped_column(String(63), primary_key=True)
    kind: Mapped[HostKind] = mapped_column(state_enum(HostKind, "host_kind"))
    build_id: Mapped[int] = mapped_column(ForeignKey("builds.id"))
    args: Mapped[str] = mapped_column(Text, default="[]")  # JSON list
    env: Mapped[str] = mapped_column(Text, default="{}")  # JSON object
    cwd: Mapped[str | None] = mapped_column(Text)
    drain_timeout: Mapped[float] = mapped_column(Float, default=10.0)
    health_timeout: Mapped[float] = mapped_column(Float, default=10.0)
    memory_tier_mb: Mapped[int | None] = mapped_column(Integer)
    desired: Mapped[Desired] = mapped_column(state_enum(Desired, "desired"), default=Desired.down)
    raised: Mapped[bool] = mapped_column(Boolean, default=False, server_default=text("false"))
    fence_seq: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    box: Mapped[str | None] = mapped_column(String(255))  # placement (several boxes)
    created_at: Mapped[datetime] = mapped_column(DateTime)
    # Workers (workflows/lifecycle/workers.py): restart policy, recycling, converging.
    one_shot: Mapped[bool] = mapped_column(Boolean, default=False, server_default=text("false"))
    max_run: Mapped[float | None] = mapped_column(Float)  # recycle after this many seconds up
    restart_floor: Mapped[float] = mapped_column(Float, default=1.0, server_default="1.0")
    restart_cap: Mapped[float] = mapped_column(Float, default=30.0, server_default="30.0")
    restart_reset: Mapped[float] = mapped_column(Float, default=60.0, server_default="60.0")
    converge_grace: Mapped[float] = mapped_column(Float, default=60.0, server_default="60.0")
    drift_since: Mapped[datetime | None] = mapped_column(DateTime)  # live build != running one
    # Who may connect to its socket (None: the agent-wide setting); see runners/backend/sockets.py.
    socket_group: Mapped[str | None] = mapped_column(String(32))
    socket_mode: Mapped[int | None] = mapped_column(Integer)
    # How a generation says it is ready (workflows/generations/readiness.py): NULL or "http" (GET / on
    # its own socket), "http:PATH", "tcp", "notify" (READY=1 on its own NOTIFY_SOCKET), "exec:CMD".
    ready: Mapped[str | None] = mapped_column(Text)
    # The ongoing health probe of an instance (workflows/lifecycle/probe.py): NULL interval, none.
    health_interval: Mapped[float | None] = mapped_column(Float)
    # What that probe asks (migration 0036): NULL GET / below 500, "http:PATH", "tcp", "exec:CMD".
    health: Mapped[str | None] = mapped_column(Text)
    unhealthy_after: Mapped[int] = mapped_column(Integer, default=3, server_default="3")
    # The watchdog (workflows/lifecycle/watchdog.py; migration 0038): WATCHDOG=1 at least
    # this often on its NOTIFY_SOCKET, or SIGABRT and a restart. NULL: none.
    watchdog: Mapped[float | None] = mapped_column(Float)
    unhealthy_restart: Mapped[bool] = mapped_column(Boolean, default=False,
                                                    server_default=text("false"))
    # Who its generations run as (NULL: the agent's user) and what they read at each start
    # (runners/backend/users.py, workflows/config/envfile.py; migration 0018).
    run_user: Mapped[str | None] = mapped_column(String(32))  # a name or a uid
    run_group: Mapped[str | None] = mapped_column(String(32))  # NULL: the user's own group
    env_files: Mapped[str] = mapped_column(Text, default="[]", server_default="[]")  # JSON list
    # Limits on each generation's cgroup and its rlimits (runners/backend/cglimits.py); NULL: none.
    memory_max: Mapped[int | None] = mapped_column(BigInteger)  # bytes
    cpu_quota: Mapped[int | None] = mapped_column(Integer)  # percent of one core
    pids_max: Mapped[int | None] = mapped_column(Integer)
    limit_nofile: Mapped[int | None] = mapped_column(Integer)  # RLIMIT_NOFILE, soft and hard
    limit_core: Mapped[int | None] = mapped_column(BigInteger)  # RLIMIT_CORE, bytes (0: none)
    # How many processes of its build share its held listeners, each a generation in its
    # own slot 0..instances-1 (workflows/generations/slots.py; migration 0024).
    instances: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    # {NAME: PATH}: copied at each start to $CREDENTIALS_DIRECTORY (runners/backend/credentials.py).
    credentials: Mapped[str] = mapped_column(Text, default="{}", server_default="{}")
    # The hosts a wake of it waits for, awake and ready (workflows/lifecycle/order.py; migration
    # 0020): a JSON list of names, `after = [...]` in the hosts file.
    start_after: Mapped[str] = mapped_column(Text, default="[]", server_default="[]")
    # What its box does with it while the store cannot be reached (runners/agent/fencing.py;
    # migration 0023): "fence" stops it before another box may take it over, "keep" leaves
    # it running. Only a host placed on several boxes is ever fenced.
    on_store_loss: Mapped[str] = mapped_column(String(8), default="fence", server_default="fence")
    # The start limit, "N/SECONDS" (workflows/lifecycle/restarts.py; migration 0037): N quick
    # exits of a slot within SECONDS make it `failed` (no more restarts). NULL: no limit.
    start_limit: Mapped[str | None] = mapped_column(String(24))
    # `vigil reload` (workflows/deploys/reload.py; migration 0039): the signal sent to each
    # current leader, and the answer to a reload not back ready ("restart": an overlap
    # restart of the same build; "keep": left as it is, with an event).
    reload_signal: Mapped[str] = mapped_column(String(16), default="HUP", server_default="HUP")
    on_reload_fail: Mapped[str] = mapped_column(String(8), default="restart",
                                                server_default="restart")
    # How a drain asks it to stop (workflows/generations/stopway.py; migration 0035): a signal
    # name without SIG (TERM unless set), or a command run instead of the signal.
    stop_signal: Mapped[str] = mapped_column(String(16), default="TERM", server_default="TERM")
    stop_command: Mapped[str | None] = mapped_column(Text)
    # A job (workflows/lifecycle/jobs.py; migration 0040): stored as a worker whose schedule
    # is set, `--every` seconds or a `--schedule` cron line (one of them), read in `timezone`
    # (NULL: UTC); `runs_from` is when its schedule was last enabled (no instant before it is due).
    every: Mapped[float | None] = mapped_column(Float)
    schedule: Mapped[str | None] = mapped_column(Text)
    timezone: Mapped[str | None] = mapped_column(String(64))
    runs_from: Mapped[datetime | None] = mapped_column(DateTime)
    # A job's policies (migration 0041): a run due while the last one runs (skip | queue |
    # replace | allow); instants missed while no agent ran (none | one | all, within
    # `catch_up_window` seconds, NULL: no bound); a run's bound in seconds (NULL: none) and
    # how many times a failed run is started again.
    overlap: Mapped[str] = mapped_column(String(8), default="skip", server_default="skip")
    catch_up: Mapped[str] = mapped_column(String(4), default="one", server_default="one")
    catch_up_window: Mapped[float | None] = mapped_column(Float)
    run_timeout: Mapped[float | None] = mapped_column(Float)
    run_retries: Mapped[int] = mapped_column(Integer, default=0, server_default="0")

    # Every duration finite, above 0, at most a day (migration 0006; on SQLite the same
    # rule is held by triggers, as adding a CHECK there means rebuilding the table; 0023's
    # on_store_loss likewise).
    __table_args__ = (CheckConstraint(" AND ".join(
        sql_check(c, nullable=c == "max_run") for c in DURATIONS), name="durations"),
        CheckConstraint(sql_check("health_interval", nullable=True), name="health_interval"),
        CheckConstraint(sql_check("watchdog", nullable=True), name="watchdog"),
        CheckConstraint("on_store_loss IN ('fence', 'keep')", name="on_store_loss"),
        CheckConstraint("start_limit IS NULL OR start_limit LIKE '_%/_%'", name="start_limit"),
        CheckConstraint("on_reload_fail IN ('restart', 'keep')", name="on_reload_fail"),
        CheckConstraint("overlap IN ('skip', 'queue', 'replace', 'allow')", name="overlap"),
        CheckConstraint("catch_up IN ('none', 'one', 'all')", name="catch_up"),
        # The hosts that have a start order, which are few: who names a host reads these
        # (workflows/lifecycle/order.py dependents; migration 0030).
        Index("ix_hosts_ordered", "name", sqlite_where=text(ORDERED)))  # PostgreSQL's: postgresql_options


class Listener(Base):
    """A listening socket vigil opens once for a host and every generation inherits
    (fd 3 + position). The inode identifies the very socket across agent restarts."""

    __tablename__ = "listeners"
    host: Mapped[str] = mapped_column(ForeignKey("hosts.name", ondelete="CASCADE"),
                                      primary_key=True)
    position: Mapped[int] = mapped_column(Integer, primary_key=True)  # fd = 3 + position
    name: Mapped[str] = mapped_column(String(64))  # LISTEN_FDNAMES
    # tcp:HOST:PORT | unix:/PATH; unique per box among hosts that can meet on one (check_free)
    address: Mapped[str] = mapped_column(Text)
    state: Mapped[ListenerState] = mapped_column(state_enum(ListenerState, "listener_state"))
    agent_id: Mapped[str | None] = mapped_column(String(64))  # the box that opened it
    inode: Mapped[int | None] = mapped_column(BigInteger)
    boot_id: Mapped[str | None] = mapped_column(String(36))  # the box's boot it was opened in
    opened_at: Mapped[datetime | None] = mapped_column(DateTime)
    reason: Mapped[str | None] = mapped_column(Text)  # why it was lost (kept once reopened)


class Generation(Base):
    __tablename__ = "generations"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)  # n
    uuid: Mapped[str] = mapped_column(String(36), unique=True)  # VIGIL_GENERATION marker
    host: Mapped[str] = mapped_column(ForeignKey("hosts.name", ondelete="CASCADE"))
    build_id: Mapped[int] = mapped_column(ForeignKey("builds.id"))
    state: Mapped[GenState] = mapped_column(state_enum(GenState, "gen_state"))
    fence: Mapped[int] = mapped_column(Integer)
    pid: Mapped[int | None] = mapped_column(Integer)
    create_time: Mapped[float | None] = mapped_column(Float)
    cgroup: Mapped[str | None] = mapped_column(Text)
    socket: Mapped[str | None] = mapped_column(Text)
    agent_id: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(DateTime)
    current_at: Mapped[datetime | None] = mapped_column(DateTime)
    ended_at: Mapped[datetime | None] = mapped_column(DateTime)
    end_reason: Mapped[str | None] = mapped_column(Text)
    # Failed probes in a row of a current instance, and since when it is unhealthy.
    health_failures: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    unhealthy_since: Mapped[datetime | None] = mapped_column(DateTime)
    # The user it was spawned as (the host's run_user then; written before the spawn).
    run_user: Mapped[str | None] = mapped_column(String(32))
    # Which instance of its host it is (0 for a host of one instance; migration 0024).
    slot: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    __table_args__ = (
        # The store itself holds "at most one current generation per host and slot".
        Index(
            "ux_generations_one_current",
            "host",
            "slot",
            unique=True,
            sqlite_where=text("state = 'current'"),  # PostgreSQL's: postgresql_options
        ),
        # A host's generations newest first (its history, kept or pruned: workflows/engine/history.py);
        # the live ones by state (the exit watcher, the backstop, the sanity check), so
        # neither read grows with the history (migration 0008).
        Index("ix_generations_host_id", "host", "id"),
        Index("ix_generations_state_host", "state", "host"),
        {"sqlite_autoincrement": True},  # n never goes back, even after deletes
    )


class KnownProcess(Base):
    """A descendant of a generation's leader seen by a walk (at spawn, health, probe and the
    liveness backstop): pid and start time. It stays a process of the generation even after
    it leaves the cgroup and clears its environment, so the proof and `vigil check` look
    for it too. Insert-only: a row has no state (a pid seen twice may be written twice)."""

    __tablename__ = "known_processes"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    generation_id: Mapped[int] = mapped_column(ForeignKey("generations.id", ondelete="CASCADE"))
    pid: Mapped[int] = mapped_column(Integer)
    create_time: Mapped[float] = mapped_column(Float)
    seen_at: Mapped[datetime] = mapped_column(DateTime)
    __table_args__ = (Index("ix_known_processes_generation", "generation_id"),)


class Chore(Base):
    """Store-wide work one agent does for the whole fleet (migration 0028): the history
    prune and the scheduled restarts' job store, which APScheduler says must never be
    shared by two schedulers. Held like a lease, by the store's clock: renewed by its
    holder, taken by another agent once expired; `epoch` counts the holders."""

    __tablename__ = "chores"
    name: Mapped[str] = mapped_column(String(32), primary_key=True)
    holder: Mapped[str | None] = mapped_column(String(64))
    epoch: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    expires_at: Mapped[datetime | None] = mapped_column(DateTime)


class SlotStreak(Base):
    """The restart streak of one slot of a host (every slot since migration 0033): its
    quick exits in a row, its own backoff's count; written by models/streaks.py alone."""

    __tablename__ = "slot_streaks"
    host: Mapped[str] = mapped_column(ForeignKey("hosts.name", ondelete="CASCADE"),
                                      primary_key=True)
    slot: Mapped[int] = mapped_column(Integer, primary_key=True)
    streak: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # The start limit's window (migration 0037): the epoch seconds of its recent quick exits
    # (JSON), and when the limit made the slot give up (NULL: it restarts).
    quick_exits: Mapped[str] = mapped_column(Text, default="[]", server_default="[]")
    failed_at: Mapped[datetime | None] = mapped_column(DateTime)


class Lease(Base):
    """A host's ownership: written on acquire, release and takeover only. Valid while its
    holder's box lease is live at `epoch` (migration 0029); a lease of epoch 0 (written
    before it) is judged by its own `expires_at` until its holder adopts it."""

    __tablename__ = "leases"
    # A box's own leases by expiry, and the expired ones: the reads on a clock stay
    # O(this box) (migration 0022); the leases from before 0029 by expiry (0029).
    __table_args__ = (Index("ix_leases_holder_expires_at", "holder", "expires_at"),
                      Index("ix_leases_expires_at", "expires_at"),
                      Index("ix_leases_epoch_expires_at", "epoch", "expires_at"))
    host: Mapped[str] = mapped_column(ForeignKey("hosts.name", ondelete="CASCADE"), primary_key=True)
    holder: Mapped[str] = mapped_column(String(64))
    fence: Mapped[int] = mapped_column(Integer)
    acquired_at: Mapped[datetime] = mapped_column(DateTime)
    # Epoch 0: the expiry itself; else the holder's box lease expiry when it was taken
    # (what it was valid until then; the box lease's own row says how long now).
    expires_at: Mapped[datetime] = mapped_column(DateTime)
    epoch: Mapped[int] = mapped_column(Integer, default=0, server_default="0")


class BoxLease(Base):
    """One box's (agent's) lease on its hosts (migration 0029): renewed by one UPDATE every
    few seconds, by the store's clock; `epoch` grows each time the box takes it anew (after
    it expired), which invalidates every host lease taken under an older one."""

    __tablename__ = "box_leases"
    box: Mapped[str] = mapped_column(String(64), primary_key=True)
    epoch: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    expires_at: Mapped[datetime | None] = mapped_column(DateTime, index=True)


class Ring(Base):
    """One NOTIFY an intent sent (migration 0032), kept as a row: an agent run with
    `--listen off` finds its box's and the shared channel's new ones in its sweep
    (runners/base/wakeup.py rung). Deleted by the store-wide prune after an hour."""

    __tablename__ = "rings"
    __table_args__ = (Index("ix_rings_channel_at", "channel", "at"), Index("ix_rings_at", "at"))
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    channel: Mapped[str] = mapped_column(String(64))
    at: Mapped[datetime] = mapped_column(DateTime)  # the store's clock when it was written


class Wake(RetryColumns, Base):
    __tablename__ = "wakes"
    # Its open rows by due time, so a round's read does not grow with the history; a host's
    # rows newest first (migration 0008).
    __table_args__ = (Index("ix_wakes_state_next_attempt_at", "state", "next_attempt_at"),
                      Index("ix_wakes_host_id", "host", "id"))
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    host: Mapped[str] = mapped_column(ForeignKey("hosts.name", ondelete="CASCADE"))
    state: Mapped[WakeState] = mapped_column(state_enum(WakeState, "wake_state"))
    cause: Mapped[str] = mapped_column(String(16), default="wake")
    fence: Mapped[int | None] = mapped_column(Integer)
    # Indexed, as every column that names a generation: deleting one (retention) looks them up.
    generation_id: Mapped[int | None] = mapped_column(ForeignKey("generations.id"), index=True)
    reason: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime)
    ended_at: Mapped[datetime | None] = mapped_column(DateTime)
    # The build this start must exec (a worker's captured build); None: the host's build.
    # No foreign key: see migrations/versions/0003_workers.py (builds rows are never deleted).
    build_id: Mapped[int | None] = mapped_column(Integer)
    # A queued wake held back by its host's start order: the hosts it waits on ("a, b"),
    # written in the step that decided it; NULL once it goes on (migration 0020).
    waiting_on: Mapped[str | None] = mapped_column(Text)
    # The instance it starts (0 for a host of one instance; migration 0024).
    slot: Mapped[int] = mapped_column(Integer, default=0, server_default="0")


class Watchdog(Base):
    """A generation spawned with a watchdog (workflows/lifecycle/watchdog.py; migration
    0038): the period its WATCHDOG_USEC said, the deadline by which WATCHDOG=1 must come
    (NULL until it runs; re-armed a full period after an agent's start), and when and why
    it fired (written before its SIGABRT)."""

    __tablename__ = "watchdogs"
    generation_id: Mapped[int] = mapped_column(ForeignKey("generations.id", ondelete="CASCADE"),
                                               primary_key=True)
    host: Mapped[str] = mapped_column(ForeignKey("hosts.name", ondelete="CASCADE"), index=True)
    period: Mapped[float] = mapped_column(Float)
    deadline: Mapped[datetime | None] = mapped_column(DateTime)
    fired_at: Mapped[datetime | None] = mapped_column(DateTime)
    reason: Mapped[str | None] = mapped_column(Text)
    __table_args__ = (CheckConstraint("period > 0 AND period <= 86400", name="period"),)


class Stop(RetryColumns, Base):
    __tablename__ = "stops"
    # Its open rows by due time, so a round's read does not grow with the history; a host's
    # rows newest first (migration 0008).
    __table_args__ = (Index("ix_stops_state_next_attempt_at", "state", "next_attempt_at"),
                      Index("ix_stops_host_id", "host", "id"))
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    host: Mapped[str] = mapped_column(ForeignKey("hosts.name", ondelete="CASCADE"))
    state: Mapped[StopState] = mapped_column(state_enum(StopState, "stop_state"))
    fence: Mapped[int | None] = mapped_column(Integer)
    generation_id: Mapped[int | None] = mapped_column(ForeignKey("generations.id"), index=True)
    signalled_at: Mapped[datetime | None] = mapped_column(DateTime)  # last SIGTERM sent
    reason: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime)
    ended_at: Mapped[datetime | None] = mapped_column(DateTime)
    # The one instance it ends (`vigil scale` down; migration 0024); NULL: the whole host.
    slot: Mapped[int | None] = mapped_column(Integer)


class JobRun(RetryColumns, Base):
    """One run of a job: its scheduled instant, written (with the wake that starts it) before
    anything of it runs; unique per host and instant, so no instant is started twice
    (workflows/lifecycle/jobs.py; migration 0040)."""

    __tablename__ = "job_runs"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    host: Mapped[str] = mapped_column(ForeignKey("hosts.name", ondelete="CASCADE"))
    scheduled_at: Mapped[datetime] = mapped_column(DateTime)
    state: Mapped[RunState] = mapped_column(state_enum(RunState, "run_state"))
    cause: Mapped[str] = mapped_column(String(16))  # schedule | manual (`vigil run`)
    wake_id: Mapped[int | None] = mapped_column(Integer, index=True)
    generation_id: Mapped[int | None] = mapped_column(ForeignKey("generations.id"), index=True)
    started_at: Mapped[datetime | None] = mapped_column(DateTime)
    ended_at: Mapped[datetime | None] = mapped_column(DateTime)
    exit_status: Mapped[int | None] = mapped_column(Integer)
    duration: Mapped[float | None] = mapped_column(Float)
    reason: Mapped[str | None] = mapped_column(Text)
    tries: Mapped[int] = mapped_column(Integer, default=0, server_default="0")  # starts after its first (--retries; 0041)
    __table_args__ = (UniqueConstraint("host", "scheduled_at", name="uq_job_runs_host_instant"),
                      Index("ix_job_runs_state_host", "state", "host"))


class Reload(RetryColumns, Base):
    """`vigil reload`: the reload signal sent to every current generation of the host, then
    each waited for back ready (workflows/deploys/reload.py; migration 0039)."""

    __tablename__ = "reloads"
    __table_args__ = (Index("ix_reloads_state_next_attempt_at", "state", "next_attempt_at"),
                      Index("ix_reloads_host_id", "host", "id"), {"sqlite_autoincrement": True})
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    host: Mapped[str] = mapped_column(ForeignKey("hosts.name", ondelete="CASCADE"))
    state: Mapped[ReloadState] = mapped_column(state_enum(ReloadState, "reload_state"))
    signal: Mapped[str] = mapped_column(String(16))
    fence: Mapped[int | None] = mapped_column(Integer)
    generation_id: Mapped[int | None] = mapped_column(ForeignKey("generations.id"), index=True)
    signalled_at: Mapped[datetime | None] = mapped_column(DateTime)  # its first signal
    reason: Mapped[str | None] = mapped_column(Text)
    attempt_id: Mapped[int | None] = mapped_column(Integer)  # the restart answering a failure
    created_at: Mapped[datetime] = mapped_column(DateTime)
    ended_at: Mapped[datetime | None] = mapped_column(DateTime)


class Release(RetryColumns, Base):
    """An owed lease release: deleted with the lease in one transaction when it succeeds."""

    __tablename__ = "releases"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    host: Mapped[str] = mapped_column(ForeignKey("hosts.name", ondelete="CASCADE"), index=True)
    holder: Mapped[str] = mapped_column(String(64))
    fence: Mapped[int] = mapped_column(Integer)


class Restore(RetryColumns, Base):
    """A parent memory limit still to be put back to the current generation's tier."""

    __tablename__ = "restores"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    host: Mapped[str] = mapped_column(ForeignKey("hosts.name", ondelete="CASCADE"), index=True)
    fence: Mapped[int] = mapped_column(Integer)


class Attempt(RetryColumns, Base):
    """One try at moving a host to a build; each step is written before it is taken."""

    __tablename__ = "attempts"
    # Its open rows by due time, so a round's read does not grow with the history; a host's
    # rows newest first (migration 0008).
    __table_args__ = (Index("ix_attempts_outcome_next_attempt_at", "outcome", "next_attempt_at"),
                      Index("ix_attempts_host_id", "host", "id"),
                      {"sqlite_autoincrement": True})  # ids never reused after `host rm` (0019)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    host: Mapped[str] = mapped_column(ForeignKey("hosts.name", ondelete="CASCADE"))
    build_id: Mapped[int] = mapped_column(ForeignKey("builds.id"))
    digest: Mapped[str] = mapped_column(String(64))
    cause: Mapped[Cause] = mapped_column(state_enum(Cause, "cause"))
    mode: Mapped[Mode] = mapped_column(state_enum(Mode, "mode"))  # asked for
    effective_mode: Mapped[Mode] = mapped_column(state_enum(Mode, "effective_mode"))  # will run
    revision: Mapped[int] = mapped_column(Integer)  # per-host; the newest one wins the gate
    canary: Mapped[bool] = mapped_column(Boolean, default=False)
    step: Mapped[AttemptStep] = mapped_column(state_enum(AttemptStep, "attempt_step"))
    fence: Mapped[int | None] = mapped_column(Integer)
    successor_id: Mapped[int | None] = mapped_column(ForeignKey("generations.id"), index=True)
    retiring_id: Mapped[int | None] = mapped_column(ForeignKey("generations.id"), index=True)
    outcome: Mapped[Outcome | None] = mapped_column(state_enum(Outcome, "outcome"))
    reason: Mapped[str | None] = mapped_column(Text)
    executed: Mapped[bool | None] = mapped_column(Boolean)
    drain_seconds: Mapped[float | None] = mapped_column(Float)
    clean_exit: Mapped[bool | None] = mapped_column(Boolean)  # a one-shot run exited 0
    # The attempt this one writes again (cause `resumed`). No foreign key: a self-reference
    # would make SQLite's table rebuilds (migrations 0009, 0014) fail on their own rows.
    resumed_from: Mapped[int | None] = mapped_column(Integer, index=True)
    created_at: Mapped[datetime] = mapped_column(DateTime)
    ended_at: Mapped[datetime | None] = mapped_column(DateTime)


class Member(RetryColumns, Base):
    """A generation in a host's operation set; a member until its termination is proven."""

    __tablename__ = "members"
    generation_id: Mapped[int] = mapped_column(ForeignKey("generations.id"), primary_key=True)
    host: Mapped[str] = mapped_column(ForeignKey("hosts.name", ondelete="CASCADE"), index=True)
    role: Mapped[MemberRole] = mapped_column(state_enum(MemberRole, "member_role"))
    attempt_id: Mapped[int | None] = mapped_column(ForeignKey("attempts.id"), index=True)
    fence: Mapped[int] = mapped_column(Integer)
    unproven: Mapped[bool] = mapped_column(Boolean, default=False)
    retried_at: Mapped[datetime | None] = mapped_column(DateTime)


class Rollout(RetryColumns, Base):
    """One build to many hosts in waves (workflows/rollouts/driver.py): an obligation until it ends,
    advanced by whichever agent claims it; its attempts are ordinary attempts."""

    __tablename__ = "rollouts"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    build_id: Mapped[int] = mapped_column(ForeignKey("builds.id"))
    digest: Mapped[str] = mapped_column(String(64))
    mode: Mapped[Mode] = mapped_column(state_enum(Mode, "mode"))
    canary: Mapped[bool] = mapped_column(Boolean, default=False)
    waves: Mapped[str] = mapped_column(Text)  # as the operator wrote them, e.g. "1,25%,100%"
    wave_count: Mapped[int] = mapped_column(Integer)
    wave: Mapped[int] = mapped_column(Integer, default=0)  # newest wave admitted (0: none yet)
    settled: Mapped[int] = mapped_column(Integer, default=0)  # newest wave settled
    pause: Mapped[float | None] = mapped_column(Float)  # seconds between two waves
    wave_due_at: Mapped[datetime | None] = mapped_column(DateTime)  # the next wave not before
    max_failures: Mapped[int] = mapped_column(Integer, default=0)
    auto_revert: Mapped[bool] = mapped_column(Boolean, default=False)
    # Watermarks at the start: an attempt or stop of a target written after them supersedes it.
    after_attempt: Mapped[int] = mapped_column(Integer, default=0)
    after_stop: Mapped[int] = mapped_column(Integer, default=0)
    state: Mapped[RolloutState] = mapped_column(state_enum(RolloutState, "rollout_state"))
    outcome: Mapped[RolloutOutcome | None] = mapped_column(
        state_enum(RolloutOutcome, "rollout_outcome"))
    reason: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime)
    ended_at: Mapped[datetime | None] = mapped_column(DateTime)
    __table_args__ = (
        CheckConstraint("pause IS NULL OR (pause > 0 AND pause <= 86400)", name="pause"),
        CheckConstraint("max_failures >= 0", name="max_failures"),
    )


class RolloutTarget(Base):
    """One host of a rollout: its wave, where it is, and the attempts written for it."""

    __tablename__ = "rollout_targets"
    rollout_id: Mapped[int] = mapped_column(ForeignKey("rollouts.id", ondelete="CASCADE"),
                                            primary_key=True)
    host: Mapped[str] = mapped_column(ForeignKey("hosts.name", ondelete="CASCADE"),
                                      primary_key=True, index=True)
    position: Mapped[int] = mapped_column(Integer)  # order of the hosts as given
    wave: Mapped[int] = mapped_column(Integer)  # 1-based; 0 for a host skipped at the start
    state: Mapped[TargetState] = mapped_column(state_enum(TargetState, "target_state"))
    # No foreign keys to attempts or builds: see migrations/versions/0009_rollouts.py.
    attempt_id: Mapped[int | None] = mapped_column(Integer)  # newest attempt of its wave
    revert_attempt_id: Mapped[int | None] = mapped_column(Integer)
    from_build_id: Mapped[int | None] = mapped_column(Integer)  # what it ran before its attempt
    tries: Mapped[int] = mapped_column(Integer, default=0)  # attempts written in its wave/revert
    spent: Mapped[int] = mapped_column(Integer, default=0)  # of them, abandoned after running
    reason: Mapped[str | None] = mapped_column(Text)


class HeldBuild(Base):
    """The failure book: a build that failed on a host is held down there. No restart,
    converge, schedule or rollout puts it back until `vigil retry HOST` (or a deploy of it
    the operator asks for, which runs, says so, and lifts it when it succeeds)."""

    __tablename__ = "held_builds"
    host: Mapped[str] = mapped_column(ForeignKey("hosts.name", ondelete="CASCADE"),
                                      primary_key=True)
    build_id: Mapped[int] = mapped_column(Integer, primary_key=True)
    digest: Mapped[str] = mapped_column(String(64))
    attempt_id: Mapped[int] = mapped_column(Integer)  # the attempt that failed
    reason: Mapped[str | None] = mapped_column(Text)
    since: Mapped[datetime] = mapped_column(DateTime)


class Event(Base):
    __tablename__ = "events"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(DateTime, index=True)
    host: Mapped[str | None] = mapped_column(String(63), index=True)
    generation_id: Mapped[int | None] = mapped_column(Integer)
    kind: Mapped[str] = mapped_column(String(32))
    detail: Mapped[str] = mapped_column(Text, default="{}")  # JSON object


class Notifier(Base):
    """Where events of some kinds are sent (`vigil notify add`; migration 0025): a command
    that reads the event as JSON on its stdin, or a webhook POSTed the same JSON."""

    __tablename__ = "notifiers"
    name: Mapped[str] = mapped_column(String(63), primary_key=True)
    exec: Mapped[str | None] = mapped_column(Text)  # a shell command line
    webhook: Mapped[str | None] = mapped_column(Text)  # an http:// or https:// URL
    timeout: Mapped[float] = mapped_column(Float, default=10.0)  # seconds per try
    created_at: Mapped[datetime] = mapped_column(DateTime)
    __table_args__ = (
        CheckConstraint("(exec IS NULL) <> (webhook IS NULL)", name="one_target"),
        CheckConstraint("timeout > 0 AND timeout <= 20", name="timeout"),
    )


class NotifyOn(Base):
    """One --on word of a notifier: the events it is sent (models/notices.py WORDS)."""

    __tablename__ = "notify_on"
    notifier: Mapped[str] = mapped_column(ForeignKey("notifiers.name", ondelete="CASCADE"),
                                          primary_key=True)
    word: Mapped[str] = mapped_column(String(16), primary_key=True, index=True)


class Delivery(RetryColumns, Base):
    """An event still owed to a notifier (or sent): written in the event's own transaction,
    open until a try delivered it. It carries the event as sent, so pruning the event
    history loses nothing owed."""

    __tablename__ = "deliveries"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    notifier: Mapped[str] = mapped_column(ForeignKey("notifiers.name", ondelete="CASCADE"))
    event_id: Mapped[int] = mapped_column(Integer)  # no foreign key: events are pruned
    word: Mapped[str] = mapped_column(String(16))
    host: Mapped[str | None] = mapped_column(String(63))
    generation_id: Mapped[int | None] = mapped_column(Integer)
    payload: Mapped[str] = mapped_column(Text)  # the event as JSON, exactly as sent
    created_at: Mapped[datetime] = mapped_column(DateTime)
    delivered_at: Mapped[datetime | None] = mapped_column(DateTime)
    __table_args__ = (Index("ix_deliveries_delivered_at_next_attempt_at", "delivered_at",
                            "next_attempt_at"),
                      Index("ix_deliveries_notifier_id", "notifier", "id"),
                      {"sqlite_autoincrement": True})


class DeliveryTry(Base):
    """One try at a delivery, written before the command runs or the POST is sent; its
    outcome after (NULL: in flight, or cut short by the agent's death)."""

    __tablename__ = "delivery_tries"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    delivery_id: Mapped[int] = mapped_column(ForeignKey("deliveries.id", ondelete="CASCADE"),
                                             index=True)
    agent_id: Mapped[str] = mapped_column(String(64))
    started_at: Mapped[datetime] = mapped_column(DateTime)
    ended_at: Mapped[datetime | None] = mapped_column(DateTime)
    outcome: Mapped[TryOutcome | None] = mapped_column(state_enum(TryOutcome, "try_outcome"))
    status: Mapped[int | None] = mapped_column(Integer)  # exit status, or HTTP status
    error: Mapped[str | None] = mapped_column(Text)
    __table_args__ = ({"sqlite_autoincrement": True},)


# APScheduler 3.11's SQLAlchemyJobStore table (scheduled restarts), column for column as
# apscheduler/jobstores/sqlalchemy.py defines it. Created by migration 0005, not by the
# job store (its create-if-missing finds it there).
SCHEDULER_JOBS = Table(
    "apscheduler_jobs",
    Base.metadata,
    Column("id", Unicode(191), primary_key=True),
    Column("next_run_time", Float(25), index=True),
    Column("job_state", LargeBinary, nullable=False),
)


def postgresql_options() -> None:
    """What only PostgreSQL reads: the WHERE of the partial indexes (one current, ordered hosts). Set when a
    PostgreSQL engine is made (models/store.py, migrations/env.py), not declared above: a
    `postgresql_*` keyword imports SQLAlchemy's PostgreSQL dialect on every start, SQLite's
    too (about two `python -c pass` of the agent's start-up). Idempotent."""
    for ix in Generation.__table__.indexes:
        if ix.name == "ux_generations_one_current":
            ix.dialect_options["postgresql"]["where"] = text("state = 'current'")
    for ix in Host.__table__.indexes:
        if ix.name == "ix_hosts_ordered":
            ix.dialect_options["postgresql"]["where"] = text(ORDERED)
