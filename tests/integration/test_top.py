"""`vigil top`: driven in a real terminal (tmux, 80x24), its screen read back with
capture-pane (host rows, states, the scroll line, the agent's footer, the last events), scrolled
with PgDn and ended with `q`; and without a terminal, the one plain table it prints."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import ROOT, Vigil, pid_dead, wait_for

FILLER = [f"zz-{i:02d}" for i in range(30)]  # more hosts than an 80x24 screen shows


class Tmux:
    """A tmux server of the test's own (its own socket), ended by the test."""

    def __init__(self, where: Path) -> None:
        self.socket = str(where / "tmux.sock")

    def __call__(self, *args: str) -> str:
        return subprocess.run(["tmux", "-S", self.socket, *args], capture_output=True,
                              text=True, check=True, timeout=20).stdout

    def alive(self) -> bool:
        return subprocess.run(["tmux", "-S", self.socket, "has-session", "-t", "top"],
                              capture_output=True, timeout=20).returncode == 0

    def screen(self) -> str:
        return self("capture-pane", "-p", "-t", "top")

    def end(self) -> None:
        subprocess.run(["tmux", "-S", self.socket, "kill-server"], capture_output=True, timeout=20)


@pytest.fixture
def tmux(short_tmp: Path) -> Iterator[Tmux]:
    if shutil.which("tmux") is None:
        pytest.fail("tmux is not installed (.ci/run installs Debian's tmux)")
    t = Tmux(short_tmp)
    try:
        yield t
    finally:
        t.end()


def test_top_in_a_terminal_shows_hosts_scrolls_and_quits_on_q(vigil: Vigil, tmux: Tmux,
                                                               short_tmp: Path) -> None:
    vigil.add_host("web1")
    vigil.add_host("web2")
    for name in FILLER:
        vigil.add_host(name)
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", "web1", "--wait")
    pid = vigil.status("web1")["pid"]

    rc = short_tmp / "top.rc"
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in vigil.env.items()
                   if k.startswith(("VIGIL_", "PATH", "HOME", "PYTHON")))
    command = (f"cd {shlex.quote(str(ROOT))} && env {env} {shlex.quote(sys.executable)} "
               f"-m runners.cli top; echo $? > {shlex.quote(str(rc))}")
    tmux("new-session", "-d", "-s", "top", "-x", "80", "-y", "24", "sh", "-c", command)
    top_pid = int(tmux("display-message", "-p", "-t", "top", "#{pane_pid}"))

    def shown(*words: str) -> str | None:
        screen = tmux.screen()
        return screen if all(w in screen for w in words) else None

    screen = wait_for(lambda: shown("web1", "awake", f"{pid}", "agent: running"), 30,
                      what="top's first screen")
    lines = screen.splitlines()
    assert len(lines) <= 24 and all(len(line) <= 80 for line in lines), screen
    row = next(line for line in lines if line.startswith("web1 "))
    assert "awake" in row and "g" in row and "M" in row, row  # generation, RSS of it
    assert any(line.startswith("web2 ") and "asleep" in line for line in lines), screen
    assert "hosts 1-" in screen and "of 32" in screen and "more" in screen, screen
    footer = next(line for line in lines if line.startswith("agent: running"))
    assert "not halted" in footer and f"pid {agent.pid}" in footer, footer
    assert "woke" in screen  # the last events, under the agent's line

    tmux("send-keys", "-t", "top", "NPage")  # PgDn: the last page, web1 scrolled away
    def last_page() -> str | None:
        screen = tmux.screen()
        rows = [line.split()[0] for line in screen.splitlines() if line.startswith(("web", "zz-"))]
        return screen if rows and rows[-1] == "zz-29" and "web1" not in rows else None

    screen = wait_for(last_page, 20, what="the last page after PgDn")
    assert "hosts 16-32 of 32  (" in screen, screen  # no "more" left

    tmux("send-keys", "-t", "top", "q")
    wait_for(lambda: rc.exists() and not tmux.alive(), 20, what="top ended by q")
    assert rc.read_text().strip() == "0"
    assert pid_dead(top_pid)
    vigil.run("stop", "web1", "--wait")


def test_top_without_a_terminal_prints_one_plain_table(vigil: Vigil) -> None:
    vigil.add_host("web1")
    vigil.add_host("web2")
    vigil.run("wake", "web2")  # no agent: the wake stays an open obligation
    cp = subprocess.run([sys.executable, "-m", "runners.cli", "top"], capture_output=True,
                        text=True, env=vigil.env, cwd=ROOT, timeout=60, stdin=subprocess.DEVNULL)
    assert cp.returncode == 0, cp.stderr
    lines = cp.stdout.splitlines()
    assert lines[0].startswith("agent: not running (1 open obligation"), lines
    assert lines[1].split() == ["host", "state", "gen", "pid", "up", "restarts", "health",
                                "cpu%", "rss", "obligations", "deploy"]
    rows = {line.split()[0]: line.split() for line in lines[2:]}
    assert set(rows) == {"web1", "web2"} and len(lines) == 4, cp.stdout
    assert rows["web1"][1:] == ["asleep", "0", "-"]
    assert rows["web2"][1:5] == ["waking", "0", "-", "wake"], rows["web2"]  # then its age
    assert "\x1b[" not in cp.stdout  # no terminal codes


