"""`vigil reload` and `vigil signal` on real apps: gunicorn (from PyPI, on a TCP listener vigil
holds) reloaded in place under a closed-loop client, by systemd's notify-reload protocol
(RELOADING=1 from its on_reload hook, READY=1 from a new worker), with no failed request; a
gunicorn whose reload never says so (stock gunicorn sends no RELOADING=1) answered by an
overlap restart of the same build, again with no failed request; a reload that breaks the
app kept as it is when told to keep, and notified (`--on reload_failed`); a signal reaching every instance of a host."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from sqlalchemy import select, update

from models.tables import Event, Lease, Reload
from tests.conftest import Vigil, wait_for
from tests.integration.test_notifications import receiver
from tests.listening import Client, add_gunicorn, free_port, serve_builds
from tests.reloadapps import breaks_on_reload, reloadable

pytestmark = pytest.mark.timeout(600)
RELOADS = 3

# gunicorn's own hooks saying the systemd protocol: RELOADING=1 when the arbiter starts a
# reload (SIGHUP), READY=1 once a worker of the reloaded configuration has loaded the app.
HOOKS = '''import os, socket


def _notify(state):
    path = os.environ.get("NOTIFY_SOCKET")
    if path:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            s.connect(path)
            s.send(state)


def on_reload(server):
    _notify(b"RELOADING=1")


def post_worker_init(worker):
    _notify(b"READY=1")
'''


def events(v: Vigil, kind: str) -> list[dict[str, object]]:
    return [json.loads(e.detail) | {"generation": e.generation_id} for e in v.store.read(
        lambda s: s.execute(select(Event).where(Event.kind == kind).order_by(Event.id))
        .scalars().all())]


def gunicorn(v: Vigil, tmp: Path, *extra: str) -> int:
    builds = serve_builds(tmp)
    port = free_port()
    add_gunicorn(v, "web", builds[0], port, *extra)
    v.wait_ready(v.start_agent())
    v.run("wake", "web", "--wait", timeout=120)
    return port


def workers(pid: int) -> set[int]:
    return {c.pid for c in psutil.Process(pid).children() if c.status() != psutil.STATUS_ZOMBIE}


def test_gunicorn_reloaded_in_place_under_load_fails_no_request(vigil: Vigil,
                                                                short_tmp: Path) -> None:
    hooks = short_tmp / "hooks.py"
    hooks.write_text(HOOKS)
    port = gunicorn(vigil, short_tmp, "--ready", "notify", "--health-timeout", "20",
                    "--env", f"GUNICORN_CMD_ARGS=--config {hooks}")
    before = vigil.status("web")
    with Client(port) as client:
        for _ in range(RELOADS):
            old = workers(before["pid"])
            cp = vigil.run("reload", "web", "--wait", timeout=60)
            assert "reloaded, back ready" in cp.stdout, cp.stdout
            wait_for(lambda old=old: not old & workers(before["pid"]), 30,
                     what="the old workers replaced")
        wait_for(lambda: client.ok > 10, 30, what="answers after the reloads")
    after = vigil.status("web")
    assert (after["generation"], after["pid"]) == (before["generation"], before["pid"])
    print(f"\nreload: {client.ok} requests answered through {RELOADS} reloads, "
          f"{len(client.failures)} failed")
    assert not client.failures, f"{len(client.failures)} failed: {client.failures[:5]}"
    assert len(client.pids) > 2, "answers came from the original workers only"
    assert len(events(vigil, "reloaded")) == RELOADS
    assert not events(vigil, "reload_failed")
    vigil.quiesce(30)
    vigil.check()


def test_gunicorn_reload_never_ready_falls_back_to_overlap_restart_failing_no_request(
        vigil: Vigil, short_tmp: Path) -> None:
    port = gunicorn(vigil, short_tmp, "--ready", "notify", "--health-timeout", "3")
    before = vigil.status("web")
    with Client(port) as client:
        cp = vigil.run("reload", "web", "--wait", timeout=120)
        wait_for(lambda: client.ok > 5, 30, what="answers after the restart")
    assert "reload failed" in cp.stdout and "no RELOADING=1" in cp.stdout, cp.stdout
    assert "done (mode overlap" in cp.stdout, cp.stdout
    after = vigil.status("web")
    assert after["generation"] != before["generation"] and after["state"] == "awake", after
    print(f"\nfailed reload: {client.ok} requests answered through its overlap restart, "
          f"{len(client.failures)} failed")
    assert not client.failures, f"{len(client.failures)} failed: {client.failures[:5]}"
    (failed,) = events(vigil, "reload_failed")
    assert failed["answer"] == "restart" and failed["attempt"], failed
    wait_for(lambda: not psutil.pid_exists(before["pid"]), 30, what="the old arbiter gone")
    vigil.quiesce(30)
    vigil.check()


def test_a_broken_reload_kept_as_it_is_when_told_to_keep(vigil: Vigil, short_tmp: Path) -> None:
    """... and `--on reload_failed` is told of it."""
    command, got = receiver(short_tmp)
    vigil.run("notify", "add", "pager", "--on", "reload_failed", "--exec", command)
    vigil.add_host("app", breaks_on_reload(short_tmp), "--on-reload-fail", "keep",
                   "--health-timeout", "1")
    vigil.wait_ready(vigil.start_agent())
    vigil.run("wake", "app", "--wait")
    before = vigil.status("app")
    cp = vigil.run("reload", "app", "--wait", check=False)
    assert cp.returncode != 0 and "reload failed, kept as it is" in cp.stderr, cp.stderr
    assert len(cp.stderr.strip().splitlines()) <= 2, cp.stderr  # the cause, then the fix
    after = vigil.status("app")
    assert (after["generation"], after["pid"]) == (before["generation"], before["pid"])
    (failed,) = events(vigil, "reload_failed")
    assert failed["answer"] == "keep" and "attempt" not in failed, failed
    (r,) = vigil.store.read(lambda s: s.execute(select(Reload)).scalars().all())
    assert r.state.value == "failed" and r.attempt_id is None and "500" in (r.reason or "")
    wait_for(lambda: got.exists() and "reload_failed" in got.read_text(), 20,
             what="the failed reload's notification")
    vigil.quiesce(30)


def test_the_broken_reload_app_answers_500_from_the_instant_of_its_signal(
        short_tmp: Path) -> None:
    """The fixture the two tests above and tests/recovery's reload.ended rely on: a probe
    right after the signal must see the breakage, even while a CPU hog delays the app's main
    thread (a Python handler answered 200 in between, 8 times in 30, and a reload that should
    fail was judged done)."""
    app = breaks_on_reload(short_tmp)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(3)]
    try:
        for i in range(30):
            sock = short_tmp / f"b{i}.sock"
            p = subprocess.Popen([sys.executable, str(app)], env={**os.environ,
                                 "VIGIL_SOCKET": str(sock)}, stderr=subprocess.DEVNULL)
            try:
                wait_for(lambda sock=sock: _answer(sock) == 200, 20, what="the app serving")
                p.send_signal(signal.SIGHUP)
                assert _answer(sock) == 500, f"try {i}: 200 right after SIGHUP"
            finally:
                p.kill()
                p.wait()
    finally:
        for h in hogs:
            h.kill()
            h.wait()


def _answer(sock: Path) -> int | None:
    try:
        with socket.socket(socket.AF_UNIX) as c:
            c.connect(str(sock))
            c.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
            return int(c.recv(64).split()[1])
    except (OSError, IndexError, ValueError):
        return None


def test_reload_over_http_readiness_and_a_second_reload_while_one_is_open(
        vigil: Vigil, short_tmp: Path) -> None:
    vigil.add_host("app", reloadable(short_tmp))
    vigil.wait_ready(vigil.start_agent())
    vigil.run("wake", "app", "--wait")
    cp = vigil.run("reload", "app", "--wait")
    assert "reloaded, back ready" in cp.stdout, cp.stdout
    assert "reloaded" in vigil.run("logs", "app").stdout  # the app's own line: it got SIGHUP
    (sent,) = events(vigil, "reload_signalled")
    assert sent["signal"] == "HUP" and sent["again"] is False, sent
    vigil.quiesce(30)
    vigil.check()


def test_signal_reaches_every_instance(vigil: Vigil, short_tmp: Path) -> None:
    """TTIN makes a gunicorn arbiter start one more worker: each instance's arbiter got it."""
    gunicorn(vigil, short_tmp, "--instances", "2")
    wait_for(lambda: len(leaders(vigil)) == 2, 60, what="two instances")
    # READY=1 comes once an arbiter has booted, its workers a moment later.
    wait_for(lambda: all(len(workers(pid)) == 2 for pid in leaders(vigil)), 30,
             what="two workers in each instance")
    before = {pid: workers(pid) for pid in leaders(vigil)}
    cp = vigil.run("signal", "web", "ttin")
    assert cp.stdout.count("sent SIGTTIN") == 2, cp.stdout
    wait_for(lambda: all(len(workers(pid)) == 3 for pid in before), 30,
             what="a third worker in each instance")
    sent = events(vigil, "signal_sent")
    assert sorted(e["pid"] for e in sent) == sorted(before) and {e["signal"] for e in sent} == {"TTIN"}
    vigil.quiesce(30)


