"""Helpers shared by the bench scripts: the vigil CLI as a subprocess, an agent started and
ended by pid, the HTTP probe on a unix socket, and how figures are printed."""

from __future__ import annotations

import os
import signal
import socket
import sqlite3
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
HELLO = ROOT / "examples" / "hello" / "hello.py"
PEERS = ROOT / "bench" / ".peers"
PEERS_PY = PEERS / "bin" / "python"
if str(ROOT) not in sys.path:  # vigil's own modules, for reading its lock files
    sys.path.append(str(ROOT))
# What PRAGMA synchronous reads back as.
SYNC_NAMES = {0: "OFF", 1: "NORMAL", 2: "FULL", 3: "EXTRA"}
# The helpers the agent starts in a state dir, by the flock file each holds (its pid in
# it); each may have a standby beside it (<lock>.standby), waiting, already started.
HELPER_LOCKS = ("listeners.lock", "logs.lock", "fence.lock")


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def durability(side: str, journal: str, synchronous: str) -> str:
    """The `result:` line's fields saying how durable one side's commits were; a side with
    no store of its own (supervisord, the bare app) says `none`."""
    return f"{side}.journal={journal} {side}.synchronous={synchronous}"


def no_store(side: str) -> str:
    return durability(side, "none", "none")


def sqlite_modes(con: sqlite3.Connection) -> tuple[str, str]:
    """(journal mode, synchronous) of one open SQLite connection."""
    journal = con.execute("PRAGMA journal_mode").fetchone()[0]
    sync = con.execute("PRAGMA synchronous").fetchone()[0]
    return str(journal).lower(), SYNC_NAMES.get(sync, str(sync))


def vigil_synchronous() -> str:
    """The synchronous level vigil's SQLite connections run at here: VIGIL_SYNCHRONOUS (default
    FULL) applied as the store applies it, read back (SQLite ignores a value it does not know)."""
    con = sqlite3.connect(":memory:")
    try:
        con.execute(f"PRAGMA synchronous={os.environ.get('VIGIL_SYNCHRONOUS', 'FULL')}")
        return sqlite_modes(con)[1]
    finally:
        con.close()


def vigil_modes(db: Path | None) -> tuple[str, str]:
    """(journal, synchronous) of vigil's store: the file's journal mode (WAL is kept in the
    file) and the level its connections use; `none` for both when `db` is None (the bench
    touches no store)."""
    if db is None:
        return "none", "none"
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        journal = sqlite_modes(con)[0]
    finally:
        con.close()
    return journal, vigil_synchronous()


def inherited_sync() -> str:
    """VIGIL_SYNCHRONOUS as the agents inherit it (`unset` when none: an inherited OFF shows)."""
    return f"VIGIL_SYNCHRONOUS={os.environ.get('VIGIL_SYNCHRONOUS', 'unset')}"


def vigil_durability(db: Path | None, side: str = "vigil") -> str:
    """vigil's side of a `result:` line: its store's journal and synchronous level, and the
    VIGIL_SYNCHRONOUS the agents inherited."""
    return f"{durability(side, *vigil_modes(db))} {inherited_sync()}"


def vigil_processes(home: Path) -> dict[str, int]:
    """Every process of vigil on the state dir `home` now, by the lock it holds: the agent
    and each helper (fd holder, log keeper, fence keeper) and standby that runs."""
    from runners.base.doorbell import lock_holder  # vigil's own reading of its lock files
    from workflows.base.paths import LOCK

    locks = [LOCK, *HELPER_LOCKS, *(Path(n).with_suffix(".standby").name for n in HELPER_LOCKS)]
    found = {name: lock_holder(home / name) for name in locks}
    return {name: pid for name, pid in found.items() if pid is not None and pid > 0}


def vigil_pids(home: Path) -> list[int]:
    return sorted(set(vigil_processes(home).values()))


def cpu_s(pids: Iterable[int]) -> float:
    """CPU seconds (user + system) of these processes so far; gone ones count 0."""
    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def memory_mb(pids: Iterable[int]) -> tuple[float, float]:
    """(RSS summed, PSS summed) in MB: PSS splits pages shared between them, so the sum of
    several processes is not inflated by what they share (the interpreter, libraries)."""
    rss = pss = 0
    for pid in pids:
        try:
            m = psutil.Process(pid).memory_full_info()
            rss, pss = rss + m.rss, pss + m.pss
        except psutil.NoSuchProcess:
            pass
    return rss / 2**20, pss / 2**20


# Each vigil process by the lock file it holds (vigil_processes' keys), as a table names it.
PROCESS_NAMES = {"agent.lock": "agent", "listeners.lock": "fd holder", "logs.lock": "log keeper",
                 "fence.lock": "fence keeper", "listeners.standby": "fd holder's standby",
                 "logs.standby": "log keeper's standby", "fence.standby": "fence keeper's standby"}


def memory_by_process(named: dict[str, int]) -> dict[str, tuple[float, float]]:
    """{process name: (RSS, PSS) in MB} of vigil_processes' answer; a process gone is left out."""
    out = {}
    for lock, pid in named.items():
        rss, pss = memory_mb([pid])
        if rss:
            out[PROCESS_NAMES.get(lock, lock)] = (rss, pss)
    return out


