"""`running = true|false` in a hosts file, and `apply --dry-run` showing the whole plan
with every refusal in it (issue 22), through the CLI as typed."""

from __future__ import annotations

import socket
from pathlib import Path

from tests.conftest import FIXTURES, HELLO, Vigil
from tests.integration.test_cli_bad_input import dump

FILE = f"""\
[hosts.web]
build = "{HELLO}"
running = true

[hosts.api]
build = "{HELLO}"

[hosts.jobs]
build = "{FIXTURES / 'worker.py'}"
kind = "worker"
running = true
"""


def test_running_key_wakes_and_stops_hosts_to_it(vigil: Vigil, short_tmp: Path) -> None:
    f = short_tmp / "hosts.toml"
    f.write_text(FILE)
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    dry = vigil.run("apply", "--dry-run", str(f)).stdout
    assert "~ wake web (running = true)" in dry and "~ wake jobs (running = true)" in dry, dry
    assert "wake api" not in dry
    out = vigil.run("apply", str(f)).stdout
    assert "+ add web: instance" in out and "asleep until" not in out.split("+ add api")[0], out
    assert "~ wake web (running = true; wake #" in out, out
    vigil.quiesce()
    assert [vigil.status(h)["state"] for h in ("web", "api", "jobs")] == [
        "awake", "asleep", "awake"]
    again = vigil.run("apply", str(f)).stdout  # already running: nothing to do
    assert "wake" not in again and "= keep web" in again, again

    f.write_text(FILE.replace("running = true", "running = false", 1))
    out = vigil.run("apply", str(f)).stdout
    assert "~ stop web (running = false; stop #" in out, out
    vigil.quiesce()
    assert vigil.status("web")["state"] == "asleep" and vigil.status("jobs")["state"] == "awake"
    vigil.check()


def test_bad_running_value_names_line_and_key(vigil: Vigil, short_tmp: Path) -> None:
    f = short_tmp / "hosts.toml"
    f.write_text(FILE.replace("running = true", 'running = "yes"', 1))
    cp = vigil.run("apply", str(f), check=False)
    assert cp.returncode == 2
    assert f'{f}:3: hosts.web.running: must be true or false, not "yes"' in cp.stderr, cp.stderr


def test_dry_run_lists_every_refusal_of_the_plan(vigil: Vigil, short_tmp: Path) -> None:
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    port = held.getsockname()[1]
    vigil.add_host("old1", HELLO)
    vigil.add_host("old2", HELLO)
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", "old1", "old2", "--wait")  # awake and not in the file: refused
    f = short_tmp / "hosts.toml"
    f.write_text(FILE + f'\n[hosts.edge]\nbuild = "{HELLO}"\nlisten = ["tcp:127.0.0.1:{port}"]\n')
    beats = frozenset({("agents", "heartbeat_at")})  # the running agent's own, not apply's
    before = dump(vigil, beats)
    try:
        cp = vigil.run("apply", "--dry-run", str(f), check=False)
    finally:
        held.close()
    assert cp.returncode == 4, cp.stdout + cp.stderr
    refused = [ln for ln in cp.stdout.splitlines() if ln.startswith("! refused")]
    assert len(refused) == 3, cp.stdout
    assert refused[0].startswith(f"! refused edge: {f}: edge: --listen tcp:127.0.0.1:{port}")
    assert refused[1].startswith("! refused old1: host old1 is not in the file but cannot be removed")
    assert refused[2].startswith("! refused old2: host old2 is not in the file")
    assert "+ add web" in cp.stdout and "~ wake web (running = true)" in cp.stdout
    assert "1 refusal" not in cp.stderr and "3 refusal(s)" in cp.stderr
    assert dump(vigil, beats) == before
