"""A real nginx, master as root and worker as its default unprivileged user, proxies to
`<state>/run/<host>.sock`.

One box, in order: without a socket group the worker is refused (502, permission denied),
which proves the setting is what lets it in; the agent restarted with `--socket-group`
adopts the running app without restarting it and opens its socket; an overlap deploy under
a client loop through nginx answers every request (no 502). The state dir stays private:
the worker cannot list it or read the database."""

from __future__ import annotations

import grp
import http.client
import os
import pwd
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.conftest import HELLO, Vigil, on_postgresql, wait_for

NGINX = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if os.path.exists(p)), None)
USER = "www-data" if any(u.pw_name == "www-data" for u in pwd.getpwall()) else "nobody"

if NGINX is None:
    print("\n!!! nginx NOT FOUND: the edge test is SKIPPED; .ci/run installs it from Debian !!!\n")
pytestmark = [
    pytest.mark.skipif(NGINX is None, reason="NGINX NOT INSTALLED (.ci/run installs it): edge test skipped"),
    pytest.mark.skipif(os.geteuid() != 0, reason="nginx's master must be root to run its worker as "
                       f"{USER}"),
]

CONF = """
user {user};
worker_processes 1;
daemon off;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log info;
events {{ worker_connections 256; }}
http {{
    access_log off;
    client_body_temp_path {prefix}/body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    server {{
        listen 127.0.0.1:{port};
        location / {{ proxy_pass http://unix:{socket}:/; }}
    }}
}}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(port: int) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/")
        r = conn.getresponse()
        return r.status, r.read().decode(errors="replace")
    finally:
        conn.close()


@pytest.fixture
def box() -> Iterator[Path]:
    """A short dir under /tmp that nginx's worker may pass through (mkdtemp makes 0700)."""
    d = Path(tempfile.mkdtemp(prefix="vg", dir="/tmp"))
    os.chmod(d, 0o711)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def vigil_edge(box: Path) -> Iterator[Vigil]:
    v = Vigil(box / "state")
    v.run("db", "upgrade")
    try:
        yield v
    finally:
        v.cleanup()


@pytest.fixture
def nginx(box: Path, vigil_edge: Vigil) -> Iterator[int]:
    prefix = box / "ngx"
    prefix.mkdir()
    port = free_port()
    (prefix / "nginx.conf").write_text(CONF.format(
        user=USER, prefix=prefix, port=port, socket=vigil_edge.state_dir / "run" / "web.sock"))
    log = open(prefix / "out.log", "wb")
    p = subprocess.Popen([str(NGINX), "-p", str(prefix), "-e", str(prefix / "error.log"),
                          "-c", str(prefix / "nginx.conf")], stdout=log, stderr=log)
    log.close()
    try:
        def listening() -> bool:
            assert p.poll() is None, (prefix / "out.log").read_text() + (prefix / "error.log").read_text()
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return True
            except OSError:
                return False

        wait_for(listening, 20, what="nginx listening")
        workers = wait_for(lambda: psutil.Process(p.pid).children(), 20, what="nginx worker")
        assert all(w.username() == USER for w in workers), "worker is not unprivileged"
        yield port
    finally:
        workers = [c.pid for c in psutil.Process(p.pid).children()] if p.poll() is None else []
        p.send_signal(signal.SIGTERM)  # the master stops its workers
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)
        for pid in workers:  # by pid, in case one outlived its master
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def as_user(*argv: str) -> subprocess.CompletedProcess[bytes]:
    pw = pwd.getpwnam(USER)
    return subprocess.run(["setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}",
                           "--clear-groups", *argv], capture_output=True)


def test_nginx_reaches_the_socket_only_with_socket_group_and_through_a_deploy(
        vigil_edge: Vigil, nginx: int, box: Path) -> None:
    v, port = vigil_edge, nginx
    group = grp.getgrgid(pwd.getpwnam(USER).pw_gid).gr_name
    v.add_host("web")
    agent = v.start_agent()
    v.wait_ready(agent)
    v.run("wake", "web", "--wait")
    pid = v.status("web")["pid"]

    # Without a socket group the private state dir keeps nginx's worker out.
    assert get(port)[0] == 502
    assert "Permission denied" in (box / "ngx" / "error.log").read_text()

    # The agent restarted with a socket group adopts the app (same pid) and opens it.
    before = v.ready_count()
    v.stop_agent(agent)
    agent = v.start_agent(None, "--socket-group", group)
    v.wait_ready_after(agent, before)
    assert v.status("web")["pid"] == pid
    status, body = get(port)
    assert status == 200 and f"pid={pid}" in body

    # An overlap deploy under a client loop through nginx: every request answered.
    new = box / "hello.py"
    new.write_bytes(HELLO.read_bytes() + b"\n# build 2\n")
    new.chmod(0o755)
    answers: list[tuple[int, str]] = []
    done = threading.Event()

    def client() -> None:
        deadline = time.monotonic() + 60
        while not done.is_set() and time.monotonic() < deadline:
            try:
                answers.append(get(port))
            except OSError as exc:
                answers.append((0, repr(exc)))
            time.sleep(0.005)

    t = threading.Thread(target=client)
    t.start()
    try:
        wait_for(lambda: len(answers) >= 20, 30, what="requests before the deploy")
        v.run("deploy", "web", str(new), "--wait")
        seen = len(answers)
        wait_for(lambda: len(answers) >= seen + 20, 30, what="requests after the deploy")
    finally:
        done.set()
        t.join(30)
    bad = [a for a in answers if a[0] != 200]
    assert not bad, f"{len(bad)} of {len(answers)} requests failed through nginx: {bad[:5]}"
    pids = {b.split("pid=")[1].split()[0] for _, b in answers}
    assert len(pids) == 2, f"expected answers from the old and the new generation: {pids}"

    # What the group was given, and what it was not.
    state = v.state_dir
    gid = grp.getgrnam(group).gr_gid
    sock = v.status("web")["socket"]
    for path, mode in ((state, 0o710), (state / "run", 0o710), (Path(sock).parent, 0o710),
                       (Path(sock), 0o660)):
        st = os.stat(path)
        assert (stat.S_IMODE(st.st_mode), st.st_gid) == (mode, gid), path
    private = [(state / "builds", 0o700), (state / "logs", 0o700)]
    if not on_postgresql():  # the SQLite file lives in the state dir
        private.append((state / "vigil.db", 0o600))
        assert as_user("cat", str(state / "vigil.db")).returncode != 0
    for path, mode in private:
        assert stat.S_IMODE(os.stat(path).st_mode) == mode, path
    assert as_user("ls", str(state)).returncode != 0  # may pass through, not list
    v.stop_agent(agent)
