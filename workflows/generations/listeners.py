"""Listeners: listening sockets vigil opens once for a host and every generation inherits
(socket activation, the sd_listen_fds protocol: fds from 3, LISTEN_FDS, LISTEN_PID,
LISTEN_FDNAMES). Connections wait in the kernel's backlog while a generation starts, so
a hold deploy or a crash restart refuses none.

A listener row moves new -> opening -> held (inode recorded) on the first spawn that needs
it: the intent is written before the bind, and the socket is with the fd holder
(runners/keepers/fdholder.py) before it is written held. On start the agent takes every held
socket back from the holder, or, if the holder died too, from a live process of the host
that inherited it (the same inode); if none has it (two deaths at once; a socket of an
earlier boot of the box), the listener is `lost`, with why. A lost listener does not keep
its host down: the host's next start binds the address again and records
`listener_reopened` (with why); the row keeps that why, so `vigil status` and `vigil check`
say it was reopened. Only an address that cannot be bound refuses (the agent's side names
what holds it). `vigil host reopen` stays as an explicit verb.
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass

from sqlalchemy import select, text
from sqlalchemy.orm import Session

from models.errors import BadInput, present
from models.states import LIVE_GEN, HostKind, ListenerState
from models.store import emit, utcnow
from models.tables import Generation, Host, Listener
from models.transition import Fence, Unfenced, move
from workflows.base.context import Context
from workflows.base.crash import crashpoint, define
from workflows.base.lookups import get_host
from workflows.base.ports import SpawnError
from workflows.base.waivers import OPERATOR
from workflows.generations.ending import ref_of
from workflows.generations.probes import OWN_SOCKET, READY_KINDS, parse_probe, probe_of
from workflows.generations.shutdown import closed
from workflows.leases import placement

OPENING = define("listen.opening", "a host's listeners are written opening; nothing bound yet")
BOUND = define("listen.bound", "a listener is bound and listening in the agent; the fd holder "
               "does not have it yet")
HANDED = define("listen.handed", "the fd holder has the listener; the store does not say held yet")
HELD = define("listen.held", "the listeners are written held with their inodes; nothing spawned")
RECOVERED = define("listen.recovered", "on start, the listeners were matched with what the fd "
                   "holder and live processes keep, and the store written (held, lost, reopened)")

OWN_BOX = Unfenced("this box's own sockets on start, before any lease: each row is guarded "
                   "by its state and by the box that opened it")

NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
FIRST_FD = 3  # SD_LISTEN_FDS_START


@dataclass(frozen=True)
class Listen:
    name: str
    address: str  # canonical: tcp:HOST:PORT (an IPv6 host in brackets) or unix:/PATH


def parse_listen(text: str, default_name: str, label: str = "--listen ") -> Listen:
    """`[NAME=]tcp:HOST:PORT` or `[NAME=]unix:/PATH`; raises BadInput."""
    name, sep, spec = text.partition("=")
    if not sep or ":" in name:
        name, spec = default_name, text
    if not NAME.fullmatch(name):
        raise BadInput(f"{label}{text!r}: name {name!r} is not 1-64 letters, digits, '_', '.', '-'",
                       "write e.g. http=tcp:127.0.0.1:8080")
    kind, _, rest = spec.partition(":")
    if kind == "unix":
        if not rest.startswith("/") or "\0" in rest:
            raise BadInput(f"{label}{text!r}: a unix listener takes an absolute path",
                           "write e.g. unix:/run/app/http.sock")
        path = "/" + os.path.normpath(rest).lstrip("/")  # POSIX keeps a leading '//'
        if len(os.fsencode(path)) > 107:
            raise BadInput(f"{label}{text!r}: the path is longer than 107 bytes, the most a unix "
                           "socket takes", "pick a shorter path")
        return Listen(name, f"unix:{path}")
    if kind == "tcp":
        host, _, port = rest.rpartition(":")
        try:
            ip = ipaddress.ip_address(host.strip("[]") if host.startswith("[") else host)
        except ValueError:
            raise BadInput(f"{label}{text!r}: {host!r} is not an IP address",
                           "write tcp:127.0.0.1:8080, tcp:0.0.0.0:8080 or tcp:[::1]:8080") from None
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise BadInput(f"{label}{text!r}: {port!r} is not a port (1-65535)",
                           "write e.g. tcp:127.0.0.1:8080")
        shown = f"[{ip}]" if ip.version == 6 else str(ip)
        return Listen(name, f"tcp:{shown}:{int(port)}")
    raise BadInput(f"{label}{text!r}: not tcp:HOST:PORT or unix:/PATH",
                   "write e.g. --listen http=tcp:127.0.0.1:8080 or --listen unix:/run/app.sock")


def parse_ready(text: str, label: str = "--ready ") -> str:
    return parse_probe(text, label, READY_KINDS)


def default_ready(listens: list[Listen]) -> str | None:
    """A host on a shared listener signals its own readiness (sd_notify) unless told;
    otherwise GET / on its own socket, as ever (stored as NULL)."""
    return "notify" if listens else None


def check_set(listens: list[Listen], kind: HostKind, ready: str | None, label: str = "--listen") -> None:
    """One host's listeners and readiness together; raises BadInput."""
    if listens and kind is not HostKind.instance:
        raise BadInput(f"{label} is for instances: a worker serves nothing",
                       "drop it, or add the host with --kind instance")
    seen: set[str] = set()
    for a in listens:
        for b in listens:
            if a is not b and overlaps(a.address, b.address) and a.address not in seen:
                raise BadInput(f"{label}: {a.address} and {b.address} are the same address",
                               "give each listener its own address")
        seen.add(a.address)
    how = probe_of(ready).kind
    if how in OWN_SOCKET and ready not in (None, "http") and kind is not HostKind.instance:
        raise BadInput(f"--ready {ready} probes the app's own socket; a worker serves none",
                       "drop --ready, or add the host with --kind instance")
    if how not in OWN_SOCKET and not listens:
        raise BadInput(f"--ready {ready} needs a shared listener (--listen): without one the "
                       "app serves on its own $VIGIL_SOCKET, probed with GET / (or "
                       "http:PATH, tcp)", "add --listen, or drop --ready")


