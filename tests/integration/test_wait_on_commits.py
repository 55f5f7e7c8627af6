"""A `--wait` through the agent waits there for the agent's next commit instead of
reading every 50 ms (runners/quick/control.py Commits): each progress answer carries the
count of commits it was read after; with no agent the same request is read from the store."""

from __future__ import annotations

import re
import subprocess

import pytest

from runners.quick import ops
from runners.quick.client import Client
from tests.conftest import HELLO, Vigil


@pytest.fixture
def agent(vigil: Vigil) -> subprocess.Popen[bytes]:
    vigil.add_host("hello")
    p = vigil.start_agent()
    vigil.wait_ready(p)
    return p


def _attempt(vigil: Vigil) -> int:
    out = vigil.run("deploy", "hello", str(HELLO)).stdout
    m = re.search(r"attempt #(\d+)", out)
    assert m, out
    return int(m[1])


def test_progress_waits_for_the_agents_commits(vigil: Vigil, agent: subprocess.Popen[bytes]) -> None:
    vigil.run("wake", "hello", "--wait")
    attempt = _attempt(vigil)
    c = Client.connect(vigil.state_dir, vigil.db_url)
    assert c is not None
    try:
        a = c.call("progress", 20, kind="attempt", id=attempt, changed_after=-1)
        counts = [a["commits"]]
        for _ in range(500):  # a bound: each answer follows a commit or the 1 s wait
            if a["outcome"] is not None:
                break
            a = c.call("progress", 20, kind="attempt", id=attempt, changed_after=counts[-1])
            counts.append(a["commits"])
        assert a["outcome"] == "done", a
        assert counts == sorted(counts) and counts[-1] > counts[0], counts
    finally:
        c.dispose()


def test_deploy_wait_through_the_agent_shows_its_steps(vigil: Vigil,
                                                       agent: subprocess.Popen[bytes]) -> None:
    vigil.run("wake", "hello", "--wait")
    out = vigil.run("deploy", "hello", str(HELLO), "--wait", subprocess=True).stdout
    assert "switched" in out and "done" in out, out


def test_progress_with_no_agent_is_read_from_the_store(vigil: Vigil) -> None:
    vigil.add_host("hello")
    attempt = _attempt(vigil)
    a = ops.run(vigil.store, vigil.state_dir, "progress",
                {"kind": "attempt", "id": attempt, "changed_after": 3})
    assert a["id"] == attempt and "commits" not in a
