"""Alembic owns the schema: these helpers ask where a database is and move it to head."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine
from sqlalchemy.exc import DatabaseError

from models.errors import StoreNotReady

MIGRATIONS = Path(__file__).resolve().parent.parent / "migrations"


def alembic_config(url: str) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()
    assert head is not None
    return head


def current_revision(engine: Engine) -> str | None:
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    except StoreNotReady:
        raise
    except DatabaseError as exc:
        raise StoreNotReady(
            f"cannot read the schema version of {engine.url!r}: {exc.orig}",
            "point --state-dir or --db at a vigil database",
        ) from None


def require_head(engine: Engine) -> None:
    current, head = current_revision(engine), head_revision()
    if current != head:
        where = "an empty database" if current is None else f"revision {current}"
        raise StoreNotReady(
            f"the database is at {where}, this vigil needs revision {head}",
            "run `vigil db upgrade`",
        )


def upgrade(engine: Engine, revision: str = "head") -> None:
    cfg = alembic_config(engine.url.render_as_string(hide_password=False))
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)


def downgrade(engine: Engine, revision: str) -> None:
    cfg = alembic_config(engine.url.render_as_string(hide_password=False))
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, revision)
