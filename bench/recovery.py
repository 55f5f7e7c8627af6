#!/usr/bin/env python3
"""Recovery and idle cost: N worker hosts awake under vigil, beside the same N programs
under supervisord in the same run; vigil's agent killed with SIGKILL and started again.

Each run, from a fresh state dir:
  wake    N hosts of kind `worker` (a `#!/bin/sh` build that `exec`s `sleep`), added and
          woken through vigil's own intents (written in-process, one ring of the doorbell),
          timed from the agent's Popen to all awake and nothing open; beside it supervisord
          with the same build as one `[program]` of numprocs=N, timed from its Popen to N
          live children
  recover SIGKILL the agent; start a new one; time from its Popen to the moment its
          `recovered` event is written and `pending_obligations` is empty (split into the
          agent's start-up, Popen -> `agent_started`, and its recovery, `agent_started` ->
          `recovered`); check every host was adopted (no generation restarted)
  idle    for --idle seconds, both at once: the CPU time of every vigil process (the agent,
          and each helper and standby it started: fd holder, log keeper, fence keeper, by
          the locks they hold) and of supervisord (one process), as a share of one core;
          then their memory, RSS and PSS summed over the processes (PSS splits the pages
          vigil's processes share), and the agent's peak RSS (VmHWM, recovery included)
Goals: <= 1 s to quiescence, recovery <= 0.3 s; idle: vigil's processes together no more
than supervisord's in the same run (the cost model: as cheap as supervisord), and <= 0.5 %
of a core absolute; <= 100 MB; wake of N <= 10 s.
At the end of each run the agent is stopped, every worker process is ended by its pid
(checked against its recorded start time) and supervisord is ended (it stops its programs).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    PEERS,
    ROOT,
    cpu_s,
    drop_cgroups,
    end,
    loadavg,
    memory_by_process,
    memory_mb,
    no_store,
    ratios,
    start_agent,
    summary,
    vigil,
    vigil_durability,
    vigil_pids,
    vigil_processes,
)

sys.path.insert(0, str(ROOT))
from runners.base.doorbell import lock_holder  # noqa: E402
from workflows.base.paths import LOCK  # noqa: E402


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


def idle_both(home: Path, sup: int | None, seconds: float) -> dict[str, Any]:
    """Both idle at once over one window: CPU share of one core of all of vigil's processes
    and of supervisord; then RSS and PSS summed (MB), and the agent's VmHWM (MB)."""
    pids = vigil_pids(home)
    c0, s0, w0 = cpu_s(pids), cpu_s([sup] if sup else []), time.monotonic()
    time.sleep(seconds)
    named = vigil_processes(home)
    now = sorted(set(named.values()))  # a helper started in the window counts from its start
    c1 = cpu_s(now) - c0 + cpu_s(set(pids) - set(now))
    wall = time.monotonic() - w0
    out: dict[str, Any] = {"cpu": c1 / wall, "procs": len(now), "names": ",".join(sorted(named))}
    out["rss"], out["pss"] = memory_mb(now)
    out["by_process"] = memory_by_process(named)  # {name: (RSS, PSS)}
    agent = lock_holder(home / LOCK)
    with open(f"/proc/{agent}/status") as f:
        out["hwm"] = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
    if sup:
        out["sup_cpu"] = (cpu_s([sup]) - s0) / wall
        out["sup_rss"], out["sup_pss"] = memory_mb([sup])
    return out


