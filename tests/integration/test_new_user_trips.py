"""What a new user tripped on (issue 39, item 7), each through the CLI against a real agent
and real processes: a `wake --wait` held by its start order says what it waits on, a
`deploy --wait` that loses its agent names the attempt's last step, `shutdown --wait`
says its listeners were closed and waits on nothing once nothing runs, and `vigil logs` of
a host that wrote nothing says so."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading

import pytest
from sqlalchemy import select

from models.tables import Stop
from tests.conftest import FIXTURES, HELLO, ROOT, Vigil, wait_for
from tests.listening import free_port

pytestmark = pytest.mark.timeout(120)


def test_logs_of_a_host_with_no_output_say_so_in_one_line(vigil: Vigil) -> None:
    vigil.add_host("quiet", FIXTURES / "worker.py", "--kind", "worker")
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", "quiet", "--wait")
    cp = vigil.run("logs", "quiet")
    assert cp.stdout == "", cp.stdout
    assert cp.stderr.splitlines() == [
        f"vigil: no output of quiet yet ({vigil.state_dir / 'logs' / 'quiet'})"], cp.stderr
    assert vigil.run("logs", "quiet", "-n", "0").stderr == ""  # none asked for, none missed
    vigil.run("stop", "quiet", "--wait")
    vigil.quiesce()


class Follow:
    """A `vigil ... --wait` as a real process, its output read line by line as it comes."""

    def __init__(self, v: Vigil, *args: str) -> None:
        self.p = subprocess.Popen([sys.executable, "-m", "runners.cli", *args], cwd=ROOT,
                                  env={**v.env, "PYTHONUNBUFFERED": "1"}, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.lines: list[str] = []
        self.err = ""
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self.lines.append(line.rstrip("\n"))

    def said(self, text: str) -> bool:
        return any(text in line for line in self.lines)

    def end(self, timeout: float = 60) -> tuple[int, str]:
        """Its exit status and stderr, once it has exited (killed, by pid, if it has not)."""
        try:
            self.p.wait(timeout)
        finally:
            if self.p.poll() is None:
                self.p.kill()
                self.p.wait()
        self.reader.join(10)
        assert self.p.stdout is not None and self.p.stderr is not None
        if not self.p.stderr.closed:
            self.err = self.p.stderr.read()
            self.p.stderr.close()
            self.p.stdout.close()
        return self.p.returncode, self.err


def test_wake_wait_says_at_once_what_its_start_order_waits_on(vigil: Vigil) -> None:
    vigil.add_host("db")
    vigil.add_host("app", HELLO, "--after", "db")
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    follow = Follow(vigil, "wake", "app", "--wait")
    try:
        # Before: silent until the timeout (300 s) or until db was up.
        wait_for(lambda: follow.said("app waits on db"), 20, what="the wait says what it waits on")
        assert follow.p.poll() is None and vigil.status("app")["state"] == "waiting"
        vigil.run("wake", "db", "--wait")
        code, err = follow.end()
    finally:
        follow.end()
    assert code == 0, err
    said = [ln.split("s  ", 1)[-1] for ln in follow.lines]
    assert said[0] == "app waits on db (its start order: each awake and ready)", follow.lines
    assert said[1].startswith("app waits no more: "), follow.lines
    assert said[-1].startswith("host app awake: generation g"), follow.lines
    assert len([s for s in said if "waits on" in s]) == 1, "said once, not at every look"
    vigil.run("stop", "app", "db", "--wait")
    vigil.quiesce()


def test_deploy_wait_that_loses_its_agent_names_the_attempts_last_step(vigil: Vigil) -> None:
    vigil.add_host("web", HELLO, "--health-timeout", "60")
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", "web", "--wait")
    follow = Follow(vigil, "deploy", "web", str(FIXTURES / "no_socket.py"), "--wait")
    try:  # the successor never listens: the attempt stays at `spawned` for its health timeout
        wait_for(lambda: follow.said("spawned"), 30, what="the successor spawned")
        agent.kill()
        agent.wait(10)
        code, err = follow.end()
    finally:
        follow.end()
    assert code == 1 and len(err.splitlines()) == 1, err
    assert "attempt #1 of web was at step spawned when its agent went" in err, err
    assert "stays queued" not in err, err  # before: said of an attempt past its spawn
    assert follow.lines[-1].endswith("spawned"), follow.lines
    vigil.run("host", "set", "web", "--health-timeout", "2")
    before = vigil.ready_count()
    vigil.wait_ready_after(vigil.start_agent(), before)
    vigil.quiesce(60)
    vigil.check()


def test_shutdown_with_nothing_running_closes_its_listeners_and_waits_on_no_idle_keeper(
        vigil: Vigil) -> None:
    port = free_port()
    vigil.add_host("front", HELLO, "--listen", f"tcp:127.0.0.1:{port}")
    vigil.add_host("spare", HELLO)  # never woken: nothing of it to stop
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", "front", "--wait")
    vigil.run("stop", "front", "--wait")
    stops = len(vigil.store.read(lambda s: s.execute(select(Stop.id)).all()))

    cp = vigil.run("shutdown", "--wait")
    agent.wait(10)
    assert cp.stdout.splitlines()[-1] == f"nothing of vigil runs on {vigil.state_dir}"
    assert not [ln for ln in cp.stdout.splitlines() if ln.startswith("host ")], cp.stdout
    # Before: a stop of each asleep host, each a round trip through the agent.
    assert len(vigil.store.read(lambda s: s.execute(select(Stop.id)).all())) == stops
    # Before: --wait waited out the keepers' idle time (IDLE, 5 s) after their last request.
    for keeper in ("fdholder", "logkeeper"):
        log = (vigil.state_dir / "logs" / f"{keeper}.log").read_text()
        assert "nothing held, asked to leave: exiting" in log, log[-2000:]
    # Closed on purpose: said so, not `(lost)`, and no listener_lost to notify of.
    text = vigil.run("status", env={"COLUMNS": "200"}).stdout
    assert f"tcp:127.0.0.1:{port} (closed)" in text and "(lost)" not in text, text
    (listener,) = vigil.status("front")["listeners"]
    assert listener["closed"] and "was closed by `vigil shutdown`" in listener["note"], listener
    kinds = [e["kind"] for e in vigil.json("events", "front")]
    assert "listener_closed" in kinds and "listener_lost" not in kinds, kinds


def test_status_at_80_columns_cuts_no_state_word_nor_an_agent_phrase(vigil: Vigil) -> None:
    web = "a-rather-long-host-name-for-the-payments-api-eu1"  # the table must narrow
    vigil.add_host(web, HELLO, "--health-timeout", "60")
    vigil.add_host("flaky-batch-worker", FIXTURES / "exit_fast.py", "--kind", "worker")
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", web, "--wait")
    vigil.run("wake", "flaky-batch-worker")
    follow = Follow(vigil, "deploy", web, str(FIXTURES / "no_socket.py"), "--wait")
    try:  # deploying for its health timeout: the successor never listens
        wait_for(lambda: vigil.status(web)["state"] == "deploying", 30, what="deploying")
        wait_for(lambda: vigil.status("flaky-batch-worker")["state"] == "crashloop", 60,
                 what="a crash loop")
        text = vigil.run("status", env={"COLUMNS": "80"}).stdout
    finally:
        follow.p.kill()  # by pid: the attempt goes on in the agent
        follow.end()
    lines = text.splitlines()
    assert all(len(line) <= 80 for line in lines), text
    rows = {line.split()[0][:5]: line.split() for line in lines if line[:5] in (web[:5], "flaky")}
    assert "deploying" in rows[web[:5]] and "crashloop" in rows["flaky"], text  # whole words
    head = lines[:[line.startswith("host ") for line in lines].index(True)]
    assert head[0].startswith("agent: running on ") and all(
        line.startswith("  ") for line in head[1:]), text
    # A line breaks only after a phrase's comma (before: `..., last` / `round 0s ago, ...`).
    assert all(line.endswith(",") for line in head[:-1]), text
    assert head[-1].endswith(("obligation", "obligations")), text
    assert re.search(r"last round \S+ ago,", " ".join(head)), text
    vigil.run("stop", web, "flaky-batch-worker", "--wait", timeout=180)


@pytest.mark.parametrize("change", [("--ready", "tcp"), ("--stop-signal", "QUIT"),
                                    ("--restart-cap", "10"), ("--socket-group", "root"),
                                    ("--drain-timeout", "5"), ("--on-store-loss", "keep")])
def test_host_show_and_set_dry_run_agree_on_defaults(vigil: Vigil, change: tuple[str, str]) -> None:
    """Before: `host show` said `ready: http` and `host set --ready tcp --dry-run` said
    `ready unset -> "tcp"` of the same host."""
    vigil.add_host("web")  # ready and health NULL: `host show` says what they stand for
    shown = vigil.json("host", "show", "web")
    line = vigil.run("host", "set", "web", *change, "--dry-run").stdout.strip()
    m = re.fullmatch(r"~ update web: (\w+) (.+) -> (.+) \(dry run: nothing changed\)", line)
    assert m, line
    column, was = m[1], m[2]
    assert column in shown, (column, shown)
    expected = "unset" if shown[column] is None else json.dumps(shown[column])
    assert was in (expected, f"{expected} (default)"), (line, shown[column])
    assert vigil.json("host", "show", "web") == shown  # nothing written
