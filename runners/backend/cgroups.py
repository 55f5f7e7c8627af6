"""cgroup v2 containment: whether this box can give each generation a cgroup of its own
(`<cgroup2 mount>/vigil/<generation uuid>`, with cgroup.kill and cgroup.events)."""

from __future__ import annotations

import os
import uuid as uuidlib


def _cgroup2_mount() -> str | None:
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and parts[2] == "cgroup2":
                    # mount points escape blanks as octal (\040)
                    return parts[1].encode().decode("unicode_escape")
    except OSError:
        return None
    return None


def _private(base: str) -> None:
    """Not world-readable: its entries are named by the generations' uuids (the marker's
    value). A box that refuses the mode keeps working (the marker scan checks the uid)."""
    try:
        if os.stat(base).st_mode & 0o077:
            os.chmod(base, 0o700)
    except OSError:
        pass


def _probe(root: str | None) -> tuple[str | None, str]:
    """(base dir, reason it is unusable)."""
    mount = root or _cgroup2_mount()
    if not mount:
        return None, "no cgroup2 mount in /proc/self/mounts"
    base = os.path.join(mount, "vigil")
    probe = os.path.join(base, f".probe-{os.getpid()}-{uuidlib.uuid4().hex[:8]}")
    try:
        os.makedirs(base, exist_ok=True)
        # Not world-readable: its names are the generations' uuids (the marker's value).
        _private(base)
        os.mkdir(probe)
    except OSError as e:
        return None, f"cannot create cgroups under {base}: {e.strerror}"
    try:
        missing = [
            n
            for n in ("cgroup.kill", "cgroup.events")
            if not os.path.exists(os.path.join(probe, n))
        ]
    finally:
        try:
            os.rmdir(probe)
        except OSError:
            pass
    if missing:
        return (
            None,
            f"cgroup v2 at {mount} lacks {', '.join(missing)} (kernel too old or not delegated)",
        )
    return base, ""


def detect_cgroup_base(mode: str = "auto", cgroup_root: str | None = None) -> str | None:
    """The usable `<cgroup2 mount>/vigil` dir, or None. mode "cgroup" raises when unusable."""
    if mode not in ("auto", "cgroup", "marker"):
        raise ValueError(f"containment must be auto, cgroup or marker, not {mode!r}")
    if mode == "marker":
        return None
    base, reason = _probe(cgroup_root)
    if base is None and mode == "cgroup":
        raise RuntimeError(
            f"containment=cgroup unavailable: {reason}; use containment=marker or auto"
        )
    return base
