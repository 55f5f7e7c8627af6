"""`vigil runs NAME` and `vigil run NAME`: a job's runs, one row per scheduled instant
(workflows/lifecycle/jobs.py), and a run now. Both work on the store whether the agent is up
or not; a run written while no agent runs starts when one does."""

from __future__ import annotations

import click

from runners.cli.common import Env, echo_json, show


@click.command("runs")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="One object a run (scheduled_at, state, "
              "started_at, ended_at, exit_status, duration, generation).")
@click.option("--limit", type=click.IntRange(min=1), default=50, show_default=True,
              help="The newest runs by scheduled instant.")
@click.pass_obj
def runs(env: Env, name: str, as_json: bool, limit: int) -> None:
    """A job's runs, newest scheduled instant first."""
    from workflows.lifecycle.jobs import runs_of

    rows = env.store().read(lambda s: runs_of(s, name, limit))
    if as_json:
        echo_json(rows)
        return
    from runners.cli.output import table

    t = table("run", "scheduled", "state", "exit", "duration", "generation")
    for r in rows:
        t.add_row(f"#{r['id']}", r["scheduled_at"], r["state"],
                  "" if r["exit_status"] is None else str(r["exit_status"]),
                  "" if r["duration"] is None else f"{r['duration']:.2f}s",
                  "" if r["generation"] is None else f"g{r['generation']}")
    show(t)


@click.command("run")
@click.argument("name")
@click.pass_obj
def run(env: Env, name: str) -> None:
    """Start a run of a job now, outside its schedule (while one runs: by its --overlap)."""
    from workflows.lifecycle.jobs import request_run

    state, rid, instant = env.store().write(lambda s: (lambda r: (r.state.value, r.id, r.scheduled_at))(
        request_run(s, name)))
    click.echo(f"run #{rid} of {name} ({instant.isoformat()}Z): {state}")
