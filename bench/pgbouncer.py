"""A PgBouncer of a bench's own in front of one database: its ini, auth file and port in a
tmp dir, pool_mode = transaction, trust auth; started and ended by its pid. The agents then
get VIGIL_DB = `url` (through it) and VIGIL_LISTEN_DB = the server's URL (their LISTEN
session, direct): docs/guides/several-boxes.md, "Behind PgBouncer". Debian's package:
`apt-get install pgbouncer` (.ci/run installs it, its service refused)."""

from __future__ import annotations

import getpass
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import sqlalchemy as sa

BINARY = shutil.which("pgbouncer") or next(
    (p for p in ("/usr/sbin/pgbouncer",) if os.access(p, os.X_OK)), None)


def answers(url: str) -> bool:
    """The server at `url` (a PostgreSQL or a pooler in front of one) answers a query."""
    eng = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with eng.connect() as c:
            return bool(c.execute(sa.text("SELECT 1")).scalar() == 1)
    except sa.exc.OperationalError:
        return False
    finally:
        eng.dispose()


class PgBouncer:
    def __init__(self, server_url: str, pool_size: int = 20, max_clients: int = 2000) -> None:
        if BINARY is None:
            raise SystemExit("pgbouncer is not installed: apt-get install pgbouncer")
        self.binary: str = BINARY
        self.server = sa.make_url(server_url)
        self.pool_size, self.max_clients = pool_size, max_clients
        self.home = Path(tempfile.mkdtemp(prefix="vgpgb", dir="/tmp"))
        self.home.chmod(0o755)  # readable by the user it runs as (it refuses to run as root)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        self.url = self.server.set(host="127.0.0.1", port=self.port).render_as_string(hide_password=False)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> str:
        db, user = self.server.database, self.server.username or getpass.getuser()
        (self.home / "users.txt").write_text(f'"{user}" ""\n')
        (self.home / "pgbouncer.ini").write_text(
            f"[databases]\n{db} = host={self.server.host or '127.0.0.1'} "
            f"port={self.server.port or 5432} dbname={db}\n[pgbouncer]\n"
            f"listen_addr = 127.0.0.1\nlisten_port = {self.port}\nunix_socket_dir =\n"
            f"auth_type = trust\nauth_file = {self.home / 'users.txt'}\npool_mode = transaction\n"
            f"default_pool_size = {self.pool_size}\nmax_client_conn = {self.max_clients}\n"
            "server_reset_query =\nignore_startup_parameters = extra_float_digits\n"
            + ("user = postgres\n" if os.geteuid() == 0 else ""))
        with open(self.home / "pgbouncer.log", "ab") as out:
            self.proc = subprocess.Popen([self.binary, str(self.home / "pgbouncer.ini")], stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 20
        while not answers(self.url):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("pgbouncer did not start: "
                                   + (self.home / "pgbouncer.log").read_text()[-1500:])
            time.sleep(0.1)
        return self.url

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        shutil.rmtree(self.home, ignore_errors=True)
