"""Limits on a generation's cgroup (`--memory-max --cpu-quota --pids-max`) and its rlimits
(`--limit-nofile`, `--limit-core`: the two of systemd's Limit*= an app server needs).

Each cgroup limit lives on the controller of its name: cgroup v2 where vigil's base has it in
`cgroup.subtree_control`, else that v1 hierarchy where mounted writable
(`<mount>/vigil/<uuid>`); neither: refused at `host add`/`apply`, and a start on such a box
fails before running anything. A host with a memory tier (`memory_tier_mb`) has a v1 memory
parent of its own, `<mount>/vigil/hosts/<box>/<host>` limited to the tier, so an overlap's
raise to twice the tier (runners/backend/limits.py) holds both generations.

The shim joins, as root before the user switch: `echo $$` into each v1 `cgroup.procs`,
`ulimit -n`/`-c`, then exec. An OOM kill is told by the cgroup's `oom_kill` counter (v1
`memory.oom_control`, v2 `memory.events`), read before its cgroups are removed.
"""

from __future__ import annotations

import os

from workflows.base.ports import SpawnError

CONTROLLERS = {"memory_max": "memory", "cpu_quota": "cpu", "pids_max": "pids"}
PERIOD_US = 100_000  # the CFS period the quota is a share of
PARENTS = "hosts"  # <v1 memory mount>/vigil/hosts/<box>/<host>: a tiered host's parent
MB = 1024 * 1024


def parent_dir(mount: str, box: str, host: str) -> str:
    """A tiered host's parent on the v1 memory hierarchy."""
    return os.path.join(mount, "vigil", PARENTS, box, host)
# Joins every cgroup.procs named before `--`, sets the open-files limit when not "-",
# then execs the rest. Exit 121: a join the agent prepared could not be made.
# The core limit is given in 512-byte blocks: the unit of `ulimit -c` in dash and in any
# POSIX-mode sh.
_SHIM = ('n=$1; c=$2; shift 2; while [ "$1" != -- ]; do echo $$ > "$1" || exit 121; shift; '
         'done; shift; [ "$n" = - ] || ulimit -n "$n" || exit 121; '
         '[ "$c" = - ] || ulimit -c "$c" || exit 121; exec "$@"')


def v1_mounts() -> dict[str, str]:
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

    def __init__(self, v2_base: str | None, box: str = "") -> None:
        self.v2 = _v2_delegated(v2_base)
        self.v1 = v1_mounts()
        self.box = box  # the agent's id: whose hosts' parents these are

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

    def _v1_dir(self, controller: str, uuid: str, parent: str | None = None) -> str:
        if controller == "memory" and parent:
            return os.path.join(parent_dir(self.v1["memory"], self.box, parent), uuid)
        return os.path.join(self.v1[controller], "vigil", uuid)

    def _v1_dirs(self, controller: str, uuid: str) -> list[str]:
        """Where a generation's v1 cgroup of this controller may be (its host unknown)."""
        dirs = [self._v1_dir(controller, uuid)]
        if controller == "memory":
            parents = os.path.join(self.v1["memory"], "vigil", PARENTS, self.box)
            try:
                dirs += [os.path.join(parents, h, uuid) for h in os.listdir(parents)]
            except OSError:
                pass
        return dirs

    def tiered(self, cgroup: str | None, tier: tuple[str, int] | None) -> bool:
        """Whether this generation joins its host's v1 memory parent (a tier, and a box
        whose memory controller is v1's: a v2 one would be the cgroup itself)."""
        return tier is not None and "memory" in self.v1 and not ("memory" in self.v2 and cgroup)

    def _parent(self, host: str, tier_mb: int) -> None:
        """The host's parent, made with the tier as its limit (an existing one keeps its
        limit: an overlap may have raised it)."""
        d = parent_dir(self.v1["memory"], self.box, host)
        if not os.path.isdir(d):
            os.makedirs(d, exist_ok=True)
            _write(os.path.join(d, "memory.limit_in_bytes"), str(tier_mb * MB))

    def prepare(self, uuid: str, cgroup: str | None, limits: dict[str, int],
                tier: tuple[str, int] | None = None) -> list[str]:
        """Before the spawn: each limit written on its controller; returns the v1
        `cgroup.procs` files the shim joins. Raises ValueError naming what is missing,
        OSError when the box refuses a write."""
        lacking = self.missing(limits)
        if lacking:
            raise ValueError("; ".join(lacking))
        parent = tier[0] if tier is not None and self.tiered(cgroup, tier) else None
        joins: list[str] = []
        if tier is not None and parent is not None:
            d = self._v1_dir("memory", uuid, parent)
            try:
                self._parent(*tier)
                os.mkdir(d)
            except FileNotFoundError:  # the last one out removed the parent just then
                self._parent(*tier)
                os.mkdir(d)
            except FileExistsError:
                pass
            joins.append(os.path.join(d, "cgroup.procs"))
        for key, value in limits.items():
            c = CONTROLLERS.get(key)
            if c is None:
                continue
            if c in self.v2 and cgroup:
                d = cgroup
            else:
                d = self._v1_dir(c, uuid, parent)
                if os.path.join(d, "cgroup.procs") not in joins:
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
             target: list[str], tier: tuple[str, int] | None = None) -> list[str]:
        """`target` behind the limit shim, or as it is when no limit is set and no
        parent is joined. `tier`: (host, MB) of a host with a memory tier."""
        if not limits and not self.tiered(cgroup, tier):
            return target
        try:
            joins = self.prepare(uuid, cgroup, limits, tier)
        except (OSError, ValueError) as exc:  # the box's fault, never the build's
            self.drop(uuid)
            raise SpawnError(f"spawn: limits: {exc}", build_fault=False) from exc
        nofile = str(limits["limit_nofile"]) if "limit_nofile" in limits else "-"
        core = str(-(-limits["limit_core"] // 512)) if "limit_core" in limits else "-"
        return ["/bin/sh", "-c", _SHIM, "vigil-limits", nofile, core, *joins, "--", *target]

    def oom_killed(self, uuid: str, cgroup: str | None) -> bool:
        """Did the kernel's OOM killer kill a process of this generation?"""
        files = [os.path.join(cgroup, "memory.events")] if cgroup and "memory" in self.v2 else []
        if "memory" in self.v1:
            files += [os.path.join(d, "memory.oom_control") for d in self._v1_dirs("memory", uuid)]
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
            for d in self._v1_dirs(c, uuid):
                try:
                    os.rmdir(d)
                except OSError:
                    continue
                if c == "memory" and d != self._v1_dir(c, uuid):
                    self._drop_parent(os.path.dirname(d))

    @staticmethod
    def _drop_parent(parent: str) -> None:
        """A tiered host's parent with no generation left in it, and its box's directory
        once empty (EBUSY/ENOTEMPTY: still in use; the next start makes it again)."""
        for d in (parent, os.path.dirname(parent)):
            try:
                os.rmdir(d)
            except OSError:
                return
