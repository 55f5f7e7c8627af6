#!/usr/bin/env python3
"""Downtime during deploys: the same app, the same client, three supervisors, one run.

(a) vigil: `vigil deploy hello BUILD --wait` (overlap: the successor answers before the
    canonical socket link is switched to it; the old one drains)
(b) supervisord: `supervisorctl restart hello` (stop, then start)
(c) circus: `circusctl reload hello --waiting`, the unix socket owned by circus and passed
    to the app as an inherited fd (spawn the new process, then stop the oldest)
Hold mode (stop, then start), the rows the comparison with (b) and (c) is about:
(d) vigil-held: `vigil deploy held BUILD --mode hold --wait` on a listening socket vigil
    holds (`--listen unix:...`, `--ready notify`): the old generation is stopped and proven
    gone before the new one starts, and connections wait in the socket's backlog meanwhile
(e) vigil-hold: the same hold deploy of a host on its own socket (no --listen): nothing
    listens between the old one's exit and the new one's bind
(f) supervisord-fcgi: `supervisorctl restart held:*` of an `[fcgi-program]`: supervisord
    opens the socket itself and passes it to the app as fd 0 (hello `--fd 0`), the
    like-for-like peer of (d) beside circus's fd passing; supervisord stops then starts

The app is examples/hello/hello.py for all three (threaded, listen backlog 1024), on a unix
socket. One closed-loop client (a new connection per request, GET /, 2 s timeout per
request) runs through each event: from 0.3 s before the command until 0.5 s after it
returned. Events are interleaved (vigil, supervisord, circus, vigil, ...). Reported per
event: failed requests (refused, reset, timed out or not 200), the longest gap between two
successful responses, and the command's wall time. supervisord and circus run from
bench/.peers (bench/install-peers); when they are not installed they are reported so.
The `result:` line gives each row's failed requests and median gap, with its durability
(vigil's store; the peers keep none).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    HELLO,
    PEERS,
    PEERS_PY,
    durability,
    end,
    inherited_sync,
    loadavg,
    no_store,
    start_agent,
    start_supervisord,
    vigil,
    vigil_modes,
    wait_ok,
)

MAX_REQUESTS = 200_000  # per event: the client is bounded in count as well as in time
LEAD, TAIL = 0.3, 0.5


@dataclass
class Event:
    who: str
    ok: int = 0
    failed: int = 0
    gap: float = 0.0
    wall: float = 0.0
    errors: dict[str, int] = field(default_factory=dict)
    oks: list[float] = field(default_factory=list)  # each success's time from the command (s)
    fails: list[float] = field(default_factory=list)  # each failure's


class Client:
    """Closed loop: one request at a time, each on a new connection."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.stop = threading.Event()
        self.done: list[float] = []  # completion time of each successful request
        self.failed_at: list[float] = []  # and of each failed one
        self.failed = 0
        self.errors: dict[str, int] = {}
        self.thread = threading.Thread(target=self.run, daemon=True)

    def one(self) -> str | None:
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(2.0)
        try:
            s.connect(self.path)
            s.sendall(b"GET / HTTP/1.0\r\n\r\n")
            data = b""
            while chunk := s.recv(4096):
                data += chunk
            return None if data.startswith(b"HTTP/1.0 200") else "status"
        except OSError as e:
            return type(e).__name__
        finally:
            s.close()

    def run(self) -> None:
        n = 0
        while not self.stop.is_set() and n < MAX_REQUESTS:
            n += 1
            err = self.one()
            if err is None:
                self.done.append(time.monotonic())
            else:
                self.failed += 1
                self.failed_at.append(time.monotonic())
                self.errors[err] = self.errors.get(err, 0) + 1
                time.sleep(0.001)  # a refused connect returns at once: do not spin


def measure(who: str, path: str, command: Callable[[], None]) -> Event:
    c = Client(path)
    c.thread.start()
    time.sleep(LEAD)
    t0 = time.monotonic()
    command()
    t1 = time.monotonic()
    time.sleep(TAIL)
    c.stop.set()
    c.thread.join(10)
    gaps = [b - a for a, b in zip(c.done, c.done[1:], strict=False)]
    return Event(who, ok=len(c.done), failed=c.failed, gap=max(gaps, default=float("inf")),
                 wall=t1 - t0, errors=c.errors, oks=[t - t0 for t in c.done],
                 fails=[t - t0 for t in c.failed_at])


def run(argv: list[str], **kw: object) -> None:
    cp = subprocess.run(argv, capture_output=True, text=True, timeout=120, **kw)  # type: ignore[call-overload]
    if cp.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {cp.returncode}: {cp.stdout}{cp.stderr}")


