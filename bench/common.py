"""Helpers shared by the bench scripts: the vigil CLI as a subprocess, an agent started and
ended by pid, the HTTP probe on a unix socket, and how figures are printed."""

from __future__ import annotations

import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HELLO = ROOT / "examples" / "hello" / "hello.py"
PEERS = ROOT / "bench" / ".peers"
PEERS_PY = PEERS / "bin" / "python"


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


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


def summary(xs: list[float], unit: str = "ms") -> str:
    """median (min-max)"""
    if not xs:
        return "n/a"
    if unit == "ms":
        return f"{statistics.median(xs) * 1000:.1f} ms ({min(xs) * 1000:.1f}-{max(xs) * 1000:.1f})"
    if unit == "/s":
        return f"{statistics.median(xs):,.0f}/s ({min(xs):,.0f}-{max(xs):,.0f})"
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
