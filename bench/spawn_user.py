#!/usr/bin/env python3
"""The cost of running an app as another user, per spawn: ProcessBackend.spawn of
/bin/true until its exit is reaped, as the agent's user (today's spawn) and as `nobody`,
interleaved in the same run, in both containment modes:

  cgroup   the shim joins the generation's cgroup v2 dir as root, then execs setpriv,
           which switches and execs the app: one exec more
  marker   no shim: Popen (vfork) execs setpriv, which switches and execs the app

(Popen's own switch, user=/group=/extra_groups=, was measured too and dropped: it rules
out vfork, and the fork of the agent made it 12.3 ms median against setpriv's 6.9 ms.)

Needs root (only root may switch users). Prints median (min-max) per case and the ratio.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import loadavg, summary, vigil_durability  # noqa: E402

from runners.backend.process import ProcessBackend  # noqa: E402
from workflows.base.ports import ProcRef, SpawnSpec  # noqa: E402

APP = shutil.which("true") or "/bin/true"


def one(backend: ProcessBackend, user: str | None) -> float:
    gen = str(uuid.uuid4())
    spec = SpawnSpec(generation_uuid=gen, host="bench", argv=[APP], user=user,
                     cgroup=backend.containment_for(gen))
    t0 = time.perf_counter()
    spawned = backend.spawn(spec)
    os.waitpid(spawned.pid, 0)  # ours: reaped here, not by the backend's handle
    took = time.perf_counter() - t0
    backend.release(ProcRef(gen, spawned.pid, spawned.create_time, spec.cgroup))
    return took


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    runs = 10 if args.quick else args.runs
    if os.geteuid() != 0:
        print(f"result: spawn_user skipped (needs root to switch users) {vigil_durability(None)}")
        return
    with tempfile.TemporaryDirectory(prefix="vgb"):
        for mode in ("cgroup", "marker"):
            try:
                backend = ProcessBackend(containment=mode)
            except RuntimeError as exc:
                print(f"{mode}: not available here ({exc})")
                continue
            times: dict[str, list[float]] = {"agent": [], "nobody": []}
            for _ in range(runs):  # interleaved: load changes hit both alike
                times["agent"].append(one(backend, None))
                times["nobody"].append(one(backend, "nobody"))
            med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
            print(f"{mode}: today {summary(times['agent'])}, as nobody "
                  f"{summary(times['nobody'])}, ratio {med['nobody'] / med['agent']:.2f}x")
    print(f"load average {loadavg()}")
    print(f"result: spawn_user {vigil_durability(None)}")  # a spawn touches no store


if __name__ == "__main__":
    main()
