"""One generation start, for a wake and for a deploy's successor alike: intend -> spawn ->
record -> ready -> current (or switch) -> link.

A caller gives only what differs: the row that carries the steps (a wake and its `state`,
an attempt and its `step`: a `Carrier`), its gate, its crash point names, and the step that
makes the generation serve (current, or a switch). Every commit of a start goes through one
runner (`Steps`): the gate, the caller's writes, the carrier's move from the value it had,
the commit, then each step's crash point. Steps with no side effect between them are taken
in one commit (one fsync), each step's crash point after it. Write-ahead: the generation
row is committed (the caller's intent step) before anything is exec'd.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from sqlalchemy.orm import Session

from models.states import GenState, HostKind, allowed
from models.store import utcnow
from models.tables import Build, Generation, Host, Listener
from models.transition import Fence, Unfenced, move
from workflows.base.context import Context
from workflows.base.crash import crashpoint
from workflows.base.ports import Spawned
from workflows.generations.access import grant_socket
from workflows.generations.create import launch
from workflows.generations.ending import ref_of
from workflows.generations.known import note
from workflows.generations.readiness import Watch, ready_problem
from workflows.lifecycle.jobs import is_job
from workflows.lifecycle.workers import settle_one_shot

T = TypeVar("T")


@dataclass(frozen=True)
class Step:
    """One step of a start: the carrier's column after it (None: it stays) and the other
    columns of the carrier it sets; what it writes once the carrier has moved (in the same
    commit); its act after the commit (`then`); and the crash point reached after that."""

    to: enum.Enum | None
    point: str | None = None
    write: Callable[[Session], Any] | None = None
    values: Mapping[str, Any] = field(default_factory=dict)
    then: Callable[[], None] | None = None


@dataclass(frozen=True)
class Carrier:
    """The row that carries a start's steps, as last committed: `col` holds `at`."""

    model: Any  # Wake or Attempt
    key: Mapping[str, Any]  # the row's guard beside its column, e.g. {"id": 7, "outcome": None}
    col: str
    at: enum.Enum
    fence: Fence | Unfenced
    gate: Callable[[Session], None] | None = None  # checked first in every commit
    label: str = ""


class Steps:
    """The step runner of one start: owns each step's gate, commit, move and crash point.
    Steps taken in one commit with no write between them are one move of the carrier when
    the transition table allows the hop (queued -> spawning, spawning -> done, ...)."""

    def __init__(self, ctx: Context, row: Carrier) -> None:
        self.ctx = ctx
        self.row = row

    def commit(self, *steps: Step, gated: bool = True) -> None:
        """The steps in one commit, then (each in turn) their acts and crash points."""
        self.decide(lambda s: (None, steps), gated=gated)

    def decide(self, fn: Callable[[Session], tuple[T, Sequence[Step]]], *,
               gated: bool = True) -> T:
        """One commit whose steps are known only inside it: `fn` (after the gate) reads and
        writes what decides them, and says which steps it takes and what to return.
        `gated` False: a commit the gate must not refuse (an end), or one that gates
        itself once it has read what the gate checks (an admission)."""
        out, steps = self.ctx.store.write(lambda s: self.decide_in(s, fn, gated=gated))
        self.taken(*steps)
        return out

    def take(self, s: Session, *steps: Step) -> None:
        """In the caller's transaction (the caller calls taken() after its commit)."""
        self.decide_in(s, lambda s: (None, steps))

    def decide_in(self, s: Session, fn: Callable[[Session], tuple[T, Sequence[Step]]], *,
                  gated: bool = True) -> tuple[T, Sequence[Step]]:
        """decide() in the caller's transaction (the caller calls taken() after its commit)."""
        if gated and self.row.gate is not None:
            self.row.gate(s)
        out, steps = fn(s)
        frm, to, values = self.row.at, None, dict[str, Any]()
        for st in steps:
            if to is not None and st.to is not None and not allowed(frm, st.to):
                frm, to, values = self._move(s, frm, to, values)
            to = st.to if st.to is not None else to
            values.update(st.values)
            if st.write is not None:
                frm, to, values = self._move(s, frm, to, values)
                st.write(s)
        self._move(s, frm, to, values)
        return out, steps

    def taken(self, *steps: Step) -> None:
        """After the commit: the carrier as written, then each step's act and crash point."""
        for st in steps:
            if st.to is not None:
                self.row = replace(self.row, at=st.to)
        for st in steps:
            if st.then is not None:
                st.then()
            if st.point is not None:
                crashpoint(st.point)

    def _move(self, s: Session, frm: enum.Enum, to: enum.Enum | None, values: dict[str, Any]
              ) -> tuple[enum.Enum, None, dict[str, Any]]:
        """The carrier from `frm` to `to` (None: it stays) with `values`, if anything moves."""
        if to is not None or values:
            to = to if to is not None else frm
            row = self.row
            move(s, row.model, dict(row.key), {row.col: to, **values},
                 f"{row.label} {frm.value} -> {to.value}", fence=row.fence, col=row.col, frm=frm)
            frm = to
        return frm, None, {}


