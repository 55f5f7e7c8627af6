"""Known descendants: what a walk of the process table saw below a generation's leader.

A descendant running as the agent's user can leave both the cgroup (writing another
`cgroup.procs`) and the `VIGIL_GENERATION` marker (re-exec with an empty environment);
until its parent exits, its parentage still names it. So the agent walks the leader's
descendants (/proc/<pid>/task/<tid>/children, else by ppid in one read of the process table)
at spawn, after health, at each probe and at the liveness backstop, and the workflows record
them (pid + start time) in `known_processes`: the proof counts a live matching one, the kill
path signals it (pidfd-verified), `vigil check` flags one alive after its generation's proof.

Still uncatchable: a descendant that escapes *and* is reparented before any walk saw it (a
double fork between two walks, or faster than the walk at spawn); one of another user that
clears its environment once it has no parent in the generation (the marker scan counts the
generation's uid only); a recorded pid reused within CTIME_TOLERANCE of its start time. A
child subreaper would not help: the agent restarts and its apps' orphans go to PID 1.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import psutil

from runners.base.pids import CTIME_TOLERANCE, live_status, read_proc
from workflows.base.ports import ProcRef


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process, one read of /proc/<pid>/stat each (psutil as the
    fallback where there is no /proc)."""
    try:
        names = os.listdir("/proc")
    except OSError:
        return {p.pid: p.info["ppid"] for p in psutil.process_iter(["ppid"])
                if p.info["ppid"] is not None}
    out: dict[int, int] = {}
    for name in names:
        if not name.isdigit():
            continue
        try:
            data = read_proc(f"/proc/{name}/stat", 4096)
            out[int(name)] = int(data[data.rindex(b")") + 2:].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
    return out


def _children(pid: int) -> list[int] | None:
    """The direct children of `pid`, from every thread's /proc/<pid>/task/<tid>/children (a
    child is listed under the thread that forked it): two or three reads, not one per
    process on the box. None: this kernel has no such file (CONFIG_PROC_CHILDREN off)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return []  # gone meanwhile
    except OSError:
        return None
    out: list[int] = []
    for tid in tids:
        try:
            out += [int(x) for x in read_proc(f"/proc/{pid}/task/{tid}/children").split()]
        except FileNotFoundError:
            if os.path.isdir(f"/proc/{pid}/task/{tid}"):
                return None  # the thread is there, its children file is not
        except (OSError, ValueError):
            continue  # the thread ended meanwhile
    return out


def _by_scan() -> Callable[[int], list[int]]:
    """Children by ppid, from one read of every process's stat (the kernel has no
    children files): built once per walk, shared by every leader of it."""
    children: dict[int, list[int]] = {}
    for pid, ppid in _parents().items():
        children.setdefault(ppid, []).append(pid)
    return lambda pid: children.get(pid, [])


def walk(refs: list[ProcRef]) -> dict[str, list[tuple[int, float]]]:
    """Live descendants (pid, start time) of each live leader, by generation uuid. A
    child is never older than its parent: an older process at a child's pid is another."""
    leaders = {}
    for r in refs:
        if r.pid is None or r.create_time is None:
            continue
        st = live_status(r.pid)
        if st is not None and abs(st[0] - r.create_time) <= CTIME_TOLERANCE:
            leaders[r.generation_uuid] = (r.pid, st[0])
    if not leaders:
        return {}
    scan: Callable[[int], list[int]] | None = None
    found: dict[str, list[tuple[int, float]]] = {}
    for uuid, (leader, born) in leaders.items():
        seen: list[tuple[int, float]] = []
        todo = [leader]
        while todo:
            pid = todo.pop()
            kids = None if scan is not None else _children(pid)
            if kids is None:
                scan = scan or _by_scan()
                kids = scan(pid)
            for kid in kids:
                st = live_status(kid)
                if st is None or st[0] < born - CTIME_TOLERANCE:
                    continue
                seen.append((kid, st[0]))
                todo.append(kid)
        if seen:
            found[uuid] = seen
    return found


def live_known(ref: ProcRef) -> dict[int, float]:
    """The recorded descendants still alive as the same process: pid -> start time."""
    out: dict[int, float] = {}
    for pid, ctime in ref.known:
        st = live_status(pid)
        if st is not None and abs(st[0] - ctime) <= CTIME_TOLERANCE:
            out[pid] = ctime
    return out

