#!/usr/bin/env python3
"""Recovery and idle cost: N worker hosts awake, the agent killed with SIGKILL and started
again, repeatedly.

Set-up (once): N hosts of kind `worker` (a `#!/bin/sh` build that `exec`s `sleep`), added
and woken through vigil's own intents (written in-process, one ring of the doorbell), the
agent started and left to wake them all.
Each run: SIGKILL the agent; start a new one; time from its Popen to the moment its
`recovered` event is written and `pending_obligations` is empty (split into the agent's
start-up, Popen -> `agent_started` event, and its recovery, `agent_started` -> `recovered`);
check every host was adopted (no generation restarted); then watch the idle agent for
--idle seconds: its CPU time over that window as a share of one core, and its peak RSS
(VmHWM, i.e. including recovery).
Goals: <= 1 s to quiescence, <= 1% of one core idle, <= 100 MB.
At the end the agent is stopped and every worker process is ended by its pid (checked
against its recorded start time).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sqlite3
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, end, loadavg, start_agent, vigil  # noqa: E402

sys.path.insert(0, str(ROOT))


def db(home: Path) -> sqlite3.Connection:
    return sqlite3.connect(f"file:{home / 'vigil.db'}?mode=ro", uri=True, timeout=30)


def q1(home: Path, sql: str, *args: object) -> object:
    con = db(home)
    try:
        return con.execute(sql, args).fetchone()[0]
    finally:
        con.close()


def at(ts: str) -> float:
    return datetime.fromisoformat(ts).replace(tzinfo=UTC).timestamp()


def setup(home: Path, tmp: Path, n: int) -> None:
    """N worker hosts, each woken: intents written in-process (what `vigil host add` and
    `vigil wake` write, without N interpreter start-ups)."""
    from models.states import HostKind
    from runners.backend.files import stage_build
    from runners.base.doorbell import ring
    from runners.wiring import open_store
    from workflows.config.hosts import add_host
    from workflows.lifecycle.wake import request_wake

    build = tmp / "worker.sh"
    build.write_text("#!/bin/sh\nexec sleep 100000\n")
    build.chmod(0o755)
    vigil(home, "db", "upgrade")
    store = open_store(home, None)
    path, digest = stage_build(str(build), home)
    names = [f"w{i:04d}" for i in range(n)]

    def add(s):  # type: ignore[no-untyped-def]
        for name in names:
            add_host(s, name, kind=HostKind.worker, build_path=path, digest=digest,
                     source=str(build), args=[], env={}, cwd=None, drain_timeout=5,
                     health_timeout=5)
            request_wake(s, name)

    store.write(add)
    store.dispose()
    ring(home)


def wait_quiet(home: Path, since_id: int, deadline: float) -> float:
    """Wall time (time.time()) when a `recovered` event after since_id exists and no
    obligation is open."""
    while time.monotonic() < deadline:
        con = db(home)
        try:
            rec = con.execute("SELECT at FROM events WHERE kind = 'recovered' AND id > ?",
                              (since_id,)).fetchone()
            left = con.execute("SELECT count(*) FROM pending_obligations").fetchone()[0]
        finally:
            con.close()
        if rec is not None and left == 0:
            return time.time()
        time.sleep(0.01)
    raise RuntimeError("no quiescence before the deadline")


def idle_cost(pid: int, seconds: float) -> tuple[float, float, float]:
    """(CPU share of one core over the window, peak RSS MB (VmHWM), max sampled RSS MB)"""
    p = psutil.Process(pid)
    t = p.cpu_times()
    c0, w0, rss = t.user + t.system, time.monotonic(), 0
    end_at = w0 + seconds
    while time.monotonic() < end_at:
        rss = max(rss, p.memory_info().rss)
        time.sleep(0.5)
    t = p.cpu_times()
    share = (t.user + t.system - c0) / (time.monotonic() - w0)
    with open(f"/proc/{pid}/status") as f:
        hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    return share, hwm / 1024, rss / 2**20


def end_workers(home: Path) -> int:
    """SIGKILL every worker of a current generation, by pid, when its start time matches."""
    con = db(home)
    rows = con.execute("SELECT pid, create_time FROM generations WHERE pid IS NOT NULL"
                       " AND ended_at IS NULL").fetchall()
    con.close()
    ended = 0
    for pid, ctime in rows:
        try:
            p = psutil.Process(pid)
            if ctime is not None and abs(p.create_time() - ctime) > 0.05:
                continue  # not ours: the pid was reused
            os.kill(pid, signal.SIGKILL)
            ended += 1
        except (psutil.NoSuchProcess, ProcessLookupError):
            pass
    return ended


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=1000)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--idle", type=float, default=30.0, help="seconds of idle watching per run")
    ap.add_argument("--quick", action="store_true", help="20 hosts, 1 run, 3 s idle: for CI")
    args = ap.parse_args()
    if args.quick:
        args.hosts, args.runs, args.idle = 20, 1, 3.0
    load0 = loadavg()
    tmp = Path(tempfile.mkdtemp(prefix="vgrec", dir="/tmp"))
    home = tmp / "state"
    agent = None
    rows = []
    woken = float("nan")
    try:
        t0 = time.monotonic()
        setup(home, tmp, args.hosts)
        t1 = time.monotonic()
        agent = start_agent(home, tmp / "agent.log")
        deadline = time.monotonic() + 60 + args.hosts * 1.0
        while (awake := q1(home, "SELECT count(*) FROM generations WHERE state = 'current'")) < args.hosts \
                or q1(home, "SELECT count(*) FROM pending_obligations"):
            if agent.poll() is not None:
                raise RuntimeError(f"agent exited {agent.returncode}; see {tmp / 'agent.log'}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"only {awake} of {args.hosts} hosts awake")
            time.sleep(0.2)
        woken = time.monotonic() - t1
        print(f"set-up: intents of {args.hosts} worker hosts written in {t1 - t0:.1f}s (in-process); "
              f"all awake {woken:.1f}s after the agent's Popen (its start-up included; goal <= 10 s)",
              flush=True)
        gens = q1(home, "SELECT group_concat(id) FROM generations WHERE state = 'current'")
        for i in range(args.runs):
            agent.send_signal(signal.SIGKILL)
            agent.wait(10)
            last = int(q1(home, "SELECT coalesce(max(id), 0) FROM events"))
            started = time.time()
            agent = start_agent(home, tmp / "agent.log")
            done = wait_quiet(home, last, time.monotonic() + 120 + args.hosts * 0.5)
            con = db(home)
            a0 = con.execute("SELECT at FROM events WHERE kind = 'agent_started' AND id > ?", (last,)).fetchone()[0]
            r0 = con.execute("SELECT at FROM events WHERE kind = 'recovered' AND id > ?", (last,)).fetchone()[0]
            adopted = con.execute("SELECT count(*) FROM events WHERE kind = 'adopted' AND id > ?", (last,)).fetchone()[0]
            con.close()
            if adopted != args.hosts or q1(home, "SELECT group_concat(id) FROM generations WHERE state = 'current'") != gens:
                raise RuntimeError(f"run {i + 1}: {adopted} of {args.hosts} adopted, or a generation changed")
            share, hwm, rss = idle_cost(agent.pid, args.idle)
            row = dict(total=done - started, startup=at(a0) - started, recovery=at(r0) - at(a0),
                       cpu=share, hwm=hwm, rss=rss)
            rows.append(row)
            print(f"run {i + 1}: quiescent {row['total']:.2f}s after Popen (start-up {row['startup']:.2f}s, "
                  f"recovery {row['recovery']:.2f}s), {adopted} adopted; idle {args.idle:.0f}s: "
                  f"CPU {share:.2%} of a core, peak RSS {hwm:.1f} MB", flush=True)
    finally:
        end(agent)
        ended = end_workers(home) if (home / "vigil.db").exists() else 0
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"ended {ended} worker processes by pid")

    def col(k: str, scale: float = 1.0, fmt: str = ".2f") -> str:
        xs = [r[k] * scale for r in rows]
        return f"median {statistics.median(xs):{fmt}} ({min(xs):{fmt}}-{max(xs):{fmt}})"

    print(f"\nhosts: {args.hosts}; runs: {args.runs}; loadavg start {load0}, end {loadavg()}")
    print(f"kill -9 -> quiescent (Popen to recovered, none open) : {col('total')} s (goal <= 1 s)")
    print(f"  agent start-up (Popen -> agent_started)            : {col('startup')} s")
    print(f"  recovery (agent_started -> recovered)              : {col('recovery')} s (goal <= 0.3 s)")
    print(f"idle CPU over {args.idle:.0f}s, share of one core              : {col('cpu', 100, '.2f')} % (goal <= 0.5%)")
    print(f"peak RSS (VmHWM)                                     : {col('hwm', 1, '.1f')} MB (goal <= 100 MB)")
    print(f"wake of {args.hosts} hosts (agent Popen -> all awake)           : {woken:.1f} s (goal <= 10 s)")
    print(f"result: recovery quiescent_s={statistics.median([r['total'] for r in rows]):.2f} "
          f"idle_cpu_pct={statistics.median([r['cpu'] for r in rows]) * 100:.2f} "
          f"peak_rss_mb={statistics.median([r['hwm'] for r in rows]):.1f}")


if __name__ == "__main__":
    main()
