#!/usr/bin/env python3
"""Takeover time of a dead box (issue 28): two agents on one PostgreSQL, each its own state
dir and box id, H worker hosts (`sleep`, as in fleet.py) placed on both and all held by one
box. Per run, that box dies: SIGKILL at one instant to its agent, its helpers (fd holder,
log keeper, fence keeper and their standbys) and its apps, as a box losing power. Timed
from the kill until every one of the H hosts runs on the other box again: a current
generation made by the other box, which holds its lease, whose process is alive (pid and
start time as recorded). Printed beside TTL + 5 s (issue 28's bound), and beside the
instant the dead box's last lease expired (before it nothing may be taken over: what
follows is the takeover's own work). The dead box's agent is started again, and the next
run kills the other box (the hosts come back), so runs alternate between the two.

`--pgbouncer`: the agents reach the store through a PgBouncer of the run's own in
transaction mode (bench/pgbouncer.py), their LISTEN sessions direct (--listen-db).

Median and min-max over --runs; the load average is printed with each run. No quiet box is
needed to say within or beyond TTL + 5 s; a load figure says what the box was doing.
Every process it started is ended by its pid; the database is dropped.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil
import sqlalchemy as sa

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this tree's vigil
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, durability, inherited_sync, kill_now, loadavg, summary, vigil_pids  # noqa: E402
from fleet import ADMIN, Fleet, admin_sql, headroom  # noqa: E402

from models.store import Store  # noqa: E402

READY = b"logger=vigil.agent ready"


def start_agent(fleet: Fleet, i: int, env: dict[str, str]) -> None:
    """Box i's agent, returned once it logged one more `ready` than before."""
    home = fleet.homes[i]
    out = home / "agent.out"
    before = out.read_bytes().count(READY) if out.exists() else 0
    with open(out, "ab") as log:
        p = subprocess.Popen([sys.executable, "-m", "runners.cli", "agent", "--box", f"box{i}",
                              "--lease-ttl", str(fleet.ttl), "--log-level", "INFO"], cwd=ROOT,
                             env={**os.environ, "VIGIL_DB": fleet.url, "VIGIL_HOME": str(home), **env},
                             stdout=log, stderr=log)
    fleet.agents.append(p)
    deadline = time.monotonic() + 90
    while out.read_bytes().count(READY) <= before:
        if p.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"agent of {home.name} not ready; see {out}")
        time.sleep(0.1)


def place(fleet: Fleet, names: list[str]) -> None:
    """The hosts, placed on both boxes, and their wakes (what `host add --box` and `wake` write)."""
    from models.states import HostKind
    from runners.backend.files import stage_build
    from runners.base.wakeup import notify_boxes
    from workflows.config.hosts import add_host
    from workflows.lifecycle.wake import request_wake

    build = fleet.tmp / "worker.sh"
    build.write_text("#!/bin/sh\nexec sleep 100000\n")
    build.chmod(0o755)
    path, digest = stage_build(str(build), fleet.homes[0])
    store = Store(fleet.url)

    def add(s: Any) -> None:
        for name in names:
            add_host(s, name, kind=HostKind.worker, build_path=path, digest=digest,
                     source=str(build), args=[], env={}, cwd=None, drain_timeout=5,
                     health_timeout=5, box="box0,box1")
            request_wake(s, name)

    try:
        store.write(add)
        notify_boxes(store)
    finally:
        store.dispose()


def running(eng: sa.Engine, box: str, names: list[str]) -> list[tuple[str, int, float]]:
    """(host, pid, start time) of the hosts running on `box`: a current generation of its
    own, its lease held by it, the process alive and the one recorded (not a reused pid)."""
    with eng.connect() as c:
        rows = c.execute(sa.text(
            "SELECT g.host, g.pid, g.create_time FROM generations g JOIN leases l ON "
            "l.host = g.host AND l.holder = g.agent_id WHERE g.state = 'current' AND "
            "g.agent_id = :box AND g.host = ANY(:names)"), {"box": box, "names": names}).all()
    alive = []
    for host, pid, ctime in rows:
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE and (ctime is None or abs(p.create_time() - ctime) <= 0.05):
                alive.append((host, pid, ctime))
        except (psutil.NoSuchProcess, TypeError):
            pass
    return alive


def wait_running(eng: sa.Engine, box: str, names: list[str], timeout: float) -> float:
    """Poll (every 20 ms) until every host runs on `box`; the wall clock then."""
    deadline = time.monotonic() + timeout
    while len(running(eng, box, names)) < len(names):
        if time.monotonic() > deadline:
            n = len(running(eng, box, names))
            raise RuntimeError(f"{n} of {len(names)} hosts running on {box} after {timeout:.0f}s")
        time.sleep(0.02)
    return time.time()


def kill_box(fleet: Fleet, i: int, eng: sa.Engine, names: list[str]) -> tuple[float, int]:
    """SIGKILL to box i's agent, helpers and apps at one instant: (the instant, processes)."""
    home = fleet.homes[i]
    apps = [pid for _, pid, _ in running(eng, f"box{i}", names)]
    pids = vigil_pids(home) + apps
    at = time.time()
    kill_now(pids)
    for p in fleet.agents:
        if p.poll() is None and p.pid in pids:
            p.wait(10)
    return at, len(pids)