def peer_version(name: str) -> str | None:
    if not PEERS_PY.exists():
        return None
    cp = subprocess.run([str(PEERS_PY), "-c", f"from importlib.metadata import version; print(version({name!r}))"],
                        capture_output=True, text=True)
    return cp.stdout.strip() if cp.returncode == 0 else None


class Vigil:
    """One agent for every vigil row; each row is a host of its own."""

    who = "vigil"
    host = "hello"
    mode = "overlap"

    def __init__(self, tmp: Path, agent: VigilAgent) -> None:
        self.home = agent.home
        self.builds = agent.builds
        vigil(self.home, "host", "add", self.host, "--build", str(HELLO), "--drain-timeout", "5",
              *self.options(tmp))
        vigil(self.home, "wake", self.host, "--wait")
        self.path = self.socket(tmp)
        self.n = 0

    def options(self, tmp: Path) -> list[str]:
        return []

    def socket(self, tmp: Path) -> str:
        return str(self.home / "run" / f"{self.host}.sock")

    def event(self) -> None:
        self.n += 1
        vigil(self.home, "deploy", self.host, str(self.builds[self.n % 2]), "--mode", self.mode,
              "--wait")

    def close(self) -> None:
        vigil(self.home, "stop", self.host, "--wait", "--timeout", "30")


class VigilHeld(Vigil):
    """Hold deploys on a listening socket vigil holds (hello serves the inherited fd)."""

    who = "vigil-held"
    host = "held"
    mode = "hold"

    def options(self, tmp: Path) -> list[str]:
        return ["--listen", f"unix:{tmp}/vigil-held.sock", "--ready", "notify"]

    def socket(self, tmp: Path) -> str:
        return f"{tmp}/vigil-held.sock"


class VigilHold(Vigil):
    """Hold deploys of a host on its own socket (no --listen): for contrast."""

    who = "vigil-hold"
    host = "hold"
    mode = "hold"


class VigilAgent:
    def __init__(self, tmp: Path) -> None:
        self.home = tmp / "vigil"
        self.builds = [HELLO, tmp / "hello-b.py"]
        shutil.copy(HELLO, self.builds[1])
        with open(self.builds[1], "a") as f:
            f.write("# second build\n")
        vigil(self.home, "db", "upgrade")
        self.agent = start_agent(self.home, tmp / "vigil-agent.log")

    def close(self) -> None:
        end(self.agent)
        holder = self.home / "listeners.lock"  # the fd holder keeps the held socket: end it
        pid = holder.read_text().strip() if holder.exists() else ""
        if pid.isdigit():
            try:
                os.kill(int(pid), signal.SIGTERM)
            except ProcessLookupError:
                pass


class Supervisord:
    who = "supervisord"

    def __init__(self, tmp: Path) -> None:
        self.path = str(tmp / "sup-hello.sock")
        self.conf, self.proc = start_supervisord(tmp, self.path, """
stopsignal=TERM
stopwaitsecs=5
autorestart=true
""")

    def event(self) -> None:
        run([str(PEERS / "bin" / "supervisorctl"), "-c", str(self.conf), "restart", "hello"])

    def close(self) -> None:
        end(self.proc)  # supervisord stops its programs on SIGTERM


