#!/usr/bin/env python3
"""The agent's memory at its `ready` line, by imported package: the Python memory each
module's import left allocated (tracemalloc, its code, classes and module-level data;
its imports' own counted under them, not under it), summed by top-level package (vigil's
by its first two parts: models.tables, workflows.engine), and what the agent allocated
beyond its imports (the store's engine and compiled statements, threads, its rows). The
process's RSS and PSS at that moment beside it: tracemalloc sees Python's allocations only,
not the interpreter's own or a library's C memory, nor the shared text of its .so files.

  bench/agent_memory.py [--top 25]    a fresh empty store (`vigil db upgrade`), one agent

  bench/agent_memory.py --root DIR     another checkout's agent (a change's before and after)

RSS and PSS are read from a plain agent (`python -m runners.cli agent`) at its ready line;
the packages from a second one run under the wrapper below (tracemalloc from its first line:
its own bookkeeping inflates that process's RSS, so it is not the one read). Each is
stopped with SIGTERM once ready and waited for."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, vigil, vigil_durability  # noqa: E402

# Runs in the agent's process: every import's allocation, then the totals at `ready`.
WRAPPER = r'''
import tracemalloc
tracemalloc.start()
import importlib.abc, json, logging, os, runpy, signal, sys, threading
out, stack, seen = sys.argv[1], [], {}
traced = lambda: tracemalloc.get_traced_memory()[0]
main = threading.main_thread()

class Loader(importlib.abc.Loader):
    def __init__(self, inner): self.inner = inner
    def create_module(self, spec): return self.inner.create_module(spec)
    def exec_module(self, module):
        stack.append(0); m0 = traced()
        try:
            self.inner.exec_module(module)
        finally:
            grown = traced() - m0; inner = stack.pop()
            if stack: stack[-1] += grown
            seen.setdefault(module.__name__, grown - inner)
    def __getattr__(self, k): return getattr(self.inner, k)

class Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if threading.current_thread() is not main: return None
        for f in sys.meta_path[1:]:
            spec = f.find_spec(name, path, target) if hasattr(f, "find_spec") else None
            if spec is not None:
                if getattr(spec.loader, "exec_module", None) is not None:
                    spec.loader = Loader(spec.loader)
                return spec
        return None
sys.meta_path.insert(0, Finder())

class Ready(logging.Handler):
    def emit(self, record):
        if record.getMessage().startswith("ready "):
            with open(out, "w") as f:
                json.dump({"modules": seen, "traced": traced(), "pid": os.getpid()}, f)
logging.getLogger("vigil.agent").addHandler(Ready())
sys.argv = ["vigil", "agent"]
runpy.run_module("runners.cli", run_name="__main__", alter_sys=True)
'''


def group(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] in ("models", "workflows", "runners") else parts[0]


def smaps(pid: int) -> tuple[float, float]:
    """(RSS, PSS) in MB from /proc/<pid>/smaps_rollup."""
    vals = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("Rss", "Pss"):
                vals[key] = int(rest.split()[0]) / 1024
    return vals["Rss"], vals["Pss"]


def run_agent(argv: list[str], root: Path, env: dict[str, str], ready: Callable[[], bool],
              timeout: float = 120.0) -> tuple[float, float]:
    """Run one agent until `ready()`, then (RSS, PSS) in MB; it is stopped and waited for."""
    agent = subprocess.Popen(argv, cwd=root, env=env, stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + timeout
        while not ready():
            if agent.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the agent did not say ready (exit {agent.poll()})")
            time.sleep(0.05)
        return smaps(agent.pid)
    finally:
        agent.terminate()
        try:
            agent.wait(30)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()
        if agent.stderr is not None:
            agent.stderr.close()


def measure(root: Path = ROOT) -> dict[str, Any]:
    """Agents on a fresh empty store: RSS/PSS at `ready` (plain), memory by package (traced)."""
    tmp = Path(tempfile.mkdtemp(prefix="vgmem", dir="/tmp"))
    home, out, log = tmp / "state", tmp / "memory.json", tmp / "agent.err"
    vigil(home, "db", "upgrade")
    env = {**os.environ, "VIGIL_HOME": str(home), "PYTHONPATH": str(root)}
    env.pop("VIGIL_DB", None)
    try:
        # The plain agent's ready line: read from its log, which the agent writes to stderr.
        argv = ["/bin/sh", "-c", f'exec "$0" -m runners.cli agent 2>>{log}', sys.executable]
        rss, pss = run_agent(argv, root, env, lambda: log.exists() and b" ready agent=" in log.read_bytes())
        run_agent([sys.executable, "-c", WRAPPER, str(out)], root, env,
                  lambda: out.exists() and out.read_text().endswith("}"))
        data: dict[str, Any] = json.loads(out.read_text())
        data["modes"] = vigil_durability(home / "vigil.db")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    data["rss"], data["pss"] = rss, pss
    return data


def lines(data: dict[str, Any], top: int) -> list[str]:
    modules: dict[str, int] = data["modules"]
    by: dict[str, int] = {}
    for name, size in modules.items():
        by[group(name)] = by.get(group(name), 0) + size
    imports = sum(modules.values())
    traced = int(data["traced"])
    out = [f"agent at ready (empty store): RSS {data['rss']:.1f} MB, PSS {data['pss']:.1f} MB; "
           f"Python memory traced {traced / 2**20:.1f} MB: imports {imports / 2**20:.1f} MB "
           f"({len(modules)} modules), beyond them {(traced - imports) / 2**20:.1f} MB",
           "| package | MB | share of imports |", "| --- | --- | --- |"]
    for name, size in sorted(by.items(), key=lambda kv: -kv[1])[:top]:
        out.append(f"| {name} | {size / 2**20:.2f} | {size / imports:.1%} |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--top", type=int, default=25, help="packages listed, largest first")
    ap.add_argument("--root", type=Path, default=ROOT, help="the checkout whose agent runs")
    ap.add_argument("--quick", action="store_true", help="the same run (it is one agent), 12 packages: for CI")
    args = ap.parse_args()
    if args.quick:
        args.top = 12
    data = measure(args.root)
    print("\n".join(lines(data, args.top)))
    print(f"result: agent_memory vigil.rss_mb={data['rss']:.1f} vigil.pss_mb={data['pss']:.1f} "
          f"vigil.traced_mb={int(data['traced']) / 2**20:.1f} {data['modes']}")


if __name__ == "__main__":
    main()
