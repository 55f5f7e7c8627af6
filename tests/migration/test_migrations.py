"""Migrations, checked by hand with Alembic's own API on every database vigil supports:
one head; upgrade from empty; downgrade to base and up again; rows in flight survive;
the models equal the migrated schema; the database holds the invariants the models name.

Every test runs on the database under test (tests/conftest.py: `--db sqlite|postgresql`):
a SQLite file in tmp_path or a throwaway PostgreSQL database; CI runs both."""

from __future__ import annotations

import pickle
import re
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Connection, DateTime, bindparam, inspect, text
from sqlalchemy.exc import IntegrityError

from models import schema, views
from models.durations import DURATIONS
from models.errors import StoreNotReady
from models.statedir import prepare_state_dir
from models.store import Store
from models.tables import Base
from tests.conftest import drop_db, new_db

pytestmark = pytest.mark.backend("the migrations, per dialect")

T0 = datetime(2026, 1, 2, 3, 4, 5, 600000)

VIEW_COLUMNS = ["kind", "host", "generation", "since", "attempts", "next_attempt_at", "last_error"]


# -- databases --------------------------------------------------------------------------

@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    """An empty database (no schema) behind a real Store, on the database under test."""
    s = Store(new_db(prepare_state_dir(tmp_path / "state")))
    try:
        yield s
    finally:
        s.dispose()
        drop_db(s.url)


@pytest.fixture
def migrated(store: Store) -> Store:
    schema.upgrade(store.engine)
    return store


# -- revisions --------------------------------------------------------------------------

def _script() -> ScriptDirectory:
    return ScriptDirectory.from_config(schema.alembic_config("sqlite://"))


def revisions_oldest_first() -> list[str]:
    return [r.revision for r in reversed(list(_script().walk_revisions()))]


# -- raw rows ---------------------------------------------------------------------------

def raw_insert(conn: Connection, table: str, row: dict[str, Any]) -> None:
    """A plain INSERT, independent of the models (which describe head only)."""
    stmt = text(f"INSERT INTO {table} ({', '.join(row)}) "
                f"VALUES ({', '.join(':' + c for c in row)})")
    stmt = stmt.bindparams(*[bindparam(c, type_=DateTime()) for c, v in row.items()
                             if isinstance(v, datetime)])
    conn.execute(stmt, row)


def retry_cols(n: int = 0) -> dict[str, Any]:
    return {"attempts": n, "next_attempt_at": T0 + timedelta(seconds=n), "last_error": None,
            "since": T0}


def seed_0001(conn: Connection) -> None:
    """One row in every table of revision 0001, open obligations of every kind included."""
    raw_insert(conn, "agents", {"id": "agent-1", "box": "box-1", "pid": 42, "create_time": 1.5,
                                "state_dir": "/var/lib/vigil", "started_at": T0,
                                "heartbeat_at": T0, "stopped_at": None})
    raw_insert(conn, "builds", {"id": 1, "digest": "ab" * 32, "path": "/s/builds/b1",
                                "source": "/src/app", "published_at": T0, "created_at": T0,
                                "deleted_at": None})
    raw_insert(conn, "hosts", {"name": "web", "kind": "instance", "build_id": 1, "args": "[]",
                               "env": "{}", "cwd": None, "drain_timeout": 10.0,
                               "health_timeout": 5.0, "memory_tier_mb": 256, "desired": "up",
                               "raised": True, "fence_seq": 3, "box": None, "created_at": T0})
    for gid, state in ((1, "current"), (2, "retiring")):
        raw_insert(conn, "generations", {
            "id": gid, "uuid": f"00000000-0000-0000-0000-00000000000{gid}", "host": "web",
            "build_id": 1, "state": state, "fence": 3, "pid": 1000 + gid,
            "create_time": 2.5, "cgroup": None, "socket": f"/run/web/g{gid}.sock",
            "agent_id": "agent-1", "created_at": T0, "current_at": T0, "ended_at": None,
            "end_reason": None})
    raw_insert(conn, "leases", {"host": "web", "holder": "agent-1", "fence": 3,
                                "acquired_at": T0, "expires_at": T0 + timedelta(seconds=30)})
    raw_insert(conn, "wakes", {"id": 1, "host": "web", "state": "checking", "cause": "wake",
                               "fence": 3, "generation_id": 1, "reason": None,
                               "created_at": T0, "ended_at": None, **retry_cols(1)})
    raw_insert(conn, "stops", {"id": 1, "host": "web", "state": "signalled", "fence": 3,
                               "generation_id": 1, "signalled_at": T0, "reason": "operator",
                               "created_at": T0, "ended_at": None, **retry_cols(2)})
    raw_insert(conn, "releases", {"id": 1, "host": "web", "holder": "agent-1", "fence": 2,
                                  **retry_cols(3)})
    raw_insert(conn, "restores", {"id": 1, "host": "web", "fence": 3, **retry_cols(4)})
    raw_insert(conn, "attempts", {
        "id": 1, "host": "web", "build_id": 1, "digest": "ab" * 32, "cause": "release",
        "mode": "overlap", "effective_mode": "overlap", "revision": 1, "canary": False,
        "step": "switched", "fence": 3, "successor_id": 1, "retiring_id": 2, "outcome": None,
        "reason": None, "executed": True, "drain_seconds": None, "created_at": T0,
        "ended_at": None, **retry_cols(5)})
    raw_insert(conn, "members", {"generation_id": 2, "host": "web", "role": "retiring",
                                 "attempt_id": 1, "fence": 3, "unproven": False,
                                 "retried_at": None, **retry_cols(6)})
    raw_insert(conn, "events", {"id": 1, "at": T0, "host": "web", "generation_id": 1,
                                "kind": "switched", "detail": '{"attempt": 1}'})


def seed_0003(conn: Connection) -> None:
    """A worker with its restart policy, a restart waiting out its backoff on its captured
    build, a one-shot attempt that exited cleanly and the build it marked good."""
    raw_insert(conn, "builds", {"id": 3, "digest": "cd" * 32, "path": "/s/builds/b3",
                                "source": "/src/job", "published_at": T0, "created_at": T0,
                                "good_at": T0, "deleted_at": None})
    raw_insert(conn, "hosts", {"name": "jobs", "kind": "worker", "build_id": 3, "args": "[]",
                               "env": "{}", "cwd": None, "drain_timeout": 10.0,
                               "health_timeout": 5.0, "memory_tier_mb": None, "desired": "up",
                               "raised": False, "fence_seq": 1, "box": None, "created_at": T0,
                               "one_shot": False, "max_run": 3600.0, "restart_floor": 0.5,
                               "restart_cap": 8.0, "restart_reset": 30.0,
                               "converge_grace": 5.0, "restart_streak": 2, "drift_since": T0})
    raw_insert(conn, "wakes", {"id": 30, "host": "jobs", "state": "queued", "cause": "restart",
                               "fence": None, "generation_id": None, "reason": None,
                               "created_at": T0, "ended_at": None, "build_id": 3,
                               **retry_cols(0)})
    raw_insert(conn, "attempts", {
        "id": 30, "host": "jobs", "build_id": 3, "digest": "cd" * 32, "cause": "release",
        "mode": "hold", "effective_mode": "hold", "revision": 1, "canary": False,
        "step": "ended", "fence": 1, "successor_id": None, "retiring_id": None,
        "outcome": "done", "reason": "ran to completion", "executed": True,
        "drain_seconds": 0.0, "clean_exit": True, "created_at": T0, "ended_at": T0,
        **retry_cols(0)})


