"""The operator's first hour: the quick CLI through the agent's control socket (and the
same commands with no agent), `vigil agent start|stop|status` as real processes, --wait
with no agent failing fast, `vigil logs` with each generation's lines named and a chatty
app's output capped, and --help/--version without SQLAlchemy."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from sqlalchemy import select

from models.tables import Attempt, Stop, Wake
from runners.base.doorbell import running_agent_pid
from runners.keepers.logkeeper import keeper_pid
from runners.quick.client import CONTROL, Client
from tests.conftest import FIXTURES, HELLO, ROOT, Vigil, pid_dead, wait_for
from workflows.base import paths

CHATTY = FIXTURES / "chatty.py"
TICKER = FIXTURES / "ticker.py"


def imported(v: Vigil, *args: str) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """Run `vigil ARGS` as a real process under -X importtime: its result and every module
    it imported."""
    cp = subprocess.run([sys.executable, "-X", "importtime", "-m", "runners.cli", *args],
                        capture_output=True, text=True, env=v.env, cwd=ROOT, timeout=60)
    mods = {line.split("|")[-1].strip() for line in cp.stderr.splitlines()
            if line.startswith("import time:")}
    cp.stderr = "\n".join(line for line in cp.stderr.splitlines()
                          if not line.startswith("import time:"))
    return cp, mods


def heavy(mods: set[str]) -> set[str]:
    return {m for m in mods if m.split(".")[0] == "sqlalchemy" or m.startswith(
        ("models.tables", "models.store", "workflows.config.hosts", "runners.quick.ops"))}


def stop_started_agent(v: Vigil) -> None:
    """End an agent that `vigil agent start` detached (not one of the harness's Popens)."""
    pid = running_agent_pid(v.state_dir)
    if pid and pid > 0:
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: running_agent_pid(v.state_dir) is None, 20, what="agent gone")


def test_control_socket_answers_the_quick_commands(vigil: Vigil) -> None:
    vigil.add_host("hello")
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    sock = vigil.state_dir / CONTROL
    assert CONTROL == paths.CONTROL
    assert stat.S_ISSOCK(sock.stat().st_mode) and stat.S_IMODE(sock.stat().st_mode) == 0o600

    c = Client.connect(vigil.state_dir, vigil.db_url)
    assert c is not None
    try:
        me = c.call("hello")
        assert me["pid"] == agent.pid and me["ready"] is True
    finally:
        c.dispose()

    # Real processes, through the socket: none of them imports SQLAlchemy or the models.
    cp, mods = imported(vigil, "wake", "hello", "--wait")
    assert cp.returncode == 0 and "host hello awake: generation g" in cp.stdout, cp.stderr
    assert not heavy(mods), heavy(mods)
    cp, mods = imported(vigil, "status")
    assert cp.returncode == 0 and f"agent: running on {vigil.state_dir}, pid {agent.pid}" in cp.stdout
    assert "awake" in cp.stdout and not heavy(mods), heavy(mods)
    cp, mods = imported(vigil, "deploy", "hello", str(HELLO), "--wait")
    assert cp.returncode == 0 and "switched" in cp.stdout and "attempt #1 done" in cp.stdout, cp.stdout + cp.stderr
    assert not heavy(mods), heavy(mods)
    cp, mods = imported(vigil, "obligations", "--json")
    assert cp.returncode == 0 and json.loads(cp.stdout) == [] and not heavy(mods)
    # The agent wrote the same rows the direct path writes.
    (a,) = vigil.store.read(lambda s: list(s.execute(select(Attempt)).scalars()))
    assert a.cause.value == "release" and a.outcome.value == "done"
    # Refusals come back as the same one line and exit code.
    cp, mods = imported(vigil, "wake", "nope")
    assert cp.returncode == 3 and cp.stderr.strip() == \
        "vigil: error: no host named 'nope'; see `vigil host list`, or add it with `vigil host add`"
    cp, _ = imported(vigil, "deploy", "hello", "missing/build")
    assert cp.returncode == 2 and "build missing/build does not exist" in cp.stderr
    cp, mods = imported(vigil, "stop", "hello", "--wait")
    assert cp.returncode == 0 and "host hello stopped" in cp.stdout and not heavy(mods)
    assert vigil.status("hello")["state"] == "asleep"
    vigil.check()


