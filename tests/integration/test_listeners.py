"""Hosts on a listening socket vigil holds (socket activation), with a real app server from
PyPI (gunicorn, sync workers) on a TCP port and a closed-loop client on it: no request
fails through hold deploys, overlap deploys and crash restarts, and the socket is the same
one throughout (its inode, in the store, the fd holder and the app). Both containments."""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import psutil
import pytest
from sqlalchemy import update

from models.tables import Host
from runners.keepers.fdholder import holder_pid
from tests.conftest import HELLO, Vigil, pid_dead, wait_for
from tests.listening import (
    Client,
    add_gunicorn,
    free_port,
    holder_inodes,
    serve_builds,
    serving_inode,
    store_inode,
)

pytestmark = pytest.mark.timeout(900)
DEPLOYS = 10
CRASHES = 10
CONTAINMENTS = ["auto", "marker"]


def started(v: Vigil, short_tmp: Path, *extra: str) -> tuple[list[Path], int]:
    builds = serve_builds(short_tmp)
    port = free_port()
    add_gunicorn(v, "web", builds[0], port, *extra)
    v.wait_ready(v.start_agent())
    v.run("wake", "web", "--wait", timeout=120)
    return builds, port


@pytest.mark.parametrize("containment", CONTAINMENTS)
@pytest.mark.parametrize("mode", ["hold", "overlap"])
def test_deploys_under_load_fail_no_request(vigil: Vigil, short_tmp: Path, mode: str) -> None:
    builds, port = started(vigil, short_tmp)
    inode = serving_inode(vigil, "web")
    with Client(port) as client:
        for i in range(DEPLOYS):
            cp = vigil.run("deploy", "web", str(builds[(i + 1) % 2]), "--mode", mode, "--wait",
                           timeout=180)
            assert f"done (mode {mode}, executed true" in cp.stdout, cp.stdout
            assert serving_inode(vigil, "web") == inode
        time.sleep(0.5)  # answers from the last generation too
    print(f"\n{mode}: {client.ok} requests answered through {DEPLOYS} deploys, "
          f"{len(client.failures)} failed")
    assert not client.failures, f"{len(client.failures)} failed: {client.failures[:5]}"
    assert client.ok > DEPLOYS
    vigil.quiesce(30)
    vigil.check()


@pytest.mark.parametrize("containment", CONTAINMENTS)
def test_crash_restarts_fail_no_request(vigil: Vigil, short_tmp: Path) -> None:
    """kill -9 of the generation's leader (gunicorn's arbiter): its workers finish what they
    accepted (SIGTERM, then the drain), the restart inherits the same socket, and what
    arrives in between waits in the backlog. Each answer takes 0.2 s, so a request is in
    a worker's hands when its leader is killed (SIGKILLed with it, that request failed).
    Ten kills a few seconds apart are a crash loop to the restart policy: its backoff is
    kept short here (0.1 s, capped at 0.4 s), as the default's seconds would outlast the
    client's timeout while the requests wait."""
    _, port = started(vigil, short_tmp, "--env", "APP_DELAY=0.2", "--restart-floor", "0.1",
                      "--restart-cap", "0.4")
    inode = serving_inode(vigil, "web")
    with Client(port) as client:
        for _ in range(CRASHES):
            before = vigil.status("web")
            os.kill(before["pid"], signal.SIGKILL)
            wait_for(lambda b=before: (st := vigil.status("web"))["state"] == "awake"
                     and st["generation"] != b["generation"], 120, interval=0.1,
                     what="the restarted generation")
            assert serving_inode(vigil, "web") == inode
        time.sleep(0.5)
    print(f"\ncrash restarts: {client.ok} requests answered through {CRASHES} kill -9, "
          f"{len(client.failures)} failed")
    assert not client.failures, f"{len(client.failures)} failed: {client.failures[:5]}"
    assert client.ok > CRASHES
    vigil.quiesce(30)
    vigil.check()


