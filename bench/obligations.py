#!/usr/bin/env python3
"""Obligation throughput: how fast the agent drains obligations that need only store work.

Each run, interleaved, on the same disk (a fresh directory under --dir, default /tmp):
  raw    stdlib sqlite3, WAL, synchronous=FULL: single-row INSERT commits/s (the limit an
         fsync per transaction puts on any durable store on this disk)
  vigil  N owed lease releases (one host each, lease held by this agent id) seeded with SQL
         into a migrated store; the agent is started and drains them; resolutions/s from
         the agent's `agent_started` event to its last `released` event (all event rows
         are written by the agent in the transactions that do the work)
  dbos   when bench/.peers has the `dbos` package: one DBOS workflow of M trivial steps on
         a SQLite system database, steps/s (bench/dbos_steps.py, DBOS's own SQLite settings)
Goals: vigil >= 5,000/s and >= 50% of raw, >= 25x DBOS, <= 0.2 ms agent CPU per resolution.

With --db postgresql+psycopg://USER@HOST/DB (a database to connect to; each run creates and
drops a database of its own beside it) the same owed releases are drained on PostgreSQL
by 1 and by 2 agents (--agents 1,2) sharing the store as two boxes would, each giving back
its own leases (claimed with SKIP LOCKED); interleaved, with the ratio of 2 to 1.
Goals there: >= 2,000/s with one agent, two agents >= 1.6x one.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timedelta
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import PEERS_PY, ROOT, end, loadavg, start_agent, vigil  # noqa: E402


def raw_rate(where: Path, n: int) -> float:
    path = where / "raw.db"
    con = sqlite3.connect(path, isolation_level=None)
    con.execute("PRAGMA journal_mode=WAL")
    con.execute("PRAGMA synchronous=FULL")
    con.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, v TEXT)")
    t0 = time.perf_counter()
    for i in range(n):
        con.execute("BEGIN IMMEDIATE")
        con.execute("INSERT INTO t (v) VALUES (?)", (f"row {i}",))
        con.execute("COMMIT")
    dt = time.perf_counter() - t0
    con.close()
    return n / dt


def seed(home: Path, n: int) -> str:
    """Migrated store with n hosts, each holding this agent's lease and owing its release."""
    vigil(home, "db", "upgrade")
    agent = f"bench-{os.getpid()}"
    (home / "agent-id").write_text(agent + "\n")
    now = datetime.utcnow()
    ts = now.isoformat(" ")
    later = (now + timedelta(hours=1)).isoformat(" ")
    con = sqlite3.connect(home / "vigil.db", isolation_level=None)
    con.execute("BEGIN")
    con.execute("INSERT INTO builds (id, digest, path, source, created_at) VALUES (1, ?, ?, ?, ?)",
                ("0" * 64, "/nonexistent/build", "/nonexistent/build", ts))
    hosts = [f"h{i:05d}" for i in range(n)]
    con.executemany("INSERT INTO hosts (name, kind, build_id, args, env, drain_timeout, health_timeout,"
                    " desired, raised, fence_seq, created_at) VALUES (?, 'worker', 1, '[]', '{}', 5, 5,"
                    " 'down', 0, 1, ?)", [(h, ts) for h in hosts])
    con.executemany("INSERT INTO leases (host, holder, fence, acquired_at, expires_at)"
                    " VALUES (?, ?, 1, ?, ?)", [(h, agent, ts, later) for h in hosts])
    con.executemany("INSERT INTO releases (host, holder, fence, attempts, next_attempt_at, since)"
                    " VALUES (?, ?, 1, 0, ?, ?)", [(h, agent, ts, ts) for h in hosts])
    con.execute("COMMIT")
    con.close()
    return agent


def pending(home: Path) -> int:
    con = sqlite3.connect(f"file:{home / 'vigil.db'}?mode=ro", uri=True)
    try:
        return con.execute("SELECT count(*) FROM pending_obligations").fetchone()[0]
    finally:
        con.close()


def cpu(p: psutil.Process) -> float:
    t = p.cpu_times()
    return t.user + t.system


def vigil_rate(where: Path, n: int, timeout: float) -> tuple[float, float, float]:
    """(resolutions/s from agent start to last release, wall s from Popen, agent CPU s per
    resolution after its start-up: from the first resolution seen to the last)"""
    home = where / "state"
    seed(home, n)
    t0 = time.monotonic()
    agent = start_agent(home, where / "agent.log")
    ps = psutil.Process(agent.pid)
    cpu0 = None
    left0 = n
    try:
        while left := pending(home):
            if cpu0 is None and left < n:
                cpu0, left0 = cpu(ps), left
            if agent.poll() is not None:
                raise RuntimeError(f"agent exited {agent.returncode}; see {where / 'agent.log'}")
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"{pending(home)} of {n} obligations still open after {timeout:.0f}s")
            time.sleep(0.05)
        wall = time.monotonic() - t0
        per = (cpu(ps) - (cpu0 or 0.0)) / max(1, left0)
    finally:
        end(agent)
    con = sqlite3.connect(home / "vigil.db")
    start = con.execute("SELECT min(at) FROM events WHERE kind = 'agent_started'").fetchone()[0]
    last, count = con.execute("SELECT max(at), count(*) FROM events WHERE kind = 'released'").fetchone()
    con.close()
    if count != n:
        raise RuntimeError(f"{count} released events for {n} owed releases")
    span = (datetime.fromisoformat(last) - datetime.fromisoformat(start)).total_seconds()
    return n / span, wall, per


