"""The parent memory limit port: a host's parent cgroup limited to its memory tier, raised
to twice the tier for an overlap and restored after it. On the cgroup v1 memory hierarchy
(these boxes: `<mount>/vigil/hosts/<box>/<host>`, the parent its generations' memory cgroups live
in, runners/backend/cglimits.py), else on cgroup v2's `memory.max` where the box delegates a
memory controller to vigil's cgroup base; neither: no limit at all (and then the swap
refuses the raise before it writes anything, so there is nothing to restore)."""

from __future__ import annotations

import os

from models.errors import BrokenInvariant
from runners.backend.cglimits import MB, parent_dir, v1_mounts


class CgroupMemoryLimit:
    def __init__(self, base: str | None, box: str = "", v1_memory: str | None = None) -> None:
        self.base = base
        self.box = box  # the agent's id, as the process backend's CgroupLimits has it
        self.v1 = v1_memory if v1_memory is not None else v1_mounts().get("memory")

    def _v2(self) -> bool:
        if not self.base:
            return False
        try:
            with open(os.path.join(self.base, "cgroup.controllers")) as f:
                return "memory" in f.read().split()
        except OSError:
            return False

    def available(self) -> bool:
        return bool(self.v1) or self._v2()

    def parent(self, host: str) -> str:
        """The directory whose limit this sets (v1 first, as the generations join it)."""
        if self.v1:
            return parent_dir(self.v1, self.box, host)
        if self.base is None:
            raise BrokenInvariant("no memory controller to limit a parent on")
        return os.path.join(self.base, host)

    def set_limit(self, host: str, megabytes: int) -> None:
        parent = self.parent(host)
        os.makedirs(parent, exist_ok=True)
        name = "memory.limit_in_bytes" if self.v1 else "memory.max"
        with open(os.path.join(parent, name), "w") as f:
            f.write(str(megabytes * MB))
