"""Running a host's generations as a user of their own (`host add --user/--group`).

The switch is in the child, after the shims (root: only root may join a cgroup) and before
the app: `setpriv --reuid --regid --groups -- APP` (util-linux), one exec more. Popen's own
`user=`/`group=` keeps it from using vfork, copying the agent's address space at each spawn
(bench/spawn_user.py: 12.3 ms against setpriv's 6.9 ms).

The app gets only: traversal (not listing) of the state dir, `builds/` and its build's
directory (0711), its `run/<host>/` and NOTIFY_SOCKET as owner, and the fds it inherits
(log pipe, listeners). The store and control socket (0600), `logs/` (0700) and every other
host's `run/<host>/` stay closed to it.
"""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import select

from models.errors import BadInput, BrokenInvariant
from models.store import Store
from models.tables import Host
from runners.backend.credentials import Credentials
from runners.backend.envfiles import read_all
from workflows.base.ports import SpawnError, SpawnSpec


@dataclass(frozen=True)
class RunAs:
    """Who a generation runs as, read from the passwd and group databases."""

    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]  # supplementary groups (the user's, from the group database)
    home: str
    shell: str

    def env(self) -> dict[str, str]:
        return {"HOME": self.home, "USER": self.name, "LOGNAME": self.name, "SHELL": self.shell}

    def setpriv(self, tool: str) -> list[str]:
        groups = ["--groups=" + ",".join(map(str, self.groups))] if self.groups else ["--clear-groups"]
        return [tool, f"--reuid={self.uid}", f"--regid={self.gid}", *groups, "--"]


def _user(text: str) -> pwd.struct_passwd:
    try:
        return pwd.getpwuid(int(text)) if text.isdigit() else pwd.getpwnam(text)
    except KeyError:
        raise ValueError(f"no user {text!r} in this box's passwd database") from None


def _group(text: str) -> int:
    try:
        return grp.getgrgid(int(text)).gr_gid if text.isdigit() else grp.getgrnam(text).gr_gid
    except KeyError:
        raise ValueError(f"no group {text!r} in this box's group database") from None


def resolve(user: str | None, group: str | None) -> RunAs | None:
    """The identity to switch to, or None (run as the agent). Raises ValueError."""
    if user is None:
        return None
    pw = _user(user)
    gid = _group(group) if group is not None else pw.pw_gid
    groups = tuple(sorted(set(os.getgrouplist(pw.pw_name, gid))))
    return RunAs(pw.pw_name, pw.pw_uid, gid, groups, pw.pw_dir, pw.pw_shell or "/bin/sh")


def check_run_as(user: str | None, group: str | None, label: str = "--") -> None:
    """At `host add` and `apply`, before anything is written: the user and group exist,
    and this process may switch to them (only root may run an app as another user)."""
    if user is None:
        if group is not None:
            raise BadInput(f"{label}group {group} without {label}user",
                           f"name the user too ({label}user NAME); the group replaces its own")
        return
    try:
        who = resolve(user, group)
    except ValueError as exc:
        raise BadInput(str(exc), "name an existing user (see `getent passwd`) and group "
                       "(`getent group`), or create them first (useradd)") from None
    if who is None:  # resolve() answers None only for no user, handled above
        raise BrokenInvariant(f"user {user} resolved to nothing")
    me = os.geteuid()
    if me != 0 and (who.uid != me or who.gid != os.getegid()):
        raise BadInput(f"this agent runs as uid {me} and cannot run an app as user {who.name} "
                       f"(uid {who.uid}, gid {who.gid})",
                       f"run the agent as root, or drop {label}user/{label}group")


def setpriv_tool() -> str:
    """util-linux setpriv (the shim's switch). Raises ValueError when the box lacks it."""
    found = shutil.which("setpriv", path="/usr/bin:/bin:/usr/sbin:/sbin")
    if not found:
        raise ValueError("setpriv (util-linux) is not installed: it switches the user after "
                         "the cgroup join; install util-linux")
    return found


def _can_pass(st: os.stat_result, who: RunAs) -> bool:
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid == who.uid:
        return bool(mode & stat.S_IXUSR)
    if st.st_gid == who.gid or st.st_gid in who.groups:
        return bool(mode & stat.S_IXGRP)
    return bool(mode & stat.S_IXOTH)


def _traversable(path: Path) -> None:
    """Anyone may pass through (not list): 0700 -> 0711, 0710 -> 0711."""
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & 0o011 != 0o011:
        os.chmod(path, mode | 0o011)