def pg_rate(admin_url: str, n: int, agents: int, where: Path, timeout: float) -> float:
    """Resolutions/s on PostgreSQL, from the first agent's `agent_started` to the last
    `released`, n owed releases split evenly over `agents` agents (one holder each)."""
    import uuid

    import psycopg
    from sqlalchemy.engine import make_url

    admin = make_url(admin_url)
    conninfo = admin.set(drivername="postgresql").render_as_string(hide_password=False)
    name = f"vigil_bench_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(conninfo, autocommit=True) as c:
        c.execute(f'CREATE DATABASE "{name}"')
    url = admin.set(database=name).render_as_string(hide_password=False)
    db_info = make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        env = {"VIGIL_DB": url}
        homes = [where / f"box{i}" for i in range(agents)]
        for home in homes:  # the first migrates the store; each makes its box's state dir
            vigil(home, "db", "upgrade", env=env)
        now = datetime.utcnow()
        later = now + timedelta(hours=1)
        hosts = [f"h{i:05d}" for i in range(n)]
        with psycopg.connect(db_info) as c:
            c.execute("INSERT INTO builds (id, digest, path, source, created_at) VALUES (1, %s, %s, %s, %s)",
                      ("0" * 64, "/nonexistent/build", "/nonexistent/build", now))
            with c.cursor() as cur:
                cur.executemany("INSERT INTO hosts (name, kind, build_id, args, env, drain_timeout,"
                                " health_timeout, desired, raised, fence_seq, created_at) VALUES"
                                " (%s, 'worker', 1, '[]', '{}', 5, 5, 'down', false, 1, %s)",
                                [(h, now) for h in hosts])
                cur.executemany("INSERT INTO leases (host, holder, fence, acquired_at, expires_at)"
                                " VALUES (%s, %s, 1, %s, %s)",
                                [(h, f"box{i % agents}", now, later) for i, h in enumerate(hosts)])
                cur.executemany("INSERT INTO releases (host, holder, fence, attempts, next_attempt_at, since)"
                                " VALUES (%s, %s, 1, 0, %s, %s)",
                                [(h, f"box{i % agents}", now, now) for i, h in enumerate(hosts)])
        t0 = time.monotonic()
        for i, home in enumerate(homes):
            procs.append(start_agent(home, where / f"agent{i}.log", {**env, "VIGIL_BOX": f"box{i}"}))
        with psycopg.connect(db_info, autocommit=True) as c:
            while c.execute("SELECT count(*) FROM releases").fetchone()[0]:
                if any(p.poll() is not None for p in procs):
                    logs = "".join(f.read_text()[-1500:] for f in sorted(where.glob("agent*.log")))
                    raise RuntimeError(f"an agent exited:\n{logs}")
                if time.monotonic() - t0 > timeout:
                    raise RuntimeError(f"releases still open after {timeout:.0f}s")
                time.sleep(0.05)
            start = c.execute("SELECT min(at) FROM events WHERE kind = 'agent_started'").fetchone()[0]
            last, count = c.execute("SELECT max(at), count(*) FROM events WHERE kind = 'released'").fetchone()
        if count != n:
            raise RuntimeError(f"{count} released events for {n} owed releases")
        return n / (last - start).total_seconds()
    finally:
        for p in procs:
            end(p)
        with psycopg.connect(conninfo, autocommit=True) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def dbos_rate(where: Path, n: int) -> float | None:
    if not PEERS_PY.exists():
        return None
    has = subprocess.run([str(PEERS_PY), "-c", "import dbos"], capture_output=True)
    if has.returncode != 0:
        return None
    cp = subprocess.run([str(PEERS_PY), str(ROOT / "bench" / "dbos_steps.py"), str(n), str(where)],
                        cwd=where, capture_output=True, text=True, timeout=600)
    m = re.search(r"steps_per_s=([\d.]+)", cp.stdout)
    if cp.returncode != 0 or not m:
        raise RuntimeError(f"dbos_steps.py exited {cp.returncode}: {cp.stderr[-2000:]}")
    return float(m.group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--obligations", type=int, default=10_000)
    ap.add_argument("--raw-commits", type=int, default=2_000)
    ap.add_argument("--dbos-steps", type=int, default=500)
    ap.add_argument("--dir", default="/tmp", help="where the databases go (the disk measured)")
    ap.add_argument("--quick", action="store_true", help="1 run of 150 obligations, for CI")
    ap.add_argument("--db", default=None, metavar="URL",
                    help="PostgreSQL instead: postgresql+psycopg://USER@HOST/DB to connect to")
    ap.add_argument("--agents", default="1,2", help="with --db: agent counts to compare (1,2)")
    args = ap.parse_args()
    if args.quick:
        args.runs, args.obligations, args.raw_commits, args.dbos_steps = 1, 150, 200, 30
    if args.db:
        return pg_main(args)
    load0 = loadavg()
    raws: list[float] = []
    vigils: list[float] = []
    walls: list[float] = []
    cpus: list[float] = []
    dboses: list[float] = []
    for i in range(args.runs):
        where = Path(tempfile.mkdtemp(prefix="vgobl", dir=args.dir))
        try:
            raws.append(raw_rate(where, args.raw_commits))
            v, wall, per = vigil_rate(where, args.obligations, timeout=900)
            vigils.append(v)
            walls.append(wall)
            cpus.append(per)
            d = dbos_rate(where, args.dbos_steps)
            if d is not None:
                dboses.append(d)
            ds = f"{d:.1f} steps/s" if d is not None else "not installed"
            print(f"run {i + 1}: raw {raws[-1]:,.0f} commits/s  vigil {v:,.1f} resolutions/s "
                  f"(wall {wall:.2f}s from Popen, agent CPU {per * 1000:.2f} ms each)  dbos {ds}",
                  flush=True)
        finally:
            shutil.rmtree(where, ignore_errors=True)

    def med(xs: list[float]) -> str:
        return f"{statistics.median(xs):,.1f}/s ({min(xs):,.1f}-{max(xs):,.1f})"

    print(f"\nruns: {args.runs} (interleaved), {args.obligations} owed releases each; "
          f"loadavg start {load0}, end {loadavg()}")
    print(f"raw sqlite3 WAL FULL single-row commits : {med(raws)}")
    print(f"vigil owed releases resolved            : {med(vigils)}")
    print(f"vigil wall from agent Popen to empty    : median {statistics.median(walls):.2f}s "
          f"({min(walls):.2f}-{max(walls):.2f})")
    print(f"vigil agent CPU per resolution          : median {statistics.median(cpus) * 1000:.2f} ms "
          f"({min(cpus) * 1000:.2f}-{max(cpus) * 1000:.2f})")
    ratio_raw = [v / r for v, r in zip(vigils, raws, strict=True)]
    print(f"ratio vigil / raw (same run)            : median {statistics.median(ratio_raw):.1%} "
          f"({min(ratio_raw):.1%}-{max(ratio_raw):.1%}) (goal >= 50%)")
    if dboses:
        ratio_dbos = [v / d for v, d in zip(vigils, dboses, strict=True)]
        print(f"dbos steps on SQLite                    : {med(dboses)}")
        print(f"ratio vigil / dbos (same run)           : median {statistics.median(ratio_dbos):.1f}x "
              f"({min(ratio_dbos):.1f}-{max(ratio_dbos):.1f}) (goal >= 25x)")
    else:
        print("dbos                                    : not installed (run bench/install-peers)")
    print(f"result: obligations vigil_per_s={statistics.median(vigils):.1f} raw_per_s={statistics.median(raws):.1f} "
          f"dbos_per_s={statistics.median(dboses) if dboses else 'n/a'}")


def pg_main(args: argparse.Namespace) -> None:
    load0 = loadavg()
    counts = [int(x) for x in args.agents.split(",")]
    rates: dict[int, list[float]] = {k: [] for k in counts}
    for i in range(args.runs):
        for k in counts:
            where = Path(tempfile.mkdtemp(prefix="vgoblpg", dir=args.dir))
            try:
                rates[k].append(pg_rate(args.db, args.obligations, k, where, timeout=900))
            finally:
                shutil.rmtree(where, ignore_errors=True)
        print(f"run {i + 1}: " + "  ".join(f"{k} agent(s) {rates[k][-1]:,.1f} resolutions/s"
                                           for k in counts), flush=True)
    print(f"\nPostgreSQL, runs: {args.runs} (interleaved), {args.obligations} owed releases each; "
          f"loadavg start {load0}, end {loadavg()}")
    for k in counts:
        xs = rates[k]
        print(f"vigil, {k} agent(s), resolved            : {statistics.median(xs):,.1f}/s "
              f"({min(xs):,.1f}-{max(xs):,.1f})" + (" (goal >= 2,000/s)" if k == 1 else ""))
    if 1 in rates and 2 in rates:
        ratio = statistics.median(rates[2]) / statistics.median(rates[1])
        print(f"ratio 2 agents / 1 (medians)              : {ratio:.2f}x (goal >= 1.6x)")
    print("result: obligations-pg " + " ".join(f"agents{k}_per_s={statistics.median(rates[k]):.1f}"
                                                for k in counts))


if __name__ == "__main__":
    main()