class Supervisord:
    """supervisord 4.3 (bench/.peers) running the same worker build as one [program] of
    numprocs=N; its wake is timed from Popen to N live children."""

    def __init__(self, tmp: Path, build: Path, n: int, timeout: float) -> None:
        d = tmp / "sup"
        d.mkdir()
        conf = d / "supervisord.conf"
        conf.write_text(f"""
[unix_http_server]
file={d}/supervisor.sock
[supervisord]
logfile={d}/supervisord.log
pidfile={d}/supervisord.pid
childlogdir={d}
nodaemon=true
minfds={max(1024, 4 * n + 64)}
[rpcinterface:supervisor]
supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface
[supervisorctl]
serverurl=unix://{d}/supervisor.sock
[program:w]
command={build}
numprocs={n}
process_name=w%(process_num)04d
startsecs=0
autorestart=true
""")
        t0 = time.monotonic()
        self.proc = subprocess.Popen([str(PEERS / "bin" / "supervisord"), "-c", str(conf)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        ps = psutil.Process(self.proc.pid)
        deadline = t0 + timeout
        while sum(c.status() != psutil.STATUS_ZOMBIE for c in ps.children()) < n:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"supervisord did not start {n} programs (see {d}/supervisord.log)")
            time.sleep(0.2)
        self.woken = time.monotonic() - t0

    def close(self) -> None:
        end(self.proc, timeout=120)  # supervisord stops its programs on SIGTERM


def end_workers(home: Path) -> int:
    """SIGKILL every worker of a current generation, by pid, when its start time matches."""
    con = db(home)
    rows = con.execute("SELECT pid, create_time FROM generations WHERE pid IS NOT NULL"
                       " AND ended_at IS NULL").fetchall()
    dirs = [d for (d,) in con.execute("SELECT cgroup FROM generations WHERE cgroup IS NOT NULL")]
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
    drop_cgroups(dirs)
    return ended


def room_for(hosts: int) -> int:
    """The hosts the agent's open-file limit holds (it needs 1 an app, its pidfd, since issue
    42: the log keeper and its standby keep the pipes; 2 before), the hard limit raised first as an operator's LimitNOFILE=
    would when it cannot hold `hosts` and this process may (root with CAP_SYS_RESOURCE, up to
    fs.nr_open). Fewer than `hosts` is said in one line: the caller runs that many."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hosts + 1024
    if want > hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, want))
            print(f"open files: the hard limit raised from {hard} to {want} for {hosts} hosts "
                  "(as LimitNOFILE= would)", flush=True)
            return hosts
        except (ValueError, OSError):
            fit = (hard - 1024) // 100 * 100
            print(f"open files: the hard limit of {hard} holds about {fit} hosts (1 an app), "
                  f"not {hosts}, and may not be raised here: measuring {fit}", flush=True)
            return fit
    return hosts


def one_run(args: argparse.Namespace, i: int) -> dict[str, Any]:
    """A fresh state dir: the wake of N (and supervisord's of N), one kill -9 and recovery,
    the idle window; everything started is ended before it returns."""
    tmp = Path(tempfile.mkdtemp(prefix="vgrec", dir="/tmp"))
    home = tmp / "state"
    agent = sup = None
    try:
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
        row: dict[str, Any] = {"woken": time.monotonic() - t1}
        if getattr(args, "peer", True) and (PEERS / "bin" / "supervisord").exists():
            sup = Supervisord(tmp, tmp / "worker.sh", args.hosts, 60 + args.hosts * 1.0)
            row["sup_woken"] = sup.woken
        gens = q1(home, "SELECT group_concat(id) FROM generations WHERE state = 'current'")
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
        row.update(total=done - started, startup=at(a0) - started, recovery=at(r0) - at(a0))
        row.update(idle_both(home, sup.proc.pid if sup else None, args.idle))
        row["modes"] = vigil_durability(home / "vigil.db")
        peer = (f"; supervisord woke {args.hosts} in {row['sup_woken']:.1f}s, idle CPU {row['sup_cpu']:.2%}, "
                f"RSS {row['sup_rss']:.1f} MB" if sup else "")
        print(f"run {i + 1}: woke {args.hosts} in {row['woken']:.1f}s; quiescent {row['total']:.2f}s after Popen "
              f"(start-up {row['startup']:.2f}s, recovery {row['recovery']:.2f}s), {adopted} adopted; idle "
              f"{args.idle:.0f}s: {row['procs']:.0f} vigil processes ({row['names']}) CPU {row['cpu']:.2%} of a core, RSS "
              f"{row['rss']:.1f} MB (PSS {row['pss']:.1f}){peer}", flush=True)
        return row
    finally:
        end(agent)
        ended = end_workers(home) if (home / "vigil.db").exists() else 0
        if sup is not None:
            sup.close()
        shutil.rmtree(tmp, ignore_errors=True)
        print(f"run {i + 1}: ended {ended} worker processes by pid", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=1000)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--idle", type=float, default=30.0, help="seconds of idle watching per run")
    ap.add_argument("--quick", action="store_true", help="20 hosts, 1 run, 3 s idle: for CI")
    args = ap.parse_args()
    if args.quick:
        args.hosts, args.runs, args.idle = 20, 1, 3.0
    args.hosts = room_for(args.hosts)
    load0 = loadavg()
    rows = [one_run(args, i) for i in range(args.runs)]

    def col(k: str, scale: float = 1.0, unit: str = "") -> str:
        return summary([r[k] * scale for r in rows], unit)

    n = args.hosts
    print(f"\nhosts: {n}; runs: {args.runs}; loadavg start {load0}, end {loadavg()}")
    print(f"kill -9 -> quiescent (Popen to recovered, none open) : {col('total', unit='s')} (goal <= 1 s)")
    print(f"  agent start-up (Popen -> agent_started)            : {col('startup', unit='s')}")
    print(f"  recovery (agent_started -> recovered)              : {col('recovery', unit='s')} (goal <= 0.3 s)")
    print(f"wake of {n} (agent Popen -> all awake)                : {col('woken', unit='s')} (goal <= 10 s)")
    print(f"idle {args.idle:.0f}s, all vigil processes, % of a core    : {col('cpu', 100)} % (goal <= 0.5 %)")
    print(f"  RSS summed / PSS summed / agent VmHWM, MB          : {col('rss')} / {col('pss')} / {col('hwm')} "
          f"(goal <= 100 MB)")
    med = statistics.median
    fields = [f"vigil.quiescent_s={med(r['total'] for r in rows):.2f}",
              f"vigil.idle_cpu_pct={med(r['cpu'] for r in rows) * 100:.2f}",
              f"vigil.rss_mb={med(r['rss'] for r in rows):.1f}", f"vigil.pss_mb={med(r['pss'] for r in rows):.1f}",
              f"vigil.wake_s={med(r['woken'] for r in rows):.1f}", str(rows[-1]["modes"])]
    if all("sup_cpu" in r for r in rows):
        print(f"wake of {n}, supervisord (Popen -> {n} children)      : {col('sup_woken', unit='s')}")
        print(f"idle, supervisord, % of a core                       : {col('sup_cpu', 100)} %")
        print(f"  RSS / PSS, MB                                      : {col('sup_rss')} / {col('sup_pss')}")
        cpu_ratio = ratios([r["cpu"] for r in rows], [r["sup_cpu"] for r in rows])
        print(f"ratio idle CPU vigil / supervisord (per run)         : {summary(cpu_ratio, 'x')} (goal <= 1x)")
        print(f"ratio PSS vigil / supervisord (per run)              : "
              f"{summary(ratios([r['pss'] for r in rows], [r['sup_pss'] for r in rows]), 'x')}")
        print(f"ratio wake vigil / supervisord (per run)             : "
              f"{summary(ratios([r['woken'] for r in rows], [r['sup_woken'] for r in rows]), 'x')}")
        fields += [f"supervisord.idle_cpu_pct={med(r['sup_cpu'] for r in rows) * 100:.2f}",
                   f"supervisord.rss_mb={med(r['sup_rss'] for r in rows):.1f}",
                   f"supervisord.pss_mb={med(r['sup_pss'] for r in rows):.1f}",
                   f"supervisord.wake_s={med(r['sup_woken'] for r in rows):.1f}", no_store("supervisord"),
                   f"idle_cpu_ratio={med(cpu_ratio):.2f}"]
    else:
        print("supervisord                                          : not installed (run bench/install-peers)")
    print("result: recovery " + " ".join(fields))


if __name__ == "__main__":
    main()