class SupervisordFcgi:
    """supervisord holding the socket itself: an [fcgi-program], the socket passed as fd 0."""

    who = "supervisord-fcgi"

    def __init__(self, tmp: Path) -> None:
        d = tmp / "sup-fcgi"
        d.mkdir()
        self.path = str(d / "held.sock")
        self.conf = d / "supervisord.conf"
        self.conf.write_text(f"""
[unix_http_server]
file={d}/supervisor.sock
[supervisord]
logfile={d}/supervisord.log
pidfile={d}/supervisord.pid
childlogdir={d}
nodaemon=true
[rpcinterface:supervisor]
supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface
[supervisorctl]
serverurl=unix://{d}/supervisor.sock
[fcgi-program:held]
socket=unix://{self.path}
command={HELLO} --fd 0
stopsignal=TERM
stopwaitsecs=5
autorestart=true
""")
        self.proc = subprocess.Popen([str(PEERS / "bin" / "supervisord"), "-c", str(self.conf)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True)
        wait_ok(self.path)

    def event(self) -> None:
        run([str(PEERS / "bin" / "supervisorctl"), "-c", str(self.conf), "restart", "held:*"])

    def close(self) -> None:
        end(self.proc)  # supervisord stops its programs on SIGTERM


class Circus:
    who = "circus"

    def __init__(self, tmp: Path) -> None:
        self.conf = tmp / "circus.ini"
        self.path = str(tmp / "circus-hello.sock")
        self.endpoint = f"ipc://{tmp}/circus-ctl.sock"
        self.conf.write_text(f"""
[circus]
endpoint = {self.endpoint}
pubsub_endpoint = ipc://{tmp}/circus-pub.sock
statsd = False
check_delay = 5

[socket:web]
path = {self.path}
family = AF_UNIX
backlog = 1024

[watcher:hello]
cmd = {HELLO}
args = --fd $(circus.sockets.web)
use_sockets = True
numprocesses = 1
graceful_timeout = 5
warmup_delay = 0
copy_env = True
""")
        self.proc = subprocess.Popen([str(PEERS / "bin" / "circusd"), str(self.conf)],
                                     stdout=subprocess.DEVNULL, stderr=open(tmp / "circusd.log", "wb"),
                                     start_new_session=True)
        wait_ok(self.path)

    def event(self) -> None:
        run([str(PEERS / "bin" / "circusctl"), "--endpoint", self.endpoint, "--timeout", "60",
             "reload", "hello", "--waiting"])

    def close(self) -> None:
        end(self.proc)  # circusd stops its watchers on SIGTERM


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=7, help="deploy events per supervisor")
    ap.add_argument("--quick", action="store_true", help="1 event each, for CI: keeps the script alive")
    ap.add_argument("--plot", type=Path, default=None, metavar="FILE.svg",
                    help="draw successful requests over time through each event (matplotlib: the bench extra)")
    args = ap.parse_args()
    n = 1 if args.quick else args.events
    load0 = loadavg()
    tmp = Path(tempfile.mkdtemp(prefix="vgdown", dir="/tmp"))
    versions = {"supervisord": peer_version("supervisor"), "circus": peer_version("circus")}
    subjects: list = []
    agent = None
    try:
        agent = VigilAgent(tmp)
        subjects.append(Vigil(tmp, agent))
        subjects.append(VigilHeld(tmp, agent))
        subjects.append(VigilHold(tmp, agent))
        if versions["supervisord"]:
            subjects.append(Supervisord(tmp))
            subjects.append(SupervisordFcgi(tmp))
        if versions["circus"]:
            subjects.append(Circus(tmp))
        results: dict[str, list[Event]] = {s.who: [] for s in subjects}
        for i in range(n):
            for s in subjects:
                ev = measure(s.who, s.path, s.event)
                results[s.who].append(ev)
                errs = " ".join(f"{k}={v}" for k, v in sorted(ev.errors.items()))
                print(f"event {i + 1} {s.who:<16} failed={ev.failed:<4} ok={ev.ok:<5} "
                      f"longest_gap={ev.gap * 1000:7.1f} ms  wall={ev.wall * 1000:7.1f} ms {errs}".rstrip(),
                      flush=True)
        modes = vigil_modes(agent.home / "vigil.db")
    finally:
        for s in reversed(subjects):
            try:
                s.close()
            except Exception as e:  # keep ending the others
                print(f"close {s.who}: {e}", file=sys.stderr)
        if agent is not None:
            agent.close()
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\nevents per supervisor: {n} (interleaved); loadavg start {load0}, end {loadavg()}")
    print(f"{'supervisor':<16} {'failed/event':<18} {'longest gap ms':<26} command wall ms   (median (min-max))")
    for who, evs in results.items():
        f = [e.failed for e in evs]
        g = [e.gap * 1000 for e in evs]
        w = [e.wall * 1000 for e in evs]
        fs = f"{statistics.median(f):g} ({min(f)}-{max(f)})"
        gs = f"{statistics.median(g):.1f} ({min(g):.1f}-{max(g):.1f})"
        ws = f"{statistics.median(w):.1f} ({min(w):.1f}-{max(w):.1f})"
        print(f"{who:<16} {fs:<18} {gs:<26} {ws}")
    if args.plot is not None:
        from plot import downtime_svg

        downtime_svg(results, args.plot, f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
                     f"load {load0} -> {loadavg()}, {n} event(s) each", LEAD, TAIL)
        print(f"plot: {args.plot}")
    for who in ("supervisord", "circus"):
        if versions[who] is None:
            print(f"{who:<16} not installed (run bench/install-peers)")
        else:
            print(f"{who:<16} version {versions[who]}")
    print("result: downtime " + " ".join(
        f"{who}.failed={sum(e.failed for e in evs)} {who}.gap_ms={statistics.median([e.gap for e in evs]) * 1000:.1f} "
        + (durability(who, *modes) if who.startswith("vigil") else no_store(who))
        for who, evs in results.items()) + f" {inherited_sync()}")


if __name__ == "__main__":
    main()
