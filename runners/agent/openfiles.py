"""The agent's open-file limit: raised to the hard limit at start (most boxes start a
service at a soft 1,024), said in its log, and measured against the apps this box may run.
A box whose limit cannot hold them gets one warning at start naming the limit and the fix,
not a crash at the thousandth start (EMFILE)."""

from __future__ import annotations

import logging
import os
import resource

from sqlalchemy import select

from models.tables import Host
from workflows.base.context import Context
from workflows.leases.placement import may_hold

log = logging.getLogger("vigil.agent")
# The agent's pidfd of each leader: the log pipe's read end is kept by the log keeper and
# copied by its standby (the agent keeps a copy too only while its limit has room for it:
# runners/keepers/logpipes.py copies_fit). The keeper and its standby, started with the
# agent's limit, hold one an app too (the keeper's files are opened as they write).
FDS_PER_APP = 1
SPARE = 64  # the store, the control socket, the doorbell, the helpers' sockets


def raise_open_file_limit() -> tuple[int, int, int]:
    """The soft RLIMIT_NOFILE raised to the hard limit: (soft before, soft now, hard)."""
    before, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    soft = before
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):  # a hard limit over the kernel's nr_open
            pass
    return before, soft, hard


def room_for_apps(soft: int) -> int:
    """How many more apps the limit holds, with what the agent has open now."""
    try:
        open_now = len(os.listdir("/proc/self/fd"))
    except OSError:
        open_now = 32
    return max(0, (soft - open_now - SPARE) // FDS_PER_APP)


def say_open_file_limit(ctx: Context, limits: tuple[int, int, int]) -> None:
    """The limit in the log; a warning when the apps placed on this box would not fit."""
    before, soft, hard = limits
    if soft != before:
        log.info("open files: soft limit raised from %d to %d (the hard limit)", before, soft)
    apps = ctx.store.read(lambda s: sum(
        n for box, n in s.execute(select(Host.box, Host.instances)) if may_hold(box, ctx.agent_id)))
    room = room_for_apps(soft)
    if apps > room:
        log.warning("open files: the limit of %d (hard %d) holds about %d apps, and %d may run "
                    "on this box: starts past it fail with 'too many open files'; raise the "
                    "hard limit (systemd LimitNOFILE=, or ulimit -Hn) and start the agent again",
                    soft, hard, room, apps)
