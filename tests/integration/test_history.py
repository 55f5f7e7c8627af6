"""Retention (issue 16 item 17): history nothing needs is deleted, in small batches, by
`vigil gc` and by the agent's scheduled prune; what something needs stays: each host's
newest N attempts, generations, wakes and stops, rows an open obligation names, live
generations, generations a kept row names, and everything younger than --keep-history."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from sqlalchemy import Connection, text

from models.store import utcnow
from tests.conftest import Vigil, wait_for
from tests.migration.test_migrations import raw_insert
from workflows.engine.history import Keep, prune

pytestmark = pytest.mark.timeout(120)

OLD = utcnow() - timedelta(days=40)
RECENT = utcnow() - timedelta(days=1)


def retry_cols() -> dict[str, Any]:
    return {"attempts": 0, "next_attempt_at": OLD, "last_error": None, "since": OLD}


def seed(conn: Connection, build: int) -> None:
    """Host web: generations 1-30 proven 40 days ago, each with a done wake and an ended
    attempt (its successor) and three events; generation 31 retiring (live), an open member
    naming it and attempt 3; attempt 32 still open; a done stop naming generation 5; and
    generation 32 proven a day ago. Host api: three attempts 40 days old. Five recent events."""
    for g in range(1, 33):
        raw_insert(conn, "generations", {
            "id": g, "uuid": f"u-{g}", "host": "web", "build_id": build,
            "state": "retiring" if g == 31 else "proven", "fence": 1, "agent_id": "a",
            "created_at": OLD, "ended_at": None if g == 31 else (RECENT if g == 32 else OLD)})
    for i in range(1, 31):
        raw_insert(conn, "wakes", {"id": i, "host": "web", "state": "done", "cause": "wake",
                                   "generation_id": i, "created_at": OLD, "ended_at": OLD,
                                   **retry_cols()})
        for _ in range(3):
            raw_insert(conn, "events", {"at": OLD, "host": "web", "generation_id": i,
                                        "kind": "swapped", "detail": "{}"})
    for a in range(1, 33):
        raw_insert(conn, "attempts", {
            "id": a, "host": "web", "build_id": build, "digest": "0" * 64, "cause": "release",
            "mode": "overlap", "effective_mode": "overlap", "revision": a, "canary": False,
            "step": "queued" if a == 32 else "ended", "successor_id": a if a <= 30 else None,
            "outcome": None if a == 32 else "done", "created_at": OLD,
            "ended_at": None if a == 32 else OLD, **retry_cols()})
    raw_insert(conn, "members", {"generation_id": 31, "host": "web", "role": "retiring",
                                 "attempt_id": 3, "fence": 1, "unproven": False, **retry_cols()})
    raw_insert(conn, "stops", {"id": 1, "host": "web", "state": "done", "generation_id": 5,
                               "created_at": OLD, "ended_at": OLD, **retry_cols()})
    for a in range(33, 36):
        raw_insert(conn, "attempts", {
            "id": a, "host": "api", "build_id": build, "digest": "0" * 64, "cause": "release",
            "mode": "hold", "effective_mode": "hold", "revision": a, "canary": False,
            "step": "ended", "outcome": "failed", "created_at": OLD, "ended_at": OLD,
            **retry_cols()})
    for _ in range(5):
        raw_insert(conn, "events", {"at": RECENT, "host": "web", "kind": "woke", "detail": "{}"})


def ids(v: Vigil, table: str, host: str = "web") -> list[int]:
    key = "generation_id" if table == "members" else "id"
    with v.store.engine.connect() as conn:
        return [r[0] for r in conn.execute(text(
            f"SELECT {key} FROM {table} WHERE host = :h ORDER BY {key}"), {"h": host})]


def old_events(v: Vigil) -> int:
    with v.store.engine.connect() as conn:
        return conn.execute(text("SELECT count(*) FROM events WHERE at < :c"),
                            {"c": utcnow() - timedelta(days=30)}).scalar_one()


@pytest.fixture
def history(vigil: Vigil) -> Vigil:
    vigil.add_host("web")
    vigil.add_host("api")
    with vigil.store.engine.begin() as conn:
        build = conn.execute(text("SELECT build_id FROM hosts WHERE name = 'web'")).scalar_one()
        seed(conn, build)
    return vigil


def snapshot(v: Vigil) -> dict[str, list[int]]:
    return {t: ids(v, t) for t in ("generations", "wakes", "stops", "attempts", "members")} | {
        "api attempts": ids(v, "attempts", "api")}


EXPECTED = {
    # newest 5 (28-32); 3 named by the open member; 5 named by the kept stop; 26, 27 named
    # by kept wakes; 31 is live
    "generations": [3, 5, 26, 27, 28, 29, 30, 31, 32],
    "wakes": [26, 27, 28, 29, 30],  # the newest 5
    "stops": [1],  # the host's only stop: among its newest 5
    "attempts": [3, 28, 29, 30, 31, 32],  # newest 5 (32 still open) and 3, named by a member
    "members": [31],
    "api attempts": [33, 34, 35],  # fewer than 5: all kept
}


def test_gc_prunes_what_nothing_needs_and_keeps_the_rest(history: Vigil) -> None:
    v = history
    before = snapshot(v)
    out = v.run("gc", "--keep-last", "5", "--dry-run").stdout
    # What a prune would delete, counted as of its end (generations named only by rows
    # that go before them go too).
    assert "90 events, 25 wakes, 0 stops, 26 attempts, 23 generations" in out, out
    assert snapshot(v) == before and old_events(v) == 90, "a dry run changes nothing"
    out = v.run("gc", "--keep-last", "5").stdout
    assert "history pruned: 90 events, 25 wakes, 0 stops, 26 attempts, 23 generations" in out, out
    assert snapshot(v) == EXPECTED
    assert old_events(v) == 0
    assert len(v.json("events", "web", "--limit", "1000")) >= 5  # the recent ones stay
    again = v.run("gc", "--keep-last", "5").stdout
    assert "0 events, 0 wakes, 0 stops, 0 attempts, 0 generations" in again, again


def test_prune_goes_in_small_batches(history: Vigil) -> None:
    """Each batch is one statement in its own transaction, of at most `batch` rows."""
    v = history
    statements: list[str] = []
    writes = 0
    real: Callable[..., Any] = v.store.write

    def counting(fn: Callable[..., Any]) -> Any:
        nonlocal writes
        writes += 1
        return real(fn)

    from sqlalchemy import event

    @event.listens_for(v.store.engine, "before_cursor_execute")
    def seen(_c: Any, _cur: Any, statement: str, *_: Any) -> None:
        if statement.lstrip().upper().startswith("DELETE"):
            statements.append(statement)

    v.store.write = counting  # type: ignore[method-assign]
    done = prune(v.store, Keep(older_than=timedelta(days=30), last=5), batch=7)
    assert done == {"events": 90, "wakes": 25, "stops": 0, "attempts": 26, "generations": 23,
                    "delivery_tries": 0, "deliveries": 0}
    # Per table, batches until one deletes fewer than 7: 90 events in 13, 25 wakes in 4, no
    # stop in 1, 26 attempts in 4, 23 generations in 4, no delivery try and no delivery in 1 each.
    assert len(statements) == writes == 13 + 4 + 1 + 4 + 4 + 1 + 1, (len(statements), writes)
    assert snapshot(v) == EXPECTED


def test_keep_forever_prunes_nothing(history: Vigil) -> None:
    before = snapshot(history)
    out = history.run("gc", "--keep-history", "forever").stdout
    assert "history pruned: nothing (kept forever)" in out, out
    assert snapshot(history) == before and old_events(history) == 90


@pytest.mark.parametrize("value", ["30", "nan", "-1d", "59m", "1e400d", "soon"])
def test_keep_history_out_of_range_is_refused(vigil: Vigil, value: str) -> None:
    from tests.integration.test_cli_bad_input import refused

    refused(vigil.run("gc", "--keep-history", value, check=False), "--keep-history", "30d")


def test_agent_prunes_history_on_its_schedule(history: Vigil) -> None:
    """The agent's first prune runs a few seconds after it is ready (then every 10 min)."""
    v = history
    with v.store.engine.begin() as conn:  # the open member and attempt would be driven
        conn.execute(text("DELETE FROM members"))
        conn.execute(text("UPDATE attempts SET outcome = 'abandoned', ended_at = :t "
                          "WHERE id = 32"), {"t": OLD})
        conn.execute(text("UPDATE generations SET state = 'proven', ended_at = :t WHERE id = 31"),
                     {"t": OLD})
    agent = v.start_agent("", "--keep-last", "5")
    v.wait_ready(agent)
    wait_for(lambda: b"history pruned" in v.agent_log(), 30, what="the agent's prune")
    assert old_events(v) == 0
    # Nothing names generation 3 or attempt 3 now: only each host's newest 5 (and what the
    # stop and the kept wakes name) stay.
    assert ids(v, "attempts") == [28, 29, 30, 31, 32]
    assert ids(v, "generations") == [5, 26, 27, 28, 29, 30, 31, 32]
    assert ids(v, "attempts", "api") == [33, 34, 35]
    assert b"Traceback" not in v.agent_log()