def never_ready(tmp: Path) -> Path:
    """hello, but it never sends READY=1 (it serves all the same)."""
    p = tmp / "never-ready.py"
    p.write_text(HELLO.read_text().replace('os.environ.get("HELLO_NEVER_READY") == "1"', "True"))
    p.chmod(0o755)
    return p


@pytest.mark.parametrize("containment", CONTAINMENTS)
def test_notify_without_ready_fails_health_and_the_old_one_keeps_serving(
        vigil: Vigil, short_tmp: Path) -> None:
    port = free_port()
    vigil.run("host", "add", "app", "--build", str(HELLO), "--listen", f"tcp:127.0.0.1:{port}",
              "--ready", "notify", "--health-timeout", "2")
    vigil.wait_ready(vigil.start_agent())
    vigil.run("wake", "app", "--wait")
    old = vigil.status("app")
    inode = serving_inode(vigil, "app")
    with Client(port) as client:
        cp = vigil.run("deploy", "app", str(never_ready(short_tmp)), "--wait", check=False,
                       timeout=60)
        assert cp.returncode != 0 and "failed" in cp.stderr, cp.stdout + cp.stderr
        assert "no READY=1 on $NOTIFY_SOCKET within 2.0s" in cp.stderr, cp.stderr
        # ... and names the readiness that works for a server that never sends it
        assert "`vigil host set app --ready http`" in cp.stderr, cp.stderr
        assert "--ready 'exec:curl -fs http://127.0.0.1:PORT/'" in cp.stderr, cp.stderr
        vigil.quiesce(30)
        now = vigil.status("app")
        assert now["generation"] == old["generation"] and now["pid"] == old["pid"]
        count = client.ok
        wait_for(lambda: client.ok > count + 5, 30, what="more answers from the old one")
    assert not client.failures, client.failures[:5]
    assert client.pids >= {old["pid"]}
    assert serving_inode(vigil, "app") == inode
    kinds = [e["kind"] for e in vigil.json("events", "app")]
    assert "app_ready" in kinds and "app_status" in kinds and "deploy_failed" in kinds
    vigil.check()


def test_exec_readiness(vigil: Vigil, short_tmp: Path) -> None:
    """exec:CMD with the generation's env: exit 0 is ready; a probe that never passes fails
    the deploy within the health timeout, and the old generation stays."""
    port = free_port()
    vigil.run("host", "add", "app", "--build", str(HELLO), "--listen", f"tcp:127.0.0.1:{port}",
              "--ready", 'exec:test -d "/proc/$VIGIL_PID" && test "$VIGIL_HOST" = app',
              "--health-timeout", "3")
    vigil.wait_ready(vigil.start_agent())
    vigil.run("wake", "app", "--wait")
    old = vigil.status("app")
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"GET / HTTP/1.0\r\n\r\n")
        assert s.recv(64).startswith(b"HTTP/1.0 200")
    vigil.store.write(lambda s: s.execute(update(Host).where(Host.name == "app").values(
        ready="exec:echo not yet; exit 3")))
    cp = vigil.run("deploy", "app", str(never_ready(short_tmp)), "--wait", check=False, timeout=60)
    assert cp.returncode != 0, cp.stdout
    assert "did not exit 0 within 3.0s (last: exit 3: not yet)" in cp.stderr, cp.stderr
    vigil.quiesce(30)
    assert vigil.status("app")["pid"] == old["pid"]


