"""A real nginx as a vigil host (issue 39 item 1's bar): it inherits the TCP socket vigil
holds as fd 3 through its own binary-upgrade variable (`NGINX="3;"`), is ready when it
answers on its own $VIGIL_SOCKET, and is stopped with `--stop-signal QUIT` (its graceful
shutdown: SIGTERM is its fast one, which drops the responses in flight). Hold deploys under
a threaded client whose responses take a while (a rate-limited body): every request
answered 200 with its whole body, none refused, reset or cut."""

from __future__ import annotations

import http.client
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import Vigil, pid_dead, wait_for
from tests.listening import free_port, serving_inode

NGINX = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if os.path.exists(p)), None)
pytestmark = [
    pytest.mark.skipif(NGINX is None, reason="NGINX NOT INSTALLED (.ci/run installs it)"),
    pytest.mark.skipif(os.geteuid() != 0, reason="nginx's master runs as root here"),
    pytest.mark.timeout(600),
]

DEPLOYS = 3
BODY = 24 * 1024  # bytes of /slow, sent at RATE: each response is in flight ~0.25 s
RATE = "96k"
THREADS = 4

CONF = """
user root;
worker_processes 2;
daemon off;
pid {prefix}/nginx-@PID@.pid;
error_log {prefix}/error.log notice;
events {{ worker_connections 256; }}
http {{
    access_log off;
    client_body_temp_path {prefix}/tmp/body;
    proxy_temp_path {prefix}/tmp/proxy;
    fastcgi_temp_path {prefix}/tmp/fastcgi;
    uwsgi_temp_path {prefix}/tmp/uwsgi;
    scgi_temp_path {prefix}/tmp/scgi;
    server {{
        listen 127.0.0.1:{port};
        listen unix:@SOCKET@;
        root {prefix}/www;
        location = / {{ return 200 "nginx pid=$pid\\n"; }}
        location = /slow {{ default_type text/plain; limit_rate {rate}; limit_rate_after 1k; }}
    }}
}}
"""
# The build: the config made for this generation (its own socket and pid file), then nginx
# itself by exec (so the leader vigil watches is nginx's master).
SERVE = """#!/bin/sh
conf={prefix}/nginx-$$.conf
sed -e "s|@SOCKET@|$VIGIL_SOCKET|" -e "s|@PID@|$$|" {prefix}/nginx.conf.in > "$conf"
exec {nginx} -p {prefix} -e {prefix}/error.log -c "$conf"
"""


@dataclass
class Load:
    """THREADS closed loops of GET /slow, each on a new connection; a failure is anything
    but a 200 with the whole body (refused, reset, cut short, timed out)."""

    port: int
    ok: int = 0
    failures: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.t0 = time.monotonic()  # a failure says when it began, to be set beside the deploys'
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(THREADS)]
        self.lock = threading.Lock()

    def one(self) -> str | None:
        began = time.monotonic() - self.t0
        err = self._get()
        return None if err is None else f"{err} (sent at {began:.2f}s)"

    def _get(self) -> str | None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request("GET", "/slow")
            r = conn.getresponse()
            body = r.read()
            if r.status != 200 or len(body) != BODY:
                return f"status {r.status}, {len(body)} bytes"
            return None
        except (OSError, http.client.HTTPException) as exc:
            return f"{type(exc).__name__}: {exc}"
        finally:
            conn.close()

    def _run(self) -> None:
        deadline = time.monotonic() + 400
        while not self.stop.is_set() and time.monotonic() < deadline:
            err = self.one()
            with self.lock:
                if err is None:
                    self.ok += 1
                else:
                    self.failures.append(err)

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        wait_for(lambda: self.ok > 0 or self.failures, 60, what="the first answer")
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(40)
        assert not any(t.is_alive() for t in self.threads), "the client did not stop"


def builds(prefix: Path, port: int) -> list[Path]:
    (prefix / "www").mkdir(parents=True)
    (prefix / "tmp").mkdir()
    (prefix / "www" / "slow").write_bytes(b"x" * BODY)
    (prefix / "nginx.conf.in").write_text(CONF.format(prefix=prefix, port=port, rate=RATE))
    out = []
    for label in ("a", "b"):
        p = prefix / f"serve-{label}"
        p.write_text(SERVE.format(prefix=prefix, nginx=NGINX) + f"# build {label}\n")
        p.chmod(0o755)
        out.append(p)
    return out


def test_nginx_quit_through_hold_deploys_under_load(vigil: Vigil, short_tmp: Path) -> None:
    port = free_port()
    two = builds(short_tmp / "ngx", port)
    vigil.run("host", "add", "edge", "--build", str(two[0]), "--listen",
              f"http=tcp:127.0.0.1:{port}", "--ready", "http", "--env", "NGINX=3;",
              "--stop-signal", "QUIT", "--drain-timeout", "20", "--health-timeout", "30")
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", "edge", "--wait", timeout=60)
    inode = serving_inode(vigil, "edge")
    masters = [vigil.status("edge")["pid"]]
    with Load(port) as load:
        spans = []
        for i in range(DEPLOYS):
            seen = load.ok
            began = time.monotonic() - load.t0
            cp = vigil.run("deploy", "edge", str(two[(i + 1) % 2]), "--mode", "hold", "--wait",
                           timeout=120)
            spans.append(f"deploy {i + 1}: {began:.2f}s-{time.monotonic() - load.t0:.2f}s")
            assert "done (mode hold, executed true" in cp.stdout, cp.stdout
            assert serving_inode(vigil, "edge") == inode  # the same socket, inherited
            masters.append(vigil.status("edge")["pid"])
            want = seen + 2 * THREADS
            wait_for(lambda: load.ok >= want, 30, what="answers after the deploy")  # noqa: B023
    print(f"\nnginx QUIT: {load.ok} answered through {DEPLOYS} hold deploys, "
          f"{len(load.failures)} failed")
    assert not load.failures, (load.failures[:5], spans, vigil.agent_log().decode()[-3000:])
    assert load.ok > DEPLOYS * THREADS
    assert len(set(masters)) == DEPLOYS + 1 and all(pid_dead(p) for p in masters[:-1])
    errors = (short_tmp / "ngx" / "error.log").read_text()
    assert "using inherited sockets from \"3;\"" in errors, errors[-2000:]
    assert "gracefully shutting down" in errors, errors[-2000:]  # QUIT, not TERM's "exiting"
    vigil.run("stop", "edge", "--wait")
    vigil.quiesce(30)
    vigil.check()
    vigil.stop_agent(agent)
