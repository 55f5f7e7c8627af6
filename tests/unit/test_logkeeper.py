"""The log keeper's client against a real keeper process: a restarted agent takes back
the pipes of many hosts (the bench's 1,000 hosts overflowed one 64 KiB list reply, and the
agent died at start on the truncated JSON)."""

from __future__ import annotations

import os
import resource
import signal
from pathlib import Path

import pytest

from runners.keepers.logkeeper import LogPipes, keeper_pid
from tests.conftest import pid_dead, wait_for

pytestmark = pytest.mark.no_db
HOSTS = 600


def test_a_restarted_agent_takes_back_every_pipe(short_tmp: Path) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 4 * HOSTS + 256)), hard))
    logs = short_tmp / "logs"
    first = LogPipes(short_tmp)
    writes = []
    try:
        for i in range(HOSTS):  # long host names: each list entry is ~150 bytes
            d = logs / f"h{i:04d}-{'x' * 50}"
            d.mkdir(parents=True)
            writes.append(first.open(f"{i:08d}-{'k' * 27}", str(d / "g1.log"), 1 << 20, 2))
        again = LogPipes(short_tmp)  # the restarted agent
        assert again.adopt() == HOSTS
        os.write(writes[-1], b"still read\n")
        last = logs / f"h{HOSTS - 1:04d}-{'x' * 50}" / "g1.log"
        wait_for(lambda: last.read_bytes() == b"still read\n", 10, what="the line written")
    finally:
        for w in writes:
            os.close(w)
        pid = keeper_pid(short_tmp)
        if pid and pid > 0:
            os.kill(pid, signal.SIGKILL)
            wait_for(lambda: pid_dead(pid), 5, what="the keeper gone")
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
