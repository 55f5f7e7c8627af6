"""`vigil scale HOST N`: a host of instances grown or shrunk while it runs. Up is a wake
of each new slot; down is a stop of each slot at or past N, highest first. Each is an
ordinary obligation (the wake's and the stop's own steps and crash points), written here
in the operator's one transaction with the new count."""

from __future__ import annotations

from dataclasses import dataclass, field

from sqlalchemy import select
from sqlalchemy.orm import Session

from models.errors import Refused
from models.states import OPEN_STOP, Desired, GenState, StopState, WakeState
from models.store import emit, utcnow
from models.tables import Generation, Host, SlotStreak, Stop, Wake
from models.transition import move, move_many
from workflows.base.lookups import get_host, open_attempt, open_stop
from workflows.base.queue import enqueue_slots
from workflows.base.waivers import OPERATOR
from workflows.generations.listeners import stored
from workflows.generations.slots import check_instances


@dataclass
class Scaled:
    host: str
    was: int
    now: int
    wakes: list[int] = field(default_factory=list)  # a wake of each new slot
    stops: list[int] = field(default_factory=list)  # a stop of each slot removed

    def line(self) -> str:
        if self.was == self.now:
            return f"host {self.host}: already {self.now} instance(s)"
        what = (f"{len(self.wakes)} wake(s) queued" if self.now > self.was
                else f"{len(self.stops)} stop(s) queued, highest slot first")
        return f"host {self.host}: {self.was} -> {self.now} instances ({what})"


def request_scale(s: Session, name: str, n: int) -> Scaled:
    h = get_host(s, name)
    check_instances(n, stored(s, name), h.kind, label="scale", tier=h.memory_tier_mb)
    busy, stopping = open_attempt(s, name), open_stop(s, name)
    if busy is not None or stopping is not None:
        what = f"deploy #{busy} is under way" if busy is not None else f"stop #{stopping} is open"
        raise Refused(f"host {name} cannot be scaled now: {what}",
                      f"wait for it to end (`vigil status {name}`), then scale again")
    out = Scaled(name, h.instances, n)
    if n == h.instances:
        return out
    _refuse_while_starting(s, name)
    move(s, Host, {"name": name}, {"instances": n}, f"host {name} scaled", fence=OPERATOR)
    now = utcnow()
    if n > out.was and h.desired is Desired.up:
        woken = enqueue_slots(s, name, "scale", n)
        s.flush()
        out.wakes = [w.id for w in woken]
    elif n < out.was:
        move_many(s, Wake, [Wake.host == name, Wake.slot >= n],
                  {"state": WakeState.cancelled, "ended_at": now, "reason": "scaled down"},
                  f"wakes of {name} past slot {n - 1} cancelled", fence=OPERATOR, col="state",
                  frm=WakeState.queued)
        # Again after the cancel: a wake the agent claimed meanwhile (its update waited for
        # that commit on PostgreSQL) would become current behind the stops written here.
        _refuse_while_starting(s, name)
        out.stops = _stop_slots(s, name, n)
        # A slot scaled away forgets its streak: one scaled back later starts afresh.
        s.execute(SlotStreak.__table__.delete().where(SlotStreak.host == name,
                                                      SlotStreak.slot >= n))
    emit(s, "scaled", name, was=out.was, to=n, wakes=out.wakes, stops=out.stops)
    return out


STARTING = (WakeState.leased, WakeState.spawning, WakeState.checking)  # may yet be current


def _refuse_while_starting(s: Session, name: str) -> None:
    """A scale while a wake of the host is starting is refused, as while a stop or deploy
    is open: a scale-down stops the current slots only, and an instance still starting
    would become current after it, past the count, with nothing left to remove it."""
    w = s.execute(select(Wake.id, Wake.slot, Wake.state).where(
        Wake.host == name, Wake.state.in_(STARTING)).order_by(Wake.id).limit(1)).first()
    if w is not None:
        slot = "" if w.slot is None else f" of slot {w.slot}"
        raise Refused(f"host {name} cannot be scaled now: wake #{w.id}{slot} is "
                      f"{w.state.value}", f"wait for it to end (`vigil status {name}`), "
                      "then scale again")


def scaling_down(s: Session, name: str) -> tuple[int, int] | None:
    """(stop id, slot) of the host's oldest open stop of one slot (a scale-down's), if any."""
    row = s.execute(select(Stop.id, Stop.slot).where(
        Stop.host == name, Stop.state.in_(OPEN_STOP), Stop.slot.is_not(None))
        .order_by(Stop.id).limit(1)).first()
    return None if row is None else (row.id, row.slot)


def refuse_while_scaling(s: Session, name: str, what: str = "deployed") -> None:
    """An operator's deploy (or retry, restart) while a scale-down's stop is open is refused,
    not queued: scale refuses while a deploy is under way, so the two never interleave, and
    the operator, who is there, sees which instances are still going rather than a deploy
    that waits with no word of why. (One written by the agent's own machinery, a schedule or
    a rollout's wave, waits at admission instead: workflows/deploys/steps.py admit_in.)"""
    open_ = scaling_down(s, name)
    if open_ is not None:
        stop, slot = open_
        h = s.get(Host, name)
        raise Refused(f"host {name} cannot be {what} now: it is scaling down to "
                      f"{h.instances if h else '?'} instance(s) and stop #{stop} of slot {slot} "
                      "is still open",
                      f"wait for it to end (`vigil scale {name} "
                      f"{h.instances if h else 'N'} --wait`, or `vigil status {name}`), "
                      "then try again")


def _stop_slots(s: Session, name: str, n: int) -> list[int]:
    """A stop of each current slot at or past `n`, highest first (its id order)."""
    slots = sorted(s.execute(select(Generation.slot).where(
        Generation.host == name, Generation.state == GenState.current,
        Generation.slot >= n)).scalars(), reverse=True)
    now = utcnow()
    stops = [Stop(host=name, state=StopState.queued, since=now, next_attempt_at=now,
                  created_at=now, slot=k, reason=f"scaled down to {n}") for k in slots]
    s.add_all(stops)
    s.flush()
    return [st.id for st in stops]
