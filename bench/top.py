#!/usr/bin/env python3
"""`vigil top`'s own cost at N hosts, beside `vigil status` at the same N in the same run
(interleaved):

  top refresh      CPU of one redraw in-process: the rows that fit an 80x24 screen read from
                   the store (workflows/config/glance.py), their generations sampled (psutil),
                   the agent's line, the last events, drawn by rich to a terminal of 80x24
  top live         `vigil top` as an operator runs it, in a pseudo-terminal of 80x24: its CPU
                   over a window after its first screen, as % of one core (about 1 redraw/s)
  status           CPU of `vigil status` in-process (every host read and drawn), and as a new
                   process (`vigil status` with no agent: start-up, store, every host)

The store is seeded straight into SQLite (no agent runs: nothing acts on the rows): N worker
hosts, each with a current generation whose leader is one `sleep` this script starts (so
psutil reads a live process), every tenth with a crash restart, an owed lease release and a
deploy attempt queued. Median (min-max) over the runs; every process started is ended by pid."""

from __future__ import annotations

import argparse
import io
import os
import pty
import select
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, end, loadavg, ratios, summary, vigil, vigil_durability  # noqa: E402


def seed(home: Path, n: int, leader: psutil.Process) -> None:
    vigil(home, "db", "upgrade")
    (home / "agent-id").write_text("bench-top\n")
    now = datetime.now(UTC).replace(tzinfo=None)
    ts, later = now.isoformat(" "), (now + timedelta(hours=1)).isoformat(" ")
    hosts = [f"h{i:05d}" for i in range(n)]
    con = sqlite3.connect(home / "vigil.db", isolation_level=None)
    con.execute("BEGIN")
    con.execute("INSERT INTO builds (id, digest, path, source, created_at) VALUES (1, ?, ?, ?, ?)",
                ("0" * 64, "/nonexistent/build", "/nonexistent/build", ts))
    con.executemany("INSERT INTO hosts (name, kind, build_id, args, env, drain_timeout, health_timeout,"
                    " desired, raised, fence_seq, created_at) VALUES (?, 'worker', 1, '[]', '{}', 5, 5,"
                    " 'up', 0, 1, ?)", [(h, ts) for h in hosts])
    con.executemany("INSERT INTO leases (host, holder, fence, acquired_at, expires_at)"
                    " VALUES (?, 'bench-top', 1, ?, ?)", [(h, ts, later) for h in hosts])
    con.executemany("INSERT INTO generations (uuid, host, build_id, state, fence, pid, create_time,"
                    " agent_id, created_at, current_at) VALUES (?, ?, 1, 'current', 1, ?, ?,"
                    " 'bench-top', ?, ?)",
                    [(str(uuid.uuid4()), h, leader.pid, leader.create_time(), ts, ts) for h in hosts])
    tenth = hosts[::10]
    con.executemany("INSERT INTO wakes (host, state, cause, attempts, next_attempt_at, since, created_at,"
                    " ended_at) VALUES (?, 'done', 'restart', 0, ?, ?, ?, ?)",
                    [(h, ts, ts, ts, ts) for h in tenth])
    con.executemany("INSERT INTO releases (host, holder, fence, attempts, next_attempt_at, since)"
                    " VALUES (?, 'bench-top', 1, 0, ?, ?)", [(h, later, ts) for h in tenth])
    con.executemany("INSERT INTO attempts (host, build_id, digest, cause, mode, effective_mode, revision,"
                    " canary, step, executed, attempts, next_attempt_at, since, created_at) VALUES (?, 1, ?,"
                    " 'release', 'hold', 'hold', 1, 0, 'queued', 0, 0, ?, ?, ?)",
                    [(h, "0" * 64, later, ts, ts) for h in tenth])
    con.execute("COMMIT")
    con.close()


def refresh_cpu(home: Path, refreshes: int) -> float:
    """Median CPU seconds of one redraw of `vigil top`, in this process."""
    from rich.console import Console

    from models.store import Store
    from runners.cli.topview import Sampler, fit_rows, read, screen

    store = Store(f"sqlite:///{home / 'vigil.db'}")
    sampler = Sampler()
    console = Console(file=io.StringIO(), width=80, height=24, force_terminal=True)
    fit, events = fit_rows(24)
    took = []
    try:
        for i in range(refreshes + 1):
            t0 = time.process_time()
            console.print(screen(read(store, home, None, i, fit, events, sampler), "00:00:00"))
            if i:  # the first one opens the store and imports what drawing needs
                took.append(time.process_time() - t0)
    finally:
        store.dispose()
    return statistics.median(took)


def status_cpu(home: Path) -> float:
    """CPU seconds of `vigil status`'s read and table, in this process."""
    from rich.console import Console

    from models.store import Store
    from runners.cli.output import status_table
    from runners.quick import ops

    store = Store(f"sqlite:///{home / 'vigil.db'}")
    try:
        ops.status(store)  # warm: the store opened, the statements compiled
        t0 = time.process_time()
        Console(file=io.StringIO(), width=80).print(status_table(ops.status(store)))
        return time.process_time() - t0
    finally:
        store.dispose()


