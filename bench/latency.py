#!/usr/bin/env python3
"""Deploy latency, side by side in one run on the example app.

floor:  the app's own spawn -> healthy time (Popen, poll GET / on its socket)
vigil:  intent -> switch committed (from the `deploy_requested` event's timestamp to the
        moment a reader polling the store every 2 ms first sees the `switched` event, i.e.
        after the switch's commit and its fsync), the same to the `switched` event's own
        timestamp (taken inside the transaction, before the fsync), and intent -> drain
        proven (`swapped`'s timestamp), for overlap deploys alternating two builds.
Runs are interleaved (floor, deploy, floor, deploy, ...) so both see the same machine.
Reports median and min-max of each and the ratio intent->switch / floor (goal <= 1.25).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HELLO = ROOT / "examples" / "hello" / "hello.py"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from common import no_store, ratios, summary, vigil_durability  # noqa: E402


def get_ok(sock: str) -> bool:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(1)
    try:
        s.connect(sock)
        s.sendall(b"GET / HTTP/1.0\r\n\r\n")
        return s.recv(64).startswith(b"HTTP/1.0 200") or False
    except OSError:
        return False
    finally:
        s.close()


def floor_once(tmp: Path) -> float:
    sock = str(tmp / "floor.sock")
    t0 = time.monotonic()
    p = subprocess.Popen([str(HELLO)], env={**os.environ, "VIGIL_SOCKET": sock},
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        while not get_ok(sock):
            if time.monotonic() - t0 > 30:
                raise RuntimeError("floor: app never answered")
            time.sleep(0.005)
        return time.monotonic() - t0
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(10)


def vigil(home: Path, *args: str) -> str:
    cp = subprocess.run([sys.executable, "-m", "runners.cli", *args], cwd=ROOT, check=True,
                        capture_output=True, text=True, env={**os.environ, "VIGIL_HOME": str(home)})
    return cp.stdout


def events(home: Path, attempt: int) -> dict[str, datetime]:
    rows = json.loads(vigil(home, "events", "hello", "--json", "--limit", "200"))
    out = {}
    for e in rows:
        if e["detail"].get("attempt") == attempt:
            out[e["kind"]] = datetime.fromisoformat(e["at"].rstrip("Z"))
    return out


def successor_times(home: Path, attempt: int) -> dict[str, datetime]:
    """When the attempt's row was written (by the CLI, with the intent) and its successor's
    row (the spawn's intent, by the agent): the part of the latency before the spawn.
    (The process's start time is left out: /proc gives it against a boot time in whole
    seconds.)"""
    con = sqlite3.connect(f"file:{home / 'vigil.db'}?mode=ro", uri=True, timeout=30)
    try:
        row = con.execute("SELECT a.created_at, g.created_at FROM attempts a"
                          " JOIN generations g ON g.id = a.successor_id WHERE a.id = ?",
                          (attempt,)).fetchone()
    finally:
        con.close()
    if row is None:
        return {}
    return {"(attempt row written)": datetime.fromisoformat(row[0]),
            "(successor row written)": datetime.fromisoformat(row[1])}


class SwitchSeen(threading.Thread):
    """Polls the store (every 2 ms) for the first `switched` event after `after`: the time
    a reader first sees the switch committed."""

    def __init__(self, home: Path, after: int) -> None:
        super().__init__(daemon=True)
        self.home, self.after, self.at = home, after, None
        self.stop = threading.Event()

    def run(self) -> None:
        con = sqlite3.connect(f"file:{self.home / 'vigil.db'}?mode=ro", uri=True, timeout=30)
        try:
            while not self.stop.is_set():
                if con.execute("SELECT 1 FROM events WHERE id > ? AND kind = 'switched'",
                               (self.after,)).fetchone():
                    self.at = time.time()
                    return
                time.sleep(0.002)
        finally:
            con.close()


def last_event(home: Path) -> int:
    con = sqlite3.connect(f"file:{home / 'vigil.db'}?mode=ro", uri=True, timeout=30)
    try:
        return con.execute("SELECT coalesce(max(id), 0) FROM events").fetchone()[0]
    finally:
        con.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--quick", action="store_true", help="2 runs, for CI: keeps the script alive")
    args = ap.parse_args()
    runs = 2 if args.quick else args.runs
    load0 = Path("/proc/loadavg").read_text().split()[:3]
    tmp = Path(tempfile.mkdtemp(prefix="vgbench", dir="/tmp"))
    home = tmp / "state"
    other = tmp / "hello2.py"
    shutil.copy(HELLO, other)
    with open(other, "a") as f:
        f.write("# second build\n")
    agent = None
    try:
        vigil(home, "db", "upgrade")
        vigil(home, "host", "add", "hello", "--build", str(HELLO), "--drain-timeout", "5")
        agent = subprocess.Popen([sys.executable, "-m", "runners.cli", "agent", "--log-level", "WARNING"],
                                 cwd=ROOT, env={**os.environ, "VIGIL_HOME": str(home)},
                                 stderr=open(tmp / "agent.log", "wb"))
        vigil(home, "wake", "hello", "--wait")
        floors, switch, stamped, drained = [], [], [], []
        steps: dict[str, list[float]] = {}
        for i in range(runs):
            floors.append(floor_once(tmp))
            build = other if i % 2 == 0 else HELLO
            seen = SwitchSeen(home, last_event(home))
            seen.start()
            out = vigil(home, "deploy", "hello", str(build), "--wait")
            seen.stop.set()
            seen.join(10)
            attempt = int(out.split("attempt #")[1].split()[0])
            ev = events(home, attempt)
            t0 = ev["deploy_requested"]
            if seen.at is None:
                raise RuntimeError(f"attempt #{attempt}: no switched event seen")
            switch.append(seen.at - t0.replace(tzinfo=UTC).timestamp())
            stamped.append((ev["switched"] - t0).total_seconds())
            drained.append((ev["swapped"] - t0).total_seconds())
            for kind, when in {**ev, **successor_times(home, attempt)}.items():
                steps.setdefault(kind, []).append((when - t0).total_seconds())  # where it goes

        def fmt(xs: list[float]) -> str:
            return f"median {statistics.median(xs) * 1000:7.1f} ms  (min {min(xs) * 1000:.1f}, max {max(xs) * 1000:.1f})"

        print(f"runs: {runs} (interleaved); loadavg start {' '.join(load0)}, "
              f"end {' '.join(Path('/proc/loadavg').read_text().split()[:3])}")
        print(f"floor  spawn->healthy (bare Popen) : {fmt(floors)}")
        print(f"vigil  intent->switch committed    : {fmt(switch)}")
        print(f"vigil  intent->switch's timestamp  : {fmt(stamped)} (in the transaction, before its fsync)")
        print(f"vigil  intent->drain proven        : {fmt(drained)}")
        for kind, xs in sorted(steps.items(), key=lambda kv: statistics.median(kv[1])):
            print(f"  step {kind:<28}: {fmt(xs)} after the intent")
        per_pair = ratios(switch, floors)
        ratio = statistics.median(switch) / statistics.median(floors)
        print(f"ratio  intent->switch / floor      : {ratio:.2f} (goal <= 1.25); per pair {summary(per_pair, 'x')}")
        print(f"result: latency ratio={ratio:.2f} pair_ratio={statistics.median(per_pair):.2f} "
              f"vigil.switch_ms={statistics.median(switch) * 1000:.1f} "
              f"floor.ms={statistics.median(floors) * 1000:.1f} "
              f"{vigil_durability(home / 'vigil.db')} {no_store('floor')}")
        vigil(home, "stop", "hello", "--wait")
    finally:
        if agent is not None:
            agent.send_signal(signal.SIGTERM)
            agent.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
