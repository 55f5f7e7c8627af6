"""Socket access: a non-root proxy (nginx) in socket group G (`vigil agent --socket-group`,
or per host `host add --socket-group`, which wins) connects to a host's canonical socket
while the state directory stays private:

- the state dir and `run/` are group G, 0710 (pass, not list); 0711 when hosts name
  different groups, and the next two steps keep each app private;
- `run/<host>/` is group G, 0710;
- each generation's socket is group G, mode `socket_mode` (0660), set after the health check
  and before the switch makes it canonical (a crash between: nothing ever linked to it).

All else is owner-only: `settle` (agent start) makes `builds/` and `logs/` 0700 and strips
group and other bits elsewhere; the database is 0600; no socket group: all 0700.
"""

from __future__ import annotations

import grp
import logging
import os
import stat
from pathlib import Path

from sqlalchemy import select

from models.statedir import private_dirs
from models.tables import Host
from workflows.base.context import Context

log = logging.getLogger("vigil.sockets")

DEFAULT_MODE = 0o660


def parse_mode(text: str) -> int:
    """'0660' -> 0o660. Raises ValueError with the reason."""
    try:
        mode = int(text, 8)
    except (TypeError, ValueError):
        raise ValueError(f"{text!r} is not an octal mode such as 0660") from None
    if not 0 <= mode <= 0o777:
        raise ValueError(f"{text!r} is not a permission mode between 0000 and 0777")
    if mode & 0o060 != 0o060:
        raise ValueError(f"{text} does not let the group read and write the socket "
                         "(connecting needs both)")
    return mode


def check_group(name: str) -> int:
    """The gid of group `name`. Raises ValueError when the box has no such group."""
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise ValueError(f"no group named {name!r} on this box") from None


def _open_dir(path: Path, gid: int) -> None:
    """Let group `gid` traverse `path` (never list it)."""
    st = os.stat(path)
    mode = stat.S_IMODE(st.st_mode)
    opened = mode in (0o710, 0o711)
    if st.st_gid == gid or not opened:
        if st.st_gid != gid:
            os.chown(path, -1, gid)
        if not opened:
            os.chmod(path, 0o710)
    elif mode != 0o711:  # already opened to another group: both must pass
        log.warning("socket_access path=%s groups=%d,%d mode=0711 (several socket groups)",
                    path, st.st_gid, gid)
        os.chmod(path, 0o711)


class SocketAccess:
    """The SocketPort: agent-wide defaults, per-host overrides."""

    def __init__(self, state_dir: Path, group: str | None = None, mode: int | None = None) -> None:
        self.state_dir = state_dir.absolute()
        self.group = group
        self.mode = mode

    def _policy(self, group: str | None, mode: int | None) -> tuple[int, int] | None:
        name = group or self.group
        if name is None:
            return None
        chosen = mode if mode is not None else self.mode
        return check_group(name), DEFAULT_MODE if chosen is None else chosen

    def prepare_dir(self, socket_dir: str, group: str | None, mode: int | None) -> None:
        """Before the spawn: `run/<host>/` exists, reachable by the host's group only."""
        run = self.state_dir / "run"
        private_dirs(socket_dir)  # run/ too
        policy = self._policy(group, mode)
        if policy is None:
            os.chmod(socket_dir, 0o700)
            return
        gid = policy[0]
        _open_dir(self.state_dir, gid)
        _open_dir(run, gid)
        os.chown(socket_dir, -1, gid)
        os.chmod(socket_dir, 0o710)

    def grant(self, socket: str, group: str | None, mode: int | None) -> None:
        """After health, before the switch: the socket's group and mode. Raises OSError."""
        policy = self._policy(group, mode)
        if policy is None:
            return
        st = os.lstat(socket)
        if not stat.S_ISSOCK(st.st_mode):  # never chmod what a symlink points at
            raise OSError(f"{socket} is not a unix socket")
        os.chown(socket, -1, policy[0], follow_symlinks=False)
        os.chmod(socket, policy[1])

    def settle(self, any_host_group: bool) -> None:
        """On agent start: every entry but `run/` owner-only; the state dir and `run/`
        opened to the agent-wide group, or closed again when no group is in play."""
        for name in ("builds", "logs"):
            (self.state_dir / name).mkdir(mode=0o700, exist_ok=True)
        for entry in os.scandir(self.state_dir):
            if entry.name == "run" or entry.is_symlink():
                continue
            mode = stat.S_IMODE(entry.stat(follow_symlinks=False).st_mode)
            if mode & 0o077:
                os.chmod(entry.path, mode & 0o700)
        run = self.state_dir / "run"
        run.mkdir(mode=0o700, exist_ok=True)
        if self.group is not None:
            gid = check_group(self.group)
            _open_dir(self.state_dir, gid)
            _open_dir(run, gid)
        elif not any_host_group:
            os.chmod(self.state_dir, 0o700)
            os.chmod(run, 0o700)


def settle_state_dir(ctx: Context) -> None:
    """Agent start (lock held, schema at head): see SocketAccess.settle."""
    if not isinstance(ctx.sockets, SocketAccess):
        return
    any_host_group = ctx.store.read(lambda s: s.execute(
        select(Host.name).where(Host.socket_group.is_not(None)).limit(1)).first() is not None)
    ctx.sockets.settle(any_host_group)
    from runners.backend.users import settle_users  # apps run as other users pass through
    settle_users(ctx.store, ctx.sockets.state_dir)
