"""`vigil db`: the schema, which Alembic owns."""

from __future__ import annotations

import click

from runners.cli.common import Env


@click.group()
def db() -> None:
    """Schema: Alembic owns it."""


@db.command("upgrade")
@click.pass_obj
def db_upgrade(env: Env) -> None:
    """Create the store or move it to the newest schema."""
    from models import schema

    store = env.store(create=True, at_head=False)
    before = schema.current_revision(store.engine)
    schema.upgrade(store.engine)
    click.echo(f"database at {schema.HEAD} (was {before or 'empty'})")


@db.command("current")
@click.pass_obj
def db_current(env: Env) -> None:
    """The store's schema revision and whether it is the newest."""
    from models import schema

    store = env.store(at_head=False)
    cur, head = schema.current_revision(store.engine), schema.HEAD
    click.echo(f"{cur or 'empty'} (head {head}{', up to date' if cur == head else ''})")
