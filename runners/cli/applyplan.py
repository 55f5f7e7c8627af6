"""`vigil apply --dry-run`: the whole plan, with every refusal in it (not only the first),
and the `running = true|false` part of an apply (a wake or a stop after the host's settings
are written). A run without --dry-run still refuses at the first refusal, changing nothing."""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import partial
from typing import Any

import click

from models.errors import VigilError
from models.states import HostKind
from runners.cli.common import Env


def dry_run(env: Env, file: str, specs: list[Any], wanted: list[Any]) -> None:
    """Print every change and every refusal; exit 4 when any host is refused."""
    from runners.cli.hostfile import order_refusals
    from runners.cli.listenopts import probe_stored
    from workflows.config.apply import diff, removal
    from workflows.config.hosts import check_socket_room
    from workflows.config.running import run_change

    store = env.store()
    lines: list[str] = []
    refused = [f"! refused {host}: {exc.line()}" for host, exc in order_refusals(file, specs)]
    order = file_order(specs)

    def attempt(host: str, step: Callable[[], Any]) -> Any:
        try:
            return step()
        except VigilError as exc:
            refused.append(f"! refused {host}: {exc.line()}")
            return None

    for spec, w in zip(specs, wanted, strict=True):
        if spec.fields["kind"] is HostKind.instance:
            attempt(spec.name, partial(check_socket_room, env.state_dir, spec.name))
        attempt(spec.name, partial(probe_stored, env, spec.name, spec.listens,
                                   label=f"{file}: {spec.name}: "))
        steps: list[Callable[[Any], Any]] = [partial(diff, w=w)]
        if spec.running is not None:
            steps.append(partial(run_change, name=spec.name, running=spec.running, order=order))
        for step in steps:
            change = attempt(spec.name, partial(store.read, step))
            if change is not None:
                lines.append(change.line())
    named = {spec.name for spec in specs}
    for name in store.read(_names):
        if name not in named:
            change = attempt(name, partial(store.read, partial(removal, name=name)))
            if change is not None:
                lines.append(change.line())
    for line in lines + refused:
        click.echo(line)
    if refused:
        click.echo(f"dry run: nothing changed; {len(refused)} refusal(s): apply would refuse "
                   "the whole file until each is resolved", err=True)
        sys.exit(4)
    click.echo("dry run: nothing changed")


def _names(s: Any) -> list[str]:
    from sqlalchemy import select

    from models.tables import Host

    return list(s.execute(select(Host.name).order_by(Host.name)).scalars())


def file_order(specs: list[Any]) -> Any:
    """The start order the file sets, and the hosts it wakes and stops."""
    from workflows.config.running import FileOrder

    return FileOrder({h.name: h.fields["start_after"] for h in specs},
                     frozenset(h.name for h in specs if h.running is True),
                     frozenset(h.name for h in specs if h.running is False))


def check_running(env: Env, specs: list[Any]) -> None:
    """Each `running` the file asks for can be done (reads only): refused otherwise."""
    from workflows.config.running import check_running as check

    order = file_order(specs)
    running = {spec.name: spec.running for spec in specs if spec.running is not None}
    if running:
        env.store().read(partial(check, running=running, order=order))


def apply_running(env: Env, specs: list[Any]) -> list[Any]:
    """After the settings: each host with a `running` key woken or stopped to it, the stops
    first, those that start after others first, then the wakes in the start order."""
    from workflows.config.running import apply_running as step
    from workflows.lifecycle.order import dependents_first, in_order

    graph = file_order(specs).graph
    woken = in_order([h.name for h in specs if h.running is True], graph)
    stopped = dependents_first([h.name for h in specs if h.running is False], graph)
    store = env.store()
    done = [store.write(partial(step, name=name, running=False)) for name in stopped]
    done += [store.write(partial(step, name=name, running=True)) for name in woken]
    return [c for c in done if c is not None]
