"""`host add`'s options for running an app the way production needs: its own user and
group, env files read at each start (and the limits on its cgroup). Each is checked here,
before anything is staged or written; the values become host columns."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import click

RUN_KEYS = ("run_user", "run_group", "env_files")


def run_options(f: Callable[..., Any]) -> Callable[..., Any]:
    for opt in reversed([
        click.option("--user", "run_user", default=None, metavar="NAME|UID",
                     help="Run the app as this user (its groups, HOME, USER, LOGNAME, SHELL "
                          "from the passwd and group databases); the agent must be root."),
        click.option("--group", "run_group", default=None, metavar="NAME|GID",
                     help="Its primary group instead of the user's own (needs --user)."),
        click.option("--env-file", "env_files", multiple=True, metavar="[-]PATH",
                     help="A systemd EnvironmentFile= file read at each start (repeatable; "
                          "-PATH: skipped when missing); --env wins."),
    ]):
        f = opt(f)
    return f


def checked_run(opts: dict[str, Any]) -> dict[str, Any]:
    """Takes RUN_KEYS out of `opts` (the command's keyword arguments); the host columns.
    Raises BadInput (one line) for an unknown user or group, a non-root agent asked for
    another user, or an env file that is missing or has a bad line."""
    from runners.backend.envfiles import check_entries
    from runners.backend.users import check_run_as

    user, group = opts.pop("run_user", None), opts.pop("run_group", None)
    files = list(opts.pop("env_files", ()) or ())
    check_run_as(user, group)
    return {"run_user": user, "run_group": group,
            "env_files": json.dumps(check_entries(files))}
