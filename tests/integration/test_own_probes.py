"""Issue 39 item 4: probes of the app's own. `--ready http:PATH|tcp|exec:CMD|notify` and
`--health http:PATH|tcp|exec:CMD`, against real apps and the real agent: an app ready only
on /healthz, an app that accepts connects and speaks no HTTP, a command that fails and then
passes; a health probe of each kind that finds a hung app and has it restarted; a command
over its time bound killed with its process group (by pid) and counted as a failure; a
command run as the app's user; a hung command left by a `kill -9`'d agent ended by the
stop (it runs in the generation's containment). Bad values are one line and change nothing."""

from __future__ import annotations

import os
import pwd
import signal
import sys
from pathlib import Path

import pytest

from tests.conftest import FIXTURES, HELLO, Vigil, pid_dead, wait_for
from tests.listening import free_port

APP = FIXTURES / "own_probes.py"
CURL = "curl -fs --max-time 1 --unix-socket \"$VIGIL_SOCKET\" http://app/healthz"


@pytest.fixture(params=["marker"])
def containment(request: pytest.FixtureRequest) -> str:
    return str(request.param)  # the probes do not depend on the containment


def lines(path: Path) -> list[str]:
    try:
        return path.read_text().splitlines()
    except FileNotFoundError:
        return []


def shown(vigil: Vigil, host: str) -> dict[str, object]:
    return dict(vigil.json("host", "show", host))


def started(vigil: Vigil) -> None:
    vigil.wait_ready(vigil.start_agent())


def test_ready_on_a_path_waits_for_2xx(vigil: Vigil, short_tmp: Path) -> None:
    """GET / answers 404 at once (plain http would call it ready); http:/healthz waits
    until /healthz answers 200."""
    flag, seen = short_tmp / "healthy", short_tmp / "seen"
    vigil.add_host("app", APP, "--ready", "http:/healthz", "--health-timeout", "60",
                   "--env", f"HEALTHY_FLAG={flag}", "--env", f"SEEN={seen}")
    assert shown(vigil, "app")["ready"] == "http:/healthz"
    started(vigil)
    vigil.run("wake", "app")
    wait_for(lambda: len(lines(seen)) >= 3, 30, what="/healthz asked three times")
    assert set(lines(seen)) == {"503 Not Yet"}
    assert vigil.status("app")["state"] != "awake", vigil.status("app")
    flag.touch()
    wait_for(lambda: vigil.status("app")["state"] == "awake", 30, what="app awake")
    assert lines(seen)[-1] == "200 OK"
    vigil.run("stop", "app", "--wait")
    vigil.check()


def test_tcp_ready_app_speaks_no_http(vigil: Vigil) -> None:
    """An app that accepts connects and answers nothing: `tcp` finds it ready."""
    vigil.add_host("raw", APP, "--ready", "tcp", "--env", "RAW=1", "--health-timeout", "30")
    assert shown(vigil, "raw")["ready"] == "tcp"
    started(vigil)
    vigil.run("wake", "raw", "--wait", timeout=60)
    assert vigil.status("raw")["state"] == "awake"
    vigil.run("stop", "raw", "--wait")
    vigil.check()


def test_exec_ready_fails_then_passes(vigil: Vigil, short_tmp: Path) -> None:
    flag, tries = short_tmp / "ready", short_tmp / "tries"
    vigil.run("host", "add", "app", "--build", str(HELLO), "--listen",
              f"tcp:127.0.0.1:{free_port()}", "--health-timeout", "60",
              "--ready", f"exec:echo try >> {tries}; test -e {flag}")
    started(vigil)
    vigil.run("wake", "app")
    wait_for(lambda: len(lines(tries)) >= 3, 30, what="the command tried three times")
    assert vigil.status("app")["state"] != "awake", vigil.status("app")
    flag.touch()
    wait_for(lambda: vigil.status("app")["state"] == "awake", 30, what="app awake")
    vigil.run("stop", "app", "--wait")
    vigil.check()