def running(gen: Generation, spawned: Spawned) -> Generation:
    """A copy of `gen` as its record step writes it (the row, not the object, changes)."""
    cols = {c.key: getattr(gen, c.key) for c in Generation.__table__.columns}
    return Generation(**{**cols, "pid": spawned.pid, "create_time": spawned.create_time,
                         "state": GenState.running})


def record_in(s: Session, gen: Generation, fence: Fence | Unfenced) -> None:
    """spawning -> running with the leader's pid and start time (its identity on the box)."""
    move(s, Generation, {"id": gen.id},
         {"state": GenState.running, "pid": gen.pid, "create_time": gen.create_time},
         f"generation g{gen.id} spawning -> running", fence=fence, col="state",
         frm=GenState.spawning)


def current_in(s: Session, gen: Generation, fence: Fence | Unfenced, *,
               recorded: bool = True) -> None:
    """running -> current; `recorded` False: spawning -> current with its pid, in the
    commit that records it (a worker with nothing to check)."""
    values: dict[str, Any] = {"state": GenState.current, "current_at": utcnow()}
    if not recorded:
        values.update(pid=gen.pid, create_time=gen.create_time)
    frm = GenState.running if recorded else GenState.spawning
    move(s, Generation, {"id": gen.id}, values,
         f"generation g{gen.id} {frm.value} -> current", fence=fence, col="state", frm=frm)


@dataclass(frozen=True)
class Check:
    """What the started generation's check found: a problem (the build's own fault, or not),
    or a one-shot run that already exited 0."""

    problem: str | None = None
    build_fault: bool = True
    clean: bool = False


def check(ctx: Context, host: Host, gen: Generation, *, walk: bool = True,
          watch: Watch | None = None) -> Check:
    """An instance's readiness (then its socket opened to its group, before it is current
    and linked), a one-shot's exit, a worker alive. `walk` False: the caller walks the
    descendants (after its commit: a walk reads the whole process table); `watch`: see
    ready_problem."""
    ref = ref_of(gen)
    if host.kind is HostKind.instance:
        problem = ready_problem(ctx, host, gen, walk=walk, watch=watch)
        if problem is not None:
            return Check(problem)
        problem = grant_socket(ctx, host, gen.socket) if gen.socket else None
        return Check(problem, build_fault=False)
    if host.one_shot:
        code = settle_one_shot(ctx, ref)
        return Check(None if code in (None, 0) else f"one-shot run exited with status {code}",
                     clean=code == 0)
    return Check(None if ctx.proc.leader_alive(ref) else "worker exited right after its start")


def at_once(ctx: Context, host: Host, gen: Generation) -> bool:
    """A worker that is not a one-shot, alive: nothing to check, current in the commit
    that records its pid."""
    return host.kind is HostKind.worker and not host.one_shot and (
        is_job(host) or ctx.proc.leader_alive(ref_of(gen)))  # a run's quick exit is its end


@dataclass(frozen=True)
class Start:
    """A start whose intent is committed: what its spawn needs, and its step names."""

    host: Host
    build: Build
    gen: Generation  # as its intent wrote it (spawning, no pid)
    execd: str  # crash point: exec'd, the pid not recorded yet
    recorded: Step  # the carrier at the pid's commit (its write is the generation's record)
    listeners: list[Listener] | None = None


def spawn(ctx: Context, go: Start) -> Generation:
    """Exec the build (raises SpawnError when it did not start): the generation as its
    record will write it."""
    spawned = launch(ctx, go.host, go.build, go.gen, go.listeners)
    crashpoint(go.execd)
    return running(go.gen, spawned)


def record(steps: Steps, go: Start, gen: Generation, fence: Fence | Unfenced,
           serve: Step | None = None) -> None:
    """The pid's commit (and, `serve` given, the step that makes it serve, in that same
    commit: nothing stands between them), then the walk at spawn."""
    if serve is None:
        steps.commit(replace(go.recorded, write=lambda s: record_in(s, gen, fence)))
    else:
        steps.commit(go.recorded, serve)
    note(steps.ctx, {gen.id: ref_of(gen)})


def link(ctx: Context, host: str, gen: Generation) -> None:
    """The canonical link names the generation that serves (after its commit)."""
    if gen.socket:
        ctx.files.point_link(ctx.link_for(host), gen.socket)