def test_the_same_commands_with_no_agent(vigil: Vigil) -> None:
    vigil.add_host("hello")
    assert not (vigil.state_dir / CONTROL).exists()
    assert "agent: not running on" in vigil.run("status").stdout
    assert "wake #1 of hello queued" in vigil.run("wake", "hello").stdout
    assert "stop #1 of hello queued" in vigil.run("stop", "hello").stdout
    assert "attempt #1 of hello queued" in vigil.run("deploy", "hello", str(HELLO)).stdout
    assert [o["kind"] for o in vigil.json("obligations")] == ["stop", "attempt"]
    assert vigil.store.read(lambda s: s.execute(select(Wake.state)).scalar()).value == "cancelled"
    assert vigil.store.read(lambda s: s.execute(select(Stop.state)).scalar()).value == "queued"
    # Open obligations with no agent to act on them: `check` says so.
    cp = vigil.run("check", check=False)
    assert cp.returncode == 1 and "agent_alive: 2 obligation(s) are open and no agent runs" in cp.stdout
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.quiesce()
    vigil.check()


@pytest.mark.parametrize("command", [("wake", "hello", "--wait"), ("stop", "hello", "--wait"),
                                     ("deploy", "hello", str(HELLO), "--wait")])
def test_wait_with_no_agent_fails_fast_with_one_line(vigil: Vigil, command: tuple[str, ...]) -> None:
    vigil.add_host("hello")
    started = time.monotonic()
    cp = vigil.run(*command, check=False)
    took = time.monotonic() - started
    assert cp.returncode == 1, cp.stdout + cp.stderr
    assert len(cp.stderr.splitlines()) == 1, cp.stderr
    assert f"no agent is running on {vigil.state_dir}" in cp.stderr and "vigil agent start" in cp.stderr
    assert took < 8, took  # 2 s without an agent, plus a loaded box's slack
    assert vigil.obligations(), "the intent is kept for the next agent"


def test_agent_start_status_stop_as_real_processes(vigil: Vigil) -> None:
    vigil.add_host("hello")
    try:
        cp = vigil.run("agent", "status", check=False)
        assert cp.returncode == 3 and "agent: not running" in cp.stdout
        cp = vigil.run("agent", "start", "--safety-interval", "1")
        pid = running_agent_pid(vigil.state_dir)
        assert pid and f"agent started on {vigil.state_dir} (pid {pid})" in cp.stdout
        assert "logger=vigil.agent ready" in (vigil.state_dir / "agent.log").read_text()
        assert "already running" in vigil.run("agent", "start").stdout
        vigil.run("wake", "hello", "--wait")
        app = vigil.status("hello")["pid"]

        info = json.loads(vigil.run("agent", "status", "--json").stdout)
        assert info["running"] and info["pid"] == pid and info["ready"]
        assert info["box"] == (vigil.state_dir / "agent-id").read_text().strip()
        assert info["version"] and info["up_since"] and info["last_round"]
        assert info["open_obligations"] == 0
        text = vigil.run("agent", "status").stdout
        assert f"pid:              {pid}" in text and "last round:" in text

        cp = vigil.run("agent", "stop", "--wait")
        assert f"agent pid {pid} stopped (apps keep running)" in cp.stdout
        assert running_agent_pid(vigil.state_dir) is None and pid_dead(pid)
        assert not pid_dead(app), "the app keeps running"
        assert "no agent is running" in vigil.run("agent", "stop").stdout

        cp = vigil.run("agent", "start")  # the next agent adopts the app
        wait_for(lambda: vigil.status("hello")["state"] == "awake", 20, what="adopted")
        assert vigil.status("hello")["pid"] == app
        vigil.run("stop", "hello", "--wait")
        vigil.check()
    finally:
        stop_started_agent(vigil)


