"""Wiring: from --state-dir/--db and the environment to a Store and a workflow Context."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from sqlalchemy.engine import make_url

from models.durations import parse_seconds
from models.errors import StoreNotReady
from models.statedir import prepare_state_dir, refuse_link, state_dir_exists
from models.store import Store, normalize_url, sqlite_url
from models.urls import listen_url_for
from runners.backend.credentials import Credentials
from runners.backend.files import LocalFiles, claim_dropper
from runners.backend.health import HttpHealth
from runners.backend.limits import CgroupMemoryLimit
from runners.backend.listen import Listeners
from runners.backend.notifysend import Notices
from runners.backend.process import LOG_FILES, LOG_MAX_BYTES, ProcessBackend
from runners.backend.readysignal import Readiness
from runners.backend.sockets import SocketAccess
from runners.keepers.logpipes import LogPipes
from workflows.base.context import Context
from workflows.base.paths import CLAIMS

CLI_LOCK_WAIT = 15.0  # seconds a command's write waits for SQLite's write lock (the agent: 60)


def open_store(state_dir: Path, db: str | None, *, create: bool = False,
               lock_wait: float = CLI_LOCK_WAIT, listen_db: str | None = None) -> Store:
    """Open the store. Without `create`, a state directory that does not exist yet is an
    error that names the command creating it (and nothing is created)."""
    state_dir = state_dir.absolute()
    refuse_link(state_dir)  # before any look inside it: a planted link aims at any directory
    db = normalize_url(db) if db else None  # a bad URL is refused before anything is created
    listen_url_for(db or "sqlite", listen_db)  # and so is a --listen-db that does not fit it
    if not create and not state_dir_exists(state_dir):
        if any(p.exists() and not p.is_dir() for p in state_dir.parents):
            prepare_state_dir(state_dir)  # says which path is a file, not a directory
        raise StoreNotReady(f"no vigil state directory at {state_dir}",
                            "run `vigil db upgrade` to create it, or pass --state-dir / VIGIL_HOME")
    if not create and not state_dir.is_dir():
        prepare_state_dir(state_dir)  # says it is not a directory
    if not create and db is None and not (state_dir / "vigil.db").exists():
        raise StoreNotReady(f"no database in {state_dir}", "run `vigil db upgrade` to create it")
    prepare_state_dir(state_dir)
    url = db or sqlite_url(state_dir)
    file = make_url(url).database if url.startswith("sqlite") else None

    def holder() -> str | None:  # who holds the SQLite file's write lock
        from runners.base.doorbell import running_agent_pid
        from runners.base.storewatch import write_lock_holder

        return write_lock_holder(Path(file), running_agent_pid(state_dir)) if file else None

    return Store(url, synchronous=os.environ.get("VIGIL_SYNCHRONOUS", "FULL"),
                 lock_wait=lock_wait, listen_url=listen_db, lock_holder=holder)


def make_context(state_dir: Path, store: Store, agent_id: str, *,
                 log_max_bytes: int = LOG_MAX_BYTES, log_files: int = LOG_FILES,
                 keeper_started: Callable[[], None] = lambda: None, **kw: object) -> Context:
    """`keeper_started`: rung when the fd holder or the log keeper is started on demand
    (the agent's keeper watch's bell: runners/cli/agent.py)."""
    ready, credentials = Readiness(store), Credentials(state_dir)
    proc = ProcessBackend(containment=os.environ.get("VIGIL_CONTAINMENT", "auto"),
                          log_max_bytes=log_max_bytes, log_files=log_files,
                          logs=LogPipes(state_dir, keeper_started), box=agent_id,
                          credentials=credentials,
                          on_release=[ready.forget, credentials.forget,
                                      claim_dropper(state_dir.absolute() / CLAIMS)])
    settle = parse_seconds(os.environ.get("VIGIL_SETTLE_SECONDS", "10"), "VIGIL_SETTLE_SECONDS")
    kw.setdefault("sockets", SocketAccess(state_dir))  # per-host groups; no agent-wide one
    kw.setdefault("ready", ready)
    kw.setdefault("listeners", Listeners(state_dir, keeper_started))
    kw.setdefault("notices", Notices())
    return Context(store=store, agent_id=agent_id, state_dir=state_dir.absolute(), proc=proc,
                   health=HttpHealth(), files=LocalFiles(), limits=CgroupMemoryLimit(proc.base, agent_id),
                   settle_seconds=settle, **kw)  # type: ignore[arg-type]