def seed_0004(conn: Connection) -> None:
    """A host whose socket is opened to a group (0004: hosts.socket_group, socket_mode)."""
    raw_insert(conn, "hosts", {"name": "edge", "kind": "instance", "build_id": 1, "args": "[]",
                               "env": "{}", "cwd": None, "drain_timeout": 10.0,
                               "health_timeout": 5.0, "memory_tier_mb": None, "desired": "down",
                               "raised": False, "fence_seq": 0, "box": None, "created_at": T0,
                               "socket_group": "www-data", "socket_mode": 0o660})


def seed_0005(conn: Connection) -> None:
    """A scheduled restart in APScheduler's job store table (0005: apscheduler_jobs)."""
    raw_insert(conn, "apscheduler_jobs", {"id": "restart:web", "next_run_time": 1767323045.6,
                                          "job_state": b"\x80\x05opaque pickle"})


def seed_0006(conn: Connection) -> None:
    """A worker whose durations sit on the bounds 0006 sets (above 0, at most a day)."""
    raw_insert(conn, "hosts", {"name": "slow", "kind": "worker", "build_id": 3, "args": "[]",
                               "env": "{}", "cwd": None, "drain_timeout": 86400.0,
                               "health_timeout": 0.001, "memory_tier_mb": None,
                               "desired": "down", "raised": False, "fence_seq": 0, "box": None,
                               "created_at": T0, "one_shot": False, "max_run": None,
                               "restart_floor": 0.001, "restart_cap": 86400.0,
                               "restart_reset": 86400.0, "converge_grace": 86400.0,
                               "restart_streak": 0, "drift_since": None})


def seed_0008(conn: Connection) -> None:
    """A host's history, open and closed rows side by side (0008 indexes them only)."""
    raw_insert(conn, "wakes", {"id": 80, "host": "web", "state": "done", "cause": "wake",
                               "fence": 3, "generation_id": 1, "reason": None,
                               "created_at": T0, "ended_at": T0, **retry_cols(0)})
    raw_insert(conn, "stops", {"id": 80, "host": "web", "state": "done", "fence": 3,
                               "generation_id": 2, "signalled_at": T0, "reason": "operator",
                               "created_at": T0, "ended_at": T0, **retry_cols(0)})


def seed_0009(conn: Connection) -> None:
    """A rollout in flight (0009): its wave's attempt with cause `rollout`, a target of each
    kind of progress, a build held down on a host by the failure book."""
    raw_insert(conn, "attempts", {
        "id": 90, "host": "web", "build_id": 3, "digest": "cd" * 32, "cause": "rollout",
        "mode": "overlap", "effective_mode": "overlap", "revision": 9, "canary": False,
        "step": "queued", "fence": None, "successor_id": None, "retiring_id": None,
        "outcome": None, "reason": None, "executed": None, "drain_seconds": None,
        "clean_exit": None, "created_at": T0, "ended_at": None, **retry_cols(0)})
    raw_insert(conn, "rollouts", {
        "id": 9, "build_id": 3, "digest": "cd" * 32, "mode": "overlap", "canary": False,
        "waves": "1,100%", "wave_count": 2, "wave": 1, "settled": 0, "pause": 30.0,
        "wave_due_at": None, "max_failures": 0, "auto_revert": True, "after_attempt": 30,
        "after_stop": 1, "state": "running", "outcome": None, "reason": None,
        "created_at": T0, "ended_at": None, **retry_cols(7)})
    for host, wave, state, attempt in (("web", 1, "deploying", 90), ("jobs", 2, "pending", None),
                                       ("edge", 0, "skipped", None)):
        raw_insert(conn, "rollout_targets", {
            "rollout_id": 9, "host": host, "position": wave, "wave": wave, "state": state,
            "attempt_id": attempt, "revert_attempt_id": None,
            "from_build_id": 1 if attempt else None, "tries": 1 if attempt else 0, "spent": 0,
            "reason": "held down" if state == "skipped" else None})
    raw_insert(conn, "held_builds", {"host": "edge", "build_id": 3, "digest": "cd" * 32,
                                     "attempt_id": 30, "reason": "health check failed",
                                     "since": T0})


def seed_0011(conn: Connection) -> None:
    """A host with a listening socket held on this box and its readiness (0011: listeners,
    hosts.ready)."""
    raw_insert(conn, "hosts", {"name": "api", "kind": "instance", "build_id": 1, "args": "[]",
                               "env": "{}", "cwd": None, "drain_timeout": 10.0,
                               "health_timeout": 5.0, "memory_tier_mb": None, "desired": "up",
                               "raised": False, "fence_seq": 0, "box": None, "created_at": T0,
                               "ready": "notify"})
    raw_insert(conn, "listeners", {"host": "api", "position": 0, "name": "http",
                                   "address": "tcp:127.0.0.1:8080", "state": "held",
                                   "agent_id": "agent-1", "inode": 4_300_000_000,
                                   "boot_id": "b" * 36, "opened_at": T0, "reason": None})


def seed_0012(conn: Connection) -> None:
    """A host probed every 5 s, restarted after 2 failures, and its generation that has
    failed one probe (0012: the ongoing health probe)."""
    raw_insert(conn, "hosts", {"name": "probed", "kind": "instance", "build_id": 1,
                               "args": "[]", "env": "{}", "cwd": None, "drain_timeout": 10.0,
                               "health_timeout": 5.0, "memory_tier_mb": None, "desired": "up",
                               "raised": False, "fence_seq": 0, "box": None, "created_at": T0,
                               "health_interval": 5.0, "unhealthy_after": 2,
                               "unhealthy_restart": True})
    raw_insert(conn, "generations", {"id": 40, "uuid": "4" * 36, "host": "probed",
                                     "build_id": 1, "state": "current", "fence": 1,
                                     "pid": 4040, "create_time": 1.0, "cgroup": None,
                                     "socket": "/run/p.sock", "agent_id": "agent-1",
                                     "created_at": T0, "current_at": T0, "ended_at": None,
                                     "end_reason": None, "health_failures": 1,
                                     "unhealthy_since": None})


def seed_0013(conn: Connection) -> None:
    """A scheduled restart stored by the code after the move (0013: the job's function
    reference is runners.agent.schedules:fire)."""
    raw_insert(conn, "apscheduler_jobs", {"id": "restart:moved", "next_run_time": 1767323045.6,
                                          "job_state": _job_state("runners.agent.schedules:fire")})


def seed_0014(conn: Connection) -> None:
    """An overlap attempt interrupted before its switch and the attempt that writes it
    again (0014: cause `resumed`, attempts.resumed_from)."""
    common = {"host": "web", "build_id": 3, "digest": "cd" * 32, "mode": "overlap",
              "effective_mode": "overlap", "canary": False, "fence": None,
              "successor_id": None, "retiring_id": None, "drain_seconds": None,
              "clean_exit": None, "created_at": T0}
    raw_insert(conn, "attempts", {
        **common, "id": 140, "cause": "release", "revision": 14, "step": "ended",
        "outcome": "abandoned", "reason": "interrupted at step spawned", "executed": True,
        "resumed_from": None, "ended_at": T0, **retry_cols(0)})
    raw_insert(conn, "attempts", {
        **common, "id": 141, "cause": "resumed", "revision": 15, "step": "queued",
        "outcome": None, "reason": None, "executed": None, "resumed_from": 140,
        "ended_at": None, **retry_cols(0)})


def _job_state(func: str) -> bytes:
    """A job's state as APScheduler 3 pickles it: a dict whose `func` is a textual reference."""
    from apscheduler.triggers.cron import CronTrigger
    return pickle.dumps({"version": 1, "id": "x", "func": func, "trigger": CronTrigger.from_crontab(
        "30 4 * * *", timezone="UTC"), "executor": "default", "args": ("web",), "kwargs": {},
        "name": "fire", "misfire_grace_time": None, "coalesce": True, "max_instances": 1,
        "next_run_time": None}, pickle.HIGHEST_PROTOCOL)


