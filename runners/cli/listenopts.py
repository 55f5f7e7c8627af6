"""The CLI's side of listeners: `--listen`/`--ready` checked before anything is written,
`vigil host reopen`, and closing a removed host's sockets in the fd holder."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from models.errors import BadInput
from models.states import HostKind

if TYPE_CHECKING:  # the heavy parts are imported where they are used: --help stays light
    from models.tables import Listener
    from workflows.generations.listeners import Listen


def probe_all(listens: list[Listen], already: list[Listen], label: str = "") -> None:
    """Each address vigil would open must be free now (one it holds for this host already
    is). Raises BadInput: port in use, privileged port, unwritable directory, ..."""
    from runners.backend.listen import probe_address

    mine = {a.address for a in already}
    for a in listens:
        if a.address in mine:
            continue
        problem = probe_address(a.address)
        if problem is not None:
            cause, _, fix = problem.rpartition("; ")
            raise BadInput(f"{label}--listen {cause}", fix)


def checked_listeners(env: Any, name: str, kind: HostKind, texts: tuple[str, ...],
                      ready: str | None, placed: str | None,
                      instances: int = 1) -> tuple[list[Listen], str | None]:
    """`host add`'s --listen, --ready and --instances (which needs listeners), refused with
    one line before anything is staged. The addresses are probed here only when the host may
    run on this box: a host placed on other boxes binds there (this box may hold the same
    address for a host of its own)."""
    from workflows.generations.listeners import (
        check_free,
        check_set,
        default_ready,
        parse_listen,
        parse_ready,
    )

    listens = [parse_listen(t, name) for t in texts]
    chosen = parse_ready(ready) if ready is not None else default_ready(listens)
    check_set(listens, kind, chosen)
    from workflows.generations.slots import check_instances

    check_instances(instances, listens, kind)
    if listens:
        env.store().read(lambda s: check_free(s, name, listens, placed))
        if runs_here(env.state_dir, placed):
            probe_all(listens, [])
    return listens, chosen


def runs_here(state_dir: Path, placed: str | None) -> bool:
    """May a host placed `placed` run on the box of this state dir? (A state dir no agent
    has started yet has no box name: taken to be one the host may run on.)"""
    from runners.base.doorbell import box_of
    from workflows.leases.placement import may_hold

    me = box_of(state_dir)
    return me is None or may_hold(placed, me)


def close_removed(state_dir: Path, rows: list[Listener]) -> None:
    """After `host rm`: the holder on this box closes the host's sockets (none runs: nothing
    to do; the agent's start closes whatever the store no longer names)."""
    if not rows:
        return
    from runners.backend.listen import Listeners
    from workflows.generations.listeners import key_of

    try:
        with Listeners(state_dir) as holder:
            holder.drop([key_of(r) for r in rows])
    except OSError as exc:
        click.echo(f"vigil: the fd holder did not close the sockets of the removed host "
                   f"({exc}); the agent closes them when it starts", err=True)


def probe_stored(env: Any, name: str, listens: list[Listen], label: str) -> None:
    """probe_all() for a stored host's new listeners (`host set`, `vigil apply`), where it
    may run on this box (a new host of a hosts file is placed nowhere: it may)."""
    from models.tables import Host
    from workflows.generations.listeners import as_listens, stored

    def read(s: Any) -> tuple[list[Listen], str | None]:
        h = s.get(Host, name)
        return as_listens(stored(s, name)), h.box if h is not None else None

    already, placed = env.store().read(read)
    if runs_here(env.state_dir, placed):
        probe_all(listens, already, label=label)


def attach(host: click.Group) -> None:
    @host.command("reopen")
    @click.argument("name")
    @click.pass_obj
    def host_reopen(env: Any, name: str) -> None:
        """Open new listening sockets for a host whose sockets were lost (connections that
        were queued on the old ones are gone with them). Not needed: the host's next start
        binds a lost one again by itself, and records why."""
        from workflows.generations.listeners import reopen

        n = env.store().write(lambda s: reopen(s, name))
        if n == 0:
            click.echo(f"host {name}: no listener is lost; nothing to do")
        else:
            click.echo(f"host {name}: {n} listener(s) will be opened afresh at its next start")
