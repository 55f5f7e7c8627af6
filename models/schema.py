"""Alembic owns the schema: these helpers ask where a database is and move it to head.

HEAD names the newest revision so that every command can check the schema without
importing Alembic (a test keeps it equal to Alembic's own head)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import Engine, text
from sqlalchemy.exc import DatabaseError, OperationalError, ProgrammingError

from models.errors import StoreNotReady

if TYPE_CHECKING:
    from alembic.config import Config

HEAD = "0041"  # ... -> 0033 -> 0034 -> 0035 -> 0036 -> 0037 -> 0038 -> 0039 -> 0040 -> 0041
MIGRATIONS = Path(__file__).resolve().parent.parent / "migrations"


def alembic_config(url: str) -> Config:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def current_revision(engine: Engine) -> str | None:
    from models.store import read_only

    try:
        # A read: it must neither wait for nor take SQLite's write lock.
        with engine.connect() as conn:
            return read_only(conn).execute(text("SELECT version_num FROM alembic_version")).scalar()
    except StoreNotReady:
        raise
    except (OperationalError, ProgrammingError) as exc:
        if "alembic_version" in str(exc.orig):  # no such table: an empty database
            return None
        raise _unreadable(engine, exc) from None
    except DatabaseError as exc:
        raise _unreadable(engine, exc) from None


def _unreadable(engine: Engine, exc: DatabaseError) -> StoreNotReady:
    from models.trouble import diagnose, explain, one_line

    url = engine.url.render_as_string(hide_password=False)
    trouble = diagnose(exc)
    if trouble is not None:  # locked, full, damaged, unreachable ...: its own cause and fix
        return explain(trouble, url)
    fix = ("make sure the database server is up and point --db at a vigil database"
           if engine.dialect.name == "postgresql" else
           "point --state-dir or --db at a vigil database")
    return StoreNotReady(f"cannot read the schema version of {engine.url.render_as_string()}: "
                         f"{one_line(exc.orig)}", fix)


def require_head(engine: Engine) -> None:
    current = current_revision(engine)
    if current != HEAD:
        where = "an empty database" if current is None else f"revision {current}"
        raise StoreNotReady(f"the database is at {where}, this vigil needs revision {HEAD}",
                            "run `vigil db upgrade`")


def upgrade(engine: Engine, revision: str = "head") -> None:
    from alembic import command

    cfg = alembic_config(engine.url.render_as_string(hide_password=False))
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)


def downgrade(engine: Engine, revision: str) -> None:
    from alembic import command

    cfg = alembic_config(engine.url.render_as_string(hide_password=False))
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, revision)