def overlaps(a: str, b: str) -> bool:
    """Two addresses one bind would refuse: the same unix path (resolved: a path through a
    symlinked directory is the same file), or the same port where either host is a
    wildcard of its family or both are the same."""
    if a == b:
        return True
    ka, _, ra = a.partition(":")
    kb, _, rb = b.partition(":")
    if ka != kb:
        return False
    if ka == "unix":
        return os.path.realpath(ra) == os.path.realpath(rb)
    if ka != "tcp":
        return False
    ha, _, pa = ra.rpartition(":")
    hb, _, pb = rb.rpartition(":")
    if pa != pb:
        return False
    ia, ib = ipaddress.ip_address(ha.strip("[]")), ipaddress.ip_address(hb.strip("[]"))
    return ia == ib or (ia.version == ib.version and (ia.is_unspecified or ib.is_unspecified))


# Every transaction that checks a host's addresses against the others' takes this lock
# first on PostgreSQL (pg_advisory_xact_lock, held to its commit), so two hosts added or
# changed at once cannot both pass the check: the second reads the first's committed rows.
# On SQLite write transactions begin IMMEDIATE and are serialized by the database itself.
ADDRESSES_LOCK = 0x7669_6c73  # "vils"


def lock_addresses(s: Session) -> None:
    if s.get_bind().dialect.name == "postgresql":
        s.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": ADDRESSES_LOCK})


def check_free(s: Session, host: str, listens: list[Listen], box: str | None) -> None:
    """No other host whose placement can meet `box` on one box listens on any of these
    addresses (a host placed on box1 and one on box2 may share tcp:127.0.0.1:8080: each
    box binds its own); raises BadInput. Not a unique index: "can meet" is an overlap of
    two box sets where no placement means every box, and an address overlaps another by
    its wildcard, neither of which an index holds; the lock above makes it race-free."""
    if not listens:
        return
    lock_addresses(s)
    for other, placed in s.execute(select(Listener, Host.box).join(Host, Host.name == Listener.host)
                                   .where(Listener.host != host)).all():
        if not placement.can_meet(box, placed):
            continue
        for a in listens:
            if overlaps(a.address, other.address):
                raise BadInput(f"{a.address} is already host {other.host}'s listener "
                               f"({other.address}) and the two hosts can run on one box "
                               f"({placement.where_they_meet(box, placed)})",
                               "give each host its own address, or place the two hosts on "
                               "different boxes (`vigil host add --box`)")


def stored(s: Session, host: str) -> list[Listener]:
    return list(s.execute(select(Listener).where(Listener.host == host)
                          .order_by(Listener.position)).scalars())


def as_listens(rows: list[Listener]) -> list[Listen]:
    return [Listen(r.name, r.address) for r in rows]


