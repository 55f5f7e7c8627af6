"""The small interfaces through which workflows touch the outside world.

`runners` implements them for real (psutil, cgroup v2, unix sockets); tests may fake
them only to cause faults that cannot be caused for real.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from models.states import TryOutcome


@dataclass(frozen=True)
class SpawnSpec:
    """Everything needed to exec one generation."""

    generation_uuid: str
    host: str
    argv: list[str]  # [staged build path, *args]
    env: dict[str, str] = field(default_factory=dict)  # the host's own env
    cwd: str | None = None
    socket_path: str | None = None  # instances only: passed as VIGIL_SOCKET
    log_path: str | None = None  # stdout and stderr are appended here
    cgroup: str | None = None  # containment directory chosen before the spawn
    # Listening sockets it inherits as fds 3, 4, ... (the sd_listen_fds protocol): this
    # process's fds, in order, and their names (LISTEN_FDNAMES).
    listen_fds: tuple[int, ...] = ()
    listen_names: tuple[str, ...] = ()
    notify_socket: str | None = None  # its own NOTIFY_SOCKET (readiness by sd_notify)
    watchdog_usec: int | None = None  # WATCHDOG_USEC (and WATCHDOG_PID): its watchdog's period
    # Who it runs as (None: the agent's user), and the env files read at this start.
    user: str | None = None
    group: str | None = None
    env_files: tuple[str, ...] = ()
    # Limits on its cgroup and rlimits: memory_max (bytes), cpu_quota (% of a core),
    # pids_max, limit_nofile, limit_core (bytes) (runners/backend/cglimits.py).
    limits: dict[str, int] = field(default_factory=dict)
    credentials: tuple[tuple[str, str], ...] = ()  # (NAME, PATH): copied in at this start
    memory_tier_mb: int | None = None  # its host's parent limit (LimitPort), if it has one
    # A job run's execution evidence: a path its shim mkdirs (exclusively) right before the
    # build's exec; a reaper that voids it first proves the build never ran (Files.void_claim).
    exec_claim: str | None = None


class SpawnError(Exception):
    """The build could not be started. `build_fault` is False when the box, not the build,
    failed (cgroup, log file): such a failure never counts against the build."""

    def __init__(self, reason: str, *, build_fault: bool = True) -> None:
        super().__init__(reason)
        self.build_fault = build_fault


@dataclass(frozen=True)
class Spawned:
    pid: int
    create_time: float


@dataclass(frozen=True)
class ProcRef:
    """A generation's identity on the box: leader pid + start time, and its containment."""

    generation_uuid: str
    pid: int | None
    create_time: float | None
    cgroup: str | None
    # Descendants of the leader seen by a walk (pid, start time): processes of the
    # generation even once they have left the cgroup and dropped the marker.
    known: tuple[tuple[int, float], ...] = ()
    user: str | None = None  # the user it was spawned as: its processes may carry the marker
    socket: str | None = None  # its own $VIGIL_SOCKET file, removed with its leftovers


