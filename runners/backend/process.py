"""Process backend: spawn generations and prove them gone (cgroup v2 or env marker).

Liveness is always read from psutil's status: on these boxes PID 1 never reaps orphans, so
an exited process of a generation spawned by a previous agent stays a zombie forever, and a
zombie counts as dead everywhere below.

Empirical cgroup v2 finding (kernel 6.18, hybrid hierarchy, checked with an unreaped child):
a task leaves `cgroup.procs` and stops counting towards `cgroup.events populated` as soon as
it exits, before it is reaped; the zombie's /proc/<pid>/cgroup still names the cgroup, and
the cgroup can be rmdir'd while the zombie exists. So zombies never block the proof or the
release. Conversely `populated 1` with every listed pid a "zombie" means a live thread group
whose main thread exited; we keep trusting `populated` there (it is really alive).
"""

from __future__ import annotations

import errno
import os
import select
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import psutil

from runners.backend import users
from runners.backend.cglimits import CgroupLimits
from runners.backend.cgroups import cgroup2_mount, detect_cgroup_base
from runners.backend.credentials import Credentials
from runners.backend.descendants import live_known, walk
from runners.backend.launch import (
    Child,
    base_environment,
    check_exec,
    command,
    environment,
    spawn_with_fds,
)
from runners.backend.stopcmd import StopCommands
from runners.base.pids import (
    CTIME_TOLERANCE,
    carriers,
    kill_leader,
    live_status,
    pid_status,
    signal_same,
)
from runners.keepers.logpipes import LogPipes
from workflows.base.ports import ProcRef, Spawned, SpawnError, SpawnSpec

JOIN_TIMEOUT = 2.0  # bound for the shim to join its cgroup
LOG_MAX_BYTES = 10 << 20  # per file of a generation's output
LOG_FILES = 3  # files kept per generation (the one written and two rotated)


def cgroup_pids(cg: str) -> list[int]:
    """Pids listed in the cgroup and its sub-cgroups (missing dir == empty)."""
    pids: list[int] = []
    for d, _, _ in os.walk(cg):
        try:
            with open(os.path.join(d, "cgroup.procs")) as f:
                pids += [int(x) for x in f.read().split()]
        except (OSError, ValueError):
            continue
    return pids


def _close(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)


