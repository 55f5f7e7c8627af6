#!/usr/bin/env python3
"""Obligation throughput: how fast the agent drains obligations that need only store work.

Each run, interleaved, on the same disk (a fresh directory under --dir, default /tmp):
  raw          stdlib sqlite3, WAL, synchronous=FULL: single-row INSERT commits/s (the
               limit an fsync per transaction puts on any durable store on this disk)
  raw_batched  the like-for-like baseline: stdlib sqlite3 on a copy of vigil's seeded store
               (same schema, rows, pragmas) running the statements the agent's give_back
               runs, 256 rows a commit: the physical limit of the agent's drain here
  vigil        N owed lease releases (one host each, lease held by this agent id) seeded
               with SQL into a migrated store; the agent is started and drains them;
               resolutions/s from the agent's `agent_started` event to the commit of its
               last row (a reader polls the store for the rows to be gone: the raw sides
               are timed around every commit too); CPU per resolution summed over every
               vigil process (the agent and the helpers it started)
  dbos_default, dbos_wal
               when bench/.peers has the `dbos` package: one DBOS workflow of M trivial
               steps on a SQLite system database, steps/s (bench/dbos_steps.py): once as
               DBOS leaves the file (rollback journal), once on a file set to WAL first
Every `result:` field names its side; each side's journal mode and synchronous level are
printed with it, and VIGIL_SYNCHRONOUS as the agents inherited it.
Ratios: vigil / raw_batched is like for like (same statements, same batch, same
durability); vigil / raw and vigil / DBOS are system-level (group commit against a commit
per row or per step), and DBOS / raw is DBOS's like-for-like figure.
Goals: vigil >= 5,000/s, >= 25x DBOS, <= 0.2 ms CPU per resolution.

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
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from baselines import raw_batched_rate, raw_rate  # noqa: E402
from common import (  # noqa: E402
    PEERS_PY,
    ROOT,
    cpu_s,
    durability,
    end,
    loadavg,
    ratios,
    start_agent,
    summary,
    vigil,
    vigil_durability,
    vigil_pids,
)


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


def at(ts: str) -> float:
    return datetime.fromisoformat(ts).replace(tzinfo=UTC).timestamp()


def drained(home: Path, agent: subprocess.Popen[bytes], n: int, timeout: float,
            first: Callable[[int], None]) -> float:
    """time.time() at which a reader first sees no owed release left: the commit of the
    agent's last row (seen within 2 ms once the end is near; 50 ms polls before). `first`
    is called once, with the rows left, when the first rows are gone."""
    con = sqlite3.connect(f"file:{home / 'vigil.db'}?mode=ro", uri=True, isolation_level=None)
    t0 = time.monotonic()
    seen_first = False
    try:
        while left := con.execute("SELECT count(*) FROM releases").fetchone()[0]:
            if not seen_first and left < n:
                first(left)
                seen_first = True
            if agent.poll() is not None:
                raise RuntimeError(f"agent exited {agent.returncode}; see the agent.log beside {home}")
            if time.monotonic() - t0 > timeout:
                raise RuntimeError(f"{left} of {n} obligations still open after {timeout:.0f}s")
            time.sleep(0.05 if left > 1024 else 0.002)
        return time.time()
    finally:
        con.close()


def vigil_rate(where: Path, n: int, timeout: float) -> dict[str, Any]:
    """The agent's drain of n owed releases, and the like-for-like raw baseline on a copy of
    the same seeded store. Keys: vigil (resolutions/s from the agent's `agent_started` event
    to the commit of its last row, as seen by a reader), wall (s from Popen), cpu (CPU s
    per resolution of every vigil process, agent and helpers, from the first resolution
    seen to the last), batched (the raw baseline's rate), modes (its journal, synchronous)."""
    home = where / "state"
    agent_id = seed(home, n)
    shutil.copy(home / "vigil.db", where / "batched.db")  # seed closed its connection: no WAL left
    batched, *modes = raw_batched_rate(where / "batched.db", agent_id, n)
    t0 = time.monotonic()
    agent = start_agent(home, where / "agent.log")
    cpu0: dict[int, float] = {}
    left0 = [n]

    def first(left: int) -> None:
        cpu0.update({pid: cpu_s([pid]) for pid in vigil_pids(home)})
        left0[0] = left

    try:
        done = drained(home, agent, n, timeout, first)
        wall = time.monotonic() - t0
        pids = vigil_pids(home)
        cpu = sum(cpu_s([pid]) - cpu0.get(pid, 0.0) for pid in pids)
        vigil_modes = vigil_durability(home / "vigil.db")
    finally:
        end(agent)
    con = sqlite3.connect(home / "vigil.db")
    start = con.execute("SELECT min(at) FROM events WHERE kind = 'agent_started'").fetchone()[0]
    count = con.execute("SELECT count(*) FROM events WHERE kind = 'released'").fetchone()[0]
    open_ = con.execute("SELECT count(*) FROM pending_obligations").fetchone()[0]
    con.close()
    if count != n or open_:
        raise RuntimeError(f"{count} released events for {n} owed releases, {open_} obligations open")
    return {"vigil": n / (done - at(start)), "wall": wall, "cpu": cpu / max(1, left0[0]), "procs": len(pids),
            "batched": batched, "modes": modes, "vigil_modes": vigil_modes}


def pg_seed(db_info: str, n: int, agents: int) -> None:
    """n hosts on PostgreSQL, each holding the lease of box i % agents and owing its release."""
    import psycopg

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


def pg_rate(admin_url: str, n: int, agents: int, where: Path, timeout: float, modes: list[str]) -> float:
    """Resolutions/s on PostgreSQL, from the first agent's `agent_started` to the commit of
    the last row, n owed releases split evenly over `agents` agents (one holder each);
    `modes` gets the server's (journal, synchronous) as the agents' sessions ran."""
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
        pg_seed(db_info, n, agents)
        t0 = time.monotonic()
        for i, home in enumerate(homes):
            procs.append(start_agent(home, where / f"agent{i}.log", {**env, "VIGIL_BOX": f"box{i}"}))
        with psycopg.connect(db_info, autocommit=True) as c:
            # Timed to the commit of the last row, as a reader sees it (2 ms polls near the end).
            while left := c.execute("SELECT count(*) FROM releases").fetchone()[0]:
                if any(p.poll() is not None for p in procs):
                    logs = "".join(f.read_text()[-1500:] for f in sorted(where.glob("agent*.log")))
                    raise RuntimeError(f"an agent exited:\n{logs}")
                if time.monotonic() - t0 > timeout:
                    raise RuntimeError(f"releases still open after {timeout:.0f}s")
                time.sleep(0.05 if left > 1024 else 0.002)
            done = time.time()
            start = c.execute("SELECT min(at) FROM events WHERE kind = 'agent_started'").fetchone()[0]
            count = c.execute("SELECT count(*) FROM events WHERE kind = 'released'").fetchone()[0]
            settings = {k: c.execute(f"SHOW {k}").fetchone()[0] for k in ("synchronous_commit", "fsync")}
        if count != n:
            raise RuntimeError(f"{count} released events for {n} owed releases")
        off = os.environ.get("VIGIL_SYNCHRONOUS", "FULL").upper() == "OFF"  # the agents set it per session
        modes[:] = ["wal", f"commit-{'off' if off else settings['synchronous_commit']},fsync-{settings['fsync']}"]
        return n / (done - start.replace(tzinfo=UTC).timestamp())
    finally:
        for p in procs:
            end(p)
        with psycopg.connect(conninfo, autocommit=True) as c:
            c.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def dbos_rate(where: Path, n: int, journal: str) -> tuple[float, str, str] | None:
    """DBOS steps/s on SQLite with its own settings (`journal` "default": the rollback
    journal it leaves in place) or on a file set to WAL first ("wal"), and the (journal,
    synchronous) read on DBOS's own connection; None when DBOS is not installed."""
    if not PEERS_PY.exists():
        return None
    has = subprocess.run([str(PEERS_PY), "-c", "import dbos"], capture_output=True)
    if has.returncode != 0:
        return None
    run = where / f"dbos-{journal}"
    run.mkdir()
    cp = subprocess.run([str(PEERS_PY), str(ROOT / "bench" / "dbos_steps.py"), str(n), str(run), journal],
                        cwd=run, capture_output=True, text=True, timeout=600)
    m = re.search(r"steps_per_s=([\d.]+) journal=(\S+) synchronous=(\S+)", cp.stdout)
    if cp.returncode != 0 or not m:
        raise RuntimeError(f"dbos_steps.py exited {cp.returncode}: {cp.stdout[-500:]}{cp.stderr[-2000:]}")
    return float(m.group(1)), m.group(2), m.group(3)


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
    rows: list[dict[str, Any]] = []
    for i in range(args.runs):
        where = Path(tempfile.mkdtemp(prefix="vgobl", dir=args.dir))
        try:
            raw, *raw_modes = raw_rate(where, args.raw_commits)
            r = {"raw": raw, "raw_modes": raw_modes, **vigil_rate(where, args.obligations, timeout=900)}
            for journal in ("default", "wal"):
                r[f"dbos_{journal}"] = dbos_rate(where, args.dbos_steps, journal)
            rows.append(r)
            ds = "  ".join(f"dbos ({d[1]}) {d[0]:.1f} steps/s" if d else "dbos not installed"
                           for d in (r["dbos_default"], r["dbos_wal"]))
            print(f"run {i + 1}: raw single-row {raw:,.0f} commits/s  raw batched {r['batched']:,.0f}/s  "
                  f"vigil {r['vigil']:,.1f} resolutions/s (wall {r['wall']:.2f}s from Popen, CPU "
                  f"{r['cpu'] * 1000:.3f} ms each over {r['procs']} vigil processes)  {ds}", flush=True)
        finally:
            shutil.rmtree(where, ignore_errors=True)
    report(args, rows, load0)


def report(args: argparse.Namespace, rows: list[dict[str, Any]], load0: str) -> None:
    def col(k: str) -> list[float]:
        return [r[k] for r in rows]

    vigils = col("vigil")
    print(f"\nruns: {args.runs} (interleaved), {args.obligations} owed releases each; "
          f"loadavg start {load0}, end {loadavg()}")
    print(f"raw sqlite3, one INSERT a commit       : {summary(col('raw'), '/s')} ({'/'.join(rows[0]['raw_modes'])})")
    print(f"raw sqlite3, give_back's statements    : {summary(col('batched'), '/s')} ({'/'.join(rows[0]['modes'])}, "
          f"256 rows a commit)")
    print(f"vigil owed releases resolved           : {summary(vigils, '/s')} (window: agent_started -> "
          f"commit of the last row)")
    print(f"vigil wall from agent Popen to empty   : {summary(col('wall'), 's')}")
    print(f"vigil CPU per resolution, all processes: {summary([c * 1000 for c in col('cpu')], '')} ms "
          f"(agent and helpers; goal <= 0.2 ms)")
    print(f"ratio vigil / raw batched (like for like): {summary(ratios(vigils, col('batched')), 'x')} "
          f"(what vigil reaches of the physical limit of its own statements)")
    print(f"ratio vigil / raw one-row commits        : {summary(ratios(vigils, col('raw')), 'x')} "
          f"(group commit against a commit per row: the system-level figure)")
    fields = [f"vigil.per_s={statistics.median(vigils):.1f}", rows[0]["vigil_modes"],
              f"raw.per_s={statistics.median(col('raw')):.1f}", durability("raw", *rows[0]["raw_modes"]),
              f"raw_batched.per_s={statistics.median(col('batched')):.1f}",
              durability("raw_batched", *rows[0]["modes"]),
              f"vigil_of_batched={statistics.median(ratios(vigils, col('batched'))):.3f}"]
    for journal in ("default", "wal"):
        side = f"dbos_{journal}"
        if rows[0][side] is None:
            print(f"{side:<39}: not installed (run bench/install-peers)")
            continue
        rates = [r[side][0] for r in rows]
        mode = f"{rows[0][side][1]}/{rows[0][side][2]}"
        print(f"{f'dbos steps on SQLite ({mode})':<39}: {summary(rates, '/s')}; of raw one-row commits "
              f"{summary(ratios(rates, col('raw')), 'x')} (one commit a step: like for like)")
        print(f"{f'ratio vigil / dbos ({mode})':<41}: {summary(ratios(vigils, rates), 'x')} "
              f"(system level: vigil batches, DBOS commits each step)")
        fields += [f"{side}.per_s={statistics.median(rates):.1f}", durability(side, *rows[0][side][1:])]
    print("result: obligations " + " ".join(fields))


def pg_main(args: argparse.Namespace) -> None:
    load0 = loadavg()
    counts = [int(x) for x in args.agents.split(",")]
    rates: dict[int, list[float]] = {k: [] for k in counts}
    modes: list[str] = []
    for i in range(args.runs):
        for k in counts:
            where = Path(tempfile.mkdtemp(prefix="vgoblpg", dir=args.dir))
            try:
                rates[k].append(pg_rate(args.db, args.obligations, k, where, timeout=900, modes=modes))
            finally:
                shutil.rmtree(where, ignore_errors=True)
        print(f"run {i + 1}: " + "  ".join(f"{k} agent(s) {rates[k][-1]:,.1f} resolutions/s"
                                           for k in counts), flush=True)
    print(f"\nPostgreSQL ({'/'.join(modes)}), runs: {args.runs} (interleaved), {args.obligations} owed "
          f"releases each; loadavg start {load0}, end {loadavg()}")
    for k in counts:
        print(f"vigil, {k} agent(s), resolved            : {summary(rates[k], '/s')}"
              + (" (goal >= 2,000/s)" if k == 1 else ""))
    fields = [f"vigil.agents{k}_per_s={statistics.median(rates[k]):.1f}" for k in counts]
    if 1 in rates and 2 in rates:
        per_run = ratios(rates[2], rates[1])
        print(f"ratio 2 agents / 1 (per run)             : {summary(per_run, 'x')} (goal >= 1.6x)")
        fields.append(f"two_over_one={statistics.median(per_run):.2f}")
    sync = os.environ.get("VIGIL_SYNCHRONOUS", "unset")
    print("result: obligations-pg " + " ".join(fields) + f" {durability('vigil', *modes)} VIGIL_SYNCHRONOUS={sync}")

if __name__ == "__main__":
    main()