class ProcessPort(Protocol):
    def containment_for(self, generation_uuid: str) -> str | None:
        """The cgroup directory a new generation will live in, or None (marker mode)."""

    def spawn(self, spec: SpawnSpec) -> Spawned:
        """Exec the build inside its containment. Raises SpawnError."""

    def leader_alive(self, ref: ProcRef) -> bool:
        """True when pid and create_time match and the process is not a zombie."""

    def live_members(self, ref: ProcRef) -> list[int]:
        """Pids of live (non-zombie) processes in the generation's containment."""

    def terminate(self, ref: ProcRef, sig: int = signal.SIGTERM) -> None:
        """Send `sig` (the host's stop signal) to the leader if its identity still matches;
        a gone process is fine."""

    def terminate_all(self, ref: ProcRef, sig: int = signal.SIGTERM) -> None:
        """Send `sig` to every live process of the containment (each pid-verified)."""

    def run_stop_command(self, spec: SpawnSpec) -> None:
        """Start the host's stop command inside the generation's containment, as its user,
        with its env (spec.argv). Raises SpawnError when it cannot start."""

    def stop_command_running(self, generation_uuid: str) -> bool:
        """True while a stop command this process started for the generation runs."""

    def stop_command_outcome(self, generation_uuid: str) -> str | None:
        """Once: how its stop command ended (`exit 0`, `exit 3: last line`, `still
        running`); None when this process started none."""

    def signal_leader(self, ref: ProcRef, signum: int) -> bool:
        """Send `signum` to the leader if its identity still matches; False when it is gone
        (`vigil signal`, `vigil reload`, a watchdog's SIGABRT)."""

    def kill_all(self, ref: ProcRef) -> None:
        """SIGKILL everything in the containment (and the leader if it still matches)."""

    def proven(self, ref: ProcRef) -> bool:
        """Leader exited (or is a zombie) and no live process is left in the containment."""

    def release(self, ref: ProcRef) -> None:
        """Drop the containment's leftovers (an empty cgroup dir) after a proof."""

    def descendants(self, refs: list[ProcRef]) -> dict[str, list[tuple[int, float]]]:
        """For each live leader: its live descendants now (pid, start time), by generation
        uuid. One walk of the process table for all of them."""

    def containments(self) -> list[str]:
        """The cgroup dirs of generations that exist on this machine (none in marker mode):
        recovery releases those of proven generations, left by a death between the proof's
        commit and its release."""


class HealthPort(Protocol):
    def check(self, socket_path: str, timeout: float, alive: Callable[[], bool],
              path: str | None = None) -> str | None:
        """Poll `GET /` on the unix socket until a status < 500 (returns None) or the
        timeout passes or `alive()` turns False (returns the reason as a string)."""

    def probe(self, socket_path: str, timeout: float, path: str | None = None) -> str | None:
        """One `GET /` (the ongoing probe): None when it answers below 500, else why not.
        With `path=PATH` (http:PATH, check too): `GET PATH` must answer 2xx or 3xx."""

    def reach(self, socket_path: str, timeout: float, alive: Callable[[], bool]) -> str | None:
        """Poll connects to the unix socket until one is accepted (None), or why not."""

    def knock(self, socket_path: str, timeout: float) -> str | None:
        """One connect (the ongoing tcp probe): None when accepted, else why not."""


class Files(Protocol):
    """The filesystem side effects a workflow asks for."""

    def point_link(self, link: str, target: str) -> None:
        """Atomically make `link` a symlink to `target` (rename over the old link)."""

    def remove_link(self, link: str, only_if_target: str | None = None) -> None:
        """Remove `link` (only when it points at `only_if_target`, if given)."""

    def read_link(self, link: str) -> str | None: ...

    def digest(self, path: str) -> str:
        """sha256 of the file, hex. Raises OSError when it cannot be read."""

    def void_claim(self, path: str) -> bool:
        """Take a start's exec claim (SpawnSpec.exec_claim) before its shim does: True when
        it is voided here (now or by an earlier call): that build never exec'd and never
        can; False when the shim took it first (the build may have run)."""


class LimitPort(Protocol):
    """A host's parent memory limit: raised for an overlap, restored after it."""

    def available(self) -> bool:
        """True when the box has a memory controller that can limit the host's parent."""

    def set_limit(self, host: str, megabytes: int) -> None:
        """Set the host's parent limit. Raises OSError when it could not be written."""


class SocketPort(Protocol):
    """Who may connect to a host's sockets (runners/backend/sockets.py). `group`/`mode` are the
    host's own settings; None falls back to the agent-wide ones."""

    def prepare_dir(self, socket_dir: str, group: str | None, mode: int | None) -> None:
        """Create the host's socket directory before the spawn, reachable by the group."""

    def grant(self, socket: str, group: str | None, mode: int | None) -> None:
        """Give the socket its group and mode (before it becomes canonical). Raises OSError."""


