#!/usr/bin/env python3
"""The agent's start-up on an empty store, beside the interpreter's own floor, in one run
(interleaved, each a new process of the same interpreter):

  python -c pass               the interpreter with its site (the floor of any Python process)
  python -c "import sqlalchemy"  the store's library alone (what a start-up that opens the
                               store through it cannot go below)
  python -c "import sqlalchemy.orm"  with its ORM: the floor issue 42 names (the agent within
                               2x of it, wall and CPU)
  python -c "import models.tables"  SQLAlchemy, its ORM and vigil's mapped schema: the floor
                               of any process that reads the store as the agent does
  vigil agent                  on a fresh state dir whose store is at head and has no host
                               (`vigil db upgrade` first, untimed): from its Popen to its
                               `ready` log line (recovered, everything started, READY=1 sent),
                               and to the commit of its `agent_started` event (recovery.py's
                               start-up)

Goals: the agent's Popen -> `ready` within 10x `python -c pass`, and within 2x `python -c
"import sqlalchemy.orm"` (issue 42; ratios per run, median, min-max). Each agent is stopped with SIGTERM and waited for; a helper it left running (none
is started on an empty store) is ended by its pid."""

from __future__ import annotations

import argparse
import os
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

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    ROOT,
    end,
    loadavg,
    no_store,
    ratios,
    summary,
    vigil,
    vigil_durability,
    vigil_processes,
)

GOAL = 10.0  # the agent's start-up within this many `python -c pass`
ORM_GOAL = 2.0  # and within this many `python -c "import sqlalchemy.orm"` (issue 42)


def timed(argv: list[str]) -> tuple[float, float]:
    """(wall seconds Popen -> exit, CPU seconds user + system of the process)."""
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(p.pid, 0)
    took = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {p.returncode}")
    return took, usage.ru_utime + usage.ru_stime


def agent_started_at(home: Path) -> float:
    """The wall time (epoch) of the `agent_started` event the store holds."""
    con = sqlite3.connect(f"file:{home / 'vigil.db'}?mode=ro", uri=True, timeout=30)
    try:
        at = con.execute("SELECT at FROM events WHERE kind = 'agent_started'").fetchone()[0]
    finally:
        con.close()
    return datetime.fromisoformat(at).replace(tzinfo=UTC).timestamp()


