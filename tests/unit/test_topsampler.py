"""`vigil top`'s and the page's sampler: CPU % and RSS of a generation without a cgroup are
its leader's and its descendants'. A leader with no children of its own (most apps, and the
`sleep` of a worker) once showed no CPU and no RSS at all: only a leader with descendants was
counted. A pid that is another process now (its start time differs) counts for nothing."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import psutil
import pytest

from runners.cli.topview import Sampler


@pytest.fixture
def lone() -> Iterator[psutil.Process]:
    p = subprocess.Popen(["sleep", "60"])
    try:
        yield psutil.Process(p.pid)
    finally:
        p.kill()
        p.wait(10)


def test_a_leader_without_children_is_sampled(lone: psutil.Process) -> None:
    got = Sampler().sample({"h": {"pid": lone.pid, "create_time": lone.create_time(),
                                  "cgroup": None}})
    assert "h" in got
    cpu, rss = got["h"]
    assert cpu >= 0.0 and rss > 0


def test_a_reused_pid_counts_for_nothing(lone: psutil.Process) -> None:
    got = Sampler().sample({"h": {"pid": lone.pid, "create_time": lone.create_time() - 100,
                                  "cgroup": None}})
    assert got == {}
