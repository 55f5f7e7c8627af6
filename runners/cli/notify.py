"""`vigil notify`: notifiers (a command or a webhook told of failures), kept in the store;
the agent delivers each event to them at least once and logs every try."""

from __future__ import annotations

import click

from runners.cli.common import Env, echo_json, show

WORDS_HELP = ("Comma-separated events: failed, down, oom, crashloop, unhealthy, listener_lost, "
              "rollout_halted, exited, restarted, reload_failed, run_failed, run_missed, "
              "run_late.")


@click.group()
def notify() -> None:
    """Notifications of failures, delivered at least once (the agent sends them)."""


@notify.command("add")
@click.argument("name")
@click.option("--on", "words", required=True, help=WORDS_HELP)
@click.option("--exec", "command", default=None,
              help="A shell command; it reads the event as JSON on its stdin.")
@click.option("--webhook", default=None, help="An http(s) URL; it is POSTed the event as JSON.")
@click.option("--timeout", default=10.0, show_default=True, type=float,
              help="Seconds a try may take, all of it (at most 20): the command is "
                   "killed, a webhook's connection cut, past it.")
@click.pass_obj
def notify_add(env: Env, name: str, words: str, command: str | None, webhook: str | None,
               timeout: float) -> None:
    """Tell a command or a webhook of every event of the kinds --on names."""
    from workflows.notices import notifiers

    on = notifiers.check(name, words, command, webhook, timeout)  # before the store is opened
    env.store().write(lambda s: notifiers.add(s, name, on, command, webhook, timeout))
    where = f"runs {command!r}" if command is not None else f"POSTs to {webhook}"
    click.echo(f"notifier {name} added: on {', '.join(on)} it {where}")


@notify.command("list")
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
def notify_list(env: Env, as_json: bool) -> None:
    """Every notifier, its events and how many are still owed to it."""
    from runners.cli import output
    from workflows.notices import notifiers

    rows = env.store().read(notifiers.listing)
    if as_json:
        echo_json(rows)
        return
    t = output.table("name", "on", "undelivered", "sends to")
    for r in rows:
        target = f"exec {r['exec']}" if r["exec"] is not None else f"webhook {r['webhook']}"
        t.add_row(r["name"], ",".join(r["on"]), str(r["undelivered"]), target)
    show(t)


@notify.command("remove")
@click.argument("name")
@click.pass_obj
def notify_remove(env: Env, name: str) -> None:
    """Remove a notifier; what is still owed to it is dropped with it."""
    from workflows.notices import notifiers

    owed = env.store().write(lambda s: notifiers.remove(s, name))
    click.echo(f"notifier {name} removed" + (f" ({owed} undelivered dropped)" if owed else ""))


@notify.command("log")
@click.argument("name", required=False)
@click.option("-n", "last", default=50, show_default=True, type=click.IntRange(1),
              help="The newest N tries.")
@click.option("--json", "as_json", is_flag=True)
@click.pass_obj
def notify_log(env: Env, name: str | None, last: int, as_json: bool) -> None:
    """Every try at a delivery (of NAME, or all): its event, outcome and exit or HTTP status."""
    from runners.cli import output
    from workflows.notices import notifiers

    rows = env.store().read(lambda s: notifiers.log(s, name, last))
    if as_json:
        echo_json(rows)
        return
    t = output.table("at", "notifier", "event", "outcome", "status", "error")
    for r in rows:
        t.add_row(str(r["started_at"])[:19], r["notifier"],
                  f"#{r['event']} {r['kind']}" + (f" {r['host']}" if r["host"] else ""),
                  r["outcome"] or "in flight", "" if r["status"] is None else str(r["status"]),
                  r["error"] or "")
    show(t)