def test_plain_table_counts_restarts_by_cause(vigil: Vigil) -> None:
    """A crash restart and an operator's restart are counted apart."""
    from sqlalchemy import update

    from models.tables import Wake

    vigil.add_host("web1")
    vigil.run("wake", "web1")
    vigil.store.write(lambda s: s.execute(update(Wake).values(cause="restart")))
    cp = vigil.run("top")
    row = next(line for line in cp.stdout.splitlines() if line.startswith("web1 "))
    assert "crash=1" in row, cp.stdout


def test_a_host_of_instances_has_a_line_for_each_slot(vigil: Vigil) -> None:
    """Under the host's line (its CPU and memory summed over every slot), one line a slot,
    each with its own pid and memory."""
    from tests.integration.test_instances import add_instances, slots_up
    from tests.listening import free_port

    add_instances(vigil, free_port(), 2)
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", "web")
    slots = slots_up(vigil, "web", 2)
    rows = {line.split()[0]: line.split() for line in vigil.run("top").stdout.splitlines()[2:]}
    assert set(rows) == {"web", "web/0", "web/1"}, rows
    for sl in slots:
        row = rows[f"web/{sl['slot']}"]
        assert row[1:4] == ["up", f"g{sl['generation']}", str(sl["pid"])], row
        assert row[-1].endswith("M") and float(row[-1][:-1]) > 0, row  # its own RSS
    mb = {k: float(rows[k][-1][:-1]) for k in rows}
    assert abs(mb["web"] - mb["web/0"] - mb["web/1"]) < 0.2, rows  # the host sums its slots
    vigil.run("stop", "web", "--wait")


def test_top_keys_restart_stop_and_wake_the_selected_host_after_a_yes(
        vigil: Vigil, tmux: Tmux, short_tmp: Path) -> None:
    from sqlalchemy import func, select

    from models.tables import Attempt

    vigil.add_host("web1")
    vigil.add_host("web2")
    vigil.wait_ready(vigil.start_agent())
    vigil.run("wake", "web1", "--wait")
    first = vigil.status("web1")["generation"]
    rc = short_tmp / "top.rc"
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in vigil.env.items()
                   if k.startswith(("VIGIL_", "PATH", "HOME", "PYTHON")))
    tmux("new-session", "-d", "-s", "top", "-x", "80", "-y", "24", "sh", "-c",
         f"cd {shlex.quote(str(ROOT))} && env {env} {shlex.quote(sys.executable)} "
         f"-m runners.cli top; echo $? > {shlex.quote(str(rc))}")

    def line(*words: str) -> str:
        def found() -> str | None:
            return next((ln for ln in tmux.screen().splitlines()
                         if all(w in ln for w in words)), None)
        return str(wait_for(found, 30, what=" ".join(words)))

    def attempts() -> int:
        return int(vigil.store.read(lambda s: s.execute(
            select(func.count()).select_from(Attempt)).scalar_one()))

    line("web1", "awake")
    before = attempts()
    tmux("send-keys", "-t", "top", "r")  # web1, the first host, is selected
    line("restart web1? y: yes, any other key: no")
    tmux("send-keys", "-t", "top", "n")
    line("restart of web1: not done")
    assert attempts() == before

    tmux("send-keys", "-t", "top", "r")
    line("restart web1?")
    tmux("send-keys", "-t", "top", "y")
    queued = line("restart of web1: attempt #", "queued")
    attempt = int(queued.split("#")[1].split()[0])
    wait_for(lambda: vigil.store.read(lambda s: s.get(Attempt, attempt).outcome), 60,
             what="top's restart")
    assert vigil.status("web1")["generation"] != first

    tmux("send-keys", "-t", "top", "Down")  # web2 selected
    for verb, kind, state in (("wake", "wake", "awake"), ("stop", "stop", "asleep")):
        tmux("send-keys", "-t", "top", verb[0])
        line(f"{verb} web2? y: yes")
        tmux("send-keys", "-t", "top", "y")
        line(f"{verb} of web2: {kind} #", "queued")
        wait_for(lambda s=state: vigil.status("web2")["state"] == s, 30, what=f"web2 {state}")
    assert vigil.status("web1")["state"] == "awake"

    tmux("send-keys", "-t", "top", "q")
    wait_for(lambda: rc.exists() and not tmux.alive(), 20, what="top ended by q")
    assert rc.read_text().strip() == "0"
    vigil.run("stop", "web1", "--wait")