def write_set(s: Session, host: str, listens: list[Listen], box: str | None) -> None:
    """The host's listeners become `listens` (new rows, in order), in the caller's
    transaction; `box` is the host's placement. The caller has refused a change while the
    host runs."""
    check_free(s, host, listens, box)
    s.execute(Listener.__table__.delete().where(Listener.host == host))
    for i, a in enumerate(listens):
        s.add(Listener(host=host, position=i, name=a.name, address=a.address,
                       state=ListenerState.new))
    s.flush()


def key_of(r: Listener) -> str:
    return f"{r.host}#{r.position}#{r.address}"


def reopened(r: Listener) -> bool:
    """A row whose socket was lost and is (being) bound again: it keeps why it was lost."""
    return r.reason is not None and r.state is not ListenerState.new


def note(r: Listener) -> str | None:
    """What `vigil status` and `vigil check` say of a lost or reopened listener, or None."""
    if r.reason is None:
        return None
    if r.state is ListenerState.held:
        at = f" at {r.opened_at.isoformat(timespec='seconds')}Z" if r.opened_at else ""
        return f"host {r.host}: {r.address} was reopened{at} ({r.reason})"
    if closed(r):
        return f"host {r.host}: {r.address} was {r.reason}; its next start binds it again"
    if r.state in (ListenerState.lost, ListenerState.opening):
        return (f"host {r.host}: {r.address} was lost ({r.reason}); its next start binds it "
                "again")
    return None


def reopen(s: Session, host: str) -> int:
    """`vigil host reopen`: the lost listeners of `host` are opened afresh at its next
    start. Returns how many."""
    get_host(s, host)
    n = 0
    for r in stored(s, host):
        if r.state is ListenerState.lost:
            move(s, Listener, {"host": host, "position": r.position},
                 {"state": ListenerState.new, "reason": None, "inode": None},
                 f"listener {r.address} lost -> new", fence=OPERATOR, col="state",
                 frm=ListenerState.lost)
            n += 1
    emit(s, "listener_reopened", host, count=n)
    return n


# -- the agent's side ----------------------------------------------------------------------


