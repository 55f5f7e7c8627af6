"""cgroup v2 containment: whether this box can give each generation a cgroup of its own
(with cgroup.kill and cgroup.events), and where: `<cgroup2 mount>/vigil/<generation uuid>`,
or under systemd the subtree its unit delegates (`Delegate=yes`): the agent in a leaf of its
own, `<unit's cgroup>/agent.leaf`, each generation's cgroup beside it (cgroup v2 lets no
process live in an inner node once controllers are enabled below it).

The agent knows it runs under systemd by `$INVOCATION_ID`, which systemd sets for every
unit it starts, and its own cgroup (/proc/self/cgroup) not being the hierarchy's root."""

from __future__ import annotations

import logging
import os
import uuid as uuidlib

log = logging.getLogger("vigil.cgroups")
AGENT_LEAF = "agent.leaf"  # the agent's own leaf in a delegated subtree: no host is named so


def cgroup2_mount() -> str | None:
    """Where the cgroup v2 hierarchy is mounted (/sys/fs/cgroup, or .../unified on a
    hybrid box), or None."""
    return _cgroup2_mount()


def _own_cgroup(mount: str) -> str | None:
    """This process's cgroup v2 directory (the `0::` line of /proc/self/cgroup)."""
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                if line.startswith("0::"):
                    rel = line[3:].strip().removesuffix(" (deleted)")
                    return os.path.normpath(os.path.join(mount, rel.lstrip("/")))
    except OSError:
        return None
    return None


def delegated_subtree(mount: str | None = None) -> str | None:
    """Under systemd, the cgroup its unit gave this process (its parent when this process
    is already in the agent's leaf); None elsewhere (the `vigil/` base at the root)."""
    mount = mount or _cgroup2_mount()
    if not mount or not os.environ.get("INVOCATION_ID"):
        return None
    own = _own_cgroup(mount)
    if own is None or os.path.normpath(own) == os.path.normpath(mount):
        return None
    return os.path.dirname(own) if os.path.basename(own) == AGENT_LEAF else own


def enter_agent_leaf() -> str | None:
    """The agent moves itself (and what it starts later: the keepers) into the leaf of its
    delegated subtree, before anything is spawned; returns the subtree, or None when there
    is none or the move is refused (then containment is probed as on any box)."""
    subtree = delegated_subtree()
    if subtree is None:
        return None
    leaf = os.path.join(subtree, AGENT_LEAF)
    try:
        os.makedirs(leaf, exist_ok=True)
        with open(os.path.join(leaf, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    except OSError as e:
        log.warning("cannot enter the delegated cgroup leaf=%s error=%r", leaf, e)
        return None
    log.info("cgroups under systemd's delegation subtree=%s agent_leaf=%s", subtree, leaf)
    return subtree


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
    # A given root (tests, an explicit mount) is used as is; else systemd's subtree first.
    base = (None if root else delegated_subtree(mount)) or os.path.join(mount, "vigil")
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
    """The usable cgroup base (systemd's delegated subtree, else `<cgroup2 mount>/vigil`),
    or None. mode "cgroup" raises when unusable."""
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