@pytest.mark.parametrize("health, hang", [
    ("http:/healthz", signal.SIGSTOP),  # hung: accepts in the backlog, never answers
    ("tcp", signal.SIGUSR1),  # stops listening: a connect is refused
    (f"exec:{CURL}", signal.SIGSTOP),
])
def test_health_probe_of_each_kind_restarts_a_hung_app(vigil: Vigil, health: str,
                                                        hang: signal.Signals) -> None:
    interval = "1" if health.startswith("exec:") else "0.3"
    vigil.add_host("app", APP, "--health", health, "--health-interval", interval,
                   "--unhealthy-after", "2", "--unhealthy-restart", "--drain-timeout", "1")
    assert shown(vigil, "app")["health"] == health
    started(vigil)
    vigil.run("wake", "app", "--wait")
    first = vigil.status("app")
    os.kill(first["pid"], hang)
    try:
        wait_for(lambda: (vigil.status("app")["generation"] or first["generation"])
                 > first["generation"], 40, what="a new generation of app")
        wait_for(lambda: pid_dead(first["pid"]), 15, what="the hung generation gone")
    finally:
        if not pid_dead(first["pid"]):
            os.kill(first["pid"], signal.SIGKILL)
    unhealthy = [e for e in vigil.json("events", "app") if e["kind"] == "unhealthy"]
    assert unhealthy and unhealthy[0]["generation"] == first["generation"], unhealthy
    wait_for(lambda: vigil.status("app")["state"] == "awake", 30, what="the new one awake")
    vigil.run("stop", "app", "--wait")
    vigil.quiesce(15)
    vigil.check()


def test_exec_probe_over_its_bound_is_killed_and_fails(vigil: Vigil, short_tmp: Path) -> None:
    """The health timeout (2 s, under the 2.5 s interval) bounds the command: its shell and
    the shell's child are killed with their process group, and each such try is a failure."""
    pids = short_tmp / "pids"
    vigil.add_host("app", APP, "--health-timeout", "2", "--health-interval", "2.5",
                   "--unhealthy-after", "2",
                   "--health", f"exec:echo $$ >> {pids}; sleep 600 & echo $! >> {pids}; wait")
    started(vigil)
    vigil.run("wake", "app", "--wait")
    wait_for(lambda: vigil.status("app")["state"] == "unhealthy", 40, what="app unhealthy")
    event = next(e for e in vigil.json("events", "app") if e["kind"] == "unhealthy")
    assert "still ran after 2.0s (killed)" in event["detail"]["reason"], event
    tried = [int(p) for p in lines(pids)[:4]]  # the two tries that made it unhealthy
    assert len(tried) == 4, tried
    wait_for(lambda: all(pid_dead(p) for p in tried), 10, what="every process of the tries gone")
    vigil.run("stop", "app", "--wait")
    vigil.quiesce(15)
    vigil.check()


def test_exec_health_of_an_app_without_a_socket_of_its_own(vigil: Vigil, short_tmp: Path) -> None:
    """On a shared listener with notify readiness the generation has no $VIGIL_SOCKET: a
    command still probes it, unhealthy while the command fails, healthy again after."""
    sick = short_tmp / "sick"
    vigil.run("host", "add", "app", "--build", str(HELLO), "--listen",
              f"tcp:127.0.0.1:{free_port()}", "--health", f"exec:test ! -e {sick}",
              "--health-interval", "0.3", "--unhealthy-after", "1")
    started(vigil)
    vigil.run("wake", "app", "--wait")
    pid = vigil.status("app")["pid"]
    sick.touch()
    wait_for(lambda: vigil.status("app")["state"] == "unhealthy", 20, what="app unhealthy")
    sick.unlink()
    wait_for(lambda: vigil.status("app")["state"] == "awake", 20, what="app healthy again")
    kinds = [e["kind"] for e in vigil.json("events", "app")]
    assert "unhealthy" in kinds and "healthy" in kinds, kinds
    assert vigil.status("app")["pid"] == pid  # no restart without --unhealthy-restart
    vigil.run("stop", "app", "--wait")
    vigil.check()


@pytest.fixture
def app_user() -> pwd.struct_passwd:
    if os.geteuid() != 0:
        pytest.skip("running a probe as another user needs a root agent")
    from tests.integration.test_run_as import ensure_user

    return ensure_user("vigil-t1")


def test_exec_probes_run_as_the_apps_user(vigil: Vigil, short_tmp: Path,
                                          app_user: pwd.struct_passwd) -> None:
    os.chmod(short_tmp, 0o755)  # mkdtemp's 0700 would keep the app's user out
    out = short_tmp / "out"
    out.mkdir(mode=0o777)
    os.chmod(out, 0o777)
    vigil.run("host", "add", "app", "--build", str(HELLO), "--user", app_user.pw_name,
              "--env", "PATH=/usr/bin:/bin", "--listen", f"tcp:127.0.0.1:{free_port()}",
              "--ready", f"exec:id -un >> {out}/ready", "--health", f"exec:id -un >> {out}/health",
              "--health-interval", "0.5")
    started(vigil)
    vigil.run("wake", "app", "--wait")
    wait_for(lambda: lines(out / "health"), 20, what="a health probe run")
    assert set(lines(out / "ready")) == {app_user.pw_name}
    assert set(lines(out / "health")) == {app_user.pw_name}
    vigil.run("stop", "app", "--wait")
    vigil.check()