def seed_0017(conn: Connection) -> None:
    """A descendant of g40's leader seen by a walk (0017: known_processes)."""
    raw_insert(conn, "known_processes", {"id": 1, "generation_id": 40, "pid": 4041,
                                         "create_time": 2.0, "seen_at": T0})


def seed_0018(conn: Connection) -> None:
    """A host run as its own user, with an env file and limits, and its generation spawned
    as that user (0018: hosts.run_user ... limit_nofile, generations.run_user)."""
    raw_insert(conn, "hosts", {"name": "owned", "kind": "worker", "build_id": 1,
                               "args": "[]", "env": "{}", "cwd": None, "drain_timeout": 10.0,
                               "health_timeout": 5.0, "memory_tier_mb": None, "desired": "up",
                               "raised": False, "fence_seq": 0, "box": None, "created_at": T0,
                               "run_user": "nobody", "run_group": "nogroup",
                               "env_files": '["/etc/owned.env", "-/etc/owned.local"]',
                               "memory_max": 64 << 20, "cpu_quota": 150, "pids_max": 10,
                               "limit_nofile": 1024, "credentials": '{"token": "/etc/owned.token"}'})
    raw_insert(conn, "generations", {"id": 41, "uuid": "5" * 36, "host": "owned",
                                     "build_id": 1, "state": "current", "fence": 1,
                                     "pid": 4141, "create_time": 1.0, "cgroup": None,
                                     "socket": None, "agent_id": "agent-1",
                                     "created_at": T0, "current_at": T0, "ended_at": None,
                                     "end_reason": None, "run_user": "nobody"})


def seed_0019(conn: Connection) -> None:
    """Nothing new to hold (0019 only makes attempt ids never reused): an open attempt."""
    raw_insert(conn, "attempts", {
        "id": 190, "host": "web", "build_id": 3, "digest": "cd" * 32, "mode": "overlap",
        "effective_mode": "overlap", "canary": False, "fence": None, "successor_id": None,
        "retiring_id": None, "drain_seconds": None, "clean_exit": None, "created_at": T0,
        "cause": "release", "revision": 19, "step": "queued", "outcome": None, "reason": None,
        "executed": None, "resumed_from": None, "ended_at": None, **retry_cols(0)})


def seed_0020(conn: Connection) -> None:
    """A host that starts after another, and its wake held back by that order (0020:
    hosts.start_after, wakes.waiting_on): queued, so pending_obligations shows it."""
    raw_insert(conn, "hosts", {"name": "after-web", "kind": "instance", "build_id": 1,
                               "args": "[]", "env": "{}", "cwd": None, "drain_timeout": 10.0,
                               "health_timeout": 5.0, "memory_tier_mb": None, "desired": "up",
                               "raised": False, "fence_seq": 0, "box": None, "created_at": T0,
                               "start_after": '["web"]'})
    raw_insert(conn, "wakes", {"id": 200, "host": "after-web", "state": "queued",
                               "cause": "wake", "fence": None, "generation_id": None,
                               "reason": None, "created_at": T0, "ended_at": None,
                               "build_id": None, "waiting_on": "web", "attempts": 0,
                               "next_attempt_at": T0, "last_error": "waiting on web",
                               "since": T0})


def seed_0021(conn: Connection) -> None:
    """A host whose generations write no core file (0021: hosts.limit_core, bytes)."""
    raw_insert(conn, "hosts", {"name": "no-core", "kind": "worker", "build_id": 1,
                               "args": "[]", "env": "{}", "cwd": None, "drain_timeout": 10.0,
                               "health_timeout": 5.0, "memory_tier_mb": None, "desired": "down",
                               "raised": False, "fence_seq": 0, "box": None, "created_at": T0,
                               "limit_core": 0})


def seed_0022(conn: Connection) -> None:
    """A host leased by another box, expired (0022: leases indexed by holder and expiry)."""
    raw_insert(conn, "hosts", {"name": "leased", "kind": "worker", "build_id": 1,
                               "args": "[]", "env": "{}", "cwd": None, "drain_timeout": 10.0,
                               "health_timeout": 5.0, "memory_tier_mb": None, "desired": "down",
                               "raised": False, "fence_seq": 1, "box": "box1,box2",
                               "created_at": T0, "limit_core": None})
    raw_insert(conn, "leases", {"host": "leased", "holder": "box1", "fence": 1,
                                "acquired_at": T0, "expires_at": T0})


def seed_0023(conn: Connection) -> None:
    """Two hosts placed on different boxes, each listening on the same address (0023: a
    listener address is unique per box among hosts that can meet, not store-wide), one of
    them kept running while the store cannot be reached (0023: hosts.on_store_loss)."""
    for name, box in (("port-a", "box1"), ("port-b", "box2")):
        raw_insert(conn, "hosts", {"name": name, "kind": "instance", "build_id": 1,
                                   "args": "[]", "env": "{}", "cwd": None, "drain_timeout": 10.0,
                                   "health_timeout": 5.0, "memory_tier_mb": None,
                                   "desired": "down", "raised": False, "fence_seq": 0,
                                   "box": box, "created_at": T0, "ready": "notify",
                                   "on_store_loss": "keep" if box == "box2" else "fence"})
        raw_insert(conn, "listeners", {"host": name, "position": 0, "name": "http",
                                       "address": "tcp:127.0.0.1:9090", "state": "new",
                                       "agent_id": None, "inode": None, "boot_id": None,
                                       "opened_at": None, "reason": None})


def seed_0025(conn: Connection) -> None:
    """A notifier, an event owed to it with one try cut short (0025: notifiers, notify_on,
    deliveries, delivery_tries): undelivered, so pending_obligations shows it."""
    raw_insert(conn, "notifiers", {"name": "pager", "exec": "cat >> /tmp/pager",
                                   "webhook": None, "timeout": 5.0, "created_at": T0})
    raw_insert(conn, "notify_on", {"notifier": "pager", "word": "failed"})
    raw_insert(conn, "deliveries", {"id": 250, "notifier": "pager", "event_id": 1,
                                    "word": "failed", "host": "web", "generation_id": 1,
                                    "payload": '{"id": 1}', "created_at": T0,
                                    "delivered_at": None, **retry_cols(2)})
    raw_insert(conn, "delivery_tries", {"id": 250, "delivery_id": 250, "agent_id": "agent-1",
                                        "started_at": T0, "ended_at": None, "outcome": None,
                                        "status": None, "error": None})


def seed_0024(conn: Connection) -> None:
    """A host of two instances on a held listener, both current, one in each slot (0024:
    hosts.instances, generations.slot, wakes.slot, stops.slot), the queued restart of a
    third slot and a scale's stop of slot 1."""
    raw_insert(conn, "hosts", {"name": "pair", "kind": "instance", "build_id": 1,
                               "args": "[]", "env": "{}", "cwd": None, "drain_timeout": 10.0,
                               "health_timeout": 5.0, "memory_tier_mb": None, "desired": "up",
                               "raised": False, "fence_seq": 1, "box": None, "created_at": T0,
                               "ready": "notify", "instances": 3})
    for slot in (0, 1):
        raw_insert(conn, "generations", {"id": 240 + slot, "uuid": f"{slot}" * 36, "host": "pair",
                                         "build_id": 1, "state": "current", "fence": 1,
                                         "pid": 2400 + slot, "create_time": 1.0, "cgroup": None,
                                         "socket": None, "agent_id": "agent-1",
                                         "created_at": T0, "current_at": T0, "ended_at": None,
                                         "end_reason": None, "slot": slot})
    raw_insert(conn, "wakes", {"id": 240, "host": "pair", "state": "queued", "cause": "restart",
                               "fence": None, "generation_id": None, "reason": None,
                               "created_at": T0, "ended_at": None, "build_id": None,
                               "waiting_on": None, "attempts": 0, "next_attempt_at": T0,
                               "last_error": None, "since": T0, "slot": 2})
    raw_insert(conn, "stops", {"id": 240, "host": "pair", "state": "queued", "fence": None,
                               "generation_id": None, "signalled_at": None,
                               "reason": "scaled down to 1", "created_at": T0, "ended_at": None,
                               "attempts": 0, "next_attempt_at": T0, "last_error": None,
                               "since": T0, "slot": 1})


