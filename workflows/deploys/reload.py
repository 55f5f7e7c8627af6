"""Reload in place (`vigil reload`) and signals on demand (`vigil signal`).

A reload is an obligation row: queued -> signalled (its fence and first generation written
before any signal: write-ahead) -> the host's reload signal sent to every current leader
(instances included) -> each back ready: with `--ready notify` RELOADING=1 then READY=1 on
its own NOTIFY_SOCKET (systemd's Type=notify-reload), else its readiness probe again -> done.
One not back ready within the health timeout fails the reload, answered in the same commit
by an overlap restart of the same build (`on_reload_fail` restart: an attempt with cause
restart) or left as it is (keep), with a `reload_failed` event either way. A drive that
finds the row signalled follows an agent that died while it waited (what the app said
meanwhile went to a closed socket): it sends the signal again and waits anew, as a reload
asked twice would.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from functools import partial
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from models.errors import BadInput, Refused, present
from models.states import OPEN_RELOAD, Cause, GenState, Mode, ReloadState
from models.store import Store, emit, utcnow
from models.tables import Build, Generation, Host, Reload
from models.transition import Fence, move
from workflows.base.context import Context, Poke, Result
from workflows.base.crash import crashpoint, define
from workflows.base.lookups import get_host, lease_of, open_attempt, open_stop
from workflows.base.ports import ProcessPort
from workflows.base.waivers import BY_STATE
from workflows.deploys.request import request_deploy
from workflows.generations.ending import ref_of
from workflows.generations.readiness import mode, ready_problem
from workflows.leases.lease import held_fence

INTENT = define("reload.intent", "the reload is signalled (fence recorded); no signal sent yet")
SENT = define("reload.sent", "the reload signal was sent to every current leader; none checked")
ENDED = define("reload.ended", "the reload's outcome is written (a failed one's restart attempt too)")

RESTART, KEEP = "restart", "keep"
NO_RELOAD = ("KILL", "STOP")  # a process cannot catch them: they never reload anything


def check_signal(value: str, label: str = "") -> str:
    """A signal's name as stored (`HUP`), from `HUP`, `SIGHUP`, `hup` or its number."""
    text = str(value).strip().upper()
    name = text[3:] if text.startswith("SIG") else text
    try:
        return signal.Signals(int(name)).name[3:] if name.isdigit() else \
            signal.Signals["SIG" + name].name[3:]
    except (KeyError, ValueError):
        raise BadInput(f"{label}{value!r} is not a signal", "give a name such as HUP, USR1, "
                       "USR2, TERM or QUIT (`kill -l` lists them)") from None


def check_reload_signal(value: str, label: str = "--reload-signal ") -> str:
    name = check_signal(value, label)
    if name in NO_RELOAD:
        raise BadInput(f"{label}{name} cannot be caught, so it reloads nothing",
                       "give the signal the app reloads on, e.g. HUP (gunicorn, nginx) or USR2")
    return name


def check_reload_fail(value: str, label: str = "--on-reload-fail ") -> str:
    if value not in (RESTART, KEEP):
        raise BadInput(f"{label}{value!r} is not an answer to a failed reload",
                       "give restart (an overlap restart of the same build) or keep")
    return value


@dataclass(frozen=True)
class ReloadRequest:
    id: int
    state: str
    new: bool  # False: a reload of the host already open, returned as it is


