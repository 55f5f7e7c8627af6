#!/usr/bin/env python3
"""What each of the agent's loops on a clock costs at N hosts while nothing happens
(docs/internals/idle.md): the CPU of one turn of each, in this process (time.process_time,
median of --runs), on a store seeded as bench/top.py seeds one (N worker hosts, each with a
current generation whose leader is one `sleep` this script starts, so the walks read a live
process) and on the same hosts asleep (no generation):

  backstop         the liveness backstop's turn: the store's count of current leaders and
                   the walk of one slice of their descendants (runners/agent/sweep.py)
  backstop, whole  what the backstop did before issue 42, and still does without an exit
                   watcher: every leader read, checked and walked, then read again
  jobs             the jobs timer's turn (every 2 s)
  probes           the ongoing probes' re-read of what is probed (every 5 s)
  watchdogs        the watchdogs' re-read (every 5 s)
  workers          the sweep's look for workers to converge (after a round moved rows)

No agent runs (nothing acts on the rows). Every process started is ended by its pid."""

from __future__ import annotations

import argparse
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, loadavg, vigil_durability  # noqa: E402
from top import seed  # noqa: E402

sys.path.insert(0, str(ROOT))
EVERY = {"backstop": 30.0, "backstop, whole": 30.0, "jobs": 2.0, "probes": 5.0,
         "watchdogs": 5.0, "workers": 30.0}  # seconds between turns while idle


def loops(home: Path) -> dict[str, Callable[[], object]]:
    from models.store import Store
    from runners.agent.sweep import Walks
    from runners.wiring import make_context
    from workflows.lifecycle.jobs import tick
    from workflows.lifecycle.members import (
        count_current_leaders,
        current_leaders,
        retire_dead_currents,
    )
    from workflows.lifecycle.probe import Prober
    from workflows.lifecycle.watchdog import Watchdogs
    from workflows.lifecycle.workers import any_to_sweep

    ctx = make_context(home, Store(f"sqlite:///{home / 'vigil.db'}"), "bench-top")
    everyone = set(current_leaders(ctx))
    walks, dogs, prober = Walks(ctx), Watchdogs(ctx, lambda: None), Prober(ctx, lambda: None)

    def backstop() -> None:
        count_current_leaders(ctx)
        walks.after, walks.done_forks = 0, None  # a slice each time, never a skipped cycle
        walks.turn()

    def whole() -> None:
        retire_dead_currents(ctx, None, everyone)  # the watched ones' pids are not checked
        current_leaders(ctx)

    def dogs_read() -> None:
        dogs.dirty = True
        dogs.round()

    def probes_read() -> None:
        prober.dirty, prober.last_read, prober.read_at = True, -10.0, 0.0
        prober.round()

    return {"backstop": backstop, "backstop, whole": whole, "jobs": lambda: tick(ctx),
            "probes": probes_read, "watchdogs": dogs_read, "workers": lambda: any_to_sweep(ctx)}


def put_to_sleep(home: Path) -> None:
    con = sqlite3.connect(home / "vigil.db", isolation_level=None)
    try:
        for table in ("attempts", "releases", "wakes", "generations", "leases"):
            con.execute(f"DELETE FROM {table}")  # noqa: S608 (names of this script's own)
        con.execute("UPDATE hosts SET desired = 'down'")
    finally:
        con.close()


def measure(n: int, asleep: bool, runs: int) -> dict[str, float]:
    """Median CPU seconds of one turn of each loop."""
    tmp = Path(tempfile.mkdtemp(prefix="vgloops", dir="/tmp"))
    leader = subprocess.Popen(["sleep", "3600"])
    try:
        seed(tmp, n, psutil.Process(leader.pid))
        if asleep:
            put_to_sleep(tmp)
        out = {}
        for name, turn in loops(tmp).items():
            turn()  # the first one builds what a statement needs once
            took = []
            for _ in range(runs):
                t0 = time.process_time()
                turn()
                took.append(time.process_time() - t0)
            out[name] = statistics.median(took)
        out["durability"] = vigil_durability(tmp / "vigil.db")  # type: ignore[assignment]
        return out
    finally:
        leader.kill()
        leader.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", default="1000,10000", help="comma-separated N")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="20 hosts, 2 runs")
    args = ap.parse_args()
    sizes = [20] if args.quick else [int(x) for x in args.hosts.split(",")]
    runs = 2 if args.quick else args.runs
    load0 = loadavg()
    rows = {(n, asleep): measure(n, asleep, runs) for n in sizes for asleep in (False, True)}
    print(f"one turn's CPU, ms (% of a core at its idle rate), median of {runs}; loadavg start "
          f"{load0}, end {loadavg()}")
    print(f"{'loop':18s} {'every':>6s}" + "".join(f" {f'{n} {s}':>22s}" for n in sizes
                                                   for s in ("running", "asleep")))
    for name, every in EVERY.items():
        cells = "".join(f" {rows[n, a][name] * 1000:9.2f} ({rows[n, a][name] / every:6.3%})"
                        for n in sizes for a in (False, True))
        print(f"{name:18s} {every:5.0f}s{cells}")
    big = rows[max(sizes), False]
    print(f"result: loops vigil.backstop_ms={big['backstop'] * 1000:.2f} "
          f"vigil.backstop_whole_ms={big['backstop, whole'] * 1000:.2f} "
          f"vigil.jobs_ms={big['jobs'] * 1000:.2f} hosts={max(sizes)} {big['durability']}")


if __name__ == "__main__":
    main()
