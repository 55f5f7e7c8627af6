"""`vigil restart HOST...`: each host onto the build it runs now, as a deploy attempt with
cause `restart` (overlap for an instance: zero downtime; stop, then start for a worker or
with `--mode hold`); a host that does not run is woken instead
(workflows/deploys/restart.py)."""

from __future__ import annotations

import time
from typing import Any

import click

from models.states import Mode
from runners.cli.common import SECONDS, Env
from runners.cli.lifecycle import _attempt, woken
from runners.cli.several import Each, resolve, targets


@click.command()
@targets
@click.option("--mode", type=click.Choice([m.value for m in Mode]), default="overlap",
              show_default=True, help="overlap: the successor starts beside the old one "
                                      "(instances); hold: stop, then start.")
@click.option("--wait", is_flag=True, help="Block until each has restarted or failed; one "
                                           "host: show the steps as they happen.")
@click.option("--timeout", type=SECONDS, default=600.0, show_default=True)
@click.pass_obj
def restart(env: Env, names: tuple[str, ...], every: bool, mode: str, wait: bool,
            timeout: float) -> None:
    """Restart hosts on the build they run (HOST..., a glob such as 'web*', or --all)."""
    hosts = resolve(env, names, every)
    each = Each(hosts)
    queued: list[tuple[str, dict[str, Any]]] = []
    for name in hosts:
        req = each.run(name, env.quick().call, "restart", name=name, mode=mode)
        if req is None:
            continue
        if "wake" in req:
            if req["wake"] is None:  # woken meanwhile: nothing to restart from
                click.echo(f"host {name} is already awake")
                continue
            click.echo(f"host {name} is not running: wake #{req['wake']} queued")
        if wait:
            queued.append((name, req))
        elif "attempt" in req:
            click.echo(f"restart of {name}: attempt #{req['attempt']} queued (mode {req['mode']})")
    deadline = time.monotonic() + timeout
    for name, req in queued:
        left = max(0.0, deadline - time.monotonic())
        if "wake" in req:
            each.run(name, woken, env, name, req["wake"], left)
        else:
            each.run(name, _attempt, env, name, req["attempt"], True, left, len(hosts) == 1)
    each.end("restart")