def test_lost_listener_is_bound_again_at_the_next_wake(vigil: Vigil, short_tmp: Path) -> None:
    """The host stopped, then its agent and its fd holder killed (-9, by pid, one after the
    other): nothing has the socket any more. The restarted agent says it is lost and that
    the next start binds it again; `vigil wake` starts the host with no `host reopen`, on a
    new socket, and `listener_reopened` says why; status and check say it was reopened.
    Before the fix the wake was refused until `vigil host reopen` (and check failed)."""
    port = free_port()
    vigil.run("host", "add", "app", "--build", str(HELLO), "--listen", f"tcp:127.0.0.1:{port}")
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", "app", "--wait")
    inode = store_inode(vigil, "app")
    vigil.run("stop", "app", "--wait")
    # hello says STOPPING=1 on its NOTIFY_SOCKET when SIGTERM comes: an event
    wait_for(lambda: "app_stopping" in [e["kind"] for e in vigil.json("events", "app")], 10,
             what="the app_stopping event")
    vigil.quiesce()
    holder = holder_pid(vigil.state_dir)
    assert holder and list(holder_inodes(vigil).values()) == [inode]
    os.kill(agent.pid, signal.SIGKILL)
    agent.wait(10)
    os.kill(holder, signal.SIGKILL)
    wait_for(lambda: pid_dead(holder), 10, what="the holder gone")
    before = vigil.ready_count()
    vigil.wait_ready_after(vigil.start_agent(), before)
    st = vigil.status("app")
    assert st["listeners"][0]["state"] == "lost", st
    assert "binds it again" in st["listeners"][0]["note"], st
    assert "(lost)" in vigil.run("status").stdout
    cp = vigil.run("check", check=False)
    assert cp.returncode == 0 and "note: host app: tcp:127.0.0.1" in cp.stdout, cp.stdout
    vigil.run("wake", "app", "--wait")
    now = serving_inode(vigil, "app")
    assert now != inode
    reopened = [e for e in vigil.json("events", "app") if e["kind"] == "listener_reopened"]
    assert len(reopened) == 1, reopened
    assert "the agent and the fd holder both died" in str(reopened[0]), reopened
    st = vigil.status("app")
    assert st["listeners"][0]["reopened"] and "was reopened" in st["listeners"][0]["note"], st
    # The table says so too (wide enough that rich does not shorten the cell).
    assert "(reopened)" in vigil.run("status", env={"COLUMNS": "200"}).stdout
    cp = vigil.run("check", check=False)
    assert cp.returncode == 0 and "was reopened" in cp.stdout, cp.stdout
    with socket.create_connection(("127.0.0.1", port), timeout=10):
        pass  # the new socket is the one clients reach


def test_bad_listen_input_is_one_line_and_writes_nothing(vigil: Vigil, short_tmp: Path) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    busy = taken.getsockname()[1]
    port = free_port()
    plain = short_tmp / "not-a-dir"
    plain.write_text("")
    try:
        vigil.run("host", "add", "first", "--build", str(HELLO), "--listen",
                  f"tcp:127.0.0.1:{port}")
        cases = {
            f"tcp:127.0.0.1:{busy}": "the port is in use",
            f"unix:{plain}/app.sock": "does not exist",
            f"tcp:0.0.0.0:{port}": "is already host first's listener",
            "tcp:localhost:80": "is not an IP address",
            "tcp:127.0.0.1:99999": "is not a port",
            "udp:127.0.0.1:80": "not tcp:HOST:PORT or unix:/PATH",
            "unix:relative.sock": "absolute path",
        }
        for spec, why in cases.items():
            cp = vigil.run("host", "add", "second", "--build", str(HELLO), "--listen", spec,
                           check=False)
            lines = cp.stderr.strip().splitlines()
            assert cp.returncode == 2 and len(lines) == 1 and why in lines[0], (spec, cp.stderr)
        for extra, why in ((["--kind", "worker", "--listen", f"tcp:127.0.0.1:{free_port()}"],
                            "--listen is for instances"),
                           (["--ready", "notify"], "needs a shared listener"),
                           (["--ready", "bogus", "--listen", f"tcp:127.0.0.1:{free_port()}"],
                            "not http, http:PATH, tcp, exec:CMD or notify")):
            cp = vigil.run("host", "add", "second", "--build", str(HELLO), *extra, check=False)
            assert cp.returncode == 2 and why in cp.stderr, (extra, cp.stderr)
        assert [h["host"] for h in vigil.json("host", "list")] == ["first"]
        f = short_tmp / "hosts.toml"
        f.write_text(f'[hosts.first]\nbuild = "{HELLO}"\nlisten = ["tcp:127.0.0.1:{port}"]\n'
                     f'[hosts.third]\nbuild = "{HELLO}"\nlisten = ["tcp:127.0.0.1:{busy}"]\n')
        cp = vigil.run("apply", str(f), check=False)
        assert cp.returncode == 2 and "the port is in use" in cp.stderr, cp.stderr
        f.write_text(f'[hosts.first]\nbuild = "{HELLO}"\nlisten = ["tcp:127.0.0.1:{port}"]\n'
                     f'[hosts.third]\nbuild = "{HELLO}"\nlisten = ["web=tcp:127.0.0.1:{port}"]\n')
        cp = vigil.run("apply", str(f), check=False)
        assert cp.returncode == 2 and "is also host first's listener" in cp.stderr, cp.stderr
        assert [h["host"] for h in vigil.json("host", "list")] == ["first"]
    finally:
        taken.close()


