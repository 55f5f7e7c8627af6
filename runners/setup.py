"""Wiring: from --state-dir/--db and the environment to a Store and a workflow Context."""

from __future__ import annotations

import os
from pathlib import Path

from models.durations import parse_seconds
from models.errors import StoreNotReady
from models.store import Store, normalize_url, prepare_state_dir, sqlite_url
from runners.files import LocalFiles
from runners.health import HttpHealth
from runners.limits import CgroupMemoryLimit
from runners.process import LOG_FILES, LOG_MAX_BYTES, ProcessBackend
from runners.sockets import SocketAccess
from workflows.context import Context


def open_store(state_dir: Path, db: str | None, *, create: bool = False) -> Store:
    """Open the store. Without `create`, a state directory that does not exist yet is an
    error that names the command creating it (and nothing is created)."""
    state_dir = state_dir.absolute()
    db = normalize_url(db) if db else None  # a bad URL is refused before anything is created
    if not create and not state_dir.exists():
        raise StoreNotReady(f"no vigil state directory at {state_dir}",
                            "run `vigil db upgrade` to create it, or pass --state-dir / VIGIL_HOME")
    if not create and db is None and not (state_dir / "vigil.db").exists():
        raise StoreNotReady(f"no database in {state_dir}", "run `vigil db upgrade` to create it")
    prepare_state_dir(state_dir)
    url = db or sqlite_url(state_dir)
    return Store(url, synchronous=os.environ.get("VIGIL_SYNCHRONOUS", "FULL"))


def make_context(state_dir: Path, store: Store, agent_id: str, *,
                 log_max_bytes: int = LOG_MAX_BYTES, log_files: int = LOG_FILES,
                 **kw: object) -> Context:
    proc = ProcessBackend(containment=os.environ.get("VIGIL_CONTAINMENT", "auto"),
                          log_max_bytes=log_max_bytes, log_files=log_files)
    settle = parse_seconds(os.environ.get("VIGIL_SETTLE_SECONDS", "10"), "VIGIL_SETTLE_SECONDS")
    kw.setdefault("sockets", SocketAccess(state_dir))  # per-host groups; no agent-wide one
    return Context(store=store, agent_id=agent_id, state_dir=state_dir.absolute(), proc=proc,
                   health=HttpHealth(), files=LocalFiles(), limits=CgroupMemoryLimit(proc.base),
                   settle_seconds=settle, **kw)  # type: ignore[arg-type]
