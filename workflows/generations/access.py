"""Socket access steps shared by wake and swap (the policy lives in runners/backend/sockets.py).

Order: the socket directory is prepared before the spawn; the socket's group and mode are
set after the health check and before the step that makes the generation current and
links it. A crash in between leaves a granted socket that nothing links to: the wake or
attempt is reaped or abandoned by recovery like any other interrupted spawn."""

from __future__ import annotations

import os

from models.statedir import private_dirs
from models.tables import Host
from workflows.base.context import Context
from workflows.base.ports import SpawnError


def prepare_socket_dir(ctx: Context, host: Host, socket: str) -> None:
    """Raises SpawnError (the box's fault, never the build's) when it cannot be done."""
    try:
        if ctx.sockets is None:
            private_dirs(os.path.dirname(socket))
        else:
            ctx.sockets.prepare_dir(os.path.dirname(socket), host.socket_group, host.socket_mode)
    except (OSError, ValueError) as exc:
        raise SpawnError(f"socket directory for {socket}: {exc}", build_fault=False) from exc


def grant_socket(ctx: Context, host: Host, socket: str) -> str | None:
    """None when done, else why the socket could not be opened to its group."""
    if ctx.sockets is None:
        return None
    try:
        ctx.sockets.grant(socket, host.socket_group, host.socket_mode)
    except (OSError, ValueError) as exc:
        return f"socket access for {socket}: {exc}"
    return None


def reopen_adopted(ctx: Context, host: Host, socket: str) -> str | None:
    """On start, for a generation adopted without a restart: its directory and socket get
    the settings in force now (the agent's socket group may have changed)."""
    try:
        prepare_socket_dir(ctx, host, socket)
    except SpawnError as exc:
        return str(exc)
    return grant_socket(ctx, host, socket)
