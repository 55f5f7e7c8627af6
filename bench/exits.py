#!/usr/bin/env python3
"""Exit -> restart: how soon a supervisor notices that an app's process died and starts it
again. The same app (examples/hello), SIGKILL of its process, interleaved runs:

  vigil        kill -> the restart wake is committed (the agent's transaction that retires
               the generation and queues its restart, from the pidfd exit event, not a
               sweep), as a reader polling the store every 2 ms first sees it; beside it the
               `exited` event's and the wake's own timestamps, taken inside that transaction
               before its commit's fsync; and kill -> the app answers again on the
               canonical socket
  supervisord  kill -> the app answers again on its socket (autorestart=true)

Goal: kill -> restart wake committed <= 50 ms. Ratios are per interleaved run (median, min-max). Each killed process is the app's leader, by
the pid the supervisor reports; everything started is ended by pid at the end.
"""

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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    HELLO,
    PEERS,
    end,
    get_ok,
    loadavg,
    no_store,
    ratios,
    start_agent,
    start_supervisord,
    summary,
    vigil,
    vigil_durability,
)


def at(ts: str) -> float:
    return datetime.fromisoformat(ts).replace(tzinfo=UTC).timestamp()


def wait_serving(sock: str, timeout: float = 30.0) -> float:
    """time.time() when a GET on `sock` first answers 200 (polled every 2 ms)."""
    deadline = time.monotonic() + timeout
    while not get_ok(sock, 0.5):
        if time.monotonic() > deadline:
            raise RuntimeError(f"nothing answered on {sock} within {timeout:.0f}s")
        time.sleep(0.002)
    return time.time()


class Vigil:
    def __init__(self, tmp: Path) -> None:
        self.home = tmp / "vigil"
        self.agent = None
        vigil(self.home, "db", "upgrade")
        # Each run's kill is a single crash, not a crash loop: a run that stayed up 0.5 s
        # restarts at once (the default, 60 s, would back the later runs off as a loop,
        # as supervisord's startsecs/backoff would for exits within startsecs).
        vigil(self.home, "host", "add", "hello", "--build", str(HELLO), "--drain-timeout", "5",
              "--restart-reset", "0.5")
        self.agent = start_agent(self.home, tmp / "agent.log")
        vigil(self.home, "wake", "hello", "--wait")
        self.sock = str(self.home / "run" / "hello.sock")

    def q(self, sql: str, *args: object) -> tuple:  # type: ignore[type-arg]
        con = sqlite3.connect(f"file:{self.home / 'vigil.db'}?mode=ro", uri=True, timeout=30)
        try:
            return con.execute(sql, args).fetchone()
        finally:
            con.close()

    def kill(self) -> dict[str, float]:
        pid, gen = self.q("SELECT pid, id FROM generations WHERE host = 'hello' AND state = 'current'")
        last_wake = self.q("SELECT coalesce(max(id), 0) FROM wakes")[0]
        con = sqlite3.connect(f"file:{self.home / 'vigil.db'}?mode=ro", uri=True, timeout=30)
        killed = time.time()
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        try:  # the commit: the first moment a reader sees the restart wake
            while con.execute("SELECT 1 FROM wakes WHERE id > ? AND host = 'hello'", (last_wake,)).fetchone() is None:
                if time.monotonic() > deadline:
                    raise RuntimeError("no restart wake within 30 s")
                time.sleep(0.002)
            committed = time.time()
        finally:
            con.close()
        back = wait_serving(self.sock)
        row = self.q("SELECT e.at, w.created_at FROM events e, wakes w WHERE e.kind = 'exited'"
                     " AND e.generation_id = ? AND w.id > ? AND w.host = 'hello'", gen, last_wake)
        if row is None:
            raise RuntimeError("a restart wake without the generation's exited event")
        # Serving again means the new generation is current: wait until the store says so.
        while self.q("SELECT count(*) FROM pending_obligations")[0]:
            time.sleep(0.01)
        return {"committed": committed - killed, "written": at(row[1]) - killed,
                "exited": at(row[0]) - killed, "serving": back - killed}

    def close(self) -> None:
        try:
            vigil(self.home, "stop", "hello", "--wait", "--timeout", "30")
        finally:
            end(self.agent)


