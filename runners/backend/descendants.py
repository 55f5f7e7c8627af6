"""Known descendants: what a walk of the process table saw below a generation's leader.

A generation's containment is its cgroup (where the box delegates one) or its session plus
the `VIGIL_GENERATION` marker. A descendant running as the agent's user (root, for a root
app) can leave both: it writes its pid into another cgroup's `cgroup.procs` and re-execs
with an empty environment. Neither the cgroup nor the marker scan finds it then. What
still names it is its parentage: until its parent exits it is a child of a process of the
generation, whatever cgroup or environment it has. So the agent walks the leader's
descendants (each process's children files, /proc/<pid>/task/<tid>/children; by ppid, in
one read of the process table, where the kernel has none) at spawn, after the health check,
at every ongoing probe and at the liveness backstop, and the workflows write what it sees
(pid + start time) to `known_processes`. The proof counts a recorded pid whose start time
still matches and that is not a zombie as a live process of the generation, and the kill
path signals it (pidfd-verified); `vigil check` flags one alive after its generation was
proven gone.

What remains uncatchable, honestly:
- a descendant that escapes *and* is reparented (its parent exits: a double fork, or its
  parent dies) between two walks, before any walk saw it: nothing on the box ties it to the
  generation any more (its ppid is 1 or a subreaper, its cgroup and environment are
  someone else's). The walks run at spawn, after health, at each probe (every
  `--health-interval`) and at the backstop (30 s), so the window is that long;
- a double fork faster than the walk at spawn (the leader forks, the child forks and
  exits at once): the same case, in the first milliseconds;
- a descendant that runs as another user (after setuid) and clears its environment: the
  walk still sees it while it has a parent in the generation, but the marker scan counts
  only the generation's own uid (so another user cannot pose as a generation);
- a pid recorded and then reused by an unrelated process started within CTIME_TOLERANCE
  of the recorded start time (the same margin every pid identity here gives up).
Making the agent a child subreaper (PR_SET_CHILD_SUBREAPER) would catch the reparented
ones that started below it, but the agent is restarted and its apps outlive it, so the
orphans of a previous agent would still go to PID 1; not done.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import psutil

from runners.base.pids import CTIME_TOLERANCE, pid_status, read_proc
from workflows.base.ports import ProcRef


def _alive(pid: int) -> tuple[float, str] | None:
    st = pid_status(pid)
    if st is None or st[1] == psutil.STATUS_ZOMBIE:
        return None
    return st


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
        st = _alive(r.pid)
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
                st = _alive(kid)
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
        st = _alive(pid)
        if st is not None and abs(st[0] - ctime) <= CTIME_TOLERANCE:
            out[pid] = ctime
    return out