def status_process(home: Path) -> float:
    """CPU seconds (user + system) of `vigil status` as a new process."""
    before = os.times()
    cp = subprocess.run([sys.executable, "-m", "runners.cli", "status"], cwd=ROOT,
                        env={**os.environ, "VIGIL_HOME": str(home)}, capture_output=True, text=True)
    after = os.times()
    if cp.returncode != 0:
        raise RuntimeError(f"vigil status exited {cp.returncode}: {cp.stderr.strip()}")
    return (after.children_user - before.children_user) + (after.children_system - before.children_system)


def live_cpu(home: Path, window: float) -> float:
    """`vigil top` in an 80x24 pseudo-terminal: its CPU over `window` seconds after its first
    screen, as % of one core; ended with `q`."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: becomes vigil top on the terminal
        os.environ.update(VIGIL_HOME=str(home), COLUMNS="80", LINES="24", TERM="xterm")
        os.chdir(ROOT)
        os.execv(sys.executable, [sys.executable, "-m", "runners.cli", "top"])
    import fcntl
    import struct
    import termios

    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    seen = b""
    try:
        deadline = time.monotonic() + 60
        while b"agent:" not in seen:  # the first screen is drawn
            if time.monotonic() > deadline:
                raise RuntimeError(f"vigil top drew no screen: {seen[-2000:]!r}")
            if select.select([fd], [], [], 1)[0]:
                seen += os.read(fd, 65536)
        proc = psutil.Process(pid)
        t0, c0 = time.monotonic(), sum(proc.cpu_times()[:2])
        while time.monotonic() - t0 < window:  # keep reading: a full pty would stall it
            if select.select([fd], [], [], 0.2)[0]:
                os.read(fd, 65536)
        used = sum(proc.cpu_times()[:2]) - c0
        took = time.monotonic() - t0
        os.write(fd, b"q")
        ended = time.monotonic() + 20
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > ended:
                raise RuntimeError("vigil top did not end on q")
            if select.select([fd], [], [], 0.1)[0]:
                try:
                    os.read(fd, 65536)
                except OSError:
                    pass
        pid = 0
        return 100 * used / took
    finally:
        if pid:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=1000)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--refreshes", type=int, default=10, help="redraws timed per run")
    ap.add_argument("--window", type=float, default=10.0, help="seconds of `vigil top` live per run")
    ap.add_argument("--quick", action="store_true", help="50 hosts, 1 run, 3 redraws, 2 s live")
    args = ap.parse_args()
    if args.quick:
        args.hosts, args.runs, args.refreshes, args.window = 50, 1, 3, 2.0
    load0 = loadavg()
    tmp = Path(tempfile.mkdtemp(prefix="vgtop", dir="/tmp"))
    home = tmp / "state"
    sleeper = subprocess.Popen(["sleep", "3600"])
    rows: dict[str, list[float]] = {k: [] for k in ("refresh", "live", "status", "status_proc")}
    try:
        seed(home, args.hosts, psutil.Process(sleeper.pid))
        for i in range(args.runs):
            rows["refresh"].append(refresh_cpu(home, args.refreshes))
            rows["status"].append(status_cpu(home))
            rows["status_proc"].append(status_process(home))
            rows["live"].append(live_cpu(home, args.window))
            print(f"run {i + 1}: top refresh {rows['refresh'][-1] * 1000:.1f} ms, top live "
                  f"{rows['live'][-1]:.1f}% of a core, status {rows['status'][-1] * 1000:.1f} ms "
                  f"in-process, {rows['status_proc'][-1] * 1000:.0f} ms as a process", flush=True)
        modes = vigil_durability(home / "vigil.db")
    finally:
        end(sleeper)
        shutil.rmtree(tmp, ignore_errors=True)
    report(args, rows, load0, modes)


def report(args: argparse.Namespace, rows: dict[str, list[float]], load0: str, modes: str) -> None:
    live = rows["live"]
    print(f"\nhosts: {args.hosts}; runs: {args.runs} (interleaved); loadavg start {load0}, end {loadavg()}")
    print(f"top refresh (CPU, in-process)   : {summary(rows['refresh'])}")
    print(f"top live (CPU, % of a core)     : {statistics.median(live):.1f}% ({min(live):.1f}-{max(live):.1f})")
    print(f"status (CPU, in-process)        : {summary(rows['status'])}")
    print(f"status (CPU, a new process)     : {summary(rows['status_proc'])}")
    print(f"ratio top refresh / status      : {summary(ratios(rows['refresh'], rows['status']), 'x')}")
    print("result: top " + " ".join([
        f"hosts={args.hosts}", f"vigil.top_refresh_ms={statistics.median(rows['refresh']) * 1000:.1f}",
        f"vigil.top_live_pct={statistics.median(live):.1f}",
        f"vigil.status_ms={statistics.median(rows['status']) * 1000:.1f}",
        f"vigil.status_process_ms={statistics.median(rows['status_proc']) * 1000:.0f}", modes]))


if __name__ == "__main__":
    main()
