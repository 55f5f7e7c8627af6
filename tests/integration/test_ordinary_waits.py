"""An obligation that waits on another one in flight is nothing wrong (issue 22: the agent
logged `result=poked error='the revert: waiting for 1 attempt(s) to end'` at WARNING). Such
a wait is `held`: paced like a poke, logged at INFO; a real fault stays a WARNING."""

from __future__ import annotations

import re

from tests.conftest import FIXTURES, HELLO, Vigil, wait_for


def test_a_rollout_waiting_for_its_attempt_is_logged_at_info(vigil: Vigil) -> None:
    vigil.add_host("web", HELLO, "--health-timeout", "6")
    agent = vigil.start_agent()
    vigil.wait_ready(agent)
    vigil.run("wake", "web", "--wait")
    # never healthy: its attempt is in flight for 6 s, and the rollout waits on it
    vigil.run("rollout", "start", str(FIXTURES / "bad_health.py"), "--host", "web")

    def waits() -> list[str]:
        return [line for line in vigil.agent_log().decode(errors="replace").splitlines()
                if re.search(r"drive kind=rollout .*waiting for \d+ attempt", line)]

    lines = wait_for(waits, 30, what="the rollout's drive waiting for its attempt")
    assert all("result=held" in line and "level=INFO" in line for line in lines), lines
    vigil.stop_agent(agent)
