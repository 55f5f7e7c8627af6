"""Addresses of listeners on this box: their parts, whether something already listens on
one, who it is (psutil), and the one line that says why one cannot be bound."""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
from typing import cast


def split(address: str) -> tuple[str, object]:
    """'tcp:127.0.0.1:8080' -> ('tcp', ('127.0.0.1', 8080)); 'unix:/p' -> ('unix', '/p')."""
    kind, _, rest = address.partition(":")
    if kind == "unix":
        return kind, rest
    host, _, port = rest.rpartition(":")
    return kind, (host.strip("[]"), int(port))


def unix_in_use(path: str) -> bool:
    """Something listens on the unix socket at path. Only ECONNREFUSED (or the file gone)
    means a stale file: a listener whose backlog is full answers EAGAIN, and is in use."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except OSError:
            return True
    return True


def _listening(address: str) -> list[int]:
    """Pids of the processes listening on `address` (on a tcp port, any host that overlaps),
    as far as psutil can see them."""
    import psutil  # only a refusal needs it

    kind, where = split(address)
    found: list[int] = []
    try:
        conns = psutil.net_connections(kind=kind)
    except (psutil.Error, OSError):
        return found
    for c in conns:
        if c.pid is None:
            continue
        if kind == "unix":
            if c.laddr and os.path.realpath(str(c.laddr)) == os.path.realpath(str(where)):
                found.append(c.pid)
            continue
        host, port = cast(tuple[str, int], where)
        if c.status != psutil.CONN_LISTEN or not c.laddr or c.laddr.port != port:
            continue
        ip, mine = ipaddress.ip_address(c.laddr.ip), ipaddress.ip_address(host)
        if ip == mine or (ip.version == mine.version and (ip.is_unspecified or mine.is_unspecified)):
            found.append(c.pid)
    return list(dict.fromkeys(found))


def holder_of(address: str) -> str:
    """Who listens on `address`, for a person: 'pid 4242 (nginx)', or how to find out."""
    import psutil

    shown = []
    for pid in _listening(address)[:3]:
        try:
            shown.append(f"pid {pid} ({psutil.Process(pid).name()})")
        except psutil.Error:
            shown.append(f"pid {pid}")
    if shown:
        return ", ".join(shown)
    return "a process vigil cannot see (see `ss -lxp`)" if address.startswith("unix:") \
        else "a process vigil cannot see (see `ss -ltnp`)"


def why_unbindable(address: str, exc: OSError) -> str:
    """The one line that says why `address` cannot be bound, naming what holds it, and the fix."""
    kind, where = split(address)
    if isinstance(exc, PermissionError) and kind == "tcp":
        return (f"{address}: port {where[1]} is privileged and vigil may not bind it "  # type: ignore[index]
                "(no CAP_NET_BIND_SERVICE); run the agent as root or with that capability, "
                "or pick a port above 1023")
    if isinstance(exc, PermissionError):
        return f"{address}: vigil may not create {where} ({exc.strerror}); pick a writable path"
    if exc.errno == errno.EADDRINUSE and kind == "unix":
        return (f"{address}: something already listens on {where}: {holder_of(address)}; "
                "stop it or pick another path")
    if exc.errno == errno.EADDRINUSE:
        return (f"{address}: the port is in use by {holder_of(address)}; stop it or pick "
                "another port")
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"{address}: {where[0]} is not an address of this box; pick one it has"  # type: ignore[index]
    return f"{address}: cannot bind ({exc.strerror or exc}); pick another address"
