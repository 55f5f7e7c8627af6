#!/usr/bin/env python3
"""The re-hand window: how long after a helper's death a new one holds everything again.

The agent's own clients and helper watch (runners/backend/listen.py Listeners,
runners/keepers/logpipes.py LogPipes, runners/agent/helpers.py KeeperWatch), in this
process, holding N listening sockets and N log pipes; interleaved runs, each one
`kill -9` of:

  fd holder    kill -> a new holder has answered the put of every socket (then checked:
               it lists every key with the same inode)
  log keeper   kill -> a new keeper holds every pipe's read end: its standby took them over
               (it kept a copy of each), or, with no standby, the agent's puts were
               answered (then checked: a line written into the last pipe reaches its file)

for N = 20 and N = 200 (`--sizes`). Only a second death inside this window can lose a
socket or a pipe. Goal: <= 100 ms. Every helper started is ended by its pid at the end.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from common import loadavg, summary, vigil_durability  # noqa: E402

from runners.agent.exit_watch import PipeBell  # noqa: E402
from runners.agent.helpers import KeeperWatch  # noqa: E402
from runners.backend.listen import Listeners  # noqa: E402
from runners.base.doorbell import lock_holder  # noqa: E402
from runners.keepers.fdholder import HOLDER_LOCK, holder_pid  # noqa: E402
from runners.keepers.logkeeper import KEEPER_LOCK, keeper_pid  # noqa: E402
from runners.keepers.logpipes import LogPipes  # noqa: E402
from runners.keepers.peer import Peer  # noqa: E402
from runners.keepers.wire import standby_of  # noqa: E402


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


class Box:
    """One state dir: N sockets with the holder, N pipes with the keeper, watched."""

    def __init__(self, tmp: Path, n: int) -> None:
        self.state = tmp / f"s{n}"
        (self.state / "logs").mkdir(parents=True)
        self.n = n
        bell = PipeBell()  # as the agent's wiring: a keeper started on demand is watched at once
        self.listeners, self.logs = Listeners(self.state, bell.ring), LogPipes(self.state, bell.ring)
        self.writes = []
        for i in range(n):
            self.listeners.bind(f"k{i}", f"unix:{self.state}/u{i}.sock")
            self.listeners.hand(f"k{i}")
            (self.state / "logs" / f"h{i}").mkdir()
            self.writes.append(self.logs.open(f"g{i}", str(self.log(i)), 1 << 20, 2))
        self.want = {k: self.listeners.inode(k) for k in self.listeners.keys()}
        self.done: dict[str, threading.Event] = {}
        for peer in (self.listeners.peer, self.logs.peer):
            self._hook(peer)
        self.watch = KeeperWatch([self.listeners.peer, self.logs.peer], bell)
        self.watch.start()

    def log(self, i: int) -> Path:
        return self.state / "logs" / f"h{i}" / "g1.log"

    def _hook(self, peer: Peer) -> None:
        """Time the revive that follows a death: it returns once every put was answered."""
        revive = peer.revive
        done = self.done[peer.what] = threading.Event()

        def timed() -> None:
            revive()
            done.set()

        peer.revive = timed  # type: ignore[method-assign]

    def kill(self, what: str) -> float:
        pid = (holder_pid if what == "fd holder" else keeper_pid)(self.state)
        if not pid or pid <= 0:
            raise RuntimeError(f"no {what} runs in {self.state}")
        done = self.done[what]
        done.clear()
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        if not done.wait(30):
            raise RuntimeError(f"no new {what} within 30 s")
        if what == "log keeper":  # the standby takes the pipes over; the agent has no copy
            self._holding_all(pid, t0 + 30)
        took = time.monotonic() - t0
        self._verify(what, pid)
        return took

    def _holding_all(self, old: int, deadline: float) -> None:
        """Until a keeper other than `old` says it holds every pipe."""
        while time.monotonic() < deadline:
            if keeper_pid(self.state) not in (None, old):
                with self.logs.peer.lock:
                    got = self.logs.peer.ask({"op": "get", "keys": []}, start=False)
                if got is not None and got[0].get("held", 0) >= self.n:
                    return
            time.sleep(0.001)
        raise RuntimeError(f"no new keeper holds every pipe within 30 s (pid {keeper_pid(self.state)}, "
                           f"old {old}, last reply {got if 'got' in locals() else None})")

    def _verify(self, what: str, old: int) -> None:
        if what == "fd holder":
            if holder_pid(self.state) in (None, old) or self.listeners.listed() != self.want:
                raise RuntimeError("the new holder does not hold every socket (same inodes)")
            return
        line = f"after {old}\n".encode()
        os.write(self.writes[-1], line)
        deadline = time.monotonic() + 30
        while line not in self.log(self.n - 1).read_bytes():
            if time.monotonic() > deadline:
                raise RuntimeError("the new keeper does not read the last pipe")
            time.sleep(0.005)

    def close(self) -> None:
        self.watch.close()
        for w in self.writes:
            os.close(w)
        for s in self.listeners.socks.values():
            s.close()
        standbys = [lock_holder(standby_of(self.state / name)) for name in (HOLDER_LOCK, KEEPER_LOCK)]
        started = [*self.listeners.peer.started, *self.logs.peer.started]  # this process's children
        for pid in [*standbys, *started, holder_pid(self.state), keeper_pid(self.state)]:
            if pid and pid > 0:  # the standbys first: each would take over
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
                while os.path.exists(f"/proc/{pid}") and "Z" not in _state(pid):
                    time.sleep(0.005)
        for pid in started:
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--sizes", default="20,200", help="held sockets/pipes per box")
    ap.add_argument("--quick", action="store_true", help="3 runs of 5 and 20, for CI")
    args = ap.parse_args()
    if args.quick:
        args.runs, args.sizes = 3, "5,20"
    sizes = [int(x) for x in args.sizes.split(",")]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 8 * max(sizes) + 512)), hard))
    tmp = Path(tempfile.mkdtemp(prefix="vk", dir="/tmp"))
    load0 = loadavg()
    boxes: list[Box] = []
    times: dict[tuple[str, int], list[float]] = {}
    try:
        boxes = [Box(tmp, n) for n in sizes]
        time.sleep(1.0)  # the helpers settle (their first checks) before the first kill
        for i in range(args.runs):  # interleaved: each run kills every helper of every box
            for what in ("fd holder", "log keeper"):
                for box in boxes:
                    times.setdefault((what, box.n), []).append(box.kill(what))
                    time.sleep(0.2)
            print(f"run {i + 1}: " + ", ".join(f"{w} {n}: {xs[-1] * 1000:.1f} ms"
                                               for (w, n), xs in times.items()))
    finally:
        for box in boxes:
            box.close()
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\nruns: {args.runs} (interleaved); loadavg start {load0}, end {loadavg()}")
    for (what, n), xs in times.items():
        print(f"{what:10} kill -9 -> a new one holds all {n:4d}: {summary(xs)} (goal <= 100 ms)")
    worst = max(statistics_median(xs) for xs in times.values())
    # The helpers hold sockets and pipes, no store: no side here commits anything.
    print(f"result: keepers vigil.rehand_median_ms_max={worst * 1000:.1f} {vigil_durability(None)}")
    return 0


def statistics_median(xs: list[float]) -> float:
    import statistics

    return statistics.median(xs)


if __name__ == "__main__":
    sys.exit(main())
