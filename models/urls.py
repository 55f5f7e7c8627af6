"""Database URLs: which vigil runs on, and the direct one of the LISTEN session behind a
pooler."""

from __future__ import annotations

from sqlalchemy import make_url
from sqlalchemy.exc import ArgumentError

from models.errors import BadInput

SUPPORTED_URLS = "sqlite:///PATH or postgresql+psycopg://USER@HOST/DATABASE"


def normalize_url(url: str) -> str:
    """The databases vigil runs on: SQLite and PostgreSQL through psycopg 3 (a bare
    postgresql:// URL means psycopg). Anything else is refused before anything is opened."""
    try:
        parsed = make_url(url)
    except ArgumentError:
        raise BadInput(f"cannot parse the database URL {url!r}", f"use {SUPPORTED_URLS}") from None
    backend, _, driver = parsed.drivername.partition("+")
    if backend in ("postgresql", "postgres") and driver in ("", "psycopg"):
        return parsed.set(drivername="postgresql+psycopg").render_as_string(hide_password=False)
    if backend == "sqlite" and driver in ("", "pysqlite"):
        db = parsed.database or ""
        if db in ("", ":memory:") or ":memory:" in db or parsed.query.get("mode") == "memory":
            # Every command and the agent would each see an empty database of their own.
            raise BadInput(f"the database URL {url!r} names a database in memory: a store "
                           "must be a file", "use sqlite:////absolute/path/vigil.db, or leave "
                           "--db out to use the state dir's vigil.db")
        return url
    raise BadInput(f"vigil does not run on {parsed.drivername} (database URL "
                   f"{parsed.render_as_string()})", f"use {SUPPORTED_URLS}")


def listen_url_for(store_url: str, listen_url: str | None) -> str | None:
    """The direct URL of the LISTEN session, for a store URL that goes through a pooler in
    transaction mode (--listen-db / VIGIL_LISTEN_DB): both PostgreSQL, or one clear line."""
    if not listen_url:
        return None
    fix = ("give --listen-db (VIGIL_LISTEN_DB) a direct postgresql:// URL of the server "
           "behind the pooler that --db names, or leave it out")
    if not store_url.startswith("postgresql"):
        raise BadInput("--listen-db is for a PostgreSQL store reached through a pooler, and "
                       f"the store is {store_url.split(':', 1)[0]}", fix)
    try:
        parsed = make_url(listen_url)
    except ArgumentError:
        raise BadInput(f"cannot parse the --listen-db URL {listen_url!r}", fix) from None
    if parsed.drivername.partition("+")[0] not in ("postgresql", "postgres"):
        raise BadInput(f"--listen-db {parsed.render_as_string()} is not a PostgreSQL URL", fix)
    return normalize_url(listen_url)
