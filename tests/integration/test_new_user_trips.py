"""What a new user tripped on (issue 39, item 7), each through the CLI against a real agent
and real processes: a `wake --wait` held by its start order says what it waits on, a
`deploy --wait` that loses its agent names the attempt's last step, `shutdown --wait`
says its listeners were closed and waits on nothing once nothing runs, and `vigil logs` of
a host that wrote nothing says so."""

from __future__ import annotations

import pytest

from tests.conftest import FIXTURES, Vigil

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