def test_agent_start_says_why_the_agent_did_not_start(vigil: Vigil) -> None:
    cp = vigil.run("agent", "start", "--metrics-listen", "127.0.0.1:99999", check=False)
    assert cp.returncode == 1 and len(cp.stderr.splitlines()) == 1, cp.stderr
    assert "the agent exited (2) before it was ready: --metrics-listen" in cp.stderr
    assert "agent.log" in cp.stderr and running_agent_pid(vigil.state_dir) is None


def test_help_and_version_import_no_sqlalchemy(vigil: Vigil) -> None:
    cp, mods = imported(vigil, "--help")
    assert cp.returncode == 0 and "agent" in cp.stdout and "logs" in cp.stdout
    assert not heavy(mods) and "DESIGN" not in cp.stdout, heavy(mods)
    cp, mods = imported(vigil, "--version")
    assert cp.returncode == 0 and cp.stdout.startswith("vigil ") and not heavy(mods)
    for sub in ("wake", "deploy", "agent", "check", "logs"):
        cp, mods = imported(vigil, sub, "--help")
        assert cp.returncode == 0 and not heavy(mods) and "DESIGN" not in cp.stdout, (sub, heavy(mods))


def test_state_dir_default_is_the_nearest_dot_vigil(short_tmp: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("VIGIL_HOME", "VIGIL_DB")}
    top = short_tmp / "proj"
    (top / "sub" / "deeper").mkdir(parents=True)

    def vigil(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "runners.cli", *args], capture_output=True,
                              text=True, env={**env, "PYTHONPATH": str(ROOT)}, cwd=cwd, timeout=60)

    cp = vigil("status", cwd=top / "sub")
    assert cp.returncode == 5 and f"no vigil state directory at {top / 'sub' / '.vigil'}" in cp.stderr
    assert "the default state dir: the nearest .vigil" in cp.stderr
    assert vigil("db", "upgrade", cwd=top).returncode == 0
    cp = vigil("status", cwd=top / "sub" / "deeper")
    assert cp.returncode == 0 and f"agent: not running on {top / '.vigil'}" in cp.stdout, cp.stderr


