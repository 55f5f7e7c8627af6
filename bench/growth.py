#!/usr/bin/env python3
"""How vigil's costs grow with the hosts on one box: bench/recovery.py's run (the wake of
N sleeping workers, a `kill -9` of the agent and its recovery, an idle window counting
every vigil process) at each N of --hosts (1, 100, 1,000 and 10,000 by default), printed
as one table so the growth shows, with supervisord beside it at --peer-at (1,000) in the
same run, and `python -c pass` and `python -c "import sqlalchemy.orm"` (the start-up's
floor) timed in the same run.

Each goal of issue 42 is printed beside its figure: at 1,000 hosts a wake <= 0.8x
supervisord's, idle CPU at or below supervisord's, PSS of every vigil process <= 1.5x
supervisord's RSS, `kill -9` -> quiescent <= 0.8 s, the agent's start-up <= 2x the floor;
at 10,000 a wake <= 60 s, idle <= 1 % of a core, RSS of all vigil processes <= 350 MB,
`kill -9` -> quiescent <= 3 s (issue 27's goals were these at 10,000, and at 1,000 a wake
<= 5 s, idle and RSS below supervisord's).
Every process a run starts is ended by recovery.py's run (by pid)."""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import agent_memory  # noqa: E402
from common import loadavg, no_store, summary  # noqa: E402
from recovery import one_run, room_for  # noqa: E402

med = statistics.median


def python_pass(runs: int, code: str = "pass") -> float:
    """The median wall time of `python -c CODE` (this interpreter), seconds."""
    times = []
    for _ in range(runs):
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-c", code], check=True)
        times.append(time.monotonic() - t0)
    return med(times)


FLOOR = "import sqlalchemy.orm"  # the start-up floor of the dependency the design requires


def measure(n: int, runs: int, idle: float, peer: bool) -> dict[str, Any]:
    n = room_for(n)
    args = argparse.Namespace(hosts=n, idle=idle, peer=peer)
    rows = [one_run(args, i) for i in range(runs)]
    out: dict[str, Any] = {"n": n, "runs": runs, "rows": rows, "load": loadavg()}
    for k in ("woken", "total", "startup", "recovery", "cpu", "rss", "pss", "sup_woken",
              "sup_cpu", "sup_rss"):
        if all(k in r for r in rows):
            out[k] = [r[k] for r in rows]
    out["modes"] = rows[-1]["modes"]
    out["by_process"] = [r["by_process"] for r in rows]
    return out


def goal(ok: bool) -> str:
    return "met" if ok else "MISSED"


def goals(by_n: dict[int, dict[str, Any]], pass_s: float, floor_s: float) -> list[str]:
    """Each goal beside its figure (medians), for the Ns measured."""
    lines = []
    if (m := by_n.get(1000)) is not None:
        lines.append(f"1,000: kill -9 -> quiescent {med(m['total']):.2f} s (goal <= 0.8 s): "
                     f"{goal(med(m['total']) <= 0.8)}")
        ratio = med(m["startup"]) / floor_s
        lines.append(f"1,000: agent start-up {med(m['startup']):.3f} s = {ratio:.1f}x python -c "
                     f"'import sqlalchemy.orm' ({floor_s * 1000:.0f} ms; python -c pass "
                     f"{pass_s * 1000:.1f} ms) (issue 42 goal <= 2x): {goal(ratio <= 2)}")
        if "sup_cpu" in m:
            wake = med(m["woken"]) / med(m["sup_woken"])
            lines.append(f"1,000: wake {med(m['woken']):.2f} s = {wake:.2f}x supervisord's "
                         f"{med(m['sup_woken']):.2f} s (issue 42 goal <= 0.8x): {goal(wake <= 0.8)}")
            lines.append(f"1,000: idle CPU {med(m['cpu']):.2%} vs supervisord {med(m['sup_cpu']):.2%} "
                         f"(goal: at or below): {goal(med(m['cpu']) <= med(m['sup_cpu']))}")
            lines.append(f"1,000: RSS {med(m['rss']):.1f} MB vs supervisord {med(m['sup_rss']):.1f} MB "
                         f"(goal: below): {goal(med(m['rss']) < med(m['sup_rss']))}")
            lines.append(f"1,000: PSS of every vigil process {med(m['pss']):.1f} MB vs 1.5x supervisord's "
                         f"RSS {1.5 * med(m['sup_rss']):.1f} MB (issue 42 goal): "
                         f"{goal(med(m['pss']) <= 1.5 * med(m['sup_rss']))}")
    if (m := by_n.get(10000)) is not None:
        lines.append(f"{m['n']:,}: wake {med(m['woken']):.1f} s (goal <= 60 s): {goal(med(m['woken']) <= 60)}")
        lines.append(f"{m['n']:,}: idle CPU {med(m['cpu']):.2%} (goal <= 1 %): {goal(med(m['cpu']) <= 0.01)}")
        lines.append(f"{m['n']:,}: RSS {med(m['rss']):.1f} MB (goal <= 350 MB): {goal(med(m['rss']) <= 350)}")
        lines.append(f"{m['n']:,}: kill -9 -> quiescent {med(m['total']):.2f} s (goal <= 3 s): "
                     f"{goal(med(m['total']) <= 3)}")
    return lines