def one_agent(tmp: Path, root: Path = ROOT, timeout: float = 60.0) -> tuple[float, float, float, str]:
    """A fresh empty store, one agent: (Popen -> `ready` line, Popen -> `agent_started`
    committed, its CPU seconds at `ready`, the store's durability fields)."""
    home = tmp / "state"
    vigil(home, "db", "upgrade")
    env = {**os.environ, "VIGIL_HOME": str(home)}
    env.pop("VIGIL_DB", None)
    wall0 = time.time()
    t0 = time.perf_counter()
    agent = subprocess.Popen([sys.executable, "-m", "runners.cli", "agent", "--log-level", "INFO"],
                             cwd=root, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE)
    seen: list[bytes] = []
    try:
        deadline = time.monotonic() + timeout
        while True:
            line = agent.stderr.readline()  # type: ignore[union-attr]
            if b"logger=vigil.agent ready " in line:  # the text log line run() writes
                ready = time.perf_counter() - t0
                times = psutil.Process(agent.pid).cpu_times()
                break
            seen.append(line)
            if not line or time.monotonic() > deadline:
                raise RuntimeError("the agent did not say ready: " + b"".join(seen[-20:]).decode(errors="replace"))
        started = agent_started_at(home) - wall0
        modes = vigil_durability(home / "vigil.db")
    finally:
        end(agent, signal.SIGTERM)
        if agent.stderr is not None:
            agent.stderr.close()
        for pid in set(vigil_processes(home).values()):  # a helper it left (none expected)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(home, ignore_errors=True)
    return ready, started, times.user + times.system, modes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--quick", action="store_true", help="2 runs, for CI")
    ap.add_argument("--before", type=Path, default=None, metavar="CHECKOUT",
                    help="also time the agent of another checkout (e.g. `git archive main` "
                         "unpacked), interleaved: a change's before and after in one run")
    args = ap.parse_args()
    if args.quick:
        args.runs = 2
    load0 = loadavg()
    names = ("pass", "sqlalchemy", "orm", "tables", "ready", "started", "pass_cpu", "sqlalchemy_cpu",
             "orm_cpu", "tables_cpu", "ready_cpu", "before", "before_cpu")
    rows: dict[str, list[float]] = {k: [] for k in names}
    modes = ""
    tmp = Path(tempfile.mkdtemp(prefix="vgstart", dir="/tmp"))
    try:
        for i in range(args.runs):
            # Interleaved, the order turned each run: a load that comes and goes is shared.
            steps = ["pass", "sqlalchemy", "orm", "tables", "agent", *(["before"] if args.before else [])]
            for step in steps[i % len(steps):] + steps[:i % len(steps)]:
                if step == "before":
                    ready, _, cpu, _ = one_agent(tmp, args.before)
                    rows["before"].append(ready)
                    rows["before_cpu"].append(cpu)
                elif step != "agent":
                    code = {"pass": "pass", "sqlalchemy": "import sqlalchemy",
                            "orm": "import sqlalchemy.orm", "tables": "import models.tables"}[step]
                    wall, cpu = timed([sys.executable, "-c", code])
                    rows[step].append(wall)
                    rows[f"{step}_cpu"].append(cpu)
                else:
                    ready, started, cpu, modes = one_agent(tmp)
                    rows["ready"].append(ready)
                    rows["started"].append(started)
                    rows["ready_cpu"].append(cpu)
            print(f"run {i + 1}: " + "  ".join(f"{k} {v[-1] * 1000:.0f} ms" for k, v in rows.items() if v)
                  + f"  load {loadavg()}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    report(args.runs, rows, load0, modes)


def report(runs: int, rows: dict[str, list[float]], load0: str, modes: str) -> None:
    def med(k: str) -> float:
        return statistics.median(rows[k])

    ready_ratio = ratios(rows["ready"], rows["pass"])
    print(f"\nruns: {runs} (interleaved); loadavg start {load0}, end {loadavg()}; {sys.executable}")
    print(f"python -c pass                          : {summary(rows['pass'])}")
    print(f"python -c 'import sqlalchemy'           : {summary(rows['sqlalchemy'])}  "
          f"ratio to pass {summary(ratios(rows['sqlalchemy'], rows['pass']), 'x')}")
    print(f"python -c 'import sqlalchemy.orm'       : {summary(rows['orm'])}  "
          f"ratio to pass {summary(ratios(rows['orm'], rows['pass']), 'x')} (issue 42's floor)")
    print(f"python -c 'import models.tables'        : {summary(rows['tables'])}  "
          f"ratio to pass {summary(ratios(rows['tables'], rows['pass']), 'x')} (SQLAlchemy, ORM, schema)")
    print(f"agent, Popen -> agent_started committed : {summary(rows['started'])}")
    print(f"agent, Popen -> ready                   : {summary(rows['ready'])}  "
          f"ratio to pass {summary(ready_ratio, 'x')} (goal <= {GOAL:g}x)")
    print(f"  ratio to import sqlalchemy.orm        : {summary(ratios(rows['ready'], rows['orm']), 'x')} "
          f"(goal <= {ORM_GOAL:g}x); CPU {summary(ratios(rows['ready_cpu'], rows['orm_cpu']), 'x')}")
    print(f"  ready beyond import sqlalchemy        : "
          f"{summary([r - s for r, s in zip(rows['ready'], rows['sqlalchemy'], strict=True)])}")
    if rows["before"]:
        print(f"agent of {'the --before checkout':<22}, Popen -> ready : {summary(rows['before'])}  "
              f"ratio to pass {summary(ratios(rows['before'], rows['pass']), 'x')}, to import "
              f"sqlalchemy.orm {summary(ratios(rows['before'], rows['orm']), 'x')}; CPU "
              f"{summary(rows['before_cpu'])}; after / before {summary(ratios(rows['ready'], rows['before']), 'x')}, "
              f"CPU {summary(ratios(rows['ready_cpu'], rows['before_cpu']), 'x')}")
    print("CPU seconds (user + system), less bent by the load than wall time:")
    print(f"  python -c pass / import sqlalchemy / import sqlalchemy.orm / import models.tables / "
          f"agent at ready : {summary(rows['pass_cpu'])} / {summary(rows['sqlalchemy_cpu'])} / "
          f"{summary(rows['orm_cpu'])} / "
          f"{summary(rows['tables_cpu'])} / {summary(rows['ready_cpu'])}")
    print(f"  ratio import models.tables / pass, CPU: {summary(ratios(rows['tables_cpu'], rows['pass_cpu']), 'x')}")
    print(f"  ratio agent / pass, CPU               : {summary(ratios(rows['ready_cpu'], rows['pass_cpu']), 'x')}")
    fields = [f"vigil.ready_ms={med('ready') * 1000:.1f}", f"vigil.agent_started_ms={med('started') * 1000:.1f}",
              modes, f"python.pass_ms={med('pass') * 1000:.1f}",
              f"python.sqlalchemy_ms={med('sqlalchemy') * 1000:.1f}",
              f"python.orm_ms={med('orm') * 1000:.1f}",
              f"python.tables_ms={med('tables') * 1000:.1f}", no_store("python"),
              f"ready_ratio={statistics.median(ready_ratio):.2f}"]
    print("result: startup " + " ".join(fields))


if __name__ == "__main__":
    main()