def reachable(path: Path, who: RunAs, stop: Path) -> None:
    """Every directory above `stop` (vigil's own) lets `who` pass; ValueError names the
    first that does not: it is the operator's, and vigil changes none of them."""
    for d in reversed(stop.parents):
        if not _can_pass(os.stat(d), who):
            st = os.stat(d)
            raise ValueError(f"user {who.name} cannot reach {path}: {d} is mode "
                             f"{stat.S_IMODE(st.st_mode):04o}, owner uid {st.st_uid}; let it pass "
                             f"(chmod o+x {d}) or move the state dir")


def grant(who: RunAs | None, build: str, socket_dir: str | None,
          notify: str | None) -> None:
    """Before the spawn: what the generation needs opened to its user (see the module
    doc); a socket dir of a host run as the agent again is the agent's again."""
    if socket_dir is not None:
        owner = who.uid if who is not None else os.geteuid()
        if os.stat(socket_dir).st_uid != owner:
            os.chown(socket_dir, owner, -1)
    if who is None:
        return
    staged = Path(build)
    if staged.parent.parent.name == "builds":  # <state>/builds/<digest>/<name>
        state = staged.parent.parent.parent
        reachable(staged, who, state)
        for d in (state, staged.parent.parent, staged.parent):
            _traversable(d)
    if socket_dir is not None:
        run = Path(socket_dir).parent
        reachable(Path(socket_dir), who, run.parent)
        for d in (run.parent, run):
            _traversable(d)
    if notify is not None:
        os.chown(notify, who.uid, -1, follow_symlinks=False)


def switch_for(user: str | None, group: str | None) -> RunAs | None:
    """At the spawn: who to switch to (None: stay the agent). Raises ValueError when the
    user is gone or this process may not switch to it."""
    who = resolve(user, group)
    if who is None:
        return None
    me = os.geteuid()
    if me == 0:
        return who
    if who.uid == me and who.gid == os.getegid():
        return None  # already that user: nothing to switch (setgroups needs root)
    raise ValueError(f"this agent runs as uid {me} and cannot run an app as user {who.name}")


def marker_uids(user: str | None) -> set[int]:
    """Whose processes may carry a generation's marker: the agent's, and its user's."""
    uids = {os.getuid()}
    if user is not None:
        try:
            uids.add(_user(user).pw_uid)
        except ValueError:  # the user was removed since: its processes still have its uid
            if user.isdigit():
                uids.add(int(user))
    return uids


def for_spawn(spec: SpawnSpec, env: dict[str, str],
              creds: Credentials | None = None) -> RunAs | None:
    """At each spawn, before the host's own env is laid over `env`: the user's HOME, USER,
    LOGNAME and SHELL, then its env files (read now, so a restart picks up a change), and
    what it needs opened to it. Raises SpawnError (never the build's fault: the box's or
    the host's settings are, and the next start reads them again)."""
    try:
        who = switch_for(spec.user, spec.group)
        if who is not None:
            env.update(who.env())
            setpriv_tool()  # the shim's switch: missing, say so before anything runs
        env.update(read_all(spec.env_files))
        if spec.credentials and creds is not None:  # copied afresh at each start
            env["CREDENTIALS_DIRECTORY"] = creds.place(
                spec.generation_uuid, dict(spec.credentials), who.uid if who else None)
        socket = spec.socket_path or spec.notify_socket
        grant(who, spec.argv[0], os.path.dirname(socket) if socket else None,
              spec.notify_socket)
    except ValueError as exc:
        raise SpawnError(f"host {spec.host}: {exc}", build_fault=False) from exc
    return who


def shim_target(who: RunAs | None, spec: SpawnSpec) -> list[str]:
    """What is exec'd after any shim: the app, through setpriv when it runs as another
    user (also without a shim: see the module doc for why not Popen's own switch)."""
    if who is None:
        return list(spec.argv)
    return [*who.setpriv(setpriv_tool()), *spec.argv]



def settle_users(store: Store, state_dir: Path) -> None:
    """On agent start, after the state dir is made owner-only again: while any host runs
    as another user, the state dir and `run/` stay passable (0711), so an adopted app still
    reaches its own `run/<host>/` (its NOTIFY_SOCKET) and credentials."""
    if store.read(lambda s: s.execute(select(Host.name).where(Host.run_user.is_not(None))
                                      .limit(1)).first()) is None:
        return
    for d in (state_dir, state_dir / "run", state_dir / "credentials"):
        if d.is_dir():  # credentials/: an adopted app still reads its own directory
            _traversable(d)