def seed_0028(conn: Connection) -> None:
    """The store's chores held by an agent (0028: chores)."""
    raw_insert(conn, "chores", {"name": "store", "holder": "agent-1", "epoch": 3,
                                "expires_at": T0})


def seed_0029(conn: Connection) -> None:
    """A box lease, and a host lease taken under its epoch (0029: box_leases)."""
    raw_insert(conn, "box_leases", {"box": "box2", "epoch": 4, "expires_at": T0})
    raw_insert(conn, "hosts", {"name": "boxed", "kind": "worker", "build_id": 1,
                               "args": "[]", "env": "{}", "cwd": None, "drain_timeout": 10.0,
                               "health_timeout": 5.0, "memory_tier_mb": None, "desired": "down",
                               "raised": False, "fence_seq": 2, "box": "box1,box2",
                               "created_at": T0, "limit_core": None})
    raw_insert(conn, "leases", {"host": "boxed", "holder": "box2", "fence": 2, "epoch": 4,
                                "acquired_at": T0, "expires_at": T0})


def seed_0026(conn: Connection) -> None:
    """A restart streak of slot 2 of seed_0024's host of instances (0026: slot_streaks)."""
    raw_insert(conn, "slot_streaks", {"host": "pair", "slot": 2, "streak": 3})


def seed_0031(conn: Connection) -> None:
    """A restore of seed_0024's host of instances (0031: its insert rings on PostgreSQL)."""
    raw_insert(conn, "restores", {"id": 31, "host": "pair", "fence": 1, **retry_cols(1)})


def seed_0030(conn: Connection) -> None:
    """A host with a start order naming seed_0029's host (0030: ix_hosts_ordered)."""
    raw_insert(conn, "hosts", {"name": "after-boxed", "kind": "worker", "build_id": 1,
                               "args": "[]", "env": "{}", "cwd": None, "drain_timeout": 10.0,
                               "health_timeout": 5.0, "memory_tier_mb": None, "desired": "down",
                               "raised": False, "fence_seq": 0, "box": None,
                               "created_at": T0, "limit_core": None, "start_after": '["boxed"]'})


def seed_0032(conn: Connection) -> None:
    """A ring of the shared channel (0032: rings)."""
    raw_insert(conn, "rings", {"id": 32, "channel": "vigil", "at": T0})


def seed_0033(conn: Connection) -> None:
    """Slot 0's restart streak of seed_0024's host of instances (0033: every slot's streak
    in slot_streaks)."""
    raw_insert(conn, "slot_streaks", {"host": "pair", "slot": 0, "streak": 1})


def seed_0034(conn: Connection) -> None:
    """A scheduled restart stored by the code after the rename (0034: the job's function
    reference is runners.agent.jobstore:fire)."""
    raw_insert(conn, "apscheduler_jobs", {"id": "restart:renamed", "next_run_time": 1767323045.6,
                                          "job_state": _job_state("runners.agent.jobstore:fire")})


def seed_0035(conn: Connection) -> None:
    """A host stopped by its own signal and one by its own command (0035: hosts.stop_signal,
    hosts.stop_command)."""
    for name, sig, command in (("quits", "QUIT", None), ("own-stop", "TERM", "nginx -s quit")):
        raw_insert(conn, "hosts", {"name": name, "kind": "instance", "build_id": 1,
                                   "args": "[]", "env": "{}", "cwd": None, "drain_timeout": 10.0,
                                   "health_timeout": 5.0, "memory_tier_mb": None,
                                   "desired": "down", "raised": False, "fence_seq": 0,
                                   "created_at": T0, "stop_signal": sig,
                                   "stop_command": command})


def seed_0036(conn: Connection) -> None:
    """An instance probed by a command of its own, ready on a path (0036: hosts.health)."""
    raw_insert(conn, "hosts", {"name": "own-probes", "kind": "instance", "build_id": 1,
                               "args": "[]", "env": "{}", "cwd": None, "drain_timeout": 10.0,
                               "health_timeout": 5.0, "memory_tier_mb": None, "desired": "down",
                               "raised": False, "fence_seq": 0, "box": None, "created_at": T0,
                               "ready": "http:/healthz", "health_interval": 2.0,
                               "health": "exec:test -e /tmp"})


def seed_0037(conn: Connection) -> None:
    """A host with a start limit, failed at it: its slot's quick exits and when it gave up
    (0037: hosts.start_limit, slot_streaks.quick_exits and failed_at)."""
    raw_insert(conn, "hosts", {"name": "gives-up", "kind": "worker", "build_id": 1,
                               "args": "[]", "env": "{}", "cwd": None, "drain_timeout": 10.0,
                               "health_timeout": 5.0, "memory_tier_mb": None, "desired": "up",
                               "raised": False, "fence_seq": 0, "created_at": T0,
                               "start_limit": "3/60"})
    raw_insert(conn, "slot_streaks", {"host": "gives-up", "slot": 0, "streak": 3,
                                      "quick_exits": "[1767323045.1, 1767323046.2, 1767323048.3]",
                                      "failed_at": T0})


def seed_0038(conn: Connection) -> None:
    """A host's watchdog and an armed one of its generation (0038: hosts.watchdog, the
    watchdogs table)."""
    conn.execute(text("UPDATE hosts SET watchdog = 3.5 WHERE name = 'web'"))
    raw_insert(conn, "watchdogs", {"generation_id": 1, "host": "web", "period": 3.5,
                                   "deadline": T0, "fired_at": None, "reason": None})


def seed_0039(conn: Connection) -> None:
    """A host's reload settings and a reload in flight (0039: hosts.reload_signal and
    on_reload_fail, the reloads table)."""
    conn.execute(text("UPDATE hosts SET reload_signal = 'USR2', on_reload_fail = 'keep' "
                      "WHERE name = 'web'"))
    raw_insert(conn, "reloads", {"id": 1, "host": "web", "state": "signalled", "signal": "USR2",
                                 "fence": 1, "generation_id": 1, "signalled_at": T0,
                                 "created_at": T0, **retry_cols(7)})


def seed_0040(conn: Connection) -> None:
    """A job's schedule and a run in flight (0040: hosts.every, schedule, timezone,
    runs_from, the job_runs table)."""
    conn.execute(text("UPDATE hosts SET every = 60.0, timezone = 'Europe/Paris', runs_from = "
                      ":t WHERE name = 'web'"), {"t": T0})
    raw_insert(conn, "job_runs", {"id": 1, "host": "web", "scheduled_at": T0, "state": "running",
                                  "cause": "schedule", "wake_id": 1, "generation_id": 1,
                                  "started_at": T0, **retry_cols(7)})


def seed_0041(conn: Connection) -> None:
    """A job's policies and a queued run (0041: hosts.overlap, catch_up, catch_up_window,
    run_timeout, run_retries; job_runs.tries and the states queued, missed)."""
    conn.execute(text("UPDATE hosts SET overlap = 'queue', catch_up = 'all', catch_up_window = "
                      "300.0, run_timeout = 30.0, run_retries = 2 WHERE name = 'web'"))
    raw_insert(conn, "job_runs", {"id": 2, "host": "web", "scheduled_at": T0 + timedelta(minutes=1),
                                  "state": "queued", "cause": "schedule", "tries": 1,
                                  **retry_cols(7)})