def last_expiry(eng: sa.Engine, box: str) -> float:
    """When the box's hosts lapse: its box lease's expiry (migration 0029), else (a tree
    from before it) the latest expiry of its host leases."""
    with eng.connect() as c:
        boxed = sa.inspect(c).has_table("box_leases")
        at = c.execute(sa.text("SELECT expires_at FROM box_leases WHERE box = :b" if boxed else
                               "SELECT max(expires_at) FROM leases WHERE holder = :b"),
                       {"b": box}).scalar()
    return at.replace(tzinfo=UTC).timestamp()


def one_run(fleet: Fleet, eng: sa.Engine, names: list[str], victim: int,
            env: dict[str, str]) -> dict[str, Any]:
    survivor = 1 - victim
    load0 = loadavg()
    expiry = last_expiry(eng, f"box{victim}")  # renewed every TTL/6: read just before the kill
    killed_at, n = kill_box(fleet, victim, eng, names)
    done = wait_running(eng, f"box{survivor}", names, fleet.ttl + 120)
    with eng.connect() as c:
        first = c.execute(sa.text("SELECT min(at) FROM events WHERE kind = 'taken_over' AND at >= :t"),
                          {"t": datetime.fromtimestamp(killed_at, UTC).replace(tzinfo=None)}).scalar()
    r = {"victim": victim, "took": done - killed_at, "after_expiry": done - expiry,
         "expiry": expiry - killed_at, "killed": n, "load": f"{load0} -> {loadavg()}",
         "first": (first.replace(tzinfo=UTC).timestamp() - killed_at) if first else None}
    start_agent(fleet, victim, env)  # the dead box comes back, idle: the next run kills the other
    fleet.helpers |= set(vigil_pids(fleet.homes[victim]))
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=20, help="hosts of the box that dies (default 20)")
    ap.add_argument("--runs", type=int, default=5, help="box deaths, alternating (default 5)")
    ap.add_argument("--ttl", type=float, default=30.0, help="--lease-ttl of both agents (default 30)")
    ap.add_argument("--pgbouncer", action="store_true",
                    help="the agents through a PgBouncer of this run's own, transaction mode "
                         "(bench/pgbouncer.py), their LISTEN sessions direct")
    ap.add_argument("--quick", action="store_true", help="5 hosts, TTL 4, 1 run: a smoke run")
    args = ap.parse_args()
    if args.quick:
        args.hosts, args.ttl, args.runs = 5, 4.0, 1
    headroom(ADMIN, 2)
    fleet = Fleet(ADMIN, 2, args.hosts, args.ttl)
    names = [f"t{h:02d}" for h in range(args.hosts)]
    eng, bouncer, env = None, None, {}
    try:
        fleet.create()
        eng = sa.create_engine(fleet.url, poolclass=sa.pool.NullPool)  # this script's reads: direct
        if args.pgbouncer:
            from pgbouncer import PgBouncer

            bouncer = PgBouncer(fleet.url)
            env = {"VIGIL_DB": bouncer.start(), "VIGIL_LISTEN_DB": fleet.url}
        start_agent(fleet, 0, env)  # alone first: box0 takes every lease
        place(fleet, names)
        wait_running(eng, "box0", names, 60 + args.hosts)
        start_agent(fleet, 1, env)
        for i in (0, 1):
            fleet.helpers |= set(vigil_pids(fleet.homes[i]))
        time.sleep(min(args.ttl / 6, 5) + 0.5)  # both renewing; box1 past its first sweep
        rows = []
        for k in range(args.runs):
            r = one_run(fleet, eng, names, k % 2, env)
            rows.append(r)
            first = "n/a" if r["first"] is None else f"{r['first']:.2f}s"
            print(f"run {k + 1}: box{r['victim']} killed ({r['killed']} processes); "
                  f"{args.hosts} hosts running on box{1 - r['victim']} {r['took']:.2f}s after the "
                  f"kill (TTL + 5 s = {args.ttl + 5:g}s: {'within' if r['took'] <= args.ttl + 5 else 'BEYOND'}); "
                  f"last lease expired at {r['expiry']:.2f}s, first taken_over at {first}, all "
                  f"running {r['after_expiry']:.2f}s after the expiry; load {r['load']}", flush=True)
    finally:
        if eng is not None:
            eng.dispose()
        fleet.close()
        if bouncer is not None:
            bouncer.stop()
    took = [r["took"] for r in rows]
    after = [r["after_expiry"] for r in rows]
    within = sum(t <= args.ttl + 5 for t in took)
    via = "through PgBouncer (transaction mode)" if args.pgbouncer else "direct"
    print(f"\ntakeover of a dead box's {args.hosts} hosts, TTL {args.ttl:g}s, {len(rows)} runs, "
          f"store {via}: "
          f"kill -> all running {summary(took, 's')} against TTL + 5 s = {args.ttl + 5:g}s "
          f"({within} of {len(rows)} within); lease expiry -> all running {summary(after, 's')}")
    (sync,), = admin_sql(ADMIN, "SELECT current_setting('synchronous_commit')")
    print(f"result: takeover vigil.hosts={args.hosts} vigil.ttl_s={args.ttl:g} "
          f"vigil.pgbouncer={'yes' if args.pgbouncer else 'no'} "
          f"vigil.median_s={statistics.median(took):.2f} vigil.max_s={max(took):.2f} "
          f"vigil.within={within}/{len(rows)} {durability('vigil', 'postgresql', sync)} "
          f"{inherited_sync()} load={loadavg().replace(' ', '/')}")


if __name__ == "__main__":
    main()
