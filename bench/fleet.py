#!/usr/bin/env python3
"""A fleet on one PostgreSQL: B agents as real processes on this machine, each with its own
state dir and box id (`vigil agent --box boxN`), each with H worker hosts (a `#!/bin/sh`
build that `exec`s `sleep`) placed on it and on the next box (so every host is
contestable, as in a fleet that fails over: each agent renews, self-fences and looks for
orphans). Per B, from a fresh database:

  start  the agents staggered (at most --starting of them starting at once: 50 or 100 agents
         starting together on 2 cores time out), each up to `ready`; then the B x H hosts
         and their wakes are written in one transaction (in-process, what `vigil host add
         --box` and `vigil wake` write) and every box rung
  quiet  every host has a current generation and nothing is open; then --settle seconds
  sample for --sample seconds, deltas of the database's own counters:
         transactions/s (pg_stat_database xact_commit + xact_rollback), statements/s
         (pg_stat_statements calls, when the server loads it; else n/a), rows read/s
         (pg_stat_user_tables seq_tup_read + idx_tup_fetch, summed over vigil's tables),
         row versions written/s (n_tup_ins + n_tup_upd + n_tup_del), and the connections
         to the database by purpose (pg_stat_activity, by application_name
         `vigil-<box>-<purpose>`); the CPU of every agent process (psutil), the first
         box's agent alone and the mean over all
  intents (--intents R > 0) the same sample again while R intents a second are written, a
         stop then a wake of one host after another across the boxes, each as the CLI of
         this tree writes and rings it (in-process: runners.quick.ops and, where this tree's
         CLI still sends it, the NOTIFY to every box); printed beside the quiet sample, with
         the rows read per intent fleet-wide (the difference over R)
Each figure is also printed per box (divided by B), so growth per box shows as the per-box
column rising with B: O(this box) reads keep it flat, O(fleet) reads make it grow with B.

The server must hold B agents' connections (`SHOW max_connections`): the script says how
many it needs and stops, before anything starts, when the server has fewer free. With
--pooler the agents' store connections go through a PgBouncer of this run's own in
transaction mode (bench/pgbouncer.py, --pool-size server sessions) and only each agent's
LISTEN session goes to the server direct (VIGIL_LISTEN_DB): B + pool size + 4 connections. Every
process it started is ended by its pid: agents, their helpers (by the locks they hold) and
every worker (by the pid and start time its generation recorded); the database is dropped.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import psutil
import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this tree's vigil, not an installed one
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    ROOT,
    cpu_s,
    drop_cgroups,
    durability,
    inherited_sync,
    kill_now,
    loadavg,
    vigil_pids,
)

sys.path.insert(0, str(ROOT))
from models import schema  # noqa: E402
from models.store import AGENT_CONNECTIONS, Store  # noqa: E402
from runners.base.wakeup import notify_boxes  # noqa: E402

ADMIN = os.environ.get("VIGIL_BENCH_PG", "postgresql+psycopg://root@127.0.0.1:5432/test")
LISTEN_SESSIONS = 1  # per agent, direct to the server even behind the pooler

TABLE_COUNTERS = ("seq_scan", "seq_tup_read", "idx_scan", "idx_tup_fetch",
                  "n_tup_ins", "n_tup_upd", "n_tup_del")


def admin_sql(admin: str, sql: str) -> list[Any]:
    eng = sa.create_engine(admin, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    try:
        with eng.connect() as c:
            r = c.execute(sa.text(sql))
            return list(r) if r.returns_rows else []
    finally:
        eng.dispose()


def need(boxes: int, pool: int | None) -> int:
    """Server connections the fleet may hold: each agent's budget (models/store.py) direct;
    through the pooler its LISTEN session and the pooler's own sessions. 4: this script."""
    return (boxes * AGENT_CONNECTIONS if pool is None else boxes * LISTEN_SESSIONS + pool) + 4


