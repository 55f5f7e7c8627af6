#!/usr/bin/env python3
"""A deploy beside 200 concurrent `status` requests on the control socket (issue 20 item 7).

Each run times `vigil deploy hello --wait` (a real process) quiet, then again while 200
threads each send one `status` through the control socket at the same moment; every status
must be answered without an error. Goal: the deploy beside them within 2x its quiet time.
Every process started is ended by pid."""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import HELLO, end, loadavg, ratios, start_agent, summary, vigil, vigil_durability  # noqa: E402

from runners.quick.client import Client  # noqa: E402


def deploy_time(home: Path) -> float:
    t0 = time.perf_counter()
    vigil(home, "deploy", "hello", str(HELLO), "--wait")
    return time.perf_counter() - t0


def statuses(home: Path, count: int, errors: list[str]) -> list[threading.Thread]:
    go = threading.Barrier(count)

    def one() -> None:
        go.wait(60)
        c = Client.connect(home, None)
        if c is None:
            errors.append("no connection")
            return
        try:
            c.call("status", 120)
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
        finally:
            c.dispose()

    threads = [threading.Thread(target=one) for _ in range(count)]
    for t in threads:
        t.start()
    return threads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--statuses", type=int, default=200)
    args = ap.parse_args()
    load0 = loadavg()
    tmp = Path(tempfile.mkdtemp(prefix="vgctl", dir="/tmp"))
    home = tmp / "state"
    agent = None
    quiet: list[float] = []
    beside: list[float] = []
    errors: list[str] = []
    try:
        vigil(home, "db", "upgrade")
        vigil(home, "host", "add", "hello", "--build", str(HELLO))
        agent = start_agent(home, tmp / "agent.log")
        deadline = time.monotonic() + 30
        while not (home / "control.sock").exists():
            if time.monotonic() > deadline:
                raise RuntimeError("the agent did not start")
            time.sleep(0.05)
        vigil(home, "wake", "hello", "--wait")
        for _ in range(args.runs):
            quiet.append(deploy_time(home))
            threads = statuses(home, args.statuses, errors)
            beside.append(deploy_time(home))
            for t in threads:
                t.join(150)
        modes = vigil_durability(home / "vigil.db")
    finally:
        end(agent)
        shutil.rmtree(tmp, ignore_errors=True)
    ratio = statistics.median(beside) / statistics.median(quiet)
    print(f"load before {load0}, after {loadavg()}; {args.runs} runs")
    print(f"deploy --wait quiet:                 {summary(quiet)}")
    print(f"deploy --wait beside {args.statuses} statuses:  {summary(beside)}")
    print(f"ratio of medians {ratio:.2f} (goal <= 2.0: {'met' if ratio <= 2 else 'missed'}); per run "
          f"{summary(ratios(beside, quiet), 'x')}; status errors: {len(errors)} {errors[:3]}")
    print(f"result: control vigil.quiet_ms={statistics.median(quiet) * 1000:.1f} "
          f"vigil.beside_ms={statistics.median(beside) * 1000:.1f} ratio={ratio:.2f} errors={len(errors)} {modes}")


if __name__ == "__main__":
    main()
