"""Instances: a host on held listeners runs `instances` processes of one build, each a
generation in its own slot (0..instances-1) with its own pid, proof, logs and restarts.
The store holds at most one current generation per host and slot (a partial unique
index); a host of one instance has only slot 0 and behaves as before slots existed."""

from __future__ import annotations

from typing import Any

from models.errors import BadInput
from models.states import HostKind

MAX_INSTANCES = 64  # more processes of one app than that is a fork bomb, not a deploy


def check_instances(n: Any, listens: list[Any], kind: HostKind, label: str = "--instances",
                    tier: int | None = None) -> int:
    """A count of instances the host can run: more than one shares held listeners (each
    process of its own would bind the address again and fail), and only an instance host
    has them."""
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_INSTANCES:
        raise BadInput(f"{label} must be a count from 1 to {MAX_INSTANCES}, not {n!r}",
                       f"give {label} a whole number, e.g. 4")
    if n > 1 and kind is not HostKind.instance:
        raise BadInput(f"{label} {n}: a {kind.value} host runs one process",
                       "run instances of a host of kind instance with --listen, or leave it at 1")
    if n > 1 and not listens:
        raise BadInput(f"{label} {n} needs held listeners: its processes share the host's "
                       "listening sockets, and it has none",
                       "add --listen (e.g. --listen http=tcp:127.0.0.1:8080), or leave "
                       f"{label} at 1")
    if n > 1 and tier:
        # One parent limit per host, sized for one generation and its overlap successor.
        raise BadInput(f"{label} {n}: a host with a memory tier runs one instance (its parent "
                       "limit is sized for one)", "drop memory_tier_mb, or leave it at 1")
    return n
