#!/usr/bin/env python3
"""Wake-up latency: an intent written by another process -> the agent's round resolving it.

Starts a real agent (safety scan every 60 s, so only the wake-up path can start a round)
and writes, from this process, one stop intent at a time on a host that is not running;
the latency is the stop row's `created_at` -> `ended_at` (intent commit -> resolved, which
includes the round and the drive). Interleaved, two ways to start the round:
  doorbell:  the local datagram socket (the floor: immediate on this box)
  wake-up:   postgresql: NOTIFY after the intent -> the agent's LISTEN thread -> round
             sqlite:     nothing sent; the agent's `PRAGMA data_version` poll (50 ms)
wake-up minus doorbell is what the cross-box wake-up path costs.
Usage: bench/wakeup.py [--pg postgresql+psycopg://root@127.0.0.1:5432/test] [-n 30]
"""

from __future__ import annotations

import argparse
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import sqlalchemy as sa  # noqa: E402

from models import schema  # noqa: E402
from models.states import StopState  # noqa: E402
from models.store import Store, sqlite_url  # noqa: E402
from models.tables import Stop  # noqa: E402
from runners.base.doorbell import ring  # noqa: E402
from runners.base.wakeup import notify_boxes  # noqa: E402
from workflows.lifecycle.stop import request_stop  # noqa: E402

HELLO = ROOT / "examples" / "hello" / "hello.py"


def measure(url: str | None, state: Path, n: int) -> dict[str, list[float]]:
    store = Store(url or sqlite_url(state))
    schema.upgrade(store.engine)
    env = {"VIGIL_HOME": str(state), **({"VIGIL_DB": url} if url else {})}
    cli = [sys.executable, "-m", "runners.cli"]
    subprocess.run([*cli, "host", "add", "idle", "--build", str(HELLO)], env=env, cwd=ROOT,
                   check=True, capture_output=True)
    log = open(state / "agent.out", "ab")
    agent = subprocess.Popen([*cli, "agent", "--safety-interval", "60"], env=env, cwd=ROOT,
                             stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 60
        while b"ready" not in (state / "agent.out").read_bytes():
            assert time.monotonic() < deadline and agent.poll() is None, "agent not ready"
            time.sleep(0.05)
        out: dict[str, list[float]] = {"doorbell": [], "wake-up": []}
        for i in range(2 * n):  # interleaved, so both modes see the same machine
            mode = "doorbell" if i % 2 else "wake-up"
            time.sleep(0.3)  # let the agent go idle
            sid = store.write(lambda s: request_stop(s, "idle").id)
            if mode == "doorbell":
                ring(state)  # the floor: the local socket, then the same round and drive
            else:
                notify_boxes(store)  # PostgreSQL: NOTIFY; SQLite: nothing (data_version poll)
            deadline = time.monotonic() + 30
            while True:
                row = store.read(lambda s, sid=sid: s.get(Stop, sid))
                if row.state is StopState.done:
                    break
                assert time.monotonic() < deadline, "stop never resolved"
                time.sleep(0.005)
            out[mode].append((row.ended_at - row.created_at).total_seconds() * 1000)
        return out
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(30)
        store.dispose()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pg", default="postgresql+psycopg://root@127.0.0.1:5432/test")
    ap.add_argument("-n", type=int, default=30)
    args = ap.parse_args()
    admin = sa.create_engine(args.pg, isolation_level="AUTOCOMMIT")
    name = f"vigil_bench_{uuid.uuid4().hex[:8]}"
    with admin.connect() as c:
        c.exec_driver_sql(f'CREATE DATABASE "{name}"')
    tmp = Path(tempfile.mkdtemp(prefix="vgb", dir="/tmp"))
    try:
        for label, url in (("postgresql", admin.url.set(database=name)
                            .render_as_string(hide_password=False)), ("sqlite", None)):
            state = tmp / label
            state.mkdir(mode=0o700)
            for mode, ms in measure(url, state, args.n).items():
                ms.sort()
                print(f"{label:10} {mode:8} intent->resolved ms: median {statistics.median(ms):.1f}"
                      f" p90 {ms[int(len(ms) * 0.9) - 1]:.1f} min {ms[0]:.1f} max {ms[-1]:.1f}"
                      f" (n={len(ms)})")
    finally:
        with admin.connect() as c:
            c.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
