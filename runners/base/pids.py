"""Process identity on the box: a pid and its start time name one process, so a reused pid is
never mistaken for it. Read straight from /proc (psutil as the fallback)."""

from __future__ import annotations

import os
import signal
from collections.abc import Collection

import psutil

MARKER = "VIGIL_GENERATION"  # the env marker every process of a generation inherits
# A process's start time is its start in ticks since boot plus the boot time, which the
# kernel derives from the wall clock in whole seconds (/proc/stat btime): while the clock
# is being slewed that second can flip between two reads, moving every start time by 1 s.
# Seen on these machines (every recovery test of a 7-minute window failed at 0.05 s).
# A pid reused within a second by another process is what the margin gives up.
CTIME_TOLERANCE = 1.05

_TICKS = os.sysconf("SC_CLK_TCK")
_BOOT: list[float] = []  # boot time, read once (psutil.Process re-reads /proc/stat each time)
_STATES = {"R": psutil.STATUS_RUNNING, "S": psutil.STATUS_SLEEPING, "D": psutil.STATUS_DISK_SLEEP,
           "T": psutil.STATUS_STOPPED, "t": psutil.STATUS_TRACING_STOP, "Z": psutil.STATUS_ZOMBIE,
           "X": psutil.STATUS_DEAD, "x": psutil.STATUS_DEAD, "W": psutil.STATUS_WAKING,
           "I": psutil.STATUS_IDLE, "P": psutil.STATUS_PARKED}


def read_proc(path: str, most: int | None = None) -> bytes:
    """A /proc file's text by os.open and os.read (half the cost of open(): no buffered
    file object, and the liveness backstop reads two of these for every host): read to
    its end, or one read of at most `most` bytes (a stat line is a single record). OSError."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if most is not None:
            return os.read(fd, most)
        parts = [os.read(fd, 1 << 16)]
        while parts[-1]:
            parts.append(os.read(fd, 1 << 16))
        return b"".join(parts)
    finally:
        os.close(fd)


def pid_status(pid: int) -> tuple[float, str] | None:
    """(create_time, status) or None when gone. One read of /proc/<pid>/stat, the start time
    computed as psutil does (start ticks / CLK_TCK + boot time): the liveness sweep checks
    every current generation every second, and psutil.Process costs several /proc reads."""
    try:
        data = read_proc(f"/proc/{pid}/stat", 4096)  # about 300 bytes; comm is at most 64
        fields = data[data.rindex(b")") + 2:].split()  # after "pid (comm) "
        if not _BOOT:
            _BOOT.append(psutil.boot_time())
        state = fields[0].decode()
        return int(fields[19]) / _TICKS + _BOOT[0], _STATES.get(state, state)
    except (FileNotFoundError, ProcessLookupError):
        return None
    except (OSError, ValueError, IndexError):
        pass  # no /proc here: ask psutil
    try:
        p = psutil.Process(pid)
        return p.create_time(), p.status()
    except psutil.Error:
        return None


def live_status(pid: int) -> tuple[float, str] | None:
    """pid_status, None for a zombie too (PID 1 here does not reap orphans)."""
    st = pid_status(pid)
    return None if st is None or st[1] in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD) else st


def carriers(uuids: Collection[str], uids: Collection[int] | None = None
             ) -> dict[int, tuple[str, float]]:
    """Live processes but this one carrying the marker of one of `uuids`, of one of `uids`
    when given (another user may set a marker in a process of theirs and must not pose as
    a generation): pid -> (uuid, create_time), in one scan of the process table."""
    found: dict[int, tuple[str, float]] = {}
    me = os.getpid()
    for p in psutil.process_iter():
        try:
            if p.pid == me or (uids is not None and p.uids().real not in uids):
                continue
            mark = p.environ().get(MARKER)
            if mark in uuids and p.status() != psutil.STATUS_ZOMBIE:
                found[p.pid] = (mark, p.create_time())
        except (psutil.Error, OSError):  # gone meanwhile, not ours to read
            continue
    return found


def matches(pid: int | None, ctime: float | None) -> bool:
    if pid is None or ctime is None:
        return False
    st = pid_status(pid)
    return st is not None and abs(st[0] - ctime) <= CTIME_TOLERANCE


def signal_same(pid: int, ctime: float, sig: int) -> None:
    """Signal pid only if it is still the process started at ctime (pidfd closes the race)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except OSError:
        fd = -1  # no pidfd support: fall back to check-then-kill
    try:
        if not matches(pid, ctime):
            return
        if fd >= 0:
            signal.pidfd_send_signal(fd, sig)
        else:
            os.kill(pid, sig)
    except ProcessLookupError:
        pass
    finally:
        if fd >= 0:
            os.close(fd)


def kill_leader(cgroup: str | None, pid: int | None, ctime: float | None) -> None:
    """SIGKILL a generation's cgroup (cgroup.kill) and its leader's session group, then the
    leader, each pid-verified: the instant part of a kill (the marker carriers come next)."""
    if cgroup:
        try:
            with open(os.path.join(cgroup, "cgroup.kill"), "w") as f:
                f.write("1")
        except OSError:
            pass
    if pid is not None and ctime is not None:
        if matches(pid, ctime):
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        signal_same(pid, ctime, signal.SIGKILL)
