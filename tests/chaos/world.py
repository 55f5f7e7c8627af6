"""What the chaos test stands on, read without vigil: the builds it deploys, the hosts it
adds (unix-socket hosts and hosts on held TCP listeners), the process table (psutil), the
kernel's listening sockets (/proc/net/tcp), plain HTTP to every host, and a client that
connects to every TCP port every ~20 ms for the whole run."""

from __future__ import annotations

import http.client
import os
import re
import socket
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from tests.conftest import HELLO, Vigil, of_box, store_uuids

TICKER = Path(__file__).resolve().parent / "ticker.py"
LABELS = ("a", "b", "c")
BOX = "chaos-a"  # the agent's box; CONTESTED hosts may also go to a box that never runs
OTHER_BOX = "chaos-b"
PROBE_TIMEOUT = 2.0
ANSWER = re.compile(rb"hello pid=(\d+) build=(\S+)")


def make_builds(tmp: Path) -> dict[str, Path]:
    """One build per label: a shell leader that starts the ticker (a child of the
    generation, writing numbered lines to the log pipe) and execs examples/hello, which
    answers `hello pid=P build=LABEL`. Different bytes, so different digests."""
    out = {}
    for label in LABELS:
        p = tmp / f"chaos-{label}"
        p.write_text("#!/bin/sh\n"
                     f"# chaos build {label}\n"
                     f"'{sys.executable}' '{TICKER}' &\n"
                     f"HELLO_BUILD={label} exec '{sys.executable}' '{HELLO}'\n")
        p.chmod(0o755)
        out[label] = p
    return out


JOB = "j0"  # the job host: every second, each instant at most once (caught up: once)


def make_job(tmp: Path) -> tuple[Path, Path]:
    """The job's build and the file each run appends "<pid> <VIGIL_SCHEDULED_AT>" to. A run
    forks a child and waits for it (0.3 s): a run's generation is two processes, both of
    which must be proven gone."""
    build, out = tmp / "chaos-job", tmp / "job-ran.txt"
    build.write_text("#!/bin/sh\n"
                     f"echo \"$$ $VIGIL_SCHEDULED_AT\" >> '{out}'\n"
                     "sleep 0.3 &\nwait\n")
    build.chmod(0o755)
    return build, out


def add_job(v: Vigil, build: Path) -> None:
    """Every second, with the default policies: the checks hold whichever instants run
    (tests/recovery/test_job_kills.py asks that every one does)."""
    v.run("host", "add", JOB, "--build", str(build), "--kind", "job", "--every", "1")


@dataclass(frozen=True)
class HostSpec:
    name: str
    port: int | None  # a held TCP listener; None: the host serves on its own unix socket
    contested: bool  # placed on two boxes: the agent runs a fence keeper for it


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def host_specs(tcp: int, unix: int) -> list[HostSpec]:
    ports = free_ports(tcp)
    specs = [HostSpec(f"t{i}", port, i == 0) for i, port in enumerate(ports)]
    return specs + [HostSpec(f"u{i}", None, i == 0) for i in range(unix)]


def add_hosts(v: Vigil, specs: list[HostSpec], first: Path) -> None:
    for h in specs:
        extra = ["--drain-timeout", "5", "--health-timeout", "30"]
        if h.port is not None:
            extra += ["--listen", f"http=tcp:127.0.0.1:{h.port}"]
        if h.contested:
            extra += ["--box", BOX, "--box", OTHER_BOX]
        v.run("host", "add", h.name, "--build", str(first), *extra)


# -- HTTP, as a client sees it ---------------------------------------------------------------


class UnixHTTP(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        try:
            s.connect(self.path)
        except OSError:
            s.close()
            raise
        self.sock = s


def get(v: Vigil, h: HostSpec, timeout: float = PROBE_TIMEOUT) -> tuple[int, str] | str:
    """GET / on the host's TCP port or its canonical unix socket: (pid, build) of the
    generation that answered, or what went wrong."""
    conn: http.client.HTTPConnection
    if h.port is not None:
        conn = http.client.HTTPConnection("127.0.0.1", h.port, timeout=timeout)
    else:
        conn = UnixHTTP(str(v.state_dir / "run" / f"{h.name}.sock"), timeout)
    try:
        conn.request("GET", "/")
        resp = conn.getresponse()
        body = resp.read()
    except (OSError, http.client.HTTPException) as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
    m = ANSWER.search(body)
    if resp.status != 200 or m is None:
        return f"answer {resp.status} {body[:60]!r}"
    return int(m[1]), m[2].decode()


@dataclass
class Prober:
    """One closed-loop client per TCP port: a new connection every ~20 ms, a GET, the
    answer classified. Counts only: a stopped host's port is meant to queue, not answer."""

    v: Vigil
    hosts: list[HostSpec]
    counts: dict[str, Counter] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(h,), daemon=True)
                        for h in self.hosts if h.port is not None]

    def _run(self, h: HostSpec) -> None:
        tally = self.counts.setdefault(h.name, Counter())
        while not self.stop.is_set():
            got = get(self.v, h)
            tally["ok" if isinstance(got, tuple) else got.split(":")[0]] += 1
            self.stop.wait(0.02)

    def __enter__(self) -> Prober:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(PROBE_TIMEOUT + 5)


# -- the kernel's and the process table's word ---------------------------------------------


def listening_inodes(port: int) -> set[int]:
    """Inodes of the sockets in LISTEN on 127.0.0.1:port (IPv4), from /proc/net/tcp."""
    want = f"0100007F:{port:04X}"
    found = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        f = line.split()
        if f[1] == want and f[3] == "0A":
            found.add(int(f[9]))
    return found


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    host: str
    marker: str
    leader: bool  # the server (examples/hello), not the ticker


def generation_procs(state_dir: Path, db_url: str | None = None) -> list[Proc]:
    """Every live (not zombie) process carrying a generation marker of this state dir: a
    uuid of its store's generations, or a socket under the state dir (apps carry no
    VIGIL_HOME)."""
    uuids = store_uuids(state_dir, db_url)
    home = str(state_dir) + os.sep
    out = []
    for p in psutil.process_iter(["pid", "ppid", "cmdline"]):
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            env = p.environ()
        except (psutil.Error, OSError):
            continue
        if not of_box(env, uuids, home):
            continue
        cmd = p.info["cmdline"] or []
        out.append(Proc(p.pid, p.info["ppid"], env.get("VIGIL_HOST", "?"),
                        env["VIGIL_GENERATION"], any(str(HELLO) == c for c in cmd)))
    return out


def same_process(pid: int, words: tuple[str, ...]) -> psutil.Process | None:
    """The live process `pid` if its command line holds every one of `words`."""
    try:
        p = psutil.Process(pid)
        cmd = " ".join(p.cmdline())
        if p.status() != psutil.STATUS_ZOMBIE and all(w in cmd for w in words):
            return p
    except psutil.Error:
        pass
    return None


def kill_dead(p: psutil.Process, bound: float = 10.0) -> None:
    """SIGKILL `p` (pid and start time checked by psutil) and wait until it is gone."""
    try:
        p.kill()
    except psutil.NoSuchProcess:
        return
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.01)
    raise AssertionError(f"pid {p.pid} still alive {bound}s after SIGKILL")


def env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    return default if value is None else value not in ("", "0", "no", "false")
