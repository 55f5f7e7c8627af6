"""`vigil reload HOST` and `vigil signal HOST SIG`, and the host options of a reload
(`--reload-signal`, `--on-reload-fail`): the reload is an obligation row the agent drives
(workflows/deploys/reload.py); a signal is sent at once, by this process, to every current
leader of the host."""

from __future__ import annotations

import os
from typing import Any

import click

from models.errors import VigilError
from runners.cli.common import SECONDS, Env, poll, ring

SETTLED = ("done", "failed", "cancelled")

# `host add`'s, among its restart policy's options: the same two are `host set`'s
# (runners/cli/hostedit.py) and the hosts file's keys `reload_signal` and `on_reload_fail`.
reload_options = [
    click.option("--reload-signal", default="HUP", show_default=True, metavar="SIG",
                 help="The signal `vigil reload` sends to each current generation's leader."),
    click.option("--on-reload-fail", type=click.Choice(["restart", "keep"]), default="restart",
                 show_default=True,
                 help="A reload not back ready within the health timeout: an overlap restart "
                      "of the same build, or keep it as it is."),
]


def checked_reload(given: dict[str, Any]) -> dict[str, str]:
    """The reload options taken out of `host add`'s other options, checked."""
    from workflows.deploys.reload import check_reload_fail, check_reload_signal

    return {"reload_signal": check_reload_signal(given.pop("reload_signal")),
            "on_reload_fail": check_reload_fail(given.pop("on_reload_fail"))}


@click.command()
@click.argument("name")
@click.option("--wait", is_flag=True, help="Block until the reload's outcome (and, when it "
                                           "failed into a restart, the restart's).")
@click.option("--timeout", type=SECONDS, default=300.0, show_default=True)
@click.pass_obj
def reload(env: Env, name: str, wait: bool, timeout: float) -> None:
    """Reload a host in place: its reload signal (HUP unless --reload-signal) to the
    leader of every current generation (each instance), then each back ready (RELOADING=1 then READY=1 with --ready notify,
    else its readiness probe); one not back ready within the health timeout is answered by
    an overlap restart of the same build (--on-reload-fail restart) or kept."""
    from workflows.deploys.reload import request_reload

    req = env.store().write(lambda s: request_reload(s, name))
    ring(env)
    if not wait:
        click.echo(f"reload #{req.id} of {name} " + ("queued" if req.new else
                                                       f"already open ({req.state})"))
        return
    row = poll(lambda: _row(env, req.id), lambda r, _: r["state"] in SETTLED, timeout=timeout,
               late=lambda r: f"reload #{req.id} is still {r['state']} "
                              f"({r['last_error'] or 'no error yet'})",
               idle=env.quick().no_agent_guard(f"reload #{req.id} of {name}"))
    _outcome(env, name, row, timeout)


def _row(env: Env, reload_id: int) -> dict[str, Any]:
    from models.tables import Reload

    def read(s: Any) -> dict[str, Any]:
        r = s.get(Reload, reload_id)
        return {"state": r.state.value, "reason": r.reason, "attempt": r.attempt_id,
                "last_error": r.last_error}
    return env.store().read(read)


def _outcome(env: Env, name: str, row: dict[str, Any], timeout: float) -> None:
    """One line: reloaded (exit 0); failed into a restart that ended done (exit 0, saying
    so); anything else a failure with its reason (non-zero)."""
    if row["state"] == "done":
        click.echo(f"host {name}: reloaded, back ready")
        return
    if row["state"] == "cancelled":
        raise VigilError(f"host {name}: reload {row['reason']}", f"see `vigil events {name}`")
    if row["attempt"] is None:
        raise VigilError(f"host {name}: reload failed, kept as it is: {row['reason']}",
                         f"see `vigil logs {name}`; `vigil restart {name}` replaces it")
    click.echo(f"host {name}: reload failed ({row['reason']}); answered by restart attempt "
               f"#{row['attempt']}")
    from runners.cli.lifecycle import _attempt

    _attempt(env, name, row["attempt"], True, timeout, False)


@click.command("signal")
@click.argument("name")
@click.argument("sig", metavar="SIG")
@click.pass_obj
def signal_cmd(env: Env, name: str, sig: str) -> None:
    """Send SIG (a name such as HUP, USR1 or SIGUSR2, or its number) to the leader of every
    current generation of a host (each instance: what vigil exec'd, which passes it on as
    the app does); an event (signal_sent) each."""
    from runners.backend.process import ProcessBackend
    from workflows.base.paths import AGENT_ID
    from workflows.deploys.reload import check_signal, signal_host

    known = check_signal(sig, "signal ")  # a bad name is refused before the store is opened
    proc = ProcessBackend(containment=os.environ.get("VIGIL_CONTAINMENT", "auto"))
    box_file = env.state_dir / AGENT_ID  # this box's name, once an agent has run here
    box = box_file.read_text().strip() if box_file.exists() else None
    sent = signal_host(env.store(), proc, name, known, box)
    for o in sent:
        click.echo(f"host {name}: g{o.generation} (slot {o.slot}, pid {o.pid}) "
                   + (f"sent SIG{known}" if o.sent else "had exited: not signalled"))
    if not any(o.sent for o in sent):
        raise VigilError(f"host {name}: no process was signalled (each had exited)",
                         f"see `vigil status {name}`")