def fds_for(ctx: Context, host: Host, fence: int | None, rows: list[Listener] | None = None,
            ) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The host's listening sockets for a spawn, opened first if they are not yet (each
    step written before it is taken). Raises SpawnError (never the build's fault).
    `rows`: the host's listener rows, when the caller has just read them."""
    if rows is None:
        rows = ctx.store.read(lambda s: stored(s, host.name))
    if not rows:
        return (), ()
    if ctx.listeners is None:
        raise SpawnError(f"host {host.name} has listeners and this process holds none",
                         build_fault=False)
    todo = [r for r in rows if not (r.state is ListenerState.held and r.agent_id == ctx.agent_id
                                    and ctx.listeners.inode(key_of(r)) == r.inode)]
    if todo:
        _open(ctx, host.name, todo, fence)
    try:
        return tuple(ctx.listeners.fds([key_of(r) for r in rows])), tuple(r.name for r in rows)
    except (KeyError, OSError) as exc:
        raise SpawnError(f"listeners of {host.name}: {exc}", build_fault=False) from exc


def _open(ctx: Context, host: str, rows: list[Listener], fence: int | None) -> None:
    guard: Fence | Unfenced = Fence(host, ctx.agent_id, fence) if fence is not None else OWN_BOX
    port = present(ctx.listeners, "ctx.listeners is missing")

    def intent(s: Session) -> None:
        for r in rows:
            move(s, Listener, {"host": host, "position": r.position},
                 {"state": ListenerState.opening, "agent_id": ctx.agent_id, "inode": None},
                 f"listener {r.address} {r.state.value} -> opening", fence=guard, col="state",
                 frm=(ListenerState.new, ListenerState.opening, ListenerState.held,
                      ListenerState.lost))

    ctx.store.write(intent)
    crashpoint(OPENING)
    inodes: dict[int, int] = {}
    for r in rows:
        key = key_of(r)
        have = port.inode(key)  # handed before a crash: the agent took it back on start
        try:
            if have is None:
                have = port.bind(key, r.address)
                crashpoint(BOUND)
            port.hand(key)
        except (OSError, ValueError) as exc:  # the port's error names what holds it, and the fix
            said = exc.strerror if isinstance(exc, OSError) else None
            why = said if said and said.startswith(r.address) else f"{r.address}: {exc}"
            again = " again (it was lost)" if reopened(r) else ""
            raise SpawnError(f"cannot open{again} {why}", build_fault=False) from exc
        crashpoint(HANDED)
        inodes[r.position] = have
    boot = port.boot()

    def held(s: Session) -> None:
        for r in rows:
            move(s, Listener, {"host": host, "position": r.position},
                 {"state": ListenerState.held, "inode": inodes[r.position], "boot_id": boot,
                  "opened_at": utcnow(), "reason": r.reason if reopened(r) else None},
                 f"listener {r.address} opening -> held", fence=guard, col="state",
                 frm=ListenerState.opening)
            emit(s, "listening", host, None, address=r.address, name=r.name,
                 inode=inodes[r.position])
            if reopened(r) and r.state is not ListenerState.held:
                emit(s, "listener_reopened", host, None, address=r.address,
                     inode=inodes[r.position], reason=r.reason)

    ctx.store.write(held)
    crashpoint(HELD)


def recover_listeners(ctx: Context) -> dict[str, int]:
    """On start: take back this box's sockets from the fd holder, or from a live process of
    the host; what nothing has any more is lost. Closes what the holder keeps for rows
    the store no longer names."""
    if ctx.listeners is None:
        return {}
    port = ctx.listeners

    def read(s: Session) -> tuple[list[Listener], dict[str, list[Generation]]]:
        rows = list(s.execute(select(Listener).where(Listener.agent_id == ctx.agent_id))
                    .scalars())
        hosts = {r.host for r in rows}
        gens: dict[str, list[Generation]] = {}
        for g in s.execute(select(Generation).where(Generation.host.in_(hosts),
                                                    Generation.state.in_(LIVE_GEN))).scalars():
            gens.setdefault(g.host, []).append(g)
        return rows, gens

    rows, gens = ctx.store.read(read)
    if not rows:
        port.fetch(set())  # a holder of removed hosts' sockets closes them
        return {}
    have = port.fetch({key_of(r) for r in rows})
    boot = port.boot()
    moves: list[tuple[Listener, ListenerState, dict[str, object]]] = []
    rescued = 0
    for r in rows:
        key = key_of(r)
        if r.state is ListenerState.opening and key in have:
            moves.append((r, ListenerState.held, {"inode": have[key], "boot_id": boot,
                                                  "opened_at": utcnow()}))
        elif r.state is ListenerState.held and r.boot_id != boot and key not in have:
            moves.append((r, ListenerState.lost, {
                "reason": f"the box rebooted (boot id {r.boot_id} is now {boot})"}))
        elif r.state is ListenerState.held and have.get(key) != r.inode:
            pids: list[int] = []
            for g in gens.get(r.host, []):
                ref = ref_of(g)
                pids += ([g.pid] if g.pid else []) + ctx.proc.live_members(ref)
            if r.inode is not None and port.rescue(key, r.inode, list(dict.fromkeys(pids))):
                rescued += 1
            else:
                moves.append((r, ListenerState.lost, {
                    "reason": "the agent and the fd holder both died, and no live process "
                              "of the host had it"}))
    if moves:
        def step(s: Session) -> None:
            for r, to, values in moves:
                move(s, Listener, {"host": r.host, "position": r.position, "agent_id": ctx.agent_id},
                     {"state": to, **values}, f"listener {r.address} {r.state.value} -> {to.value}",
                     fence=OWN_BOX, col="state", frm=r.state)
                emit(s, f"listener_{to.value}", r.host, None, address=r.address,
                     **({"reason": values["reason"]} if "reason" in values else {}))
                if to is ListenerState.held and reopened(r):  # bound again before a crash
                    emit(s, "listener_reopened", r.host, None, address=r.address,
                         inode=values["inode"], reason=r.reason)

        ctx.store.write(step)
        crashpoint(RECOVERED)
    return {"rescued": rescued, "lost": sum(1 for _, to, _ in moves if to is ListenerState.lost)}


def collect(ctx: Context) -> int:
    """Close the sockets this agent (and its holder) keeps that no listener row of this box
    names any more: a host removed or its listeners changed. Returns how many."""
    if ctx.listeners is None or not ctx.listeners.keys():
        return 0
    named = set(ctx.store.read(lambda s: [key_of(r) for r in s.execute(
        select(Listener).where(Listener.agent_id == ctx.agent_id)).scalars()]))
    doomed = [k for k in ctx.listeners.keys() if k not in named]
    if doomed:
        ctx.listeners.drop(doomed)
    return len(doomed)