def leaders(v: Vigil) -> list[int]:
    from models.states import GenState
    from models.tables import Generation

    return v.store.read(lambda s: list(s.execute(select(Generation.pid).where(
        Generation.host == "web", Generation.state == GenState.current)).scalars()))


def test_signal_and_reload_refuse_with_one_line(vigil: Vigil) -> None:
    vigil.add_host("app")
    cp = vigil.run("signal", "app", "HUP", check=False)
    assert cp.returncode != 0 and "has nothing running: no signal was sent" in cp.stderr, cp.stderr
    cp = vigil.run("signal", "app", "NOPE", check=False)
    assert cp.returncode == 2 and "'NOPE' is not a signal" in cp.stderr, cp.stderr
    cp = vigil.run("reload", "app", check=False)
    assert cp.returncode != 0 and "is not running: nothing to reload" in cp.stderr, cp.stderr
    assert not vigil.store.read(lambda s: s.execute(select(Reload)).scalars().all())
    assert not events(vigil, "signal_sent")


def test_reload_settings_on_add_set_show_and_the_hosts_file(vigil: Vigil,
                                                           short_tmp: Path) -> None:
    vigil.add_host("app", reloadable(short_tmp), "--reload-signal", "sigusr2",
                   "--on-reload-fail", "keep")
    shown = vigil.json("host", "show", "app")
    assert (shown["reload_signal"], shown["on_reload_fail"]) == ("USR2", "keep"), shown
    cp = vigil.run("host", "set", "app", "--reload-signal", "KILL", check=False)
    assert cp.returncode == 2 and "KILL cannot be caught" in cp.stderr, cp.stderr
    vigil.run("host", "set", "app", "--unset", "reload-signal", "--on-reload-fail", "restart")
    shown = vigil.json("host", "show", "app")
    assert (shown["reload_signal"], shown["on_reload_fail"]) == ("HUP", "restart"), shown
    hosts = short_tmp / "hosts.toml"
    hosts.write_text(f'[hosts.app]\nbuild = "{reloadable(short_tmp)}"\nreload_signal = "USR1"\n'
                     'on_reload_fail = "keep"\n')
    vigil.run("apply", str(hosts))
    shown = vigil.json("host", "show", "app")
    assert (shown["reload_signal"], shown["on_reload_fail"]) == ("USR1", "keep"), shown
    hosts.write_text(f'[hosts.app]\nbuild = "{reloadable(short_tmp)}"\non_reload_fail = "maybe"\n')
    cp = vigil.run("apply", str(hosts), check=False)
    assert cp.returncode == 2 and "on_reload_fail" in cp.stderr, cp.stderr


