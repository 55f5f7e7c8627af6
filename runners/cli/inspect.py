"""`vigil status|obligations|events|check|gc|crashpoints`: what the store and the box say."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import click

from models.errors import NotFound
from runners.cli.common import Env, echo_json, show
from runners.cli.retention import keep_of, keep_options, summary


@click.command("status")
@click.argument("names", nargs=-1, metavar="[HOST...]")
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
def status_cmd(env: Env, names: tuple[str, ...], as_json: bool) -> None:
    """Each host (or those named: names or globs such as 'web*'): state, generation, pid,
    build and how long it has served, under a line saying whether an agent runs."""
    from runners.cli.several import resolve

    quick = env.quick()
    hosts = resolve(env, names, False, required=False)
    rows = quick.call("status", name=hosts[0] if len(hosts) == 1 else None)
    if len(hosts) > 1:
        rows = [r for r in rows if r["host"] in hosts]
    from runners.base.doorbell import halted_line

    halted = halted_line(env.state_dir)
    if halted is not None:  # on stderr: --json keeps its shape
        click.echo(f"vigil: warning: the agent has stopped acting: {halted}", err=True)
    if as_json:
        echo_json(rows)
        return
    from runners.cli.output import Phrases, agent_phrases, status_table

    show(Phrases(agent_phrases(quick.call("agent"))))  # wrapped between its phrases
    show(status_table(rows))


@click.command()
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
def obligations(env: Env, as_json: bool) -> None:
    """Every open obligation (the pending_obligations view)."""
    rows = env.quick().call("obligations")
    if as_json:
        echo_json(rows)
        return
    from runners.cli.output import obligations_table

    show(obligations_table(rows))


@click.command()
@click.argument("name", required=False)
@click.option("--json", "as_json", is_flag=True,
              help="A JSON array; with --follow, one JSON object a line.")
@click.option("--follow", "-f", is_flag=True, help="Keep printing new events (Ctrl-C to end).")
@click.option("--limit", type=int, default=50, show_default=True)
@click.pass_obj
def events(env: Env, name: str | None, as_json: bool, follow: bool, limit: int) -> None:
    """Recent event rows, oldest first: time, host, generation, kind, detail."""
    from models.tables import Host
    from runners.cli import output

    store = env.store()
    data = output.events_after(store, name, -1, limit)
    if name is not None and not data and store.read(lambda s: s.get(Host, name)) is None:
        # (A removed host's events still show: its name is in them.)
        raise NotFound(f"no host named {name!r}", "see `vigil host list`")
    if as_json and not follow:
        echo_json(data)
        return

    def emit(d: dict[str, Any]) -> None:
        click.echo(json.dumps(d, default=str) if as_json else output.event_line(d))

    for d in data:
        emit(d)
    if follow:
        output.follow(store, name, data[-1]["id"] if data else 0, emit)


@click.command()
@keep_options
@click.option("--dry-run", is_flag=True, help="Count what would be deleted; change nothing.")
@click.pass_obj
def gc(env: Env, keep_history: Any, keep_last: int, dry_run: bool) -> None:
    """Delete staged builds that no host, live generation or open attempt references, and
    history nothing needs (see --keep-history)."""
    from workflows.builds.staged import collect, unreferenced
    from workflows.engine import history

    keep = keep_of(keep_history, keep_last)
    if dry_run:
        builds = env.store().read(lambda s: len(unreferenced(s)))
        rows = env.store().read(lambda s: history.count(s, keep))
        click.echo(f"dry run: {builds} build(s) and {summary(rows)} row(s) of history would "
                   "be deleted; nothing changed")
        return
    doomed = env.store().write(collect)
    for b in doomed:
        # Only this build's file: builds with the same bytes under another name share the
        # digest directory, and one of them may still be referenced.
        try:
            os.unlink(b.path)
        except FileNotFoundError:
            pass
        try:
            os.rmdir(Path(b.path).parent)  # the digest dir, once nothing else is in it
        except OSError:
            pass
    pruned = history.prune(env.store(), keep)
    click.echo(f"{len(doomed)} build(s) deleted; history pruned: {summary(pruned)}")


@click.command()
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
def check(env: Env, as_json: bool) -> None:
    """Exit 0 when every invariant holds (one current generation per host, no stray
    process, every obligation visible, leases held iff needed, referenced builds kept, an
    agent running while obligations are open); else print each violation and exit 1."""
    from runners.cli.check import listener_notes, run_checks

    store = env.store()
    violations = run_checks(store, env.state_dir)
    if as_json:
        echo_json([v.__dict__ for v in violations])
    else:
        for line in listener_notes(store):  # not violations: said, never failed on
            click.echo(f"note: {line}")
        for v in violations:
            click.echo(f"{v.name}: {v.message}")
        if not violations:
            click.echo("ok: every invariant holds")
    sys.exit(1 if violations else 0)


@click.command()
def crashpoints() -> None:
    """Every registered crash point, one a line."""
    from runners.base.workflows import every_workflow
    from workflows.base import crash

    every_workflow()  # every workflow module: each registers its points at import

    for name in sorted(crash.REGISTERED):
        click.echo(name)
