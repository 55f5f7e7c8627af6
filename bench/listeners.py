#!/usr/bin/env python3
"""What a fleet's LISTEN sessions cost the server (issue 28: one direct LISTEN session a box).

On a PostgreSQL of this run's own (bench/pgserver.py), N idle sessions each LISTEN on a
box channel of its own (`vigil_box_<i>`, as agents do) and one more on the target box's
channel; then --notifies NOTIFYs, each in its own transaction, ring the target box only,
and the target session reads every one. Per N (default 1,100,1000; N=1 is the baseline of
the same run):
  server CPU per NOTIFY  utime + stime of every server process (the postmaster's children,
                         from /proc) over the NOTIFYs, divided by their count: it shows
                         whether a NOTIFY to one box costs the sessions of the others
  wall per NOTIFY        the sender's commit until the target session has it, median
  memory per session     the private memory (Pss, /proc/<pid>/smaps_rollup) of an idle
                         listening backend, median
Every connection is closed and the server stopped and removed at the end.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import psutil
import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import loadavg  # noqa: E402
from pgserver import PgServer, postmaster_pid  # noqa: E402


def server_cpu(postmaster: int) -> float:
    total = 0.0
    for p in psutil.Process(postmaster).children():
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def pss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1])
    return 0


def measure(dsn: str, postmaster: int, n: int, notifies: int) -> dict[str, float]:
    idle = []
    try:
        for i in range(n):
            c = psycopg.connect(dsn, autocommit=True)
            c.execute(f"LISTEN vigil_box_{i}")
            idle.append(c)
        target = psycopg.connect(dsn, autocommit=True)
        idle.append(target)
        target.execute("LISTEN vigil_box_target")
        sender = psycopg.connect(dsn, autocommit=True)
        idle.append(sender)
        heard = target.notifies(timeout=0.05)
        for _ in heard:  # drain: none expected
            pass
        time.sleep(1.0)  # the connections' own start-up CPU settles
        walls = []
        cpu0 = server_cpu(postmaster)
        for k in range(notifies):
            t0 = time.perf_counter()
            sender.execute(f"NOTIFY vigil_box_target, '{k}'")
            got = next(target.notifies(timeout=10, stop_after=1), None)
            if got is None:
                raise RuntimeError(f"NOTIFY {k} not heard within 10 s at N={n}")
            walls.append(time.perf_counter() - t0)
        time.sleep(0.5)  # the other sessions' wake-ups (signal, queue read) end
        cpu = server_cpu(postmaster) - cpu0
        mem = [pss_kb(c.info.backend_pid) for c in idle[:min(n, 50)]] or [pss_kb(target.info.backend_pid)]
        return {"n": n, "cpu_ms": cpu / notifies * 1000, "wall_ms": statistics.median(walls) * 1000,
                "pss_kb": statistics.median(mem)}
    finally:
        for c in idle:
            c.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sessions", default="1,100,1000", help="comma-separated N (default 1,100,1000)")
    ap.add_argument("--notifies", type=int, default=500, help="NOTIFYs per N (default 500)")
    ap.add_argument("--quick", action="store_true", help="N = 1 and 20, 50 NOTIFYs: a smoke run")
    args = ap.parse_args()
    sizes = [int(x) for x in args.sessions.split(",")]
    if args.quick:
        sizes, args.notifies = [1, 20], 50
    server = PgServer(max(sizes) + 20)
    load0 = loadavg()
    try:
        url = server.start()
        dsn = url.replace("postgresql+psycopg://", "postgresql://")
        postmaster = postmaster_pid(server.data)
        assert postmaster is not None
        rows = [measure(dsn, postmaster, n, args.notifies) for n in sizes]
    finally:
        server.stop()
    base = rows[0]
    print(f"{args.notifies} NOTIFYs to one box's channel per N; loadavg start {load0}, end {loadavg()}")
    print(f"{'N listening':>12}{'server CPU/NOTIFY':>20}{'x N=' + str(base['n']):>10}"
          f"{'wall/NOTIFY':>14}{'Pss/session':>14}")
    for r in rows:
        print(f"{r['n']:>12,}{r['cpu_ms']:>17.3f} ms{r['cpu_ms'] / base['cpu_ms']:>9.1f}x"
              f"{r['wall_ms']:>11.3f} ms{r['pss_kb'] / 1024:>11.2f} MB")
    print("result: listeners " + " ".join(
        f"N{r['n']}.cpu_ms={r['cpu_ms']:.3f} N{r['n']}.wall_ms={r['wall_ms']:.3f}" for r in rows)
        + f" load={loadavg().replace(' ', '/')}")


if __name__ == "__main__":
    main()
