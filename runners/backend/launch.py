"""How a generation's process is started: its environment, the build vetted before the
spawn, the shell shims that join its cgroup and set LISTEN_PID, and posix_spawn where
listening sockets must sit at fds 3, 4, ... (runners/backend/process.py spawns with them)."""

from __future__ import annotations

import os
import shutil
import subprocess

from runners.base.pids import MARKER
from workflows.base.ports import SpawnError, SpawnSpec
from workflows.generations.listeners import FIRST_FD

SHIM = 'echo $$ > "$1/cgroup.procs" && exec </dev/null && shift && exec "$@"'
# (Its stdin, the agent's pipe, closed once it joined: the agent's wait for the join ends
# on that EOF; the build's stdin is /dev/null as ever.)
# For a generation on shared listeners: join the cgroup (if any), enter its working dir,
# and set LISTEN_PID to its own pid, which exec keeps: the pid of the process that serves
# (sd_listen_fds ignores the fds unless LISTEN_PID is its pid; only the shim knows it).
LISTEN_SHIM = ('{ [ -z "$1" ] || echo $$ > "$1/cgroup.procs"; } && { [ -z "$2" ] || cd "$2"; } '
               '&& shift 2 && LISTEN_PID=$$ && export LISTEN_PID && exec "$@"')
# A host with a watchdog: WATCHDOG_PID is the leader's pid, which every shim's exec keeps.
WATCHDOG_SHIM = 'WATCHDOG_PID=$$ && export WATCHDOG_PID && exec "$@"'
# A job run's exec claim, taken (mkdir: exclusive) right before the build's exec: a reaper
# that voids it first (Files.void_claim) knows the build never ran and never will.
CLAIM_SHIM = 'mkdir -- "$1" 2>/dev/null || exit 125; shift && exec "$@"'
BASE_ENV = ("PATH", "HOME", "LANG")


def base_environment() -> dict[str, str]:
    """The few of the agent's variables every generation inherits."""
    return {k: os.environ[k] for k in BASE_ENV if k in os.environ}


def environment(spec: SpawnSpec, env: dict[str, str]) -> dict[str, str]:
    """The generation's environment: `env` (the agent's few, its user's, its env files'),
    then the host's own, then vigil's."""
    env.update(spec.env)
    # Always set: a descendant that escapes the cgroup is still found by the marker scan.
    env[MARKER] = spec.generation_uuid
    env["VIGIL_HOST"] = spec.host
    if spec.socket_path:
        env["VIGIL_SOCKET"] = spec.socket_path
    if spec.notify_socket:
        env["NOTIFY_SOCKET"] = spec.notify_socket
    if spec.watchdog_usec:
        env["WATCHDOG_USEC"] = str(spec.watchdog_usec)
    if spec.listen_fds:
        env["LISTEN_FDS"] = str(len(spec.listen_fds))
        env["LISTEN_FDNAMES"] = ":".join(spec.listen_names)
    return env


def command(spec: SpawnSpec, cg: str | None, target: list[str]) -> list[str]:
    """The argv to start: `target` (the build's, behind the limits' and user's shims),
    behind the shim that joins cgroup `cg` and, on shared listeners, sets LISTEN_PID."""
    argv = list(target)
    if spec.exec_claim:  # the innermost shim: in the cgroup, right before the build
        target = argv = ["/bin/sh", "-c", CLAIM_SHIM, "vigil-shim", spec.exec_claim, *target]
    if cg:
        argv = ["/bin/sh", "-c", SHIM, "vigil-shim", cg, *target]
    if spec.listen_fds:
        argv = ["/bin/sh", "-c", LISTEN_SHIM, "vigil-shim", cg or "", spec.cwd or "",
                *target]
    if spec.watchdog_usec:
        argv = ["/bin/sh", "-c", WATCHDOG_SHIM, "vigil-shim", *argv]
    return argv


def check_exec(argv0: str, env: dict[str, str], cwd: str | None) -> None:
    """Resolve and vet the build up front so a bad one fails the same way in both modes
    (behind the shim, exec errors would only show up as sh exit codes)."""
    if "/" not in argv0:
        found = shutil.which(argv0, path=env.get("PATH", os.defpath))
        if not found:
            raise SpawnError(f"spawn {argv0}: not found on PATH (ENOENT)")
        return
    path = argv0 if os.path.isabs(argv0) else os.path.join(cwd or os.getcwd(), argv0)
    if not os.path.exists(path):
        raise SpawnError(f"spawn {argv0}: no such file (ENOENT)")
    if not os.path.isfile(path):
        raise SpawnError(f"spawn {argv0}: not a regular file (EACCES)")
    if not os.access(path, os.X_OK):
        raise SpawnError(f"spawn {argv0}: not executable (EACCES)")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise SpawnError(f"spawn {argv0}: cannot read ({e.strerror})") from e
    if not (magic.startswith(b"#!") or magic == b"\x7fELF"):
        raise SpawnError(f"spawn {argv0}: not an ELF binary or #! script (ENOEXEC)")


class Child:
    """What Popen gives for a child started by posix_spawn: its pid, poll, wait."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: its status is unknown
                self.returncode = -1
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            try:
                _, status = os.waitpid(self.pid, 0)
                self.returncode = os.waitstatus_to_exitcode(status)
            except ChildProcessError:
                self.returncode = -1
        return self.returncode


def spawn_with_fds(argv: list[str], env: dict[str, str], out: object,
                    fds: tuple[int, ...]) -> Child:
    """posix_spawn with `fds` placed at 3, 4, ... in the child (Popen keeps a passed fd at
    its own number, and the shell cannot move one above 9); stdin /dev/null, stdout and
    stderr to `out`, a session of its own. Every other fd of this process is close-on-exec
    (Python's default, and what the fd holder's replies are set to)."""
    log = out if isinstance(out, int) else out.fileno()  # type: ignore[attr-defined]
    if log == subprocess.DEVNULL:
        log = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
        opened = True
    else:
        opened = False
    try:
        # Through numbers above every source first: a source may sit where a target goes.
        high = max((log, FIRST_FD + len(fds), *fds)) + 1
        actions: list[tuple[object, ...]] = [
            (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
            (os.POSIX_SPAWN_DUP2, log, 1), (os.POSIX_SPAWN_DUP2, log, 2)]
        actions += [(os.POSIX_SPAWN_DUP2, fd, high + i) for i, fd in enumerate(fds)]
        actions += [(os.POSIX_SPAWN_DUP2, high + i, FIRST_FD + i) for i in range(len(fds))]
        actions += [(os.POSIX_SPAWN_CLOSE, high + i) for i in range(len(fds))]
        pid = os.posix_spawn(argv[0], argv, env, file_actions=actions, setsid=True)
    finally:
        if opened:
            os.close(log)
    return Child(pid)
