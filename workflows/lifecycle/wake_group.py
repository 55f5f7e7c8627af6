"""Wakes of worker hosts started together (group commit): one commit writes every wake's
intent (leased, its generation row spawning, its build published), then each is spawned in
turn, then one commit records every pid and makes each current; one walk of their
descendants follows. What each wake writes, and the guard of every move (expected state,
the wake's lease fence), is what workflows/lifecycle/wake.py writes for one: only the
commits are shared. When a wake's part of a shared commit fails, the commit is run again
with a savepoint for each part, so that wake writes nothing and the others commit.

Write-ahead holds for each wake: its intent is committed before any process is spawned
(every intent of the group is, in fact); a crash between the spawns leaves some wakes
spawned and some not, each in `spawning`, which recovery settles as it does for one wake
(the crash matrix's wake.* points, and tests/recovery/test_group_wake.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy.orm import Session

from models.tables import Generation
from workflows.base.context import Context, Result
from workflows.generations.ending import ref_of
from workflows.generations.known import note
from workflows.lifecycle.order import wake_waiters
from workflows.lifecycle.start import Step, at_once
from workflows.lifecycle.wake import (
    Launch,
    begun,
    drive_wake,
    intent,
    serve,
    settle,
    spawned,
)

GROUP = 16  # wakes per group: one drive's share of a round
Outcome = Result | Exception


def drive_wakes(ctx: Context, ids: list[int]) -> dict[int, Outcome]:
    """Advance several wakes as far as each can go now; what each ended as, or raised."""
    out: dict[int, Outcome] = {}
    started = shared(ctx, [(wake_id, functools.partial(intent, ctx=ctx, wake_id=wake_id))
                           for wake_id in ids])  # each start's first commit
    going: list[Launch] = []
    for wake_id in ids:
        got = started[wake_id]
        try:
            if isinstance(got, Exception):
                raise got
            go = begun(got)
            if go is None:  # found mid-flight: the single drive settles it
                out[wake_id] = drive_wake(ctx, wake_id)
            elif isinstance(go, Result):
                out[wake_id] = go
            else:
                going.append(go)
        except Exception as exc:
            out[wake_id] = exc
    ready = _spawn_all(ctx, going, out)
    if ready:
        _make_current(ctx, ready, out)
    return out


@contextmanager
def own_part(s: Session) -> Iterator[None]:
    """One wake's part of a shared commit: a savepoint, and the events it emitted dropped
    with it when it fails (the agent logs the events of a commit once it is done)."""
    n = len(s.info.get("events", []))
    try:
        with s.begin_nested():
            yield
    except BaseException:
        del s.info.setdefault("events", [])[n:]
        raise


def shared(ctx: Context, parts: list[tuple[int, Callable[[Session], Any]]]) -> dict[int, Any]:
    """Each wake's part of one commit, by wake id: what it returned, or what it raised. All
    in one transaction when none fails (the usual case); when one does, the transaction is
    rolled back and run again with a savepoint for each part, so only the failed ones
    write nothing."""
    try:
        return ctx.store.write(lambda s: {key: part(s) for key, part in parts})
    except Exception:  # noqa: S110 - a part (or the store) failed: each part on its own
        pass

    def each(s: Session) -> dict[int, Any]:
        out: dict[int, Any] = {}
        for key, part in parts:
            try:
                with own_part(s):
                    out[key] = part(s)
            except Exception as exc:
                out[key] = exc
        return out

    return ctx.store.write(each)


def _spawn_all(ctx: Context, going: list[Launch], out: dict[int, Outcome]
               ) -> list[tuple[Launch, Generation]]:
    """Spawn each in turn (its intent is committed); those that must be checked go the
    single wake's way at once, the always-on workers alive come back to be made current."""
    ready = []
    for go in going:
        try:
            gen = spawned(ctx, go)
            if isinstance(gen, Result):
                out[go.wake.id] = gen
            elif at_once(ctx, go.start.host, gen):
                ready.append((go, gen))
            else:
                out[go.wake.id] = settle(ctx, go, gen)
        except Exception as exc:
            out[go.wake.id] = exc
    return ready


def _part(go: Launch, steps: tuple[Step, ...]) -> Callable[[Session], Any]:
    return lambda s: go.steps.take(s, *steps)


def _make_current(ctx: Context, ready: list[tuple[Launch, Generation]],
                  out: dict[int, Outcome]) -> None:
    """One commit: each spawned worker's pid recorded and current, the waiting wakes told
    once; then one walk of all their descendants."""
    taken = {go.wake.id: (go.start.recorded, serve(go, gen, recorded=False, waiters=False))
             for go, gen in ready}
    parts: list[tuple[int, Callable[[Session], Any]]] = [
        (go.wake.id, _part(go, taken[go.wake.id])) for go, _ in ready]
    parts.append((0, wake_waiters))  # no wake has id 0
    try:
        written = shared(ctx, parts)
    except Exception as exc:  # the commit failed: each is found spawning and reaped
        out.update({go.wake.id: exc for go, _ in ready})
        return
    failed = {k: v for k, v in written.items() if isinstance(v, Exception) and k}
    done = [(go, gen) for go, gen in ready if go.wake.id not in failed]
    out.update(failed)
    for go, _ in done:
        go.steps.taken(*taken[go.wake.id])
        out[go.wake.id] = Result.progress
    try:
        note(ctx, {gen.id: ref_of(gen) for _, gen in done})  # the walk at spawn
    except Exception as exc:  # a sighting lost: the next walk records it again
        out.update({go.wake.id: exc for go, _ in done})