def get_ok(sock: str, timeout: float = 1.0) -> bool:
    """One `GET /` on a new connection; True when it answered 200."""
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(timeout)
    try:
        s.connect(sock)
        s.sendall(b"GET / HTTP/1.0\r\n\r\n")
        return s.recv(64).startswith(b"HTTP/1.0 200")
    except OSError:
        return False
    finally:
        s.close()


def wait_ok(sock: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not get_ok(sock):
        if time.monotonic() > deadline:
            raise RuntimeError(f"nothing answered on {sock} within {timeout:.0f}s")
        time.sleep(0.01)


def vigil(home: Path, *args: str, check: bool = True, env: dict[str, str] | None = None) -> str:
    cp = subprocess.run([sys.executable, "-m", "runners.cli", *args], cwd=ROOT, check=False,
                        capture_output=True, text=True,
                        env={**os.environ, "VIGIL_HOME": str(home), **(env or {})})
    if check and cp.returncode != 0:
        raise RuntimeError(f"vigil {' '.join(args)} exited {cp.returncode}: {cp.stderr.strip()}")
    return cp.stdout


def start_agent(home: Path, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "runners.cli", "agent", "--log-level", "WARNING"],
                            cwd=ROOT, env={**os.environ, "VIGIL_HOME": str(home), **(env or {})},
                            stdout=subprocess.DEVNULL, stderr=open(log, "ab"))


def end(p: subprocess.Popen[bytes] | None, sig: int = signal.SIGTERM, timeout: float = 30) -> None:
    """End one process this script started, by its pid; SIGKILL if it outlives the timeout."""
    if p is None or p.poll() is not None:
        return
    try:
        p.send_signal(sig)
        p.wait(timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait(10)


def ms(x: float) -> str:
    return f"{x * 1000:.1f} ms"


def ratios(xs: list[float], ys: list[float]) -> list[float]:
    """x / y per interleaved run: the ratio's spread, not only the ratio of medians (inf
    where y measured 0, e.g. CPU time below the clock's 10 ms tick in a short window)."""
    return [x / y if y else float("inf") for x, y in zip(xs, ys, strict=True)]


def summary(xs: list[float], unit: str = "ms") -> str:
    """median (min-max)"""
    if not xs:
        return "n/a"
    if unit == "ms":
        return f"{statistics.median(xs) * 1000:.1f} ms ({min(xs) * 1000:.1f}-{max(xs) * 1000:.1f})"
    if unit == "/s":
        return f"{statistics.median(xs):,.0f}/s ({min(xs):,.0f}-{max(xs):,.0f})"
    if unit == "s":
        return f"{statistics.median(xs):.2f} s ({min(xs):.2f}-{max(xs):.2f})"
    if unit == "x":
        return f"{statistics.median(xs):.2f}x ({min(xs):.2f}-{max(xs):.2f})"
    return f"{statistics.median(xs):.3g} ({min(xs):.3g}-{max(xs):.3g})"


def start_supervisord(tmp: Path, sock: str, program: str) -> tuple[Path, subprocess.Popen[bytes]]:
    """supervisord from bench/.peers running examples/hello on `sock` (config from
    supervisord_conf), returned once the app answers: (config path, supervisord process)."""
    conf = supervisord_conf(tmp, sock, program)
    proc = subprocess.Popen([str(PEERS / "bin" / "supervisord"), "-c", str(conf)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    wait_ok(sock)
    return conf, proc


def supervisord_conf(tmp: Path, sock: str, program: str) -> Path:
    """A supervisord config in `tmp` running examples/hello as program `hello` on `sock`,
    with `program` lines added to its section (restart policy, stop signal)."""
    conf = tmp / "supervisord.conf"
    conf.write_text(f"""
[unix_http_server]
file={tmp}/supervisor.sock
[supervisord]
logfile={tmp}/supervisord.log
pidfile={tmp}/supervisord.pid
childlogdir={tmp}
nodaemon=true
[rpcinterface:supervisor]
supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface
[supervisorctl]
serverurl=unix://{tmp}/supervisor.sock
[program:hello]
command={HELLO}
environment=VIGIL_SOCKET="{sock}"
{program.strip()}
""")
    return conf


def drop_cgroups(dirs: list[str], bound: float = 10.0) -> int:
    """Remove the cgroup dirs of generations whose processes this script ended by pid (vigil
    releases a dir only when it proves the generation gone, which a killed bench never lets
    it do): 80,000 dirs left by a day of runs made every agent's start list them. A dir is
    removed once its killed processes are gone (EBUSY until then), within `bound` seconds."""
    left = [d for d in dirs if d]
    removed = 0
    deadline = time.monotonic() + bound
    while left and time.monotonic() < deadline:
        busy = []
        for d in left:
            try:
                os.rmdir(d)
                removed += 1
            except FileNotFoundError:
                pass
            except OSError:
                busy.append(d)
        left = busy
        if left:
            time.sleep(0.05)
    return removed


def kill_now(pids: list[int]) -> float:
    """SIGKILL to every pid at one instant (a box dying whole); the monotonic instant."""
    at = time.monotonic()
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return at
