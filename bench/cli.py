#!/usr/bin/env python3
"""The CLI's own cost, side by side in one run (interleaved, each command a new process):

  python -c pass           the interpreter vigil runs on, bare (the floor of any Python CLI),
                           and `python3 -c pass` as PATH finds it (often a shim), for reference
  vigil --help             click and the command modules, no SQLAlchemy
  vigil status             with an agent up: through its control socket
  vigil deploy (submit)    with an agent up: the attempt written by the agent, answered
  supervisorctl status     supervisord 4.3 (bench/.peers) with one program, over its socket

Goals: `vigil status` and a deploy's submission within 1.5x `supervisorctl status`;
`vigil --help` within 2x `python -c pass`. Ratios are per interleaved run (median, min-max).
Every process started is ended by pid."""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    HELLO,
    PEERS,
    ROOT,
    end,
    loadavg,
    no_store,
    ratios,
    start_agent,
    start_supervisord,
    summary,
    vigil,
    vigil_durability,
)


def timed(argv: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    cp = subprocess.run(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                        stderr=subprocess.PIPE, text=True)
    took = time.perf_counter() - t0
    if cp.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {cp.returncode}: {cp.stderr.strip()}")
    return took


def wait_quiet(home: Path, timeout: float = 60) -> None:
    """Untimed: the last deploy has ended before the next run."""
    deadline = time.monotonic() + timeout
    while vigil(home, "obligations", "--json").strip() != "[]":
        if time.monotonic() > deadline:
            raise RuntimeError("the deploy did not end within 60 s")
        time.sleep(0.05)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--quick", action="store_true", help="3 runs, for CI")
    args = ap.parse_args()
    if args.quick:
        args.runs = 3
    script = Path(sys.executable).parent / "vigil"  # the console script, as an operator runs it
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "runners.cli"]
    load0 = loadavg()
    tmp = Path(tempfile.mkdtemp(prefix="vgcli", dir="/tmp"))
    home = tmp / "state"
    env = {**os.environ, "VIGIL_HOME": str(home)}
    env.pop("VIGIL_DB", None)
    agent = sup = None
    ctl = PEERS / "bin" / "supervisorctl"
    rows: dict[str, list[float]] = {k: [] for k in ("pass", "python3", "help", "status", "deploy",
                                                    "supervisorctl")}
    python3 = shutil.which("python3")
    try:
        vigil(home, "db", "upgrade")
        vigil(home, "host", "add", "hello", "--build", str(HELLO))
        agent = start_agent(home, tmp / "agent.log")
        deadline = time.monotonic() + 30
        while not (home / "control.sock").exists():
            if agent.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the agent did not start: {(tmp / 'agent.log').read_text()[-2000:]}")
            time.sleep(0.05)
        vigil(home, "wake", "hello", "--wait")
        conf = None
        if ctl.exists():
            conf, sup = start_supervisord(tmp, str(tmp / "hello-sup.sock"), "")
        for i in range(args.runs):
            rows["pass"].append(timed([sys.executable, "-c", "pass"], env))
            if python3:
                rows["python3"].append(timed([python3, "-c", "pass"], env))
            rows["help"].append(timed([*cmd, "--help"], env))
            rows["status"].append(timed([*cmd, "status"], env))
            if conf is not None:
                rows["supervisorctl"].append(timed([str(ctl), "-c", str(conf), "status"], env))
            rows["deploy"].append(timed([*cmd, "deploy", "hello", str(HELLO)], env))
            wait_quiet(home)
            line = "  ".join(f"{k} {v[-1] * 1000:.0f} ms" for k, v in rows.items() if v)
            print(f"run {i + 1}: {line}", flush=True)
        modes = vigil_durability(home / "vigil.db")
    finally:
        if agent is not None:
            subprocess.run([*cmd, "stop", "hello", "--wait", "--timeout", "30"], cwd=ROOT, env=env,
                           capture_output=True)
            end(agent)
        end(sup)  # supervisord stops its program on SIGTERM
        shutil.rmtree(tmp, ignore_errors=True)
    report(args.runs, rows, load0, python3, modes)


def report(runs: int, rows: dict[str, list[float]], load0: str, python3: str | None, modes: str) -> None:
    def col(k: str) -> str:
        xs = [x * 1000 for x in rows[k]]
        return f"median {statistics.median(xs):6.1f} ms ({min(xs):.1f}-{max(xs):.1f})" if xs else "n/a"

    def med(k: str) -> float:
        return statistics.median(rows[k])

    print(f"\nruns: {runs} (interleaved); loadavg start {load0}, end {loadavg()}")
    print(f"python -c pass         : {col('pass')}  ({sys.executable})")
    if rows["python3"]:
        print(f"python3 -c pass        : {col('python3')}  ({python3})")
    def per_run(a: str, b: str) -> str:
        return summary(ratios(rows[a], rows[b]), "x")

    print(f"vigil --help           : {col('help')}  ratio to python -c pass {per_run('help', 'pass')} (goal <= 2)"
          + (f"; to python3 -c pass {per_run('help', 'python3')}" if rows["python3"] else ""))
    print(f"vigil status           : {col('status')}")
    print(f"vigil deploy (submit)  : {col('deploy')}")
    fields = [f"vigil.help_ms={med('help') * 1000:.1f}", f"vigil.status_ms={med('status') * 1000:.1f}",
              f"vigil.deploy_ms={med('deploy') * 1000:.1f}", modes,
              f"python.pass_ms={med('pass') * 1000:.1f}", no_store("python"),
              f"help_ratio={statistics.median(ratios(rows['help'], rows['pass'])):.2f}"]
    if rows["supervisorctl"]:
        print(f"supervisorctl status   : {col('supervisorctl')}")
        print(f"ratio status / supervisorctl status : {per_run('status', 'supervisorctl')} (goal <= 1.5)")
        print(f"ratio deploy / supervisorctl status : {per_run('deploy', 'supervisorctl')} (goal <= 1.5)")
        fields += [f"supervisorctl.status_ms={med('supervisorctl') * 1000:.1f}", no_store("supervisorctl"),
                   f"status_ratio={statistics.median(ratios(rows['status'], rows['supervisorctl'])):.2f}",
                   f"deploy_ratio={statistics.median(ratios(rows['deploy'], rows['supervisorctl'])):.2f}"]
    else:
        print("supervisorctl          : not installed (run bench/install-peers)")
    print("result: cli " + " ".join(fields))

if __name__ == "__main__":
    main()