def test_logs_name_each_generation(vigil: Vigil) -> None:
    vigil.add_host("job", CHATTY, "--kind", "worker", "--env", "CHATTY_BYTES=0")
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", "job", "--wait")
    first = vigil.status("job")["generation"]
    wait_for(lambda: "done" in vigil.run("logs", "job").stdout, 20, what="first output")
    follow = subprocess.Popen([sys.executable, "-m", "runners.cli", "logs", "job", "-f", "-n", "0"],
                              env=vigil.env, cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    first_log = str(vigil.state_dir / "logs" / "job" / f"g{first}.log")

    def following() -> bool:  # it has opened the first generation's file: it is following
        return any(f.path == first_log for f in psutil.Process(follow.pid).open_files())

    try:
        wait_for(following, 60, what="logs --follow started")
        vigil.run("deploy", "job", str(CHATTY), "--wait")
        second = vigil.status("job")["generation"]
        assert second != first
        wait_for(lambda: f"g{second} | done" in vigil.run("logs", "job").stdout, 20,
                 what="second generation's output")
        out = vigil.run("logs", "job").stdout.splitlines()
        assert out == [f"g{first} | done", f"g{second} | done"], out
        assert vigil.run("logs", "job", "--generation", str(first)).stdout.splitlines() == \
            [f"g{first} | done"]
        assert vigil.run("logs", "job", "-n", "1").stdout.splitlines() == [f"g{second} | done"]
        assert (vigil.state_dir / "logs" / "job" / f"g{second}.log").stat().st_mode & 0o077 == 0
        refused = vigil.run("logs", "nope", check=False)
        assert refused.returncode == 3 and "no host named 'nope'" in refused.stderr
        refused = vigil.run("logs", "job", "--generation", "9999", check=False)
        assert refused.returncode == 3 and "no output of generation 9999" in refused.stderr
    finally:
        follow.send_signal(signal.SIGTERM)
        got, err = follow.communicate(timeout=20)
    assert f"g{second} | done" in got.splitlines(), got + err  # it picked up the new generation
    assert f"g{first} | done" not in got.splitlines(), got  # -n 0: nothing old


def test_a_chatty_app_cannot_fill_the_disk(vigil: Vigil) -> None:
    """1 GiB written as fast as the app can: the files stay within --log-files of
    --log-max-bytes, at every moment, and the newest lines are kept."""
    cap, files = 1 << 20, 3
    vigil.add_host("chat", CHATTY, "--kind", "worker")
    agent = vigil.start_agent(None, "--log-max-bytes", "1M", "--log-files", str(files))
    vigil.wait_ready(agent)
    vigil.run("wake", "chat", "--wait")
    logs = vigil.state_dir / "logs" / "chat"
    biggest = [0]

    def used() -> int:  # the output's files (each one's times are beside the cap)
        total = 0
        for p in logs.glob("g*.log*"):
            try:
                total += p.stat().st_size
            except FileNotFoundError:  # rotated away between the listing and the stat
                pass
        biggest[0] = max(biggest[0], total)
        return total

    def done() -> bool:
        used()
        return vigil.run("logs", "chat", "-n", "1").stdout.strip().endswith("| done")

    wait_for(done, 240, interval=0.02, what="1 GiB written")
    assert biggest[0] <= files * cap, biggest[0]
    assert len(list(logs.glob("g*.log*"))) <= files
    times = sum(p.stat().st_size for p in logs.glob("g*.times*"))
    assert times <= files * cap // 100, times  # 1 GiB in seconds: a record per 10 ms
    assert keeper_pid(vigil.state_dir), "the log keeper runs as long as the app"
    last = vigil.run("logs", "chat", "-n", "2").stdout.splitlines()
    assert last[0].startswith(f"g{vigil.status('chat')['generation']} | 000001023 "), last
    vigil.run("stop", "chat", "--wait")
    vigil.check()


def test_output_outlives_the_agent_and_the_keeper_one_at_a_time(vigil: Vigil) -> None:
    """One keeper for the box, whatever the number of hosts; the app's lines keep coming
    through a kill -9 of the agent, then of the keeper (started again by the restarted
    agent, which took the pipes back from the first keeper), and no line is torn."""
    vigil.add_host("tick", TICKER, "--kind", "worker")
    vigil.add_host("other", TICKER, "--kind", "worker")
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", "tick", "--wait")
    gen = vigil.status("tick")["generation"]
    log = vigil.state_dir / "logs" / "tick" / f"g{gen}.log"

    def lines() -> int:
        return len(log.read_bytes().splitlines()) if log.exists() else 0

    def grows() -> None:
        n = lines()
        wait_for(lambda: lines() > n + 3, 20, what=f"new lines in {log.name} (has {n})")

    grows()
    first = keeper_pid(vigil.state_dir)
    assert first and vigil.stop_agent(agent, signal.SIGKILL) == -signal.SIGKILL
    grows()  # the keeper writes on with no agent
    before = vigil.ready_count()
    agent = vigil.start_agent()
    vigil.wait_ready_after(agent, before)
    os.kill(first, signal.SIGKILL)
    wait_for(lambda: pid_dead(first), 10, what="the first keeper gone")
    vigil.run("wake", "other", "--wait")  # a spawn meets no keeper: starts one, gives it all
    second = keeper_pid(vigil.state_dir)
    assert second and second != first
    grows()  # the first app's pipe was handed to the new keeper: its lines go on
    assert lines() > 0 and all(b.startswith(b"tick ") for b in log.read_bytes().splitlines())
    vigil.run("stop", "tick", "--wait")
    vigil.run("stop", "other", "--wait")
    vigil.check()


def test_top_level_help_is_click_s_without_importing_click() -> None:
    """`vigil --help` (the console script, runners/entry.py) prints the stored copy of the
    group's help: equal to what click renders, and no click imported to print it."""
    from runners.help_text import HELP, rendered

    assert HELP == rendered(), "run `python -m runners.help_text --write` after changing the CLI"
    probe = ("import sys; sys.argv = ['vigil', '--help']\n"
             "from runners.entry import main; main()\n"
             "assert 'click' not in sys.modules, 'click was imported'\n")
    cp = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT,
                        timeout=60)
    assert cp.returncode == 0, cp.stderr
    assert cp.stdout == HELP