def request_reload(s: Session, host: str) -> ReloadRequest:
    """The CLI's intent: one reload row. Refused, nothing written, while the host is
    stopped, stopping or deploying; a reload already open is returned, not doubled."""
    get_host(s, host)
    stopping = open_stop(s, host)
    if stopping is not None:
        raise Refused(f"host {host} is being stopped (stop #{stopping}): nothing to reload",
                      f"wait for the stop (`vigil stop {host} --wait`), then `vigil wake {host}`")
    busy = open_attempt(s, host)
    if busy is not None:
        raise Refused(f"host {host} is deploying (attempt #{busy}): a reload would race it",
                      f"let it end (`vigil events {host}`), then reload again")
    if _currents(s, host) == []:
        raise Refused(f"host {host} is not running: nothing to reload",
                      f"start it with `vigil wake {host}`")
    r = s.execute(select(Reload).where(Reload.host == host, Reload.state.in_(OPEN_RELOAD))
                  .order_by(Reload.id).limit(1)).scalar_one_or_none()
    if r is not None:
        return ReloadRequest(r.id, r.state.value, False)
    now = utcnow()
    sig = s.execute(select(Host.reload_signal).where(Host.name == host)).scalar_one()
    r = Reload(host=host, state=ReloadState.queued, signal=sig, since=now, next_attempt_at=now,
               created_at=now)
    s.add(r)
    s.flush()
    emit(s, "reload_requested", host, reload=r.id, signal=sig)
    return ReloadRequest(r.id, r.state.value, True)


def _currents(s: Session, host: str) -> list[Generation]:
    return list(s.execute(select(Generation).where(
        Generation.host == host, Generation.state == GenState.current)
        .order_by(Generation.slot)).scalars())


def drive_reload(ctx: Context, reload_id: int) -> Result:
    r = ctx.store.read(lambda s: s.get(Reload, reload_id))
    if r is None or r.state not in OPEN_RELOAD:
        return Result.gone
    begun = ctx.store.write(lambda s: _begin(s, ctx, r))
    if begun is None:
        return Result.progress  # cancelled: nothing to reload any more
    host, gens, fence = begun
    crashpoint(INTENT)
    signum = signal.Signals["SIG" + r.signal]
    notify = mode(host) == "notify" and ctx.ready is not None
    marks = {g.uuid: ctx.ready.reload_mark(g.uuid) if notify and ctx.ready else None
             for g in gens}
    gone = [g for g in gens if not ctx.proc.signal_leader(ref_of(g), signum)]
    crashpoint(SENT)
    problem = (f"g{gone[0].id} had exited before its signal" if gone
               else _check(ctx, host, gens, marks))
    ctx.store.write(lambda s: _end(s, ctx, r.id, host, gens, fence, problem))
    crashpoint(ENDED)
    return Result.progress


def _begin(s: Session, ctx: Context, r: Reload
           ) -> tuple[Host, list[Generation], int] | None:
    """queued -> signalled: the gate, then the fence and the first generation written (a
    row found signalled, left by an agent that died waiting, is sent again as it is). None:
    the reload is cancelled instead."""
    host = get_host(s, r.host)
    gens = _currents(s, r.host)
    why = _superseded(s, r.host, gens)
    if why is not None:
        _cancel(s, r.id, r.state, r.host, why)
        return None
    fence = held_fence(s, ctx, r.host)
    if fence is None:
        raise Poke(f"this agent does not hold the lease of {r.host}")
    again = r.state is ReloadState.signalled  # its row stays as written; the event says so
    if not again:
        move(s, Reload, {"id": r.id}, {"state": ReloadState.signalled, "fence": fence,
                                       "generation_id": gens[0].id, "signalled_at": utcnow()},
             f"reload #{r.id} queued -> signalled", fence=Fence(r.host, ctx.agent_id, fence),
             col="state", frm=ReloadState.queued)
    emit(s, "reload_signalled", r.host, gens[0].id, reload=r.id, signal=r.signal,
         generations=[g.id for g in gens], again=again)
    return host, gens, fence


def _superseded(s: Session, host: str, gens: list[Generation]) -> str | None:
    """Why a reload of the host no longer applies (a stop, a deploy, nothing running)."""
    stopping = open_stop(s, host)
    if stopping is not None:
        return f"cancelled by stop #{stopping}"
    busy = open_attempt(s, host)
    if busy is not None:
        return f"superseded by attempt #{busy}"
    return None if gens else "nothing is running"


def _cancel(s: Session, reload_id: int, frm: ReloadState, host: str, why: str) -> None:
    move(s, Reload, {"id": reload_id}, {"state": ReloadState.cancelled, "reason": why,
                                        "ended_at": utcnow()},
         f"reload #{reload_id} {frm.value} -> cancelled", fence=BY_STATE, col="state", frm=frm)
    emit(s, "reload_cancelled", host, reload=reload_id, reason=why)