def test_apply_listen_and_ready_keys(vigil: Vigil, short_tmp: Path) -> None:
    port = free_port()
    f = short_tmp / "hosts.toml"
    f.write_text(f'[hosts.app]\nbuild = "{HELLO}"\nlisten = ["http=tcp:127.0.0.1:{port}"]\n')
    assert "+ add app" in vigil.run("apply", str(f)).stdout
    st = vigil.status("app")
    assert st["ready"] == "notify" and st["listeners"][0]["address"] == f"tcp:127.0.0.1:{port}"
    assert "= keep app" in vigil.run("apply", str(f), "--dry-run").stdout
    vigil.wait_ready(vigil.start_agent())
    vigil.run("wake", "app", "--wait")
    other = free_port()
    f.write_text(f'[hosts.app]\nbuild = "{HELLO}"\nlisten = ["http=tcp:127.0.0.1:{other}"]\n')
    cp = vigil.run("apply", str(f), check=False)
    assert cp.returncode == 4 and "its listen cannot change while it runs" in cp.stderr
    vigil.run("stop", "app", "--wait")
    assert "listen" in vigil.run("apply", str(f)).stdout
    vigil.run("wake", "app", "--wait")
    with socket.create_connection(("127.0.0.1", other), timeout=10) as s:
        s.sendall(b"GET / HTTP/1.0\r\n\r\n")
        assert s.recv(64).startswith(b"HTTP/1.0 200")
    # The old port is closed again (by the agent and its holder): free for anyone.
    wait_for(lambda: _bindable(port), 10, what=f"port {port} closed")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.mark.parametrize("containment", CONTAINMENTS)
def test_listen_pid_is_the_exec_d_process(vigil: Vigil) -> None:
    """LISTEN_PID names the process that serves, in both spawn paths (the cgroup shim and
    the marker one): the shim sets it to its own pid, which exec keeps."""
    port = free_port()
    vigil.run("host", "add", "app", "--build", str(HELLO), "--listen", f"a=tcp:127.0.0.1:{port}",
              "--listen", f"b=unix:{vigil.state_dir.parent}/b.sock", "--ready", "notify")
    vigil.wait_ready(vigil.start_agent())
    vigil.run("wake", "app", "--wait")
    pid = vigil.status("app")["pid"]
    env = psutil.Process(pid).environ()
    assert env["LISTEN_PID"] == str(pid) and env["LISTEN_FDS"] == "2"
    assert env["LISTEN_FDNAMES"] == "a:b" and env["NOTIFY_SOCKET"].endswith(".sock")
    inodes = [r["inode"] for r in vigil.status("app")["listeners"]]
    assert os.readlink(f"/proc/{pid}/fd/3") == f"socket:[{inodes[0]}]"
    assert os.readlink(f"/proc/{pid}/fd/4") == f"socket:[{inodes[1]}]"
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(str(vigil.state_dir.parent / "b.sock"))
        s.sendall(b"GET / HTTP/1.0\r\n\r\n")
        assert s.recv(64).startswith(b"HTTP/1.0 200")
