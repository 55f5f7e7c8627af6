"""Limits on a generation's cgroup (`host add --memory-max --cpu-quota --pids-max`) and its
rlimit (`--limit-nofile`).

Each limit lives on the controller of the same name: cgroup v2 where vigil's cgroup base
has it in `cgroup.subtree_control` (delegated), else the cgroup v1 hierarchy of that name
where one is mounted writable (hybrid and legacy boxes: `<mount>/vigil/<uuid>`). Neither:
the limit is refused at `host add`/`apply` naming what is missing, and a start that meets
such a box (the host was added elsewhere) fails without running anything.

The join is the shim's, as root, before the user switch and the exec: `echo $$` into each
v1 `cgroup.procs`, `ulimit -n` for the rlimit, then exec what follows (setpriv or the app).
An app killed by the kernel's OOM killer is told apart by its cgroup's `oom_kill` counter
(v1 `memory.oom_control`, v2 `memory.events`), read before its cgroups are removed.
"""

from __future__ import annotations

import os

from workflows.base.ports import SpawnError

CONTROLLERS = {"memory_max": "memory", "cpu_quota": "cpu", "pids_max": "pids"}
PERIOD_US = 100_000  # the CFS period the quota is a share of
# Joins every cgroup.procs named before `--`, sets the open-files limit when not "-",
# then execs the rest. Exit 121: a join the agent prepared could not be made.
_SHIM = ('n=$1; shift; while [ "$1" != -- ]; do echo $$ > "$1" || exit 121; shift; done; '
         'shift; [ "$n" = - ] || ulimit -n "$n" || exit 121; exec "$@"')


def _v1_mounts() -> dict[str, str]:
    out: dict[str, str] = {}
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 4 or parts[2] != "cgroup":
                    continue
                opts = parts[3].split(",")
                for c in CONTROLLERS.values():
                    if c in opts and c not in out and os.access(parts[1], os.W_OK):
                        out[c] = parts[1].encode().decode("unicode_escape")
    except OSError:
        pass
    return out


def _v2_delegated(base: str | None) -> set[str]:
    if not base:
        return set()
    try:
        with open(os.path.join(base, "cgroup.subtree_control")) as f:
            return set(f.read().split())
    except OSError:
        return set()


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


class CgroupLimits:
    """Which controller enforces each limit on this box, and the per-generation cgroups."""

    def __init__(self, v2_base: str | None) -> None:
        self.v2 = _v2_delegated(v2_base)
        self.v1 = _v1_mounts()

    def where(self, controller: str) -> str | None:
        """"cgroup v2", "cgroup v1" or None (the box cannot enforce it)."""
        if controller in self.v2:
            return "cgroup v2"
        return "cgroup v1" if controller in self.v1 else None

    def describe(self) -> dict[str, str]:
        return {c: self.where(c) or "none" for c in CONTROLLERS.values()}

    def missing(self, limits: dict[str, int]) -> list[str]:
        """The limits asked for that this box cannot enforce, each with what it lacks."""
        return [f"{k.replace('_', '-')} needs the {CONTROLLERS[k]} controller (no cgroup v2 "
                f"delegation of it and no writable cgroup v1 {CONTROLLERS[k]} mount)"
                for k in limits if k in CONTROLLERS and self.where(CONTROLLERS[k]) is None]

    def _v1_dir(self, controller: str, uuid: str) -> str:
        return os.path.join(self.v1[controller], "vigil", uuid)

    def prepare(self, uuid: str, cgroup: str | None, limits: dict[str, int]) -> list[str]:
        """Before the spawn: each limit written on its controller; returns the v1
        `cgroup.procs` files the shim joins. Raises ValueError naming what is missing,
        OSError when the box refuses a write."""
        lacking = self.missing(limits)
        if lacking:
            raise ValueError("; ".join(lacking))
        joins: list[str] = []
        for key, value in limits.items():
            c = CONTROLLERS.get(key)
            if c is None:
                continue
            if c in self.v2 and cgroup:
                d = cgroup
            else:
                d = self._v1_dir(c, uuid)
                joins.append(os.path.join(d, "cgroup.procs"))
            os.makedirs(d, exist_ok=True)
            self._set(d, key, value, v2=d == cgroup)
        return joins

    @staticmethod
    def _set(d: str, key: str, value: int, v2: bool) -> None:
        if key == "memory_max":
            if v2:
                _write(os.path.join(d, "memory.max"), str(value))
                return
            _write(os.path.join(d, "memory.limit_in_bytes"), str(value))
            swap = os.path.join(d, "memory.memsw.limit_in_bytes")
            if os.path.exists(swap):  # swap counts too: the limit is one of memory
                _write(swap, str(value))
        elif key == "cpu_quota":
            quota = value * PERIOD_US // 100
            if v2:
                _write(os.path.join(d, "cpu.max"), f"{quota} {PERIOD_US}")
                return
            _write(os.path.join(d, "cpu.cfs_period_us"), str(PERIOD_US))
            _write(os.path.join(d, "cpu.cfs_quota_us"), str(quota))
        elif key == "pids_max":
            _write(os.path.join(d, "pids.max"), str(value))

    def wrap(self, uuid: str, cgroup: str | None, limits: dict[str, int],
             target: list[str]) -> list[str]:
        """`target` behind the limit shim, or as it is when no limit is set."""
        if not limits:
            return target
        try:
            joins = self.prepare(uuid, cgroup, limits)
        except (OSError, ValueError) as exc:  # the box's fault, never the build's
            self.drop(uuid)
            raise SpawnError(f"spawn: limits: {exc}", build_fault=False) from exc
        nofile = str(limits["limit_nofile"]) if "limit_nofile" in limits else "-"
        return ["/bin/sh", "-c", _SHIM, "vigil-limits", nofile, *joins, "--", *target]

    def oom_killed(self, uuid: str, cgroup: str | None) -> bool:
        """Did the kernel's OOM killer kill a process of this generation?"""
        files = [os.path.join(cgroup, "memory.events")] if cgroup and "memory" in self.v2 else []
        if "memory" in self.v1:
            files.append(os.path.join(self._v1_dir("memory", uuid), "memory.oom_control"))
        for path in files:
            try:
                with open(path) as f:
                    for line in f:
                        k, _, v = line.partition(" ")
                        if k == "oom_kill" and int(v) > 0:
                            return True
            except (OSError, ValueError):
                continue
        return False

    def drop(self, uuid: str) -> None:
        """After the proof: its v1 cgroups removed (ENOENT: gone; EBUSY: left for later)."""
        for c in self.v1:
            try:
                os.rmdir(self._v1_dir(c, uuid))
            except OSError:
                pass
