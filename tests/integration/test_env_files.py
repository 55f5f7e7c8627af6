"""Env files are read at each start (issue 21 item 4): a restart picks up a change, and a
file gone bad keeps the generation from starting with the file and line in `vigil status`;
its values are in no status, event nor agent log line."""

from __future__ import annotations

import json
import signal
from pathlib import Path

from tests.conftest import FIXTURES, Vigil, wait_for


def printed(vigil: Vigil, host: str) -> dict[str, str] | None:
    n = vigil.status(host)["generation"]
    if n is None:
        return None
    try:
        text = (vigil.state_dir / "logs" / host / f"g{n}.log").read_text()
    except FileNotFoundError:
        return None
    return next((dict(json.loads(x)) for x in text.splitlines() if x.startswith("{")), None)


def test_each_start_reads_the_file_again(vigil: Vigil, short_tmp: Path) -> None:
    f = short_tmp / "app.env"
    f.write_text('TOKEN="first value"\nLEVEL=info\n')
    vigil.add_host("w", FIXTURES / "env_printer.py", "--kind", "worker", "--env-file", str(f),
                   "--env", "LEVEL=debug")  # --env wins over the file
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", "w", "--wait")
    assert wait_for(lambda: printed(vigil, "w"), what="its env") == {
        "TOKEN": "first value", "LEVEL": "debug"}
    f.write_text("TOKEN='second value'\n")
    vigil.run("stop", "w", "--wait")
    vigil.run("wake", "w", "--wait")
    assert wait_for(lambda: printed(vigil, "w"), what="its env")["TOKEN"] == "second value"

    f.write_text("TOKEN=ok\nthis line is bad\n")
    vigil.run("stop", "w", "--wait")
    vigil.run("wake", "w", check=False)
    wait_for(lambda: vigil.status("w").get("problem"), 20, what="the failed start in status")
    assert vigil.status("w")["generation"] is None
    problem = vigil.status("w")["problem"]
    assert f"env file {f}:2: the line is not NAME=value" in problem, problem
    assert "this line is bad" not in problem, problem  # its text is never shown
    for out in (json.dumps(vigil.status("w")), vigil.run("events", "w").stdout,
                vigil.agent_log().decode()):
        assert "first value" not in out and "second value" not in out
    f.write_text("TOKEN=fixed\n")  # fixed: the next start goes through
    vigil.run("wake", "w", "--wait")
    assert wait_for(lambda: printed(vigil, "w"), what="its env")["TOKEN"] == "fixed"
    vigil.run("stop", "w", "--wait")
    vigil.stop_agent(agent, signal.SIGTERM)