def test_signal_refused_for_a_host_another_box_holds(vigil: Vigil) -> None:
    """The lease names another box: its processes are not this box's to signal (a pid here
    may be anything), so nothing is sent. The agent is stopped (the app keeps running) while
    the lease is made another box's, and given back before the app is stopped."""
    vigil.add_host("app")
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", "app", "--wait")
    pid = vigil.status("app")["pid"]
    vigil.stop_agent(agent)
    mine = vigil.store.read(lambda s: s.execute(select(Lease.holder)).scalar_one())

    def holder(name: str) -> None:
        vigil.store.write(lambda s: s.execute(update(Lease).values(holder=name)))

    holder("box-b")
    try:
        cp = vigil.run("signal", "app", "HUP", check=False)
    finally:
        holder(mine)
    assert cp.returncode != 0 and "runs on box box-b, not this one" in cp.stderr, cp.stderr
    assert psutil.pid_exists(pid) and not events(vigil, "signal_sent")
    vigil.wait_ready(vigil.start_agent())
    vigil.run("stop", "app", "--wait")


def test_gunicorn_instances_each_reloaded(vigil: Vigil, short_tmp: Path) -> None:
    """--instances 2: the reload signals both arbiters and waits for each one's READY=1."""
    hooks = short_tmp / "hooks.py"
    hooks.write_text(HOOKS)
    gunicorn(vigil, short_tmp, "--instances", "2", "--health-timeout", "20",
             "--env", f"GUNICORN_CMD_ARGS=--config {hooks}")
    wait_for(lambda: len(leaders(vigil)) == 2, 60, what="two instances")
    before = {pid: workers(pid) for pid in leaders(vigil)}
    cp = vigil.run("reload", "web", "--wait", timeout=60)
    assert "reloaded, back ready" in cp.stdout, cp.stdout
    assert sorted(leaders(vigil)) == sorted(before)
    for pid, old in before.items():
        wait_for(lambda pid=pid, old=old: not old & workers(pid), 30,
                 what=f"arbiter {pid}'s workers replaced")
    (sent,) = events(vigil, "reload_signalled")
    assert len(sent["generations"]) == 2, sent  # type: ignore[arg-type]
    vigil.quiesce(30)
    vigil.check()