def table(by_n: dict[int, dict[str, Any]]) -> list[str]:
    head = ("| hosts | runs | wake | kill -9 -> quiescent | start-up | recovery | idle CPU, % of a core "
            "| RSS, MB (all vigil processes) | PSS, MB | load at end |")
    lines = [head, "| " + " | ".join(["---"] * 10) + " |"]
    for _, m in sorted(by_n.items()):
        lines.append(f"| {m['n']:,} | {m['runs']} | {summary(m['woken'], 's')} | {summary(m['total'], 's')} "
                     f"| {summary(m['startup'], 's')} | {summary(m['recovery'], 's')} "
                     f"| {summary([c * 100 for c in m['cpu']], '')} | {summary(m['rss'], '')} "
                     f"| {summary(m['pss'], '')} | {m['load']} |")
        if "sup_cpu" in m:
            lines.append(f"| {m['n']:,}, supervisord | {m['runs']} | {summary(m['sup_woken'], 's')} | - | - | - "
                         f"| {summary([c * 100 for c in m['sup_cpu']], '')} | {summary(m['sup_rss'], '')} "
                         "| - | same run |")
    return lines


def by_process(by_n: dict[int, dict[str, Any]]) -> list[str]:
    """PSS of each vigil process (RSS beside it), MB, the median over the runs at each N."""
    names = sorted({k for m in by_n.values() for r in m["by_process"] for k in r},
                   key=lambda k: (k != "agent", k))
    lines = ["| hosts | " + " | ".join(f"{k}: PSS (RSS)" for k in names) + " |",
             "| " + " | ".join(["---"] * (len(names) + 1)) + " |"]
    for _, m in sorted(by_n.items()):
        cells = []
        for k in names:
            got = [r[k] for r in m["by_process"] if k in r]
            cells.append(f"{med(g[1] for g in got):.1f} ({med(g[0] for g in got):.1f})" if got else "-")
        lines.append(f"| {m['n']:,} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", default="1,100,1000,10000", help="the Ns, comma-separated")
    ap.add_argument("--runs", type=int, default=3, help="runs at each N below 10,000")
    ap.add_argument("--big-runs", type=int, default=1, help="runs at each N of 10,000 or more")
    ap.add_argument("--idle", type=float, default=20.0, help="seconds of idle watching per run")
    ap.add_argument("--peer-at", type=int, default=1000, help="the N supervisord runs beside")
    ap.add_argument("--quick", action="store_true", help="1 and 20 hosts, 1 run, 2 s idle: for CI")
    args = ap.parse_args()
    if args.quick:
        args.hosts, args.runs, args.idle, args.peer_at = "1,20", 1, 2.0, 20
    ns = [int(x) for x in args.hosts.split(",")]
    load0 = loadavg()
    pass_s, floor_s = python_pass(9), python_pass(5, FLOOR)
    by_n = {n: measure(n, args.big_runs if n >= 10000 else args.runs, args.idle, n == args.peer_at)
            for n in ns}
    pass_s = med([pass_s, python_pass(9)])  # before and after, the same interpreter
    floor_s = med([floor_s, python_pass(5, FLOOR)])
    print(f"\nloadavg start {load0}, end {loadavg()}; python -c pass {pass_s * 1000:.1f} ms (median)")
    print("\n".join(table(by_n)))
    print("\nMemory of each vigil process at the end of the idle window, MB (median):")
    print("\n".join(by_process(by_n)))
    print("\nThe agent's memory by imported package (bench/agent_memory.py):")
    print("\n".join(agent_memory.lines(agent_memory.measure(), 12 if args.quick else 25)))
    print("\n".join(goals(by_n, pass_s, floor_s)))
    last = by_n[ns[-1]]
    fields = [f"vigil.wake_s.{m['n']}={med(m['woken']):.2f}" for m in by_n.values()]
    fields += [f"vigil.rss_mb.{m['n']}={med(m['rss']):.1f}" for m in by_n.values()]
    print("result: growth " + " ".join(fields) + f" {last['modes']} {no_store('supervisord')}")


if __name__ == "__main__":
    main()
