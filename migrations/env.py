"""Alembic environment: SQLite in batch mode, the same revisions for PostgreSQL.

A caller may hand the database over in `config.attributes["connection"]`: a Connection
(vigil's own `models/schema.upgrade` passes one inside its transaction) or an Engine (the
convention of pytest-alembic and of many other callers); else the URL from `-x url=...` or
the ini file is opened."""

from __future__ import annotations

from typing import Any

from alembic import context
from sqlalchemy import Connection, create_engine

from models.tables import Base, postgresql_options

config = context.config
target_metadata = Base.metadata


def _run(connection: Connection) -> None:
    if connection.dialect.name == "postgresql":
        postgresql_options()  # the metadata compared is the one PostgreSQL has
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    given: Any = config.attributes.get("connection")
    if isinstance(given, Connection):
        _run(given)  # the caller owns its transaction
        return
    if given is None:
        url = context.get_x_argument(as_dictionary=True).get("url") or config.get_main_option(
            "sqlalchemy.url")
        if not url:
            raise RuntimeError("no database URL: pass -x url=URL or set sqlalchemy.url")
        given = create_engine(url)
    # An Engine, or anything whose connect() gives a Connection: the migrations are
    # committed on that connection, unless it came inside its caller's transaction.
    with given.connect() as conn:
        outer = conn.in_transaction()  # an engine-like wrapper of a connection in a transaction
        _run(conn)
        if not outer and conn.in_transaction():
            conn.commit()


if context.is_offline_mode():
    raise SystemExit("vigil migrations run online only: use `vigil db upgrade`")
run_migrations_online()
