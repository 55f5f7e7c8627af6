"""The log keeper's client against a real keeper process: a restarted agent takes back
the pipes of many hosts (the bench's 1,000 hosts overflowed one 64 KiB list reply, and the
agent died at start on the truncated JSON)."""

from __future__ import annotations

import os
import resource
import signal
from pathlib import Path

from runners.keepers.logkeeper import keeper_pid
from runners.keepers.logpipes import LogPipes
from tests.conftest import pid_dead, wait_for

HOSTS = 600


def test_a_restarted_agent_takes_back_every_pipe(short_tmp: Path) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 4 * HOSTS + 256)), hard))
    logs = short_tmp / "logs"
    first = again = LogPipes(short_tmp)
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
        close_all(writes, first, again)
        end_keeper(short_tmp)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_the_keeper_holds_more_apps_than_its_limit_holds_files(short_tmp: Path) -> None:
    """A keeper started under a limit of L open files (1,024, or what this process already
    holds) writes for L/2 apps: it holds a pipe an app and the files of the few that wrote
    last (it held the log and its times open for every app, 3 an app: 10,000 sleeping
    workers hit EMFILE at 6,650 under a limit of 20,000). Each app writes twice, the second
    time after all the others, so its files were closed and are opened again at their end."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = max(1024, len(os.listdir("/proc/self/fd")) + 16)  # the suite may hold many
    apps = limit // 2  # 3 an app is 1.5 L; 1 an app and 128 files open is well under L
    pipes = LogPipes(short_tmp)
    writes: list[int] = []
    files = [short_tmp / "logs" / f"h{i:04d}" / "g1.log" for i in range(apps)]
    try:
        for i, f in enumerate(files):
            f.parent.mkdir(parents=True)
            if i == 0:  # the keeper starts at the first pipe, with this limit
                resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
            writes.append(pipes.open(f"{i:08d}", str(f), 1 << 20, 2))
            if i == 0:  # this process holds 2 an app: its own limit back
                resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        pid = keeper_pid(short_tmp)
        with open(f"/proc/{pid}/limits") as lim:
            assert f"Max open files            {limit}" in lim.read()
        for rnd in (b"first", b"second"):
            for i, w in enumerate(writes):
                os.write(w, b"%s %d\n" % (rnd, i))
            wait_for(lambda lines=[b"%s %d\n" % (rnd, i) for i in range(apps)]: all(
                f.read_bytes().endswith(x) for f, x in zip(files, lines, strict=True)),
                20, what=f"the {rnd!r} lines")
        assert all(f.read_bytes() == b"first %d\nsecond %d\n" % (i, i) for i, f in enumerate(files))
        assert pid and len(os.listdir(f"/proc/{pid}/fd")) < apps + 2 * 128 + 32
    finally:
        close_all(writes, pipes)
        end_keeper(short_tmp)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def close_all(writes: list[int], *agents: LogPipes) -> None:
    """The test's write ends and each agent side's copies of the read ends."""
    for w in writes:
        os.close(w)
    for fd in {fd for agent in agents for fd, _ in agent.ends.values()}:
        os.close(fd)


def end_keeper(state_dir: Path) -> None:
    pid = keeper_pid(state_dir)
    if pid and pid > 0:
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: pid_dead(pid), 5, what="the keeper gone")
