"""Start order between hosts: a host's `after` names the hosts a wake of it waits for,
awake and ready (`hosts.start_after`, a JSON list; migration 0020).

A wake whose `after` hosts are not all ready stays queued, holding nothing (no lease, no
process), with what it waits on written on its row in the step that decided it; it looks
again every RECHECK seconds, and at once when one of them becomes ready (`wake_waiters`).
A stop of a host that hosts still up name is refused unless forced; a stop waits while a
host that names it is itself being stopped (and looks again at once when that stop ends,
`stop_waiters`), so one command over both stops the dependent first. A cycle, or a name no host has, is refused before anything is written.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from datetime import timedelta

from sqlalchemy import func, literal_column, select, update
from sqlalchemy.orm import Session, aliased

from models.errors import BadInput, Refused
from models.states import OPEN_STOP, Desired, GenState, StopState, WakeState
from models.store import emit, utcnow
from models.tables import Generation, Host, Stop, Wake
from models.transition import move
from workflows.base.waivers import BY_STATE

RECHECK = 2.0  # seconds between a waiting wake's looks (a host becoming ready ends it sooner)
NONE = "[]"  # the column's value for a host that starts after nothing

Graph = Mapping[str, Iterable[str]]


def names_of(text: str | None) -> list[str]:
    return list(json.loads(text)) if text and text != NONE else []


def check_graph(graph: Graph, known: Iterable[str] | None = None) -> None:
    """Every name in an `after` is a host (of `known`, else of the graph) and the order has
    no cycle, a host naming itself included; else one line (BadInput) naming it."""
    for _, exc in problems(graph, known)[:1]:
        raise exc


def problems(graph: Graph, known: Iterable[str] | None = None) -> list[tuple[str, BadInput]]:
    """Every name no host has, then a cycle: (the host whose after says it, the line)."""
    hosts = set(graph) if known is None else set(known) | set(graph)
    out = [(host, BadInput(f"host {host} starts after {name!r}, and no host has that name",
                           f"add host {name} first, or drop it from {host}'s after"))
           for host, after in graph.items() for name in after if name not in hosts]
    cycle = find_cycle(graph)
    if cycle is not None:
        out.append((cycle[0], BadInput(
            f"the start order has a cycle: {' -> '.join(cycle)}",
            f"drop {cycle[1]} from {cycle[0]}'s after (or another link of it)")))
    return out


def find_cycle(graph: Graph) -> list[str] | None:
    """A cycle as the names along it, first repeated last (`a -> b -> a`); None: none."""
    done: set[str] = set()
    for root in sorted(graph):
        if root in done:
            continue
        path = [root]
        stack = [iter(sorted(graph.get(root, ())))]
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                stack.pop()
                done.add(path.pop())
            elif nxt in path:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in done:
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def in_order(names: Iterable[str], graph: Graph) -> list[str]:
    """`names` with every host after the hosts it names (of those given), otherwise as
    given: the order to wake them in. Depth first by a stack, not recursion: a chain of
    thousands of hosts must sort too (issue 37)."""
    given = list(dict.fromkeys(names))
    wanted, out, placed = set(given), [], set()
    for root in given:
        if root in placed:
            continue
        path = {root}  # hosts on the walk: one met again is a cycle (refused where it is written), cut
        stack = [(root, iter(graph.get(root, ())))]
        while stack:
            n, deps = stack[-1]
            dep = next((d for d in deps if d in wanted and d not in placed and d not in path), None)
            if dep is None:
                stack.pop()
                path.discard(n)
                placed.add(n)
                out.append(n)
            else:
                path.add(dep)
                stack.append((dep, iter(graph.get(dep, ()))))
    return out


def dependents_first(names: Iterable[str], graph: Graph) -> list[str]:
    """`names` with every host before the hosts it names (of those given), otherwise as
    given: the order to stop or remove them in."""
    named_by: dict[str, list[str]] = {}
    for host, after in graph.items():
        for name in after:
            named_by.setdefault(name, []).append(host)
    return in_order(names, named_by)


def stored_graph(s: Session) -> dict[str, list[str]]:
    return {n: names_of(a) for n, a in s.execute(select(Host.name, Host.start_after))}


def dependents(s: Session, host: str, *, up: bool = False) -> list[str]:
    """Hosts whose after names `host` (up: only those desired up)."""
    # The predicate as a literal, so the planner reads the partial index ix_hosts_ordered.
    q = select(Host.name, Host.start_after).where(Host.start_after != literal_column("'[]'"),
                                                   Host.start_after.like(f'%"{host}"%'))
    if up:
        q = q.where(Host.desired == Desired.up)
    return sorted(n for n, a in s.execute(q) if host in names_of(a))


def unready(s: Session, names: list[str]) -> list[str]:
    """Those of `names` that are not awake and ready: no current generation (a one-shot is
    ready once its newest wake is done: its run exited 0). A name no host has is skipped
    (`host rm` refuses a host others name)."""
    if not names:
        return []
    newest = aliased(Wake)
    last = select(func.max(newest.id)).where(newest.host == Host.name).scalar_subquery()
    ran = select(Wake.id).where(Wake.id == last, Wake.state == WakeState.done).exists()
    current = select(Generation.host).where(Generation.state == GenState.current)
    rows = s.execute(select(Host.name).where(
        Host.name.in_(names), Host.name.not_in(current), ~(Host.one_shot & ran))).scalars()
    down = set(rows)
    return [n for n in names if n in down]


def hold(s: Session, w: Wake, waits: list[str]) -> None:
    """The queued wake waits on `waits` (in the caller's transaction): written on its row,
    due again after RECHECK; said once in the events, when what it waits on changes."""
    on = ", ".join(waits)
    said = w.waiting_on  # (the move below updates the row this session holds)
    move(s, Wake, {"id": w.id}, {"waiting_on": on, "last_error": f"waiting on {on}", "attempts": 0,
                         "next_attempt_at": utcnow() + timedelta(seconds=RECHECK)},
         f"wake #{w.id} waits on {on}", fence=BY_STATE, col="state", frm=WakeState.queued)
    if said != on:
        emit(s, "wake_waiting", w.host, wake=w.id, on=waits)


def go_on(s: Session, w: Wake) -> None:
    """A wake that waited goes on: its row no longer says it waits."""
    if w.waiting_on is not None:
        move(s, Wake, {"id": w.id}, {"waiting_on": None, "last_error": None},
             f"wake #{w.id} waits no more", fence=BY_STATE, col="state", frm=WakeState.queued)


def wake_waiters(s: Session) -> None:
    """A host became ready: every waiting wake looks again now (they are few)."""
    s.execute(update(Wake).where(Wake.state == WakeState.queued, Wake.waiting_on.is_not(None))
              .values(next_attempt_at=utcnow()))


def stop_waiters(s: Session, host: str) -> None:
    """A stop of `host` ended: the stops of the hosts it starts after wait for it
    (`stopping_dependents`) and look again now, not after their backoff (down a chain of a
    thousand hosts, backoffs added up to hours)."""
    names = names_of(s.execute(select(Host.start_after).where(Host.name == host)).scalar())
    if names:
        s.execute(update(Stop).where(Stop.host.in_(names), Stop.state == StopState.queued)
                  .values(next_attempt_at=utcnow()))


def refuse_stop(s: Session, host: str) -> None:
    """A stop of a host that hosts still up start after: refused, naming them."""
    up = dependents(s, host, up=True)
    if up:
        raise stop_refusal(host, up)


def stop_refusal(host: str, up: list[str], fix: str | None = None) -> Refused:
    one = len(up) == 1
    return Refused(f"host {host} cannot stop: {', '.join(up)} start{'s' if one else ''} after "
                   f"it and {'is' if one else 'are'} up",
                   fix or f"stop {'it' if one else 'them'} first (`vigil stop {' '.join(up)} "
                   f"{host}` stops them in that order), or give --force")


def stopping_dependents(s: Session, host: str) -> list[str]:
    """Hosts that name `host` and are being stopped: its stop waits for theirs."""
    names = dependents(s, host)
    if not names:
        return []
    return sorted(set(s.execute(select(Stop.host).where(
        Stop.host.in_(names), Stop.state.in_(OPEN_STOP))).scalars()))