class ProcessBackend:
    """ProcessPort over real processes; `containment` is auto | cgroup | marker. Each
    generation's output goes through a pipe to the box's log keeper (runners/keepers/logkeeper.py),
    which caps and rotates its file."""

    def __init__(self, containment: str = "auto", cgroup_root: str | None = None,
                 log_max_bytes: int = LOG_MAX_BYTES, log_files: int = LOG_FILES,
                 logs: LogPipes | None = None, box: str = "",
                 credentials: Credentials | None = None,
                 on_release: Iterable[Callable[[str], None]] = ()) -> None:
        """`box`: the agent's id (its hosts' memory parents: runners/backend/cglimits.py);
        `credentials`: the state dir's; `on_release`: told each generation (uuid) proven
        gone and released (its NOTIFY_SOCKET, its credentials' directory: runners/wiring.py)."""
        self.log_max_bytes, self.log_files = log_max_bytes, log_files
        self.logs, self.credentials = logs, credentials
        self.base = detect_cgroup_base(containment, cgroup_root)
        self.mode = "cgroup" if self.base else "marker"
        # The hierarchy's mount, not the base's parent: under systemd the base is deeper.
        self._mount = (cgroup_root or cgroup2_mount()) if self.base else None
        self._handles: dict[int, subprocess.Popen[bytes] | Child] = {}
        self.limits = CgroupLimits(self.base, box)
        self.on_release: list[Callable[[str], None]] = [self.limits.drop, *on_release]
        self._lock = threading.Lock()
        self.stops = StopCommands()  # hosts' stop commands in flight (runners/backend/stopcmd.py)

    # -- handles ------------------------------------------------------------------------

    def oom_killed(self, ref: ProcRef) -> bool:
        return self.limits.oom_killed(ref.generation_uuid, ref.cgroup)

    def reap(self, pid: int | None = None) -> None:
        """Reap our own exited children (only those this agent instance spawned), or only
        `pid` (a check of one generation must not cost a wait on every child)."""
        with self._lock:
            if pid is not None:
                h = self._handles.get(pid)
                if h is not None:
                    h.poll()
                return
            for h in list(self._handles.values()):
                h.poll()

    def exit_status(self, pid: int) -> int | None:
        """Return code of a child we spawned and reaped, else None."""
        self.reap(pid)
        h = self._handles.get(pid)
        return None if h is None else h.returncode

    # -- ProcessPort --------------------------------------------------------------------

    def containment_for(self, generation_uuid: str) -> str | None:
        return os.path.join(self.base, generation_uuid) if self.base else None

    def spawn(self, spec: SpawnSpec) -> Spawned:
        if not spec.argv:
            raise SpawnError("spawn: empty argv")
        env = base_environment()
        who = users.for_spawn(spec, env, self.credentials)  # user, env files, credentials
        env = environment(spec, env)
        check_exec(spec.argv[0], env, spec.cwd)
        if spec.cwd and not os.path.isdir(spec.cwd):
            raise SpawnError(f"spawn {spec.argv[0]}: working dir {spec.cwd} does not exist")
        cg = spec.cgroup  # the caller chose (and recorded) it; honour exactly that
        target = self._target(spec, who)
        if cg:
            if not self._mount or os.path.commonpath([self._mount, cg]) != self._mount:
                raise SpawnError(f"spawn: cgroup {cg} is not under a usable cgroup2 mount", build_fault=False)
            try:
                os.makedirs(cg, exist_ok=True)
            except OSError as e:
                raise SpawnError(f"spawn: cannot create cgroup {cg}: {e.strerror}", build_fault=False) from e
        h, bell = self._start(spec, command(spec, cg, target), env, cg)
        try:
            # Not reaped yet, so the pid (zombie or not) cannot have been reused.
            ctime = psutil.Process(h.pid).create_time()
            if cg:
                self._await_join(h, cg, bell)
        finally:
            if bell is not None:
                os.close(bell)
        with self._lock:
            self._handles[h.pid] = h
        return Spawned(pid=h.pid, create_time=ctime)

    def _start(self, spec: SpawnSpec, argv: list[str], env: dict[str, str], cg: str | None
               ) -> tuple[subprocess.Popen[bytes] | Child, int | None]:
        """The process, its output on a pipe to the log keeper; a failure drops its cgroup.
        With a cgroup (not on shared listeners), also the read end of a pipe on the shim's
        stdin: the shim closes it once it is in its cgroup (launch.SHIM), so the join's
        wait blocks on that rather than polling /proc."""
        try:
            out = self._log_pipe(spec) if spec.log_path else subprocess.DEVNULL
        except OSError as e:
            self._drop_cgroup(cg)
            raise SpawnError(f"spawn: cannot open log {spec.log_path}: {e.strerror}", build_fault=False) from e
        bell, stdin = None, subprocess.DEVNULL
        try:
            if cg and not spec.listen_fds:  # in the try: a pipe refused (EMFILE) is a failed spawn
                bell, stdin = os.pipe()
            if spec.listen_fds:
                h: subprocess.Popen[bytes] | Child = spawn_with_fds(
                    argv, env, out, spec.listen_fds)
            else:
                h = subprocess.Popen(argv, stdin=stdin, stdout=out, stderr=out,
                                     cwd=spec.cwd, env=env, start_new_session=True,
                                     close_fds=True)
        except OSError as e:
            _close(bell)
            self._drop_cgroup(cg)
            name = errno.errorcode.get(e.errno or 0, "error")
            raise SpawnError(f"spawn {spec.argv[0]}: {e.strerror} ({name})") from e
        except ValueError as e:  # an env name or an argument execve cannot take: never starts
            _close(bell)
            self._drop_cgroup(cg)
            raise SpawnError(f"spawn {spec.argv[0]}: {e} (fix the host's args or env)") from e
        except BaseException:
            _close(bell)
            raise
        finally:
            if stdin != subprocess.DEVNULL:
                os.close(stdin)  # the shim's end: EOF once it has closed it (or ended)
            if out != subprocess.DEVNULL:
                os.close(out)  # the app holds it now; the writer sees EOF once it and its
                # descendants have all closed it
        return h, bell

    def _target(self, spec: SpawnSpec, who: users.RunAs | None) -> list[str]:
        """What the v2 join's shim execs; every shim runs as root: the limits' (v1 joins,
        rlimits), then setpriv to the app's user, then the app."""
        tier = (spec.host, spec.memory_tier_mb) if spec.memory_tier_mb else None
        return self.limits.wrap(spec.generation_uuid, spec.cgroup, spec.limits,
                                users.shim_target(who, spec), tier)

    def _log_pipe(self, spec: SpawnSpec) -> int:
        """The pipe end the app writes to; the box's log keeper reads the other end."""
        if spec.log_path is None:
            raise ValueError("a log pipe needs the generation's log path")
        if self.logs is None:  # the agent passes its own; <state>/logs/<host>/g<N>.log
            log = Path(spec.log_path)
            self.logs = LogPipes(log.parents[2] if log.parents[1].name == "logs"
                                 else log.parent)
        return self.logs.open(spec.generation_uuid, spec.log_path, self.log_max_bytes,
                              self.log_files)

    def _await_join(self, h: subprocess.Popen[bytes] | Child, cg: str, bell: int | None) -> None:
        """Bounded wait until the shim is in its cgroup. Read /proc/<pid>/cgroup, not
        cgroup.procs: an unreaped zombie still names its cgroup, so a build that joined and
        exited at once is not mistaken for a failed join. `bell`: the read end of the pipe
        the shim closes once it joined (or it ended), waited on first: one read of /proc
        then, not one a millisecond (at 1,000 wakes ~0.3 ms of CPU each on a loaded box)."""
        want = "0::/" + os.path.relpath(cg, self._mount)
        deadline = time.monotonic() + JOIN_TIMEOUT
        if bell is not None:
            poller = select.poll()
            poller.register(bell, select.POLLIN)
            poller.poll(JOIN_TIMEOUT * 1000)  # EOF (POLLHUP), or the bound: the loop decides

        def joined() -> bool:
            try:
                with open(f"/proc/{h.pid}/cgroup") as f:
                    lines = f.read().splitlines()
            except OSError:
                lines = []
            return any(line == want or line.startswith(want + " ") for line in lines)

        while True:
            if joined():
                return
            st = pid_status(h.pid)
            if st is None or st[1] == psutil.STATUS_ZOMBIE:
                # It may have joined, run the build and exited since the read above (this
                # thread paused in between): read again before calling the join failed.
                if joined():
                    return
                rc = h.wait()
                self._drop_cgroup(cg)
                raise SpawnError(f"spawn: could not join cgroup {cg} (shim exit {rc})", build_fault=False)
            if time.monotonic() > deadline:
                try:
                    os.killpg(h.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                h.wait()
                self._drop_cgroup(cg)
                raise SpawnError(f"spawn: did not join cgroup {cg} within {JOIN_TIMEOUT}s", build_fault=False)
            time.sleep(0.001)

    @staticmethod
    def _drop_cgroup(cg: str | None) -> None:
        if cg:
            try:
                os.rmdir(cg)
            except OSError:
                pass

    def leader_alive(self, ref: ProcRef) -> bool:
        self.reap(ref.pid)
        if ref.pid is None or ref.create_time is None:
            return False
        st = live_status(ref.pid)
        return st is not None and abs(st[0] - ref.create_time) <= CTIME_TOLERANCE

    def _marker_scan(self, generation_uuid: str, user: str | None = None) -> dict[int, float]:
        """Live processes of the generation's own uid carrying its marker: pid -> ctime."""
        found = carriers({generation_uuid}, users.marker_uids(user))
        return {pid: ctime for pid, (_, ctime) in found.items()}

    def descendants(self, refs: list[ProcRef]) -> dict[str, list[tuple[int, float]]]:
        return walk(refs)

    def live_members(self, ref: ProcRef) -> list[int]:
        self.reap(ref.pid)
        live = set(self._marker_scan(ref.generation_uuid, ref.user)) | set(live_known(ref))
        if ref.cgroup:
            live |= {pid for pid in cgroup_pids(ref.cgroup) if live_status(pid) is not None}
        return sorted(live)

    def terminate(self, ref: ProcRef, sig: int = signal.SIGTERM) -> None:
        if ref.pid is not None and ref.create_time is not None:
            signal_same(ref.pid, ref.create_time, sig)

    def run_stop_command(self, spec: SpawnSpec) -> None:
        self.stops.start(spec)

    def stop_command_running(self, generation_uuid: str) -> bool:
        return self.stops.running(generation_uuid)

    def stop_command_outcome(self, generation_uuid: str) -> str | None:
        return self.stops.outcome(generation_uuid)

    def terminate_all(self, ref: ProcRef, sig: int = signal.SIGTERM) -> None:
        pids: dict[int, float] = {**live_known(ref), **self._marker_scan(ref.generation_uuid, ref.user)}
        if ref.cgroup:
            for pid in cgroup_pids(ref.cgroup):
                if (st := live_status(pid)) is not None:
                    pids.setdefault(pid, st[0])
        for pid, ctime in pids.items():
            signal_same(pid, ctime, sig)

    def signal_leader(self, ref: ProcRef, signum: int) -> bool:
        if ref.pid is None or ref.create_time is None or not self.leader_alive(ref):
            return False
        signal_same(ref.pid, ref.create_time, signum)
        return True

    def kill_all(self, ref: ProcRef) -> None:
        kill_leader(ref.cgroup, ref.pid, ref.create_time)
        # Then every carrier of the marker and every recorded descendant (an escaped one
        # is in neither the cgroup nor the marker scan), each pid-verified.
        for pid, ctime in {**live_known(ref), **self._marker_scan(ref.generation_uuid, ref.user)}.items():
            signal_same(pid, ctime, signal.SIGKILL)
        self.reap(ref.pid)

    def _populated(self, cg: str) -> bool:
        try:
            with open(os.path.join(cg, "cgroup.events")) as f:
                for line in f:
                    k, _, v = line.partition(" ")
                    if k == "populated":
                        return v.strip() != "0"
        except FileNotFoundError:
            return False
        return True  # unreadable or no key: cannot prove empty

    def proven(self, ref: ProcRef) -> bool:
        if self.leader_alive(ref) or self.live_members(ref):
            return False
        return not (ref.cgroup and self._populated(ref.cgroup))

    def containments(self) -> list[str]:
        if not self.base:
            return []
        try:
            names = os.listdir(self.base)
        except OSError:
            return []
        # A generation's dir is named by its uuid; the base's own files (cgroup.procs, ...)
        # have dots. No isdir of each: 79,000 leftovers cost 0.4 s of stat calls.
        return [os.path.join(self.base, n) for n in names if len(n) == 36 and "." not in n]

    def release(self, ref: ProcRef) -> None:
        self._drop_cgroup(ref.cgroup)  # ENOENT: already gone; EBUSY etc.: leave it
        if ref.socket:  # proven gone: nothing listens on it any more
            try:
                os.unlink(ref.socket)
            except OSError:
                pass
        if self.logs is not None:
            self.logs.forget(ref.generation_uuid)
        self.stops.outcome(ref.generation_uuid)  # a stop command's handle, if still kept
        for hook in self.on_release:  # e.g. its NOTIFY_SOCKET is closed
            hook(ref.generation_uuid)
        if ref.pid is not None:
            with self._lock:
                h = self._handles.get(ref.pid)
                if h is not None and h.poll() is not None:
                    del self._handles[ref.pid]