def _check(ctx: Context, host: Host, gens: list[Generation],
           marks: dict[str, int | None]) -> str | None:
    """None once every signalled generation is back ready within the health timeout (one
    bound for all of them), else why the first one is not."""
    deadline = ctx.clock.now() + host.health_timeout
    for g in gens:
        left = max(0.0, deadline - ctx.clock.now())
        mark = marks.get(g.uuid)
        if mark is not None and ctx.ready is not None:
            problem = ctx.ready.wait_reload(g.uuid, mark, left, partial(ctx.proc.leader_alive,
                                                                        ref_of(g)))
        else:
            problem = ready_problem(ctx, host, g, left, walk=False)
        if problem is not None:
            return f"g{g.id}: {problem}"
    return None


def _end(s: Session, ctx: Context, reload_id: int, host: Host, gens: list[Generation],
         fence: int, problem: str | None) -> None:
    """signalled -> done, or failed with its answer (an overlap restart of the same build,
    or nothing), or cancelled when a stop, a deploy or an exit took the host over."""
    now_current = {g.id for g in _currents(s, host.name)}
    left = [g for g in gens if g.id not in now_current]
    why = _superseded(s, host.name, gens) or (
        f"g{left[0].id} is no longer current (it exited or was replaced)" if left else None)
    if why is not None:
        _cancel(s, reload_id, ReloadState.signalled, host.name, why)
        return
    values: dict[str, Any] = {"ended_at": utcnow(), "reason": problem}
    if problem is None:
        values["state"] = ReloadState.done
        emit(s, "reloaded", host.name, gens[0].id, reload=reload_id,
             generations=[g.id for g in gens])
    else:
        values["state"] = ReloadState.failed
        answer = host.on_reload_fail
        if answer == RESTART:
            build = present(s.get(Build, gens[0].build_id), "the running build is missing")
            a = request_deploy(s, host.name, build, mode=Mode.overlap, canary=False,
                               cause=Cause.restart)
            values["attempt_id"] = a.id
        emit(s, "reload_failed", host.name, gens[0].id, reload=reload_id, reason=problem,
             answer=answer, **({"attempt": values["attempt_id"]} if "attempt_id" in values else {}))
    move(s, Reload, {"id": reload_id}, values,
         f"reload #{reload_id} signalled -> {values['state'].value}",
         fence=Fence(host.name, ctx.agent_id, fence), col="state", frm=ReloadState.signalled)


@dataclass(frozen=True)
class Signalled:
    generation: int
    slot: int
    pid: int | None
    sent: bool  # False: it had exited


def signal_host(store: Store, proc: ProcessPort, host: str, name: str,
                box: str | None = None) -> list[Signalled]:
    """`vigil signal HOST SIG`: the signal sent to every current leader of the host
    (instances included), an event each. Refused, nothing sent, when nothing runs or when
    another box than `box` (this one's agent id) holds the host."""
    sig = check_signal(name, "signal ")

    def read(s: Session) -> tuple[list[Generation], str | None]:
        get_host(s, host)
        lease = lease_of(s, host)
        return _currents(s, host), lease.holder if lease is not None else None

    gens, holder = store.read(read)
    if not gens:
        raise Refused(f"host {host} has nothing running: no signal was sent",
                      f"start it with `vigil wake {host}`, or check `vigil status {host}`")
    if box is not None and holder is not None and holder != box:
        raise Refused(f"host {host} runs on box {holder}, not this one ({box}): no signal was "
                      "sent", f"run `vigil signal` on {holder}")
    out = [Signalled(g.id, g.slot, g.pid, proc.signal_leader(ref_of(g), signal.Signals["SIG" + sig]))
           for g in gens]

    def record(s: Session) -> None:
        for o in out:
            if o.sent:
                emit(s, "signal_sent", host, o.generation, signal=sig, pid=o.pid, slot=o.slot)
    store.write(record)
    return out