# Rows valid at each revision, written right after upgrading to it. A new revision adds
# its own seed here (test_seeds_cover_every_revision fails until it does), so the test
# below checks that rows written at every older revision survive the upgrade to head.
SEEDS: dict[str, Callable[[Connection], None]] = {
    "0001": seed_0001,
    "0003": seed_0003,
    "0004": seed_0004,
    "0005": seed_0005,
    "0006": seed_0006,
    "0008": seed_0008,
    "0009": seed_0009,
    "0011": seed_0011,
    "0012": seed_0012,
    "0013": seed_0013,
    "0014": seed_0014,
    "0017": seed_0017,
    "0018": seed_0018,
    "0019": seed_0019,
    "0020": seed_0020,
    "0021": seed_0021,
    "0022": seed_0022,
    "0023": seed_0023,
    "0024": seed_0024,
    "0025": seed_0025,
    "0028": seed_0028,
    "0026": seed_0026,
    "0031": seed_0031,
    "0029": seed_0029,
    "0030": seed_0030,
    "0032": seed_0032,
    "0033": seed_0033,
    "0034": seed_0034,
    "0035": seed_0035,
    "0036": seed_0036,
    "0037": seed_0037,
    "0038": seed_0038,
    "0039": seed_0039,
    "0040": seed_0040,
    "0041": seed_0041,
}
# Tables a later revision creates: their rows cannot survive going below it (seeded and
# checked by test_rows_seeded_at_each_revision_survive_upgrade_to_head instead).
LATER_TABLES = {"watchdogs", "box_leases", "chores", "slot_streaks", "apscheduler_jobs", "listeners", "known_processes", "rollouts", "rollout_targets",
                "held_builds", "notifiers", "notify_on", "deliveries", "delivery_tries", "reloads", "job_runs"}
SEEDED_KINDS_0001 = {("wake", "web", 1), ("stop", "web", 1), ("release", "web", None),
                     ("restore", "web", None), ("attempt", "web", 1), ("member", "web", 2)}