class ListenerPort(Protocol):
    """The box's listening sockets (runners/backend/listen.py), by key (workflows/generations/listeners.py):
    this agent's copies, and the fd holder that keeps them across agent restarts."""

    def boot(self) -> str:
        """This boot of the box (a socket of another boot cannot be held by anything)."""

    def keys(self) -> list[str]:
        """The keys this agent has a copy of."""

    def inode(self, key: str) -> int | None:
        """The inode of this agent's copy of `key`, or None when it has none."""

    def bind(self, key: str, address: str) -> int:
        """Open (bind, listen) `address` as `key`; its inode. Raises OSError / ValueError."""

    def hand(self, key: str) -> None:
        """Give the fd holder its copy of `key`. Raises OSError."""

    def fds(self, keys: list[str]) -> list[int]:
        """This agent's fds of `keys`, in order. Raises KeyError (one it does not have)."""

    def fetch(self, keep: set[str]) -> dict[str, int]:
        """Take back what the holder keeps of `keep` (it closes the rest): key -> inode."""

    def rescue(self, key: str, inode: int, pids: list[int]) -> bool:
        """Copy socket `inode` out of a live process among `pids` and hand it to the holder."""

    def drop(self, keys: list[str]) -> None:
        """Close `keys`, here and in the holder."""


class ReadinessPort(Protocol):
    """A generation's own readiness signal on a shared listener (runners/backend/readysignal.py)."""

    def watchdog_seen(self, generation_uuid: str) -> tuple[float | None, bool]:
        """The generation's last WATCHDOG=1 (epoch seconds; None: none heard since its
        socket was bound) and whether it sent WATCHDOG=trigger."""

    def open_notify(self, generation_uuid: str, path: str, host: str, generation_id: int) -> None:
        """Bind the generation's NOTIFY_SOCKET at `path` (before its spawn, or again when it
        is adopted). Raises OSError."""

    def wait_notify(self, generation_uuid: str, timeout: float,
                    alive: Callable[[], bool]) -> str | None:
        """Until READY=1 arrives from the generation (None), or why not."""

    def reload_mark(self, generation_uuid: str) -> int | None:
        """Where the generation's notify messages are now (None: no NOTIFY_SOCKET is
        watched): taken before a reload's signal, given to wait_reload."""

    def wait_reload(self, generation_uuid: str, mark: int, timeout: float,
                    alive: Callable[[], bool]) -> str | None:
        """Until RELOADING=1 then READY=1 arrive after `mark` (None: reloaded), or why not
        (systemd's Type=notify-reload protocol)."""

    def run_probe(self, spec: SpawnSpec, timeout: float, alive: Callable[[], bool]) -> str | None:
        """Run `spec.argv` (`/bin/sh -c CMD`, workflows/generations/readiness.py command_spec)
        in the generation's containment, as its user, until it exits 0 (None), or why it did
        not within `timeout`."""

    def run_once(self, spec: SpawnSpec, timeout: float) -> str | None:
        """Run `spec.argv` once, as run_probe: None when it exits 0 within `timeout`, else
        why not (over time, its process group is killed)."""


@dataclass(frozen=True)
class Sent:
    """How one try at a notification ended: `status` is the command's exit status or the
    webhook's HTTP status (None when there was none), `error` what went wrong."""

    outcome: TryOutcome
    status: int | None = None
    error: str | None = None


class NoticePort(Protocol):
    """Sending a notification (runners/backend/notifysend.py); each call is bounded by `timeout`."""

    def run(self, command: str, body: bytes, env: dict[str, str], timeout: float) -> Sent:
        """Run the shell command with `body` on its stdin; past the timeout it is killed."""

    def post(self, url: str, body: bytes, headers: dict[str, str], timeout: float) -> Sent:
        """POST `body` to the URL; a 2xx answer delivers it."""
