"""Starting the agent's helpers and ending them: each in its own session (it outlives the
agent), started from the checkout's root, killed only by pid and start time."""

from __future__ import annotations

import os
import select
import signal
import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])  # the checkout: `-m runners...` finds it
BOUND = 2.0  # seconds a running helper has to answer one exchange (or to die when killed)


def spawn(module: str, state_dir: Path, log_name: str, *, site: bool = False,
          standby: bool = False) -> int:
    """Start a helper in its own session (it outlives the agent), its output appended to
    `<state>/<log_name>`; returns its pid. Without `site` it starts as `python -S` (the
    standard library only: the fastest start)."""
    env = {k: v for k, v in os.environ.items() if k != "VIGIL_CRASH_AT"}
    env["PYTHONPATH"] = ROOT
    log_path = state_dir / log_name
    log_path.parent.mkdir(mode=0o700, exist_ok=True)
    out = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    argv = [sys.executable, *([] if site else ["-S"]), "-m", module, str(state_dir),
            *(["--standby"] if standby else [])]
    try:  # posix_spawn: no Popen handle to outlive (the helper outlives this process)
        return os.posix_spawn(sys.executable, argv, env,
                              file_actions=[(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                                            (os.POSIX_SPAWN_DUP2, out, 1),
                                            (os.POSIX_SPAWN_DUP2, out, 2)],
                              setsid=True)
    finally:
        os.close(out)


def reap(pids: list[int]) -> None:
    """Collect the helpers this process started that have ended (they are its children)."""
    for pid in list(pids):
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done = pid
        if done:
            pids.remove(pid)


def start_time(pid: int) -> float | None:
    from runners.base.pids import pid_status  # psutil's fallback stays out of -S helpers

    st = pid_status(pid)
    return None if st is None else st[0]


def kill_and_wait(pid: int, ctime: float, bound: float = BOUND) -> bool:
    """SIGKILL `pid` if it is still the process started at `ctime`; True once it is gone
    (within `bound`)."""
    from runners.base.pids import CTIME_TOLERANCE, pid_status

    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        st = pid_status(pid)
        if st is None or abs(st[0] - ctime) > CTIME_TOLERANCE:
            return True  # that process is already gone; the pid names another
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        return bool(poller.poll(bound * 1000))
    except ProcessLookupError:
        return True
    finally:
        os.close(pidfd)
