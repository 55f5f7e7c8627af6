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

from workflows.base.context import Context, Result
from workflows.base.crash import crashpoint
from workflows.base.ports import Spawned
from workflows.generations.ending import ref_of
from workflows.generations.known import note
from workflows.lifecycle.order import wake_waiters
from workflows.lifecycle.wake import (
    CURRENT,
    RECORDED,
    Intent,
    Launch,
    after_intent,
    drive_wake,
    intent,
    settle_started,
    spawn,
)
from workflows.lifecycle.wake_steps import always_on, recorded_current

GROUP = 16  # wakes per group: one drive's share of a round
Outcome = Result | Exception


def drive_wakes(ctx: Context, ids: list[int]) -> dict[int, Outcome]:
    """Advance several wakes as far as each can go now; what each ended as, or raised."""
    out: dict[int, Outcome] = {}
    started = shared(ctx, [(wake_id, _intent_part(ctx, wake_id)) for wake_id in ids])
    going: list[Launch] = []
    for wake_id in ids:
        got = started[wake_id]
        try:
            if isinstance(got, Exception):
                raise got
            go = after_intent(ctx, *got)
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


def _intent_part(ctx: Context, wake_id: int) -> Callable[[Session], Any]:
    """One start's first commit (workflows/lifecycle/wake.py `intent`): (intent, coalesced,
    elsewhere)."""

    def part(s: Session) -> tuple[Intent | Result, bool, bool]:
        coalesced: list[int] = []
        elsewhere: list[bool] = []
        it = intent(s, ctx, wake_id, coalesced, elsewhere)
        return it, bool(coalesced), bool(elsewhere)

    return part


def _spawn_all(ctx: Context, going: list[Launch], out: dict[int, Outcome]
               ) -> list[tuple[Launch, Spawned]]:
    """Spawn each in turn (its intent is committed); those that must be checked go the
    single wake's way at once, the always-on workers alive come back to be made current."""
    ready = []
    for go in going:
        try:
            spawned = spawn(ctx, go)
            if isinstance(spawned, Result):
                out[go.wake.id] = spawned
            elif always_on(go.host, go.gen) and ctx.proc.leader_alive(ref_of(go.gen)):
                ready.append((go, spawned))
            else:
                out[go.wake.id] = settle_started(ctx, go, spawned)
        except Exception as exc:
            out[go.wake.id] = exc
    return ready


def _recorded_current(go: Launch, spawned: Spawned, s: Session) -> None:
    recorded_current(s, go.wake, go.gen, go.build, spawned, go.ours)


def _make_current(ctx: Context, ready: list[tuple[Launch, Spawned]],
                  out: dict[int, Outcome]) -> None:
    """One commit: each spawned worker's pid recorded and current, the waiting wakes told
    once; then one walk of all their descendants."""
    parts: list[tuple[int, Callable[[Session], Any]]] = [
        (go.wake.id, functools.partial(_recorded_current, go, spawned)) for go, spawned in ready]
    parts.append((0, wake_waiters))  # no wake has id 0
    try:
        written = shared(ctx, parts)
    except Exception as exc:  # the commit failed: each is found spawning and reaped
        out.update({go.wake.id: exc for go, _ in ready})
        return
    failed = {k: v for k, v in written.items() if isinstance(v, Exception) and k}
    done = [go for go, _ in ready if go.wake.id not in failed]
    out.update(failed)
    for go in done:
        crashpoint(RECORDED)
        crashpoint(CURRENT)
        out[go.wake.id] = Result.progress
    try:
        note(ctx, {go.gen.id: ref_of(go.gen) for go in done})  # the walk at spawn
    except Exception as exc:  # a sighting lost: the next walk records it again
        out.update({go.wake.id: exc for go in done})
