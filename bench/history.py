#!/usr/bin/env python3
"""History size: a reconciler round costs the same whether the store keeps 1,000 events or
1,000,000 (and the attempts, generations, wakes and stops that go with them).

Each size gets a fresh store (a SQLite file under --dir, default /tmp, or with --db a
PostgreSQL database created beside the one named and dropped after), migrated, then seeded
in SQL: --hosts hosts, each with a current generation and a wake queued for an hour from
now (open rows a round reads but that are not due), and a history of N events with, per
three events, one ended attempt, one proven generation, one done wake and, every other
time, one done stop (the mix of the issue's soak: about 1.2 KB per deploy). The small size
is the baseline, measured in the same run, interleaved with the large one.

A round is what the agent's reconciler reads when it starts one afresh: the earliest due
row of each host (`due`, rotating, up to 256 hosts), the store-only batches
(`drain_batches`), and its next wake-up (`next_due`); then the exit watcher's read of the
current leaders. Timed in this process, --rounds rounds per size per pass, --passes passes.
Goal: the large store's median round within 1.5x of the baseline's.

    bench/history.py                         # 1,000 vs 1,000,000 events, SQLite
    bench/history.py --db postgresql+psycopg://root@127.0.0.1:5432/test
    bench/history.py --quick                 # 1,000 vs 20,000: a smoke run, not a figure
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SYNC_NAMES, durability, inherited_sync, loadavg, ratios, summary  # noqa: E402

from models import schema  # noqa: E402
from models.statedir import prepare_state_dir  # noqa: E402
from models.store import Store, sqlite_url, utcnow  # noqa: E402
from runners.wiring import make_context  # noqa: E402
from workflows.engine.obligations import drain_batches, due, next_due  # noqa: E402
from workflows.lifecycle.members import current_leaders  # noqa: E402

DIGEST = "ab" * 32


def seed(store: Store, hosts: int, events: int) -> None:
    """Hosts with a current generation and a wake due in an hour; `events` events of
    history, and per three of them an ended attempt, a proven generation, a done wake and
    (every other time) a done stop, all spread over the hosts."""
    now = utcnow()
    old = now - timedelta(days=1)
    later = now + timedelta(hours=1)
    deploys = max(1, events // 3)
    with store.engine.begin() as c:
        c.execute(sa.text("INSERT INTO builds (id, digest, path, source, created_at) "
                          "VALUES (1, :d, '/b/1', '/s', :t)"), {"d": DIGEST, "t": old})
        c.execute(sa.text(
            "INSERT INTO hosts (name, kind, build_id, args, env, drain_timeout, health_timeout,"
            " desired, raised, fence_seq, created_at) VALUES (:n, 'instance', 1, '[]', '{}',"
            " 10, 10, 'up', false, 1, :t)"), [{"n": f"h{i:04d}", "t": old} for i in range(hosts)])
        # History first (low ids), then the live rows.
        series = ("WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < :count) ")
        pad = ("lpad(CAST(i % {n} AS TEXT), 4, '0')" if store.dialect == "postgresql"
               else "substr('0000' || (i % {n}), -4, 4)")
        host_of = "'h' || " + pad.format(n=hosts)
        c.execute(sa.text(series + f"""
            INSERT INTO generations (id, uuid, host, build_id, state, fence, pid, create_time,
                                     agent_id, created_at, ended_at, end_reason)
            SELECT i, 'hist-' || i, {host_of}, 1, 'proven', 1, 1, 1.0, 'bench', :t, :t, 'replaced'
            FROM n"""), {"count": deploys, "t": old})
        c.execute(sa.text(series + f"""
            INSERT INTO attempts (id, host, build_id, digest, cause, mode, effective_mode,
                                  revision, canary, step, fence, successor_id, outcome, reason,
                                  executed, attempts, next_attempt_at, since, created_at, ended_at)
            SELECT i, {host_of}, 1, :d, 'release', 'overlap', 'overlap', i, false, 'ended', 1, i,
                   'done', 'switched and drained', true, 0, :t, :t, :t, :t
            FROM n"""), {"count": deploys, "t": old, "d": DIGEST})
        c.execute(sa.text(series + f"""
            INSERT INTO wakes (id, host, state, cause, fence, generation_id, attempts,
                               next_attempt_at, since, created_at, ended_at)
            SELECT i, {host_of}, 'done', 'wake', 1, i, 0, :t, :t, :t, :t FROM n"""),
                  {"count": deploys, "t": old})
        c.execute(sa.text(series + f"""
            INSERT INTO stops (id, host, state, fence, generation_id, attempts, next_attempt_at,
                               since, created_at, ended_at)
            SELECT i, {host_of}, 'done', 1, i * 2, 0, :t, :t, :t, :t FROM n"""),
                  {"count": max(1, deploys // 2), "t": old})
        c.execute(sa.text(series + f"""
            INSERT INTO events (at, host, generation_id, kind, detail)
            SELECT :t, {host_of}, i / 3, 'swapped', '{{"attempt": 1, "drain_seconds": 0.01}}'
            FROM n"""), {"count": events, "t": old})
        if store.dialect == "postgresql":  # ids given explicitly: move the sequences past them
            for table in ("generations", "attempts", "wakes", "stops", "events", "builds"):
                c.execute(sa.text(f"SELECT setval(pg_get_serial_sequence('{table}', 'id'), "
                                  f"(SELECT max(id) FROM {table}))"))
        for i in range(hosts):
            gid = deploys + 1 + i
            c.execute(sa.text(
                "INSERT INTO generations (id, uuid, host, build_id, state, fence, pid, "
                "create_time, agent_id, created_at, current_at) VALUES (:g, :u, :h, 1, "
                "'current', 1, 1, 1.0, 'bench', :t, :t)"),
                {"g": gid, "u": str(uuid.uuid4()), "h": f"h{i:04d}", "t": old})
            c.execute(sa.text(
                "INSERT INTO wakes (host, state, cause, attempts, next_attempt_at, since, "
                "created_at) VALUES (:h, 'queued', 'wake', 0, :later, :t, :t)"),
                {"h": f"h{i:04d}", "later": later, "t": now})
    if store.dialect == "postgresql":  # as autovacuum would by then (SQLite: vigil runs no ANALYZE)
        with store.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
            c.execute(sa.text("ANALYZE"))


def one_round(ctx: Any) -> float:
    t0 = time.perf_counter()
    rows = due(ctx, utcnow(), after="", limit=256)
    drain_batches(ctx)
    next_due(ctx, set())
    current_leaders(ctx)
    took = time.perf_counter() - t0
    if rows:
        raise RuntimeError(f"a round found {len(rows)} due rows: the seed is wrong")
    return took


class Box:
    def __init__(self, where: Path, db: str | None, hosts: int, events: int) -> None:
        self.state = prepare_state_dir(where / f"s{events}")
        self.pg_name = None
        if db:
            self.pg_name = f"vigil_bench_history_{uuid.uuid4().hex[:8]}"
            self.admin = sa.create_engine(db, isolation_level="AUTOCOMMIT")
            with self.admin.connect() as c:
                c.execute(sa.text(f'CREATE DATABASE "{self.pg_name}"'))
            url = sa.make_url(db).set(database=self.pg_name).render_as_string(hide_password=False)
        else:
            url = sqlite_url(self.state)
        self.store = Store(url)
        schema.upgrade(self.store.engine)
        t0 = time.monotonic()
        seed(self.store, hosts, events)
        self.seeded = time.monotonic() - t0
        self.ctx = make_context(self.state, self.store, "bench")
        self.events = events

    def modes(self) -> tuple[str, str]:
        """(journal, synchronous) on the store's own connection."""
        with self.store.engine.connect() as c:
            if self.pg_name:
                return "wal", f"commit-{c.execute(sa.text('SHOW synchronous_commit')).scalar()}"
            journal = c.execute(sa.text("PRAGMA journal_mode")).scalar()
            sync = c.execute(sa.text("PRAGMA synchronous")).scalar()
        return str(journal).lower(), SYNC_NAMES.get(sync, str(sync))  # type: ignore[call-overload]

    def close(self) -> None:
        self.store.dispose()
        if self.pg_name:
            with self.admin.connect() as c:
                c.execute(sa.text(f'DROP DATABASE IF EXISTS "{self.pg_name}" WITH (FORCE)'))
            self.admin.dispose()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", type=int, default=1_000, help="events in the baseline store")
    ap.add_argument("--large", type=int, default=1_000_000, help="events in the large store")
    ap.add_argument("--hosts", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=200, help="rounds per size per pass")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--db", default=None, help="a PostgreSQL URL to create databases beside")
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--quick", action="store_true", help="1,000 vs 20,000 events, a few rounds")
    args = ap.parse_args()
    if args.quick:
        args.large, args.rounds, args.passes, args.hosts = 20_000, 20, 1, 20
    where = Path(tempfile.mkdtemp(prefix="vigil-history-", dir=args.dir))
    print(f"history: {args.small:,} vs {args.large:,} events, {args.hosts} hosts, "
          f"{'PostgreSQL' if args.db else 'SQLite'}, load {loadavg()}")
    boxes = []
    try:
        for n in (args.small, args.large):
            b = Box(where, args.db, args.hosts, n)
            boxes.append(b)
            print(f"  seeded {n:,} events in {b.seeded:.1f}s")
        times: dict[int, list[float]] = {b.events: [] for b in boxes}
        passes: dict[int, list[float]] = {b.events: [] for b in boxes}  # each pass's median
        for _ in range(args.passes):
            for b in boxes:  # interleaved: the baseline and the large store in turn
                one_round(b.ctx)  # warm the connection and the statement cache
                got = [one_round(b.ctx) for _ in range(args.rounds)]
                times[b.events] += got
                passes[b.events].append(statistics.median(got))
        med = {n: statistics.median(t) * 1000 for n, t in times.items()}
        for n, t in times.items():
            q = statistics.quantiles(t, n=10) if len(t) >= 10 else [max(t)] * 9
            print(f"  {n:>9,} events: round median (min-max) {summary(t)}, p90 {q[8] * 1000:.3f} ms "
                  f"({len(t)} rounds)")
        ratio = med[args.large] / med[args.small]
        per_pass = ratios(passes[args.large], passes[args.small])
        print(f"  ratio large / baseline: {ratio:.2f}x of the medians; per pass {summary(per_pass, 'x')}")
        side = durability("vigil", *boxes[0].modes())
        print(f"result: history large/baseline round cost {ratio:.2f}x "
              f"(goal <= 1.5x: {'met' if ratio <= 1.5 else 'missed'}) ratio={ratio:.2f} "
              f"vigil.small_ms={med[args.small]:.3f} vigil.large_ms={med[args.large]:.3f} {side} {inherited_sync()}")
    finally:
        for b in boxes:
            b.close()
        shutil.rmtree(where, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
