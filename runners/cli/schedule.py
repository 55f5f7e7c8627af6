"""`vigil schedule`: cron restarts, kept in APScheduler's job store in the same database."""

from __future__ import annotations

import click

from runners.cli.common import Env, echo_json, show


@click.group()
def schedule() -> None:
    """Scheduled restarts (cron, UTC), kept in the store; the agent runs them."""


@schedule.command("add")
@click.argument("name")
@click.option("--cron", "expr", required=True, help="Five crontab fields in UTC, e.g. '30 4 * * *'.")
@click.pass_obj
def schedule_add(env: Env, name: str, expr: str) -> None:
    """Restart HOST on a cron schedule: an overlap deploy of the build it runs (cause restart)."""
    from runners.agent import jobstore

    job = jobstore.add(env.store(), name, expr)
    click.echo(f"restart of {name} scheduled ({expr}); next run {job['next_run']}")


@schedule.command("list")
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
def schedule_list(env: Env, as_json: bool) -> None:
    """Every restart schedule and its next run."""
    from datetime import datetime

    from runners.agent import jobstore
    from runners.cli import output

    rows = jobstore.listing(env.store())
    if as_json:
        echo_json(rows)
        return
    t = output.table("host", "cron (UTC)", "next run", "in")
    for r in rows:
        t.add_row(r["host"], r["cron"], r["next_run"] or "paused", output.until(
            datetime.fromisoformat(r["next_run"]).replace(tzinfo=None) if r["next_run"] else None))
    show(t)


@schedule.command("rm")
@click.argument("name")
@click.pass_obj
def schedule_rm(env: Env, name: str) -> None:
    """Remove HOST's restart schedule."""
    from runners.agent import jobstore

    jobstore.remove(env.store(), name)
    click.echo(f"restart schedule of {name} removed")
