"""The parent memory limit port: cgroup v2 `memory.max` where the box has a memory
controller delegated to vigil's cgroup base, otherwise no limit at all (and then the
swap refuses the raise before it writes anything, so there is nothing to restore)."""

from __future__ import annotations

import os

from models.errors import BrokenInvariant


class CgroupMemoryLimit:
    def __init__(self, base: str | None) -> None:
        self.base = base

    def available(self) -> bool:
        if not self.base:
            return False
        try:
            with open(os.path.join(self.base, "cgroup.controllers")) as f:
                return "memory" in f.read().split()
        except OSError:
            return False

    def set_limit(self, host: str, megabytes: int) -> None:
        if self.base is None:
            raise BrokenInvariant("self.base is missing")
        parent = os.path.join(self.base, host)
        os.makedirs(parent, exist_ok=True)
        with open(os.path.join(parent, "memory.max"), "w") as f:
            f.write(str(megabytes * 1024 * 1024))
