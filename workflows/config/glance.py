"""The read model of `vigil top`: what `vigil status` says of a few hosts (the rows on the
screen), and what it leaves out, read for all of them at once (a handful of grouped queries,
whatever the number of hosts): restarts by cause, open obligations with their ages, the
rollout in flight, and where each current generation's processes are."""

from __future__ import annotations

from collections import Counter
from datetime import datetime
from typing import Any

from sqlalchemy import bindparam, func, select, text
from sqlalchemy.orm import Session

from models.durations import iso
from models.states import IN_FLIGHT, OPEN_ROLLOUT, Cause, GenState
from models.tables import Attempt, Generation, Host, Rollout, RolloutTarget, Wake
from workflows.config.hostrows import rows_of

# A wake's cause when the agent started the host again by itself, and what `top` calls it.
RESTART_WAKES = {"restart": "crash", "recycle": "recycle", "converge": "converge"}


def names(s: Session) -> list[str]:
    return list(s.execute(select(Host.name).order_by(Host.name)).scalars())


def restarts(s: Session, hosts: list[str]) -> dict[str, Counter[str]]:
    """Per host, its restarts by cause: `crash` (an exit the agent started it again after),
    `recycle` (max-run), `converge` (a worker moved onto its live build), `restart` (an
    operator's, a schedule's or an unhealthy probe's restart attempt). Counted over the
    history the store still keeps (`vigil gc --keep-history`)."""
    out: dict[str, Counter[str]] = {h: Counter() for h in hosts}
    for host, cause, n in s.execute(
            select(Wake.host, Wake.cause, func.count()).where(
                Wake.host.in_(hosts), Wake.cause.in_(list(RESTART_WAKES)))
            .group_by(Wake.host, Wake.cause)):
        out[host][RESTART_WAKES[cause]] += n
    for host, n in s.execute(
            select(Attempt.host, func.count()).where(
                Attempt.host.in_(hosts), Attempt.cause == Cause.restart).group_by(Attempt.host)):
        out[host]["restart"] += n
    return out


def obligations(s: Session, hosts: list[str]) -> dict[str, list[dict[str, Any]]]:
    """Per host, its open obligations (the pending_obligations view), oldest first."""
    out: dict[str, list[dict[str, Any]]] = {h: [] for h in hosts}
    if not hosts:
        return out
    rows = s.execute(text("SELECT kind, host, since FROM pending_obligations WHERE host IN "
                          ":hosts ORDER BY since").bindparams(bindparam("hosts", expanding=True)),
                     {"hosts": hosts})
    for kind, host, since in rows:
        if isinstance(since, str):  # SQLite hands a view's times back as text
            since = datetime.fromisoformat(since)
        out[host].append({"kind": kind, "since": iso(since)})
    return out


def rollouts(s: Session, hosts: list[str]) -> dict[str, dict[str, Any]]:
    """Per host in an open rollout: which, its state, the wave it is in of how many."""
    out: dict[str, dict[str, Any]] = {}
    for t, r in s.execute(
            select(RolloutTarget, Rollout).join(Rollout, Rollout.id == RolloutTarget.rollout_id)
            .where(RolloutTarget.host.in_(hosts), Rollout.state.in_(OPEN_ROLLOUT))):
        out[t.host] = {"id": r.id, "state": r.state.value, "wave": t.wave,
                       "wave_count": r.wave_count, "target": t.state.value,
                       "in_flight": t.state in IN_FLIGHT}
    return out


def leaders(s: Session, hosts: list[str]) -> dict[str, dict[int, dict[str, Any]]]:
    """Per host, each current generation's leader (pid and start time) and cgroup, by slot:
    where `top` reads the generation's CPU and memory (a host of instances: one per slot)."""
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for g in s.execute(select(Generation).where(
            Generation.host.in_(hosts), Generation.state == GenState.current)).scalars():
        out.setdefault(g.host, {})[g.slot] = {"pid": g.pid, "create_time": g.create_time,
                                              "cgroup": g.cgroup}
    return out


def glance(s: Session, hosts: list[str]) -> list[dict[str, Any]]:
    """`vigil status`'s row of each host named (in the order given; one removed meanwhile
    is left out), each with `restarts`, `obligations`, `rollout` and `leaders` (by slot)
    added."""
    rows = rows_of(s, hosts)
    shown = [r["host"] for r in rows]
    counts, owed = restarts(s, shown), obligations(s, shown)
    waves, leads = rollouts(s, shown), leaders(s, shown)
    for r in rows:
        h = r["host"]
        r.update(restarts=dict(counts[h]), obligations=owed[h], rollout=waves.get(h),
                 leaders=leads.get(h, {}))
    return rows