def headroom(admin: str, boxes: int, pool: int | None = None) -> None:
    """Stop before anything starts when the server cannot hold the fleet's connections."""
    (limit,), = admin_sql(admin, "SELECT current_setting('max_connections')::int")
    (reserved,), = admin_sql(admin, "SELECT current_setting('superuser_reserved_connections')::int")
    (used,), = admin_sql(admin, "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'")
    wanted = need(boxes, pool)
    free = limit - reserved - used
    if wanted > free:
        sys.exit(f"fleet.py: {boxes} boxes need up to {wanted} connections, the server has {free} free "
                 f"(max_connections {limit}, {used} in use); run fewer boxes, or point "
                 "VIGIL_BENCH_PG at a server with a larger max_connections")


class Fleet:
    def __init__(self, admin: str, boxes: int, hosts: int, ttl: float, starting: int = 4) -> None:
        self.admin, self.boxes, self.hosts, self.ttl = admin, boxes, hosts, ttl
        self.starting = starting  # agents starting at once, at most
        self.agent_env: dict[str, str] = {}  # VIGIL_DB and VIGIL_LISTEN_DB behind a pooler
        self.tmp = Path(tempfile.mkdtemp(prefix="vgfleet", dir="/tmp"))
        self.name = f"vigil_fleet_{uuid.uuid4().hex[:12]}"
        self.url = sa.make_url(admin).set(database=self.name).render_as_string(hide_password=False)
        self.homes = [self.tmp / f"box{i}" for i in range(boxes)]
        self.agents: list[subprocess.Popen[bytes]] = []
        self.helpers: set[int] = set()
        self.peak: dict[str, int] = {}  # the most connections by purpose seen while waking
        self.listen = "on"  # each agent's --listen: off reads its rings each sweep instead

    def create(self) -> None:
        admin_sql(self.admin, f'CREATE DATABASE "{self.name}"')
        store = Store(self.url)
        try:
            schema.upgrade(store.engine)
        finally:
            store.dispose()
        shared = self.tmp / "builds"  # one staging root for every box (docs/guides/several-boxes.md)
        shared.mkdir(mode=0o700)
        for home in self.homes:
            home.mkdir(mode=0o700)
            (home / "builds").symlink_to(shared)

    def start(self) -> None:
        """Every agent, at most `starting` of them not yet ready at any time."""
        env = {**os.environ, "VIGIL_DB": self.url, **self.agent_env}
        self.deadlines: list[float] = []  # each agent's own, from its start: a loaded box is slow
        unready: list[int] = []
        for i, home in enumerate(self.homes):
            log = open(home / "agent.out", "ab")
            self.agents.append(subprocess.Popen(
                [sys.executable, "-m", "runners.cli", "agent", "--box", f"box{i}",
                 "--lease-ttl", str(self.ttl), "--log-level", "INFO", "--listen", self.listen],
                cwd=ROOT, env={**env, "VIGIL_HOME": str(home)}, stdout=log, stderr=log))
            log.close()
            self.deadlines.append(time.monotonic() + 180)
            unready.append(i)
            while len(unready) >= (self.starting if i < self.boxes - 1 else 1):
                unready = [j for j in unready if not self._ready(j, self.deadlines[j])]
                if unready:
                    time.sleep(0.2)

    def _ready(self, i: int, deadline: float) -> bool:
        home, p = self.homes[i], self.agents[i]
        if b"logger=vigil.agent ready" in (home / "agent.out").read_bytes():
            return True
        if p.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"agent of {home.name} not ready; see {home / 'agent.out'}")
        return False

    def place(self, boxes: range | None = None) -> None:
        """H worker hosts of each of `boxes` (default: all B), each placed on its box and the
        next, all woken."""
        from models.states import HostKind
        from runners.backend.files import stage_build
        from workflows.config.hosts import add_host
        from workflows.lifecycle.wake import request_wake

        build = self.tmp / "worker.sh"
        build.write_text("#!/bin/sh\nexec sleep 100000\n")
        build.chmod(0o755)
        path, digest = stage_build(str(build), self.homes[0])
        store = Store(self.url)

        def add(s: Any) -> None:
            for b in boxes if boxes is not None else range(self.boxes):
                placed = ",".join(sorted({f"box{b}", f"box{(b + 1) % self.boxes}"}))
                for h in range(self.hosts):
                    name = f"w{b}-{h}"
                    add_host(s, name, kind=HostKind.worker, build_path=path, digest=digest,
                             source=str(build), args=[], env={}, cwd=None, drain_timeout=5,
                             health_timeout=5, box=placed)
                    request_wake(s, name)

        try:
            store.write(add)
            notify_boxes(store)  # every agent starts a round, as after `vigil wake`
        finally:
            store.dispose()

    def phantoms(self, n: int) -> None:
        """n boxes only the store knows (ph0..): each a live box lease until the run ends
        (its expiry a day away: no renewal to count), an agents row, and H hosts placed on
        it and the next phantom, leased to it at its epoch, each with a current generation of
        no process. Every table a real agent reads is then as large as B + n boxes' would
        be, and the planner picks the plans of that size; the real agents never act on them
        (placed elsewhere, held by a live box)."""
        from models.states import Desired, GenState, HostKind
        from models.store import store_now
        from models.tables import Agent, BoxLease, Build, Generation, Host, Lease

        if n <= 0:
            return
        store = Store(self.url)

        def add(s: Any) -> None:
            now = store_now(s)
            build = s.execute(sa.select(Build.id).order_by(Build.id)).scalars().first()
            names = [f"ph{p}" for p in range(n)]
            s.execute(sa.insert(BoxLease), [{"box": b, "epoch": 1, "expires_at": now + timedelta(days=1)}
                                            for b in names])
            s.execute(sa.insert(Agent), [{"id": b, "box": b, "state_dir": "/nonexistent",
                                          "started_at": now, "heartbeat_at": now} for b in names])
            hosts = [(f"p{p}-{h}", names[p], ",".join(sorted({names[p], names[(p + 1) % n]})))
                     for p in range(n) for h in range(self.hosts)]
            s.execute(sa.insert(Host), [{"name": h, "kind": HostKind.worker, "build_id": build,
                                         "desired": Desired.up, "box": placed, "created_at": now,
                                         "fence_seq": 1} for h, _, placed in hosts])
            s.execute(sa.insert(Lease), [{"host": h, "holder": b, "fence": 1, "acquired_at": now,
                                          "expires_at": now + timedelta(days=1), "epoch": 1}
                                         for h, b, _ in hosts])
            s.execute(sa.insert(Generation), [{"uuid": str(uuid.uuid4()), "host": h, "build_id": build,
                                               "state": GenState.current, "fence": 1, "agent_id": b,
                                               "created_at": now, "current_at": now}
                                              for h, b, _ in hosts])

        try:
            store.write(add)
        finally:
            store.dispose()
        admin_sql(self.url, "ANALYZE")  # the planner's view of the large tables, as autovacuum's would be

    def wake_in_waves(self, per_wave: int, settle: float) -> float:
        """The boxes' hosts placed and woken `per_wave` boxes at a time, each wave once the
        one before runs (all at once starts B x H apps and their transactions together,
        which 100 agents on 2 cores do not survive); then quiet as wait_quiet."""
        t0 = time.monotonic()
        for first in range(0, self.boxes, per_wave):
            last = min(self.boxes, first + per_wave)
            self.place(range(first, last))
            self.wait_quiet(0.0, want=last * self.hosts)
        self.wait_quiet(settle)
        return time.monotonic() - t0 - settle

    def wait_quiet(self, settle: float, want: int | None = None) -> float:
        t0 = time.monotonic()
        want = self.boxes * self.hosts if want is None else want
        deadline = t0 + 60 + want * 0.2
        eng = sa.create_engine(self.url, poolclass=sa.pool.NullPool)
        try:
            while True:
                with eng.connect() as c:
                    up = c.execute(sa.text("SELECT count(*) FROM generations WHERE state = 'current' "
                                          "AND agent_id NOT LIKE 'ph%'")).scalar()
                    left = c.execute(sa.text("SELECT count(*) FROM pending_obligations")).scalar()
                now = connections(self)
                for k, v in now.items():
                    self.peak[k] = max(self.peak.get(k, 0), v)
                if up == want and left == 0:
                    break
                dead = [h.name for h, p in zip(self.homes, self.agents, strict=True) if p.poll() is not None]
                if time.monotonic() > deadline or dead:
                    tails = "".join(f"\n--- {h.name} ---\n" + (h / "agent.out").read_text()[-2000:]
                                    for h in self.homes if h.name in dead[:2])
                    raise RuntimeError(f"{up} of {want} hosts up, {left} obligations open, agents "
                                       f"exited: {dead or 'none'}{tails}")
                time.sleep(0.2)
        finally:
            eng.dispose()
        woken = time.monotonic() - t0
        for home in self.homes:  # the helpers each agent started (fd holder, log and fence keepers)
            self.helpers |= set(vigil_pids(home))
        time.sleep(settle)
        return woken

    def held(self) -> list[int]:
        rows = dict(admin_sql(self.url, "SELECT holder, count(*) FROM leases GROUP BY holder"))
        return [int(rows.get(f"box{i}", 0)) for i in range(self.boxes)]

    def close(self) -> None:
        pids = {p.pid for p in self.agents}
        for p in self.agents:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.agents:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        for pid in self.helpers - pids:  # a helper outlives its agent on purpose (fd hand-over)
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        try:
            rows = admin_sql(self.url, "SELECT pid, create_time FROM generations WHERE pid IS NOT NULL "
                                       "AND ended_at IS NULL")
        except sa.exc.SQLAlchemyError:
            rows = []
        for pid, ctime in rows:  # every worker, by its pid and recorded start time
            try:
                if ctime is None or abs(psutil.Process(pid).create_time() - ctime) <= 0.05:
                    os.kill(pid, signal.SIGKILL)
            except (psutil.NoSuchProcess, ProcessLookupError):
                pass
        try:
            drop_cgroups([d for (d,) in admin_sql(self.url, "SELECT cgroup FROM generations "
                                                            "WHERE cgroup IS NOT NULL")])
        except sa.exc.SQLAlchemyError:
            pass
        if os.environ.get("FLEET_KEEP"):  # to look into a failed run: say where it is
            print(f"kept: database {self.name}, state dirs {self.tmp}", flush=True)
            return
        admin_sql(self.admin, f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')
        shutil.rmtree(self.tmp, ignore_errors=True)


def statements(url: str) -> tuple[int, int] | None:
    """Statements run in this database so far and the shared blocks (8 KiB pages, hit or
    read) they touched, when the server loads pg_stat_statements. Blocks measure the read
    work whatever plan the planner picks: on a small table it scans every row (cheaper
    than an index there), so rows read alone overstates what a small fleet reads."""
    try:
        admin_sql(url, "CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        (n, blocks), = admin_sql(url, "SELECT coalesce(sum(calls), 0)::bigint, coalesce(sum("
                                      "shared_blks_hit + shared_blks_read), 0)::bigint FROM "
                                      "pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database "
                                      "WHERE datname = current_database())")
        return int(n), int(blocks)
    except sa.exc.SQLAlchemyError:  # not in shared_preload_libraries: no such view to read
        return None


def by_statement(url: str) -> dict[int, tuple[float, float, str]]:
    """queryid -> (calls, shared blocks touched, text), when pg_stat_statements is loaded."""
    try:
        rows = admin_sql(url, "SELECT queryid, calls, shared_blks_hit + shared_blks_read, query "
                              "FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database "
                              "WHERE datname = current_database()) AND queryid IS NOT NULL")
    except sa.exc.SQLAlchemyError:
        return {}
    return {int(q): (float(c), float(b), text) for q, c, b, text in rows}


def heaviest(before: dict[int, tuple[float, float, str]], after: dict[int, tuple[float, float, str]],
             wall: float, n: int = 6, by_calls: bool = False) -> list[tuple[float, float, str]]:
    """The n statements that touched the most shared blocks in the sample (by_calls: that
    ran most often): (blocks/s, calls/s, text)."""
    out = []
    for q, (calls, blocks, text) in after.items():
        c0, b0, _ = before.get(q, (0.0, 0.0, ""))
        if (calls if by_calls else blocks) > (c0 if by_calls else b0):
            out.append(((blocks - b0) / wall, (calls - c0) / wall, " ".join(text.split())))
    return sorted(out, key=lambda r: r[1] if by_calls else r[0], reverse=True)[:n]


def counters(fleet: Fleet) -> dict[str, float]:
    (xc, xr), = admin_sql(fleet.url, "SELECT xact_commit, xact_rollback FROM pg_stat_database "
                                     "WHERE datname = current_database()")
    sums = ", ".join(f"coalesce(sum({c}), 0)::bigint" for c in TABLE_COUNTERS)
    row, = admin_sql(fleet.url, f"SELECT {sums} FROM pg_stat_user_tables")
    out = {"xacts": float(xc + xr), **{c: float(v) for c, v in zip(TABLE_COUNTERS, row, strict=True)}}
    for table, seq, idx in admin_sql(fleet.url, "SELECT relname, coalesce(seq_tup_read, 0), "
                                                "coalesce(idx_tup_fetch, 0) FROM pg_stat_user_tables"):
        out[f"seq:{table}"], out[f"idx:{table}"] = float(seq), float(idx)
    n = statements(fleet.url)
    if n is not None:
        out["statements"], out["blocks"] = float(n[0]), float(n[1])
    return out


def connections(fleet: Fleet) -> dict[str, int]:
    """Connections to the fleet's database by purpose (the last part of vigil-<box>-<purpose>)."""
    rows = admin_sql(fleet.url, "SELECT application_name, count(*) FROM pg_stat_activity "
                                "WHERE datname = current_database() AND pid <> pg_backend_pid() GROUP BY 1")
    out: dict[str, int] = {}
    for name, n in rows:
        purpose = name.rsplit("-", 1)[-1] if name.startswith("vigil-") else (name or "unnamed")
        out[purpose] = out.get(purpose, 0) + int(n)
    return out


class Intents(threading.Thread):
    """R intents a second while it runs: a stop, then a wake, of one host after another
    (box b's host w<b>-0, b in turn), each written and rung as this tree's CLI does."""

    def __init__(self, fleet: Fleet, rate: float) -> None:
        super().__init__(name="intents", daemon=True)
        self.fleet, self.rate, self.done = fleet, rate, threading.Event()
        self.written = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        from runners.cli import common
        from runners.quick import ops

        # A tree whose CLI rings every box after an intent (main before migration 0031);
        # with 0031 the intent row's trigger rings its host's boxes and the CLI nothing more.
        every_box = not hasattr(common, "ring_doorbell")
        store = Store(self.fleet.url)
        home = self.fleet.homes[0]  # no agent reads this dir's doorbell: in-process, as `direct`
        t0 = time.monotonic()
        try:
            while not self.done.wait(max(0.0, t0 + self.written / self.rate - time.monotonic())):
                k = self.written
                host = f"w{(k // 2) % self.fleet.boxes}-0"
                ops.run(store, home, "stop" if k % 2 == 0 else "wake", {"name": host})
                if every_box:
                    notify_boxes(store)
                self.written += 1
        except BaseException as exc:  # said by sample(), which stops the run
            self.error = exc
        finally:
            store.dispose()


def rounds(fleet: Fleet) -> int:
    """Reconciler rounds run so far, summed over the agents (each one's control socket says
    its own: `vigil agent status`); an intent that wakes every box shows as B rounds."""
    from runners.quick.client import Client

    db = fleet.agent_env.get("VIGIL_DB", fleet.url)
    total = 0
    for home in fleet.homes:
        c = Client.connect(home, db)
        if c is None:
            raise RuntimeError(f"the agent of {home.name} does not answer on its control socket")
        try:
            total += int(c.call("hello", 10)["rounds"])
        finally:
            c.dispose()
    return total


def sample(fleet: Fleet, seconds: float, intents: float = 0.0) -> dict[str, Any]:
    pids = [p.pid for p in fleet.agents]
    time.sleep(1.5)  # backends flush their counters at most once a second
    r0, c0, cpu0, one0, t0 = rounds(fleet), counters(fleet), cpu_s(pids), cpu_s(pids[:1]), time.monotonic()
    q0 = by_statement(fleet.url)  # after counters(): it loads pg_stat_statements into the database
    writer = Intents(fleet, intents) if intents > 0 else None
    if writer is not None:
        writer.start()
    time.sleep(seconds)
    if writer is not None:
        writer.done.set()
        writer.join(30)
        if writer.error is not None:
            raise RuntimeError(f"writing intents failed: {writer.error!r}")
    time.sleep(1.5)
    c1, cpu1, one1, r1 = counters(fleet), cpu_s(pids), cpu_s(pids[:1]), rounds(fleet)
    wall = time.monotonic() - t0
    q1 = by_statement(fleet.url)
    top = heaviest(q0, q1, wall)
    often = heaviest(q0, q1, wall, n=10, by_calls=True)
    rate = {k: (c1[k] - c0[k]) / wall for k in c1 if k in c0}
    rate["rounds"] = (r1 - r0) / wall
    return {"rate": rate, "agents_cpu": (cpu1 - cpu0) / wall, "one_cpu": (one1 - one0) / wall,
            "conns": connections(fleet), "intents": writer.written / wall if writer else 0.0,
            "top": top, "often": often}


def run(admin: str, boxes: int, hosts: int, args: argparse.Namespace,
        phantoms: int = 0) -> list[dict[str, Any]]:
    """The quiet sample, and with --intents the same while intents are written."""
    headroom(admin, boxes, args.pool_size if args.pooler else None)
    fleet = Fleet(admin, boxes, hosts, args.ttl, args.starting)
    fleet.listen = args.listen
    bouncer = None
    try:
        fleet.create()
        if args.pooler:
            from pgbouncer import PgBouncer

            bouncer = PgBouncer(fleet.url, pool_size=args.pool_size)
            fleet.agent_env = {"VIGIL_DB": bouncer.start(), "VIGIL_LISTEN_DB": fleet.url}
        t0 = time.monotonic()
        fleet.start()
        started = time.monotonic() - t0
        if args.wave:
            woken = fleet.wake_in_waves(args.wave, args.settle)
            fleet.phantoms(phantoms)
        else:
            fleet.place()
            fleet.phantoms(phantoms)
            woken = fleet.wait_quiet(args.settle)
        held = fleet.held()
        out = [{"boxes": boxes, "phantoms": phantoms, "hosts": hosts, "peak": fleet.peak, "label": f"B={boxes}" + (f"+{phantoms}ph" if phantoms else ""),
                **sample(fleet, args.sample)}]
        if args.intents > 0:
            out.append({**out[0], "label": f"B={boxes} +{args.intents:g}/s" + (f"+{phantoms}ph" if phantoms else ""),
                        **sample(fleet, args.sample, args.intents)})
        print(f"B={boxes}: agents ready in {started:.1f}s, {boxes * hosts} hosts up in {woken:.1f}s; "
              f"leases held per box min {min(held)} max {max(held)}; connections {out[0]['conns']}; "
              f"load {loadavg()}", flush=True)
        print(f"B={boxes}: connections at most while waking: {fleet.peak}", flush=True)
        if args.takeover:
            dead = dead_box(fleet, args.ttl)
            out[0].update(dead)
            print(f"B={boxes}: box{dead['box']:.0f} killed (agent, helpers, apps): its {dead['taken']:.0f} hosts running "
                  f"elsewhere after {dead['takeover_s']:.2f}s (goal <= TTL + 5 = {args.ttl + 5:g}s)",
                  flush=True)
        return out
    finally:
        fleet.close()
        if bouncer is not None:
            bouncer.stop()


def _running_on(eng: sa.Engine, sql: str, **params: Any) -> list[tuple[str, int]]:
    """(host, pid) of the rows whose process is alive and the one recorded."""
    with eng.connect() as c:
        rows = c.execute(sa.text(sql), params).all()
    out = []
    for host, pid, ctime in rows:
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE and abs(p.create_time() - ctime) <= 0.05:
                out.append((host, pid))
        except (psutil.NoSuchProcess, TypeError):
            pass
    return out


_HELD = ("SELECT g.host, g.pid, g.create_time FROM generations g JOIN leases l ON l.host = g.host "
         "AND l.holder = g.agent_id WHERE g.state = 'current' AND g.agent_id {} :box")


def dead_box(fleet: Fleet, ttl: float) -> dict[str, float]:
    """SIGKILL to the agent, helpers and apps of the box that holds the most hosts, at one
    instant; the seconds until every host it held runs on another box (a current generation
    of that box, which holds its lease, its process alive): issue 28's TTL + 5 s."""
    held_by = fleet.held()
    i = max(range(fleet.boxes), key=held_by.__getitem__)
    box = f"box{i}"
    eng = sa.create_engine(fleet.url, poolclass=sa.pool.NullPool)
    try:
        held = _running_on(eng, _HELD.format("="), box=box)
        names = [h for h, _ in held]
        pids = vigil_pids(fleet.homes[i]) + [pid for _, pid in held]
        at = kill_now(pids)
        fleet.agents[i].wait(10)
        deadline = at + 3 * ttl + 60
        elsewhere = _HELD.format("<>") + " AND g.host = ANY(:names)"
        while len(_running_on(eng, elsewhere, box=box, names=names)) < len(names):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{box}'s {len(names)} hosts not all running elsewhere after "
                                   f"{deadline - at:.0f}s")
            time.sleep(0.05)
        return {"box": i, "taken": len(names), "takeover_s": time.monotonic() - at}
    finally:
        eng.dispose()


def table(rows: list[dict[str, Any]]) -> None:
    def fig(r: dict[str, Any], key: str) -> float | None:
        return r["rate"].get(key)

    def read(r: dict[str, Any]) -> float:
        return r["rate"]["seq_tup_read"] + r["rate"]["idx_tup_fetch"]

    cols: list[tuple[str, Any]] = [
        ("xacts/s", lambda r: fig(r, "xacts")),
        ("stmts/s", lambda r: fig(r, "statements")),
        ("rows read/s", read),
        ("  seq", lambda r: fig(r, "seq_tup_read")),
        ("  idx", lambda r: fig(r, "idx_tup_fetch")),
        ("blocks/s", lambda r: fig(r, "blocks")),
        ("rows written/s", lambda r: sum(r["rate"][k] for k in ("n_tup_ins", "n_tup_upd", "n_tup_del"))),
        ("connections", lambda r: float(sum(r["conns"].values()))),
        ("agents CPU %", lambda r: r["agents_cpu"] * 100),
        ("rounds/s", lambda r: fig(r, "rounds")),
    ]
    print(f"{'figure':<16}" + "".join(f"{r['label']:>16}{'per box':>10}" for r in rows))
    for name, get in cols:
        line = f"{name:<16}"
        for r in rows:
            v = get(r)
            line += f"{'n/a':>16}{'n/a':>10}" if v is None else f"{v:>16,.1f}{v / r['boxes']:>10,.2f}"
        print(line)
    print(f"{'one agent CPU %':<16}" + "".join(f"{r['one_cpu'] * 100:>16.2f}{'':>10}" for r in rows))
    for r in rows:  # where the rows are read: the tables that grow with the fleet show here
        tables = sorted({k[4:] for k in r["rate"] if k[:4] in ("seq:", "idx:")})
        by = sorted(((r["rate"][f"seq:{n}"] + r["rate"][f"idx:{n}"], n) for n in tables), reverse=True)
        print(f"{r['label']} rows read/s per box by table (seq+idx): " + ", ".join(
            f"{n} {v / r['boxes']:.1f} ({r['rate'][f'seq:{n}'] / r['boxes']:.1f}+"
            f"{r['rate'][f'idx:{n}'] / r['boxes']:.1f})" for v, n in by if v > 0))
    quiet = {(r["boxes"], r["phantoms"]): r for r in rows if not r["intents"]}
    for r in rows:
        if r["intents"]:
            q = quiet[(r["boxes"], r["phantoms"])]
            extra = read(r) - read(q)
            woke = (r["rate"]["rounds"] - q["rate"]["rounds"]) / r["intents"]
            print(f"{r['label']}: {r['intents']:.2f} intents/s written; per intent, fleet-wide: "
                  f"{woke:.1f} rounds (of {r['boxes']} agents), {extra / r['intents']:,.0f} rows read "
                  f"(the difference from the quiet sample: noisy where the quiet reads vary more)")
    for r in rows:  # the statements behind the reads (shared blocks: 8 KiB pages, hit or read)
        for what in ("top", "often"):
            for blocks, calls, text in r.get(what, []):
                print(f"{r['label']} {'heaviest' if what == 'top' else 'most run'}: "
                      f"{blocks / r['boxes']:8.1f} blocks/s/box {calls / r['boxes']:6.2f} "
                      f"calls/s/box  {text[:150]}")
    for r in rows:
        print(f"{r['label']} connections by purpose: " +
              ", ".join(f"{k} {v} ({v / r['boxes']:.1f}/box)" for k, v in sorted(r["conns"].items())))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--boxes", default="10,50", help="comma-separated fleet sizes (default 10,50)")
    ap.add_argument("--hosts", type=int, default=20, help="hosts per box (default 20)")
    ap.add_argument("--sample", type=float, default=30.0, help="seconds sampled per fleet size")
    ap.add_argument("--settle", type=float, default=10.0, help="seconds quiet before the sample")
    ap.add_argument("--ttl", type=float, default=30.0, help="--lease-ttl of every agent")
    ap.add_argument("--pooler", action="store_true",
                    help="the agents through a PgBouncer of this run's own, transaction mode "
                         "(bench/pgbouncer.py), their LISTEN sessions direct")
    ap.add_argument("--pool-size", type=int, default=20,
                    help="with --pooler: its server sessions (default_pool_size, default 20)")
    ap.add_argument("--starting", type=int, default=4,
                    help="agents starting at once, at most (default 4)")
    ap.add_argument("--intents", type=float, default=0.0,
                    help="intents a second in a second sample (stop, wake; default 0: none)")
    ap.add_argument("--private-server", action="store_true",
                    help="a PostgreSQL of this run's own (bench/pgserver.py) with the max_connections "
                         "the largest fleet needs and pg_stat_statements, instead of VIGIL_BENCH_PG")
    ap.add_argument("--takeover", action="store_true",
                    help="after the samples, kill the box holding most hosts and time them running elsewhere")
    ap.add_argument("--listen", choices=("on", "off"), default="on",
                    help="every agent's --listen (off: no LISTEN session, intents read each sweep)")
    ap.add_argument("--wave", type=int, default=0,
                    help="place and wake the hosts this many boxes at a time, each wave once the "
                         "one before runs (default 0: all at once)")
    ap.add_argument("--phantoms", default="0",
                    help="boxes only the store knows, each with --hosts hosts leased and current "
                         "(no process): the store of a fleet of B + PHANTOMS boxes under B real agents "
                         "(comma-separated: each with each fleet size; default 0)")
    ap.add_argument("--quick", action="store_true", help="2 and 4 boxes x 3 hosts, 5 s: a smoke run")
    args = ap.parse_args()
    sizes = [int(b) for b in args.boxes.split(",")]
    if args.quick:
        sizes, args.hosts, args.sample, args.settle = [2, 4], 3, 5.0, 2.0
    pool = args.pool_size if args.pooler else None
    server, admin = None, ADMIN
    if args.private_server:
        from pgserver import PgServer

        server = PgServer(need(max(sizes), pool) + 10)
        admin = server.start()
    try:
        for b in sizes:  # every size checked before the first starts
            headroom(admin, b, pool)
        load0 = loadavg()
        rows: list[dict[str, Any]] = []
        for b in sizes:  # each size's table as it ends: a larger one that fails loses none
            for ph in [int(p) for p in args.phantoms.split(",")]:
                rows += run(admin, b, args.hosts, args, ph)
                table(rows)
        (sync,), = admin_sql(admin, "SELECT current_setting('synchronous_commit')")
    finally:
        if server is not None:
            server.stop()
    via = f"through PgBouncer (transaction mode, pool {args.pool_size})" if args.pooler else "direct"
    via += f"; agents --listen {args.listen}"
    where = "a private server" if server is not None else "VIGIL_BENCH_PG"
    print(f"\n{args.hosts} hosts per box; store on {where}, {via}; sample {args.sample:.0f}s each; "
          f"loadavg start {load0}, end {loadavg()}")
    table(rows)
    fields = [f"{r['label'].replace(' ', '')}.xacts_per_box={r['rate']['xacts'] / r['boxes']:.2f}" for r in rows]
    fields += [f"{r['label'].replace(' ', '')}.rows_read_per_box="
               f"{(r['rate']['seq_tup_read'] + r['rate']['idx_tup_fetch']) / r['boxes']:.1f}" for r in rows]
    fields += [f"B{r['boxes']}.conns_per_box={sum(r['conns'].values()) / r['boxes']:.2f}"
               for r in rows if not r["intents"]]
    print("result: fleet " + " ".join(fields) + f" pooler={'yes' if args.pooler else 'no'} "
          f"{durability('vigil', 'postgresql', sync)} {inherited_sync()} load={loadavg().replace(' ', '/')}")


if __name__ == "__main__":
    main()