@pytest.mark.parametrize("args, says", [
    (("--ready", "http:healthz"), "must start with /"),
    (("--ready", "grpc"), "not http, http:PATH, tcp, exec:CMD or notify"),
    (("--ready", "exec: "), "names no command"),
    (("--health", "notify", "--health-interval", "1"), "not http, http:PATH, tcp or exec:CMD"),
    (("--health", "http:/a b", "--health-interval", "1"), "must start with /"),
    (("--health", "tcp"), "needs a probe interval"),
    (("--kind", "worker", "--health", "tcp", "--health-interval", "1"), "a worker serves none"),
    (("--kind", "worker", "--ready", "tcp"), "a worker serves none"),
])
def test_bad_probes_are_one_line_and_add_nothing(vigil: Vigil, args: tuple[str, ...],
                                                 says: str) -> None:
    cp = vigil.run("host", "add", "p", "--build", str(APP), *args, check=False)
    assert cp.returncode != 0 and says in cp.stderr, cp.stderr
    assert len(cp.stderr.strip().splitlines()) <= 2, cp.stderr
    assert vigil.run("host", "list", "--json").stdout.strip() == "[]"


def test_set_and_hosts_file_take_the_probes(vigil: Vigil, short_tmp: Path) -> None:
    vigil.add_host("app", APP)
    vigil.run("host", "set", "app", "--ready", "tcp", "--health", "http:/healthz",
              "--health-interval", "2")
    info = shown(vigil, "app")
    assert (info["ready"], info["health"], info["health_interval"]) == ("tcp", "http:/healthz", 2.0)
    cp = vigil.run("host", "set", "app", "--health", "http:", check=False)
    assert cp.returncode != 0 and "host set app: --health" in cp.stderr, cp.stderr
    assert shown(vigil, "app")["health"] == "http:/healthz"  # nothing changed
    vigil.run("host", "set", "app", "--unset", "health")
    assert shown(vigil, "app")["health"] == "http"
    f = short_tmp / "hosts.toml"
    f.write_text(f'[hosts.web]\nbuild = "{APP}"\nready = "http:/healthz"\n'
                 f'health = "exec:{sys.executable} -c pass"\nhealth_interval = 3\n')
    vigil.run("apply", str(f))
    info = shown(vigil, "web")
    assert (info["ready"], info["health"]) == ("http:/healthz", f"exec:{sys.executable} -c pass")
    f.write_text(f'[hosts.web]\nbuild = "{APP}"\nhealth = "udp"\nhealth_interval = 3\n')
    cp = vigil.run("apply", str(f), check=False)
    assert cp.returncode != 0 and "hosts.web.health" in cp.stderr, cp.stderr
    assert shown(vigil, "web")["ready"] == "http:/healthz"


@pytest.mark.parametrize("containment", ["auto", "marker"], indirect=True)
def test_a_ready_probe_left_by_a_killed_agent_is_ended_by_the_stop(vigil: Vigil,
                                                                   short_tmp: Path) -> None:
    """A probe command runs in the generation's containment (its cgroup, or its marker), as
    the stop command does: an agent `kill -9`'d while a hung readiness probe runs leaves it
    behind, and the next agent's stop of the host (drain, SIGKILL, proof) ends it too."""
    pids = short_tmp / "pids"
    vigil.run("host", "add", "app", "--build", str(HELLO), "--listen",
              f"tcp:127.0.0.1:{free_port()}", "--health-timeout", "8", "--drain-timeout", "1",
              "--ready", f"exec:echo $$ >> {pids}; sleep 600 & echo $! >> {pids}; wait")
    agent = vigil.start_agent()
    try:
        vigil.wait_ready(agent)
        vigil.run("wake", "app")
        wait_for(lambda: len(lines(pids)) >= 2, 30, what="the probe's shell and its sleep")
        first = [int(p) for p in lines(pids)[:2]]
        agent.kill()
        agent.wait(10)
        assert not any(pid_dead(p) for p in first), "the probe died with its agent"
        before = vigil.ready_count()
        agent = vigil.start_agent()
        vigil.wait_ready_after(agent, before)
        vigil.run("stop", "app", "--wait")
        probes = [int(p) for p in lines(pids)]  # the next agent's try too, if it made one
        wait_for(lambda: all(pid_dead(p) for p in probes), 10, what="every probe process gone")
        vigil.quiesce(15)
        assert vigil.status("app")["state"] == "asleep"
        assert vigil.app_pids() == []
        vigil.check()
        vigil.stop_agent(agent)
    finally:
        for p in (int(x) for x in lines(pids)):  # by pid, had one outlived the stop
            if not pid_dead(p):
                os.kill(p, signal.SIGKILL)