class Supervisord:
    def __init__(self, tmp: Path) -> None:
        self.sock = str(tmp / "sup-hello.sock")
        self.conf, self.proc = start_supervisord(tmp, self.sock, """
autorestart=true
startsecs=0
""")

    def kill(self) -> dict[str, float]:
        pid = int(subprocess.run([str(PEERS / "bin" / "supervisorctl"), "-c", str(self.conf), "pid",
                                  "hello"], capture_output=True, text=True, check=True).stdout)
        killed = time.time()
        os.kill(pid, signal.SIGKILL)
        return {"serving": wait_serving(self.sock) - killed}

    def close(self) -> None:
        end(self.proc)  # supervisord stops its programs on SIGTERM


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--quick", action="store_true", help="3 runs, for CI")
    args = ap.parse_args()
    if args.quick:
        args.runs = 3
    load0 = loadavg()
    tmp = Path(tempfile.mkdtemp(prefix="vgexit", dir="/tmp"))
    v = s = None
    rows: dict[str, list[dict[str, float]]] = {"vigil": [], "supervisord": []}
    try:
        v = Vigil(tmp)
        if (PEERS / "bin" / "supervisord").exists():
            s = Supervisord(tmp)
        for i in range(args.runs):
            rows["vigil"].append(v.kill())
            if s is not None:
                rows["supervisord"].append(s.kill())
            r = rows["vigil"][-1]
            peer = f"; supervisord serving again {rows['supervisord'][-1]['serving'] * 1000:.0f} ms" if s else ""
            print(f"run {i + 1}: vigil restart wake committed {r['committed'] * 1000:.1f} ms, serving again "
                  f"{r['serving'] * 1000:.0f} ms{peer}", flush=True)
        modes = vigil_durability(v.home / "vigil.db")
    finally:
        if v is not None:
            v.close()
        if s is not None:
            s.close()
        shutil.rmtree(tmp, ignore_errors=True)

    def col(who: str, k: str) -> str:
        xs = [r[k] * 1000 for r in rows[who]]
        return f"median {statistics.median(xs):.1f} ms ({min(xs):.1f}-{max(xs):.1f})"

    print(f"\nruns: {args.runs} (interleaved); loadavg start {load0}, end {loadavg()}")
    print(f"vigil kill -> exited event's timestamp    : {col('vigil', 'exited')} (in the transaction)")
    print(f"vigil kill -> restart wake's timestamp    : {col('vigil', 'written')} (in the transaction)")
    print(f"vigil kill -> restart wake committed      : {col('vigil', 'committed')} (goal <= 50 ms)")
    print(f"vigil kill -> serving again               : {col('vigil', 'serving')}")
    fields = [f"vigil.committed_ms={statistics.median(r['committed'] for r in rows['vigil']) * 1000:.1f}",
              f"vigil.serving_ms={statistics.median(r['serving'] for r in rows['vigil']) * 1000:.1f}",
              modes]
    if rows["supervisord"]:
        sup = [r["serving"] for r in rows["supervisord"]]
        per_run = ratios([r["serving"] for r in rows["vigil"]], sup)
        print(f"supervisord kill -> serving again         : {col('supervisord', 'serving')}")
        print(f"ratio vigil / supervisord, serving again  : {summary(per_run, 'x')} (per run)")
        fields += [f"supervisord.serving_ms={statistics.median(sup) * 1000:.1f}", no_store("supervisord"),
                   f"serving_ratio={statistics.median(per_run):.2f}"]
    else:
        print("supervisord                               : not installed (run bench/install-peers)")
    print("result: exits " + " ".join(fields))

if __name__ == "__main__":
    main()
