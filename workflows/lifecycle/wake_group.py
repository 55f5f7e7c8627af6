"""Wakes of worker hosts started together (group commit): one commit writes every wake's
intent (leased, its generation row spawning, its build published), then each is spawned in
turn, then one commit records every pid and makes each current; one walk of their
descendants follows. What each wake writes, and the guard of every move (expected state,
the wake's lease fence), is what workflows/lifecycle/wake.py writes for one: only the
commits are shared. Each wake's part of a shared commit sits in a savepoint of its own, so
a wake whose step fails writes nothing and the others commit.

Write-ahead holds for each wake: its intent is committed before any process is spawned
(every intent of the group is, in fact); a crash between the spawns leaves some wakes
spawned and some not, each in `spawning`, which recovery settles as it does for one wake
(the crash matrix's wake.* points, and tests/recovery/test_group_wake.py).
"""

from __future__ import annotations

from collections.abc import Iterator
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
    started = ctx.store.write(lambda s: _intents(s, ctx, ids))
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


def _intents(s: Session, ctx: Context, ids: list[int]) -> dict[int, Any]:
    """Every start's first commit (workflows/lifecycle/wake.py `intent`), each in a
    savepoint: per wake (intent, coalesced, elsewhere), or what it raised."""
    out: dict[int, tuple[Intent | Result, bool, bool] | Exception] = {}
    for wake_id in ids:
        coalesced: list[int] = []
        elsewhere: list[bool] = []
        try:
            with own_part(s):
                it = intent(s, ctx, wake_id, coalesced, elsewhere)
            out[wake_id] = (it, bool(coalesced), bool(elsewhere))
        except Exception as exc:
            out[wake_id] = exc
    return out


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


def _make_current(ctx: Context, ready: list[tuple[Launch, Spawned]],
                  out: dict[int, Outcome]) -> None:
    """One commit: each spawned worker's pid recorded and current (a savepoint each), the
    waiting wakes told once; then one walk of all their descendants."""

    def step(s: Session) -> dict[int, Exception]:
        failed: dict[int, Exception] = {}
        for go, spawned in ready:
            try:
                with own_part(s):
                    recorded_current(s, go.wake, go.gen, go.build, spawned, go.ours)
            except Exception as exc:
                failed[go.wake.id] = exc
        wake_waiters(s)
        return failed

    try:
        failed = ctx.store.write(step)
    except Exception as exc:  # the commit failed: each is found spawning and reaped
        out.update({go.wake.id: exc for go, _ in ready})
        return
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