def snapshot(conn: Connection) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every table (by primary key) and of the view, for before/after checks."""
    out: dict[str, list[tuple[Any, ...]]] = {}
    for table in Base.metadata.sorted_tables:
        if table.name == "rings":  # what the intents' trigger rang when written (PostgreSQL): a log, not state
            continue
        pk = ", ".join(c.name for c in table.primary_key.columns)
        out[table.name] = [tuple(r) for r in conn.execute(
            text(f"SELECT * FROM {table.name} ORDER BY {pk}"))]
    out["pending_obligations"] = [tuple(r) for r in conn.execute(
        text("SELECT * FROM pending_obligations ORDER BY kind, host"))]
    return out


# -- revisions and heads ------------------------------------------------------------------

def test_single_head_and_linear_history() -> None:
    script = _script()
    assert len(script.get_heads()) == 1, f"several heads: {script.get_heads()}"
    assert len(script.get_bases()) == 1, f"several bases: {script.get_bases()}"
    for rev in script.walk_revisions():
        assert not rev.is_merge_point, f"merge revision {rev.revision}"
        assert not rev.branch_labels, f"branch label on {rev.revision}"


def test_models_head_constant_is_alembic_head() -> None:
    assert schema.HEAD == _script().get_current_head() == revisions_oldest_first()[-1]


def test_seeds_cover_every_revision() -> None:
    missing = [r for r in revisions_oldest_first() if r not in SEEDS]
    assert not missing, f"add a seed for revision(s) {missing} to SEEDS in this file"
    assert set(SEEDS) <= set(revisions_oldest_first())


# -- upgrade, downgrade -------------------------------------------------------------------

def test_upgrade_from_empty_to_head(store: Store) -> None:
    assert schema.current_revision(store.engine) is None
    schema.upgrade(store.engine)
    assert schema.current_revision(store.engine) == schema.HEAD
    schema.require_head(store.engine)
    insp = inspect(store.engine)
    assert set(insp.get_table_names()) == {t.name for t in Base.metadata.sorted_tables} | {
        "alembic_version"}
    assert insp.get_view_names() == ["pending_obligations"]
    with store.engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM pending_obligations")).scalar() == 0


def test_downgrade_to_base_leaves_nothing(migrated: Store) -> None:
    engine = migrated.engine
    schema.downgrade(engine, "base")
    insp = inspect(engine)
    assert insp.get_table_names() == ["alembic_version"]
    assert insp.get_view_names() == []
    if engine.dialect.name == "postgresql":
        assert insp.get_sequence_names() == []
    with engine.connect() as conn:
        assert conn.execute(text("SELECT count(*) FROM alembic_version")).scalar() == 0
    assert schema.current_revision(engine) is None


def test_up_down_up_over_seeded_rows(migrated: Store) -> None:
    engine = migrated.engine
    with engine.begin() as conn:
        seed_0001(conn)
        before = snapshot(conn)
    assert {k for k, v in before.items() if not v} == LATER_TABLES, "every table holds a seeded row"

    # An upgrade that has nothing to do touches nothing.
    schema.upgrade(engine)
    with engine.connect() as conn:
        assert snapshot(conn) == before

    # Each later revision: step down below it and back up, rows intact. (0001 is the base,
    # whose downgrade drops everything: covered below.)
    for rev in reversed(revisions_oldest_first()[1:]):
        down = _script().get_revision(rev).down_revision
        assert isinstance(down, str)
        schema.downgrade(engine, down)
        schema.upgrade(engine)
        with engine.connect() as conn:
            assert snapshot(conn) == before, f"rows changed by down/up through {rev}"

    # Down to base and up again: a fresh, working schema that takes the same rows.
    schema.downgrade(engine, "base")
    schema.upgrade(engine)
    assert schema.current_revision(engine) == schema.HEAD
    with engine.begin() as conn:
        assert not any(snapshot(conn).values())
        seed_0001(conn)
    with engine.connect() as conn:
        assert snapshot(conn) == before


def test_rows_seeded_at_each_revision_survive_upgrade_to_head(store: Store) -> None:
    engine = store.engine
    for rev in revisions_oldest_first():
        schema.upgrade(engine, rev)
        assert schema.current_revision(engine) == rev
        with engine.begin() as conn:
            SEEDS[rev](conn)
    schema.upgrade(engine)
    schema.require_head(engine)
    with engine.connect() as conn:
        open_kinds = {tuple(r) for r in conn.execute(
            text("SELECT kind, host, generation FROM pending_obligations"))}
        assert SEEDED_KINDS_0001 <= open_kinds
        assert conn.execute(text("SELECT state FROM generations WHERE id = 1")).scalar() == "current"
        assert conn.execute(text("SELECT fence_seq FROM hosts WHERE name = 'web'")).scalar() == 3
        assert ("wake", "jobs", None) in open_kinds
        # Rows written before 0003 take the new columns' defaults.
        assert tuple(conn.execute(text(
            "SELECT one_shot, restart_floor FROM hosts WHERE name = 'web'"
        )).one()) in ((False, 1.0), (0, 1.0))
        assert tuple(conn.execute(text("SELECT id, next_run_time FROM apscheduler_jobs"
                                       " WHERE id = 'restart:web'")).one()) \
            == ("restart:web", 1767323045.6)
        assert tuple(conn.execute(text(
            "SELECT socket_group, socket_mode FROM hosts WHERE name = 'edge'")).one()) == \
            ("www-data", 0o660)
        assert ("rollout", "rollout #9", None) in open_kinds
        assert conn.execute(text("SELECT cause FROM attempts WHERE id = 90")).scalar() == "rollout"
        assert conn.execute(text("SELECT count(*) FROM rollout_targets")).scalar() == 3
        assert tuple(conn.execute(text("SELECT cause, resumed_from FROM attempts WHERE id = 141"
                                       )).one()) == ("resumed", 140)
        assert conn.execute(text("SELECT resumed_from FROM attempts WHERE id = 90")).scalar() is None
        # 0020: a host written before it starts after nothing; a wake held back by the order
        # is an open wake, its last_error saying what it waits on.
        assert conn.execute(text("SELECT start_after FROM hosts WHERE name = 'web'")).scalar() == "[]"
        assert tuple(conn.execute(text(
            "SELECT kind, generation, last_error FROM pending_obligations WHERE host = 'after-web'"
        )).one()) == ("wake", None, "waiting on web")
        assert conn.execute(text("SELECT waiting_on FROM wakes WHERE id = 200")).scalar() == "web"
        # 0021: a host written before it keeps the agent's core limit (NULL); 0 is kept as 0.
        assert conn.execute(text("SELECT limit_core FROM hosts WHERE name = 'web'")).scalar() is None
        assert conn.execute(text("SELECT limit_core FROM hosts WHERE name = 'no-core'")).scalar() == 0
        # 0023: the listener of 0011 kept through the rebuild of `listeners`, beside two
        # hosts on different boxes sharing one address.
        assert conn.execute(text("SELECT inode FROM listeners WHERE host = 'api'")).scalar() == 4_300_000_000
        assert conn.execute(text("SELECT count(*) FROM listeners WHERE address = "
                                 "'tcp:127.0.0.1:9090'")).scalar() == 2
        # 0023: a host written before it is fenced, as before; a value not known is refused.
        assert conn.execute(text("SELECT on_store_loss FROM hosts WHERE name = 'web'")).scalar() == "fence"
        assert conn.execute(text("SELECT on_store_loss FROM hosts WHERE name = 'port-b'")).scalar() == "keep"
        # 0035: a host written before it is stopped by SIGTERM, as before; its own kept.
        assert tuple(conn.execute(text(
            "SELECT stop_signal, stop_command FROM hosts WHERE name = 'web'")).one()) == ("TERM", None)
        assert tuple(conn.execute(text(
            "SELECT stop_signal, stop_command FROM hosts WHERE name = 'own-stop'")).one()) == \
            ("TERM", "nginx -s quit")
        assert conn.execute(text("SELECT stop_signal FROM hosts WHERE name = 'quits'")).scalar() == "QUIT"
        # 0025: an undelivered notification is an open obligation, paced as its notifier.
        assert ("notification", "notify pager", 1) in open_kinds
        assert conn.execute(text("SELECT outcome FROM delivery_tries WHERE id = 250")).scalar() is None
        # 0039: a reload in flight is an open obligation; a host written before it reloads by HUP.
        assert ("reload", "web", 1) in open_kinds
        assert conn.execute(text("SELECT reload_signal, on_reload_fail FROM hosts WHERE name = "
                                 "'api'")).one() == ("HUP", "restart")
        # 0029: a lease from before it has epoch 0 (judged by its own expiry); the box
        # lease and the host lease taken under its epoch are kept.
        assert conn.execute(text("SELECT epoch FROM leases WHERE host = 'leased'")).scalar() == 0
        assert tuple(conn.execute(text("SELECT b.epoch, l.fence FROM box_leases b JOIN leases l"
                                       " ON l.holder = b.box AND l.epoch = b.epoch")).one()) == (4, 2)
        # 0030: the hosts with a start order, by the partial index's own predicate.
        assert conn.execute(text("SELECT name FROM hosts WHERE start_after <> '[]' ORDER BY name")).scalars().all() \
            == ["after-boxed", "after-web"]
        # 0032: a ring row is kept.
        assert tuple(conn.execute(text("SELECT id, channel FROM rings")).one()) == (32, "vigil")
        # 0033: the worker's streak of 0003 is its slot 0's row; a streak of 0 is no row.
        assert [tuple(r) for r in conn.execute(text(
            "SELECT host, slot, streak FROM slot_streaks ORDER BY host, slot"))] == [
            ("gives-up", 0, 3), ("jobs", 0, 2), ("pair", 0, 1), ("pair", 2, 3)]
        # 0037: a host's start limit, and the slot it made give up with its window.
        assert conn.execute(text("SELECT start_limit FROM hosts WHERE name = 'gives-up'")
                            ).scalar() == "3/60"
        assert conn.execute(text("SELECT count(*) FROM slot_streaks WHERE failed_at IS NOT NULL "
                                 "AND quick_exits LIKE '[1767323045.1,%'")).scalar() == 1
        # 0013 and 0034: every stored job names the function where it is now.
        assert {i: pickle.loads(b)["func"] for i, b in conn.execute(text(
            "SELECT id, job_state FROM apscheduler_jobs WHERE id <> 'restart:web'"))} == {
            "restart:moved": "runners.agent.jobstore:fire",
            "restart:renamed": "runners.agent.jobstore:fire"}
    with pytest.raises(IntegrityError), engine.begin() as conn:
        conn.execute(text("UPDATE hosts SET on_store_loss = 'maybe' WHERE name = 'web'"))


def test_slot_0_streaks_go_back_to_hosts_and_return(store: Store) -> None:
    """0033 down: slot 0's streak is the host's `restart_streak` again (slots 1.. keep their
    rows); up again: the same rows as before."""
    engine = store.engine
    schema.upgrade(engine, "0032")
    with engine.begin() as conn:
        for rev in ("0001", "0003", "0024", "0026"):
            SEEDS[rev](conn)
    schema.upgrade(engine)
    with engine.connect() as conn:
        before = snapshot(conn)
    assert ("jobs", 0, 2) in [r[:3] for r in before["slot_streaks"]]
    schema.downgrade(engine, "0032")
    with engine.connect() as conn:
        assert dict(conn.execute(text("SELECT name, restart_streak FROM hosts")).all()) == {
            "web": 0, "jobs": 2, "pair": 0}
        assert conn.execute(text("SELECT host, slot FROM slot_streaks")).all() == [("pair", 2)]
    schema.upgrade(engine)
    with engine.connect() as conn:
        assert snapshot(conn) == before


@pytest.mark.sqlite_only("a PostgreSQL sequence never goes back (the seeds' explicit ids bypass it)")
def test_attempt_ids_are_never_reused(store: Store) -> None:
    """The newest attempts deleted (`host rm`): the next one takes a new id (issue 20 item
    16), also for attempts written before the upgrade to head."""
    engine = store.engine
    schema.upgrade(engine, "0001")
    with engine.begin() as conn:
        seed_0001(conn)
    schema.upgrade(engine)
    with engine.begin() as conn:
        top = conn.execute(text("SELECT max(id) FROM attempts")).scalar()
        row = dict(conn.execute(text(f"SELECT * FROM attempts WHERE id = {top}")).mappings().one())
        conn.execute(text(f"DELETE FROM members WHERE attempt_id = {top}"))
        conn.execute(text(f"DELETE FROM attempts WHERE id = {top}"))
        row.pop("id")
        raw_insert(conn, "attempts", row)
        assert conn.execute(text("SELECT max(id) FROM attempts")).scalar() == top + 1


def test_stored_schedules_follow_the_move(store: Store) -> None:
    """A job stored by the code before the move names runners.schedules:fire; after 0013 it
    names runners.agent.schedules:fire, after 0034 runners.agent.jobstore:fire (APScheduler
    drops a job it cannot import), and a downgrade puts each older name back. An unreadable
    row is left as it was."""
    schema.upgrade(store.engine, "0012")
    with store.engine.begin() as conn:
        raw_insert(conn, "apscheduler_jobs", {"id": "restart:web", "next_run_time": 1.0,
                                              "job_state": _job_state("runners.schedules:fire")})
        raw_insert(conn, "apscheduler_jobs", {"id": "restart:odd", "next_run_time": 1.0,
                                              "job_state": b"not a pickle"})

    def funcs() -> dict[str, Any]:
        with store.engine.connect() as conn:
            rows = conn.execute(text("SELECT id, job_state FROM apscheduler_jobs")).all()
        return {i: (pickle.loads(b)["func"] if i != "restart:odd" else bytes(b)) for i, b in rows}
    schema.upgrade(store.engine)
    assert funcs() == {"restart:web": "runners.agent.jobstore:fire", "restart:odd": b"not a pickle"}
    schema.downgrade(store.engine, "0033")
    assert funcs()["restart:web"] == "runners.agent.schedules:fire"
    schema.downgrade(store.engine, "0012")
    assert funcs()["restart:web"] == "runners.schedules:fire"


# -- models == migrated schema -----------------------------------------------------------

def test_models_equal_migrated_schema(migrated: Store) -> None:
    with migrated.engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": True,
                                                     "compare_server_default": True})
        diff = compare_metadata(ctx, Base.metadata)
    assert diff == []


def test_apscheduler_job_store_table_is_the_migrated_one(migrated: Store) -> None:
    """APScheduler's own table definition equals the one 0005 created, and its job store
    works on it (its create-if-missing does nothing: the table is there)."""
    from apscheduler.jobstores.sqlalchemy import SQLAlchemyJobStore
    from apscheduler.schedulers.background import BackgroundScheduler

    jobstore = SQLAlchemyJobStore(engine=migrated.engine)
    with migrated.engine.connect() as conn:
        only_jobs = {"compare_type": True,  # vigil's own tables are unknown to that metadata
                     "include_name": lambda name, kind, _parent: kind != "table"
                     or name == "apscheduler_jobs"}
        diff = compare_metadata(MigrationContext.configure(conn, opts=only_jobs),
                                jobstore.jobs_t.metadata)
    assert diff == []
    scheduler = BackgroundScheduler(jobstores={"default": jobstore}, timezone="UTC")
    scheduler.start(paused=True)
    try:
        scheduler.add_job("builtins:print", "interval", hours=1, id="probe")
        assert [j.id for j in scheduler.get_jobs()] == ["probe"]
    finally:
        scheduler.shutdown(wait=False)


def test_view_equals_the_models_view(migrated: Store) -> None:
    """compare_metadata does not see views: the migrated view must be the one in
    models/views.py, compared as the database itself renders both."""
    engine = migrated.engine
    fresh = views.PENDING_OBLIGATIONS.replace("VIEW pending_obligations", "VIEW po_models", 1)
    assert fresh != views.PENDING_OBLIGATIONS
    with engine.begin() as conn:
        conn.exec_driver_sql(fresh)
    insp = inspect(engine)

    def norm(sql: str, name: str) -> str:
        return " ".join(sql.replace(name, "V").split())

    assert norm(insp.get_view_definition("pending_obligations"), "pending_obligations") == \
        norm(insp.get_view_definition("po_models"), "po_models")


def test_pending_obligations_columns(migrated: Store) -> None:
    with migrated.engine.connect() as conn:
        result = conn.execute(text("SELECT * FROM pending_obligations"))
        assert list(result.keys()) == VIEW_COLUMNS
    cols = [c["name"] for c in inspect(migrated.engine).get_columns("pending_obligations")]
    assert cols == VIEW_COLUMNS


def test_pending_obligations_lists_every_open_kind(migrated: Store) -> None:
    with migrated.engine.begin() as conn:
        seed_0001(conn)
        raw_insert(conn, "wakes", {"id": 2, "host": "web", "state": "unproven",
                                   "cause": "wake", "created_at": T0, **retry_cols()})
        raw_insert(conn, "wakes", {"id": 3, "host": "web", "state": "done",
                                   "cause": "wake", "created_at": T0, **retry_cols()})
        raw_insert(conn, "stops", {"id": 2, "host": "web", "state": "cancelled",
                                   "created_at": T0, **retry_cols()})
        conn.execute(text("UPDATE members SET unproven = :t"), {"t": True})
        raw_insert(conn, "reloads", {"id": 1, "host": "web", "state": "queued", "signal": "HUP",
                                     "created_at": T0, **retry_cols(7)})
        raw_insert(conn, "reloads", {"id": 2, "host": "web", "state": "done", "signal": "HUP",
                                     "created_at": T0, **retry_cols()})
        rows = {tuple(r) for r in conn.execute(
            text("SELECT kind, host, generation, attempts FROM pending_obligations"))}
    assert rows == {("wake", "web", 1, 1), ("unproven_wake", "web", None, 0),
                    ("stop", "web", 1, 2), ("release", "web", None, 3),
                    ("restore", "web", None, 4), ("attempt", "web", 1, 5),
                    ("unproven_member", "web", 2, 6), ("reload", "web", None, 7)}


# -- invariants the database holds ----------------------------------------------------------

def enum_columns() -> list[tuple[str, str, sa.Enum]]:
    return [(t.name, c.name, c.type) for t in Base.metadata.sorted_tables for c in t.columns
            if isinstance(c.type, sa.Enum)]


def _parents(conn: Connection) -> None:
    """The rows a state row refers to: a build, a host, a (retiring) generation, an attempt."""
    raw_insert(conn, "builds", {"id": 1, "digest": "0" * 64, "path": "/b/1", "source": "/s",
                                "created_at": T0})
    raw_insert(conn, "hosts", {"name": "web", "kind": "instance", "build_id": 1, "args": "[]",
                               "env": "{}", "drain_timeout": 1.0, "health_timeout": 1.0,
                               "desired": "down", "raised": False, "fence_seq": 0,
                               "created_at": T0})
    raw_insert(conn, "generations", {"id": 1, "uuid": "g-1", "host": "web", "build_id": 1,
                                     "state": "retiring", "fence": 1, "agent_id": "a",
                                     "created_at": T0})
    raw_insert(conn, "attempts", {"id": 1, "host": "web", "build_id": 1, "digest": "0" * 64,
                                  "cause": "retry", "mode": "hold", "effective_mode": "hold",
                                  "revision": 1, "canary": False, "step": "queued",
                                  "created_at": T0, **retry_cols()})
    raw_insert(conn, "rollouts", {**_row("rollouts", -1), "id": 1})
    raw_insert(conn, "notifiers", {"name": "pager", "exec": "true", "timeout": 1.0,
                                   "created_at": T0})
    raw_insert(conn, "deliveries", {"id": 1, "notifier": "pager", "event_id": 1,
                                    "word": "down", "payload": "{}", "created_at": T0,
                                    **retry_cols()})


def _row(table: str, i: int) -> dict[str, Any]:
    """A complete valid row of `table`, new in its keys (i), to set one state column in."""
    rows: dict[str, dict[str, Any]] = {
        "hosts": {"name": f"h{i}", "kind": "worker", "build_id": 1, "args": "[]", "env": "{}",
                  "drain_timeout": 1.0, "health_timeout": 1.0, "desired": "down",
                  "raised": False, "fence_seq": 0, "created_at": T0},
        "generations": {"id": 100 + i, "uuid": f"u-{i}", "host": "web", "build_id": 1,
                        "state": "spawning", "fence": 1, "agent_id": "a", "created_at": T0},
        "wakes": {"id": 100 + i, "host": "web", "state": "queued", "cause": "wake",
                  "created_at": T0, **retry_cols()},
        "stops": {"id": 100 + i, "host": "web", "state": "queued", "created_at": T0,
                  **retry_cols()},
        "attempts": {"id": 100 + i, "host": "web", "build_id": 1, "digest": "0" * 64,
                     "cause": "retry", "mode": "hold", "effective_mode": "hold", "revision": 2,
                     "canary": False, "step": "queued", "created_at": T0, **retry_cols()},
        "members": {"generation_id": 1, "host": "web", "role": "retiring", "fence": 1,
                    "unproven": False, **retry_cols()},
        "listeners": {"host": "web", "position": 100 + i, "name": "http",
                      "address": f"unix:/run/l{i}.sock", "state": "new"},
        "rollouts": {"id": 100 + i, "build_id": 1, "digest": "0" * 64, "mode": "hold",
                     "canary": False, "waves": "100%", "wave_count": 1, "wave": 0,
                     "settled": 0, "max_failures": 0, "auto_revert": False, "after_attempt": 0,
                     "after_stop": 0, "state": "running", "created_at": T0, **retry_cols()},
        "rollout_targets": {"rollout_id": 1, "host": "web", "position": i, "wave": 1,
                            "state": "pending", "tries": 0, "spent": 0},
        "delivery_tries": {"id": 100 + i, "delivery_id": 1, "agent_id": "a",
                           "started_at": T0},
        "reloads": {"id": 100 + i, "host": "web", "state": "queued", "signal": "HUP",
                    "created_at": T0, **retry_cols()},
        "job_runs": {"id": 100 + i, "host": "web", "scheduled_at": T0 + timedelta(seconds=i),
                     "state": "due", "cause": "schedule", **retry_cols()},
    }
    return rows[table]


def test_enum_columns_are_known() -> None:
    cols = {(t, c) for t, c, _ in enum_columns()}
    assert cols == {("hosts", "kind"), ("hosts", "desired"), ("generations", "state"),
                    ("wakes", "state"), ("stops", "state"), ("attempts", "cause"),
                    ("attempts", "mode"), ("attempts", "effective_mode"), ("attempts", "step"),
                    ("attempts", "outcome"), ("members", "role"), ("listeners", "state"),
                    ("rollouts", "mode"), ("rollouts", "state"), ("rollouts", "outcome"),
                    ("rollout_targets", "state"), ("delivery_tries", "outcome"),
                    ("reloads", "state"), ("job_runs", "state")}
    for _, _, typ in enum_columns():
        assert typ.enum_class is not None
        assert list(typ.enums) == [m.value for m in typ.enum_class]


def test_state_checks_allow_exactly_the_enum_values(migrated: Store) -> None:
    engine = migrated.engine
    insp = inspect(engine)
    with engine.connect() as conn:
        with conn.begin():
            _parents(conn)
        for table, column, typ in enum_columns():
            values = list(typ.enums)
            # What the database says its CHECK allows...
            checks = {c["name"]: c["sqltext"] for c in insp.get_check_constraints(table)}
            sqltext = checks[f"ck_{table}_{typ.name}"]
            assert column in sqltext
            assert set(re.findall(r"'([^']*)'", sqltext)) == set(values), (table, column)
            # ...and what it does: every value goes in, anything else is refused.
            for i, value in enumerate(values):
                with conn.begin() as tx:
                    raw_insert(conn, table, {**_row(table, i), column: value})
                    tx.rollback()
            for bogus in ("bogus", values[0].upper(), ""):
                with pytest.raises(IntegrityError), conn.begin():
                    raw_insert(conn, table, {**_row(table, 99), column: bogus})


@pytest.mark.parametrize("column", DURATIONS)
def test_duration_columns_refuse_unbounded_values(migrated: Store, column: str) -> None:
    """Every duration of a host is finite, above 0 and at most a day, on insert and update."""
    engine = migrated.engine
    with engine.connect() as conn:
        with conn.begin():
            _parents(conn)
        with conn.begin() as tx:  # the bounds themselves go in
            raw_insert(conn, "hosts", {**_row("hosts", 1), column: 86400.0})
            raw_insert(conn, "hosts", {**_row("hosts", 2), column: 0.001})
            tx.rollback()
        for bogus in (float("inf"), 1e300, 86400.5, 0.0, -1.0):
            with pytest.raises(IntegrityError), conn.begin():
                raw_insert(conn, "hosts", {**_row("hosts", 99), column: bogus})
            with pytest.raises(IntegrityError), conn.begin():
                conn.execute(text(f"UPDATE hosts SET {column} = :v WHERE name = 'web'"),
                             {"v": bogus})


def test_upgrade_clamps_durations_written_out_of_bounds(store: Store) -> None:
    engine = store.engine
    schema.upgrade(engine, "0005")
    with engine.begin() as conn:
        seed_0001(conn)
        seed_0003(conn)
        conn.execute(text("UPDATE hosts SET drain_timeout = 1e300, restart_cap = :inf "
                          "WHERE name = 'jobs'"), {"inf": float("inf")})
    schema.upgrade(engine)
    with engine.connect() as conn:
        assert tuple(conn.execute(text(
            "SELECT drain_timeout, restart_cap, max_run FROM hosts WHERE name = 'jobs'")).one()) \
            == (86400.0, 86400.0, 3600.0)
        assert conn.execute(text("SELECT count(*) FROM hosts")).scalar() == 2  # rows kept


def test_one_current_generation_per_host(migrated: Store) -> None:
    engine = migrated.engine
    with engine.begin() as conn:
        _parents(conn)
        raw_insert(conn, "hosts", {**_row("hosts", 0), "name": "api"})

    def gen(conn: Connection, gid: int, host: str, state: str) -> None:
        raw_insert(conn, "generations", {"id": gid, "uuid": f"u-{gid}", "host": host,
                                         "build_id": 1, "state": state, "fence": 1,
                                         "agent_id": "a", "created_at": T0})

    with engine.begin() as conn:
        gen(conn, 10, "web", "current")
        gen(conn, 11, "web", "running")  # other states are not limited
        gen(conn, 12, "web", "retiring")
        gen(conn, 13, "api", "current")  # one per host, not one in all
    with pytest.raises(IntegrityError), engine.begin() as conn:
        gen(conn, 14, "web", "current")
    with pytest.raises(IntegrityError), engine.begin() as conn:
        conn.execute(text("UPDATE generations SET state = 'current' WHERE id = 11"))
    with engine.begin() as conn:  # after the old one retires, a successor may be current
        conn.execute(text("UPDATE generations SET state = 'retiring' WHERE id = 10"))
        conn.execute(text("UPDATE generations SET state = 'current' WHERE id = 11"))
        current = conn.execute(text(
            "SELECT id FROM generations WHERE host = 'web' AND state = 'current'")).scalars().all()
    assert current == [11]


# -- the agent refuses a schema it does not know ---------------------------------------------

def test_require_head_refuses_an_empty_database(store: Store) -> None:
    with pytest.raises(StoreNotReady) as err:
        schema.require_head(store.engine)
    assert "vigil db upgrade" in str(err.value)
    assert "empty database" in err.value.cause
    assert err.value.exit_code == StoreNotReady.exit_code


def test_require_head_refuses_after_downgrade(migrated: Store) -> None:
    schema.require_head(migrated.engine)
    schema.downgrade(migrated.engine, "base")
    with pytest.raises(StoreNotReady, match="vigil db upgrade"):
        schema.require_head(migrated.engine)


def test_require_head_refuses_an_unknown_revision(migrated: Store) -> None:
    with migrated.engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = 'ffff'"))
    with pytest.raises(StoreNotReady) as err:
        schema.require_head(migrated.engine)
    assert "revision ffff" in err.value.cause and "vigil db upgrade" in str(err.value)
