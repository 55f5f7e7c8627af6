"""A PostgreSQL server of a bench's own: initdb in a tmp dir, started on a free port with the
max_connections a fleet needs and pg_stat_statements loaded (statements/s), trust auth for
its superuser `root`; ended by its postmaster's pid and removed. For a fleet larger than the
shared server's max_connections holds (each agent keeps one LISTEN session on the server,
even behind PgBouncer: 100 boxes need more than the default 100). The binaries are the
installed server's (`pg_config --bindir`, or /usr/lib/postgresql/<n>/bin); as root they run
as the `postgres` user, which PostgreSQL requires."""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pgbouncer import answers  # noqa: E402


def _bindir() -> Path:
    for d in sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True):
        if os.access(os.path.join(d, "initdb"), os.X_OK):
            return Path(d)
    found = shutil.which("initdb")
    if found is None:
        raise SystemExit("no initdb: install the PostgreSQL server (apt-get install postgresql)")
    return Path(found).parent


class PgServer:
    def __init__(self, max_connections: int) -> None:
        self.max_connections = max_connections
        self.bin = _bindir()
        self.home = Path(tempfile.mkdtemp(prefix="vgpgs", dir="/tmp"))
        self.data = self.home / "data"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        self.url = f"postgresql+psycopg://root@127.0.0.1:{self.port}/postgres"
        self.proc: subprocess.Popen[bytes] | None = None

    def _as_owner(self, argv: list[str]) -> list[str]:
        return ["runuser", "-u", "postgres", "--", *argv] if os.geteuid() == 0 else argv

    def start(self) -> str:
        if os.geteuid() == 0:
            pw = pwd.getpwnam("postgres")
            os.chown(self.home, pw.pw_uid, pw.pw_gid)
        subprocess.run(self._as_owner([str(self.bin / "initdb"), "-D", str(self.data), "-U", "root",
                                       "-A", "trust", "--no-sync"]),
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        log = open(self.home / "server.log", "ab")
        self.proc = subprocess.Popen(self._as_owner([
            str(self.bin / "postgres"), "-D", str(self.data), "-p", str(self.port),
            "-c", "listen_addresses=127.0.0.1", "-c", f"unix_socket_directories={self.home}",
            "-c", f"max_connections={self.max_connections}",
            "-c", "shared_preload_libraries=pg_stat_statements"]),
            stdout=log, stderr=log, start_new_session=True)
        log.close()
        deadline = time.monotonic() + 30
        while not answers(self.url):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the private PostgreSQL did not start: "
                                   + (self.home / "server.log").read_text()[-1500:])
            time.sleep(0.2)
        return self.url

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            pid = postmaster_pid(self.data)  # runuser's child when started through it
            os.kill(pid or self.proc.pid, signal.SIGINT)  # fast shutdown
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.kill(pid or self.proc.pid, signal.SIGQUIT)
                self.proc.wait(10)
        shutil.rmtree(self.home, ignore_errors=True)


def postmaster_pid(data: Path) -> int | None:
    try:
        return int((data / "postmaster.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
