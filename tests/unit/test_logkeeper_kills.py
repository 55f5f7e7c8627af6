"""The log keeper killed 20 times by pid (kill -9, at random instants) under an app that
writes numbered lines as fast as its pipe takes them, brought back each time the way the
agent does (LogPipes.ensure: a new keeper, handed every read end): every number is in the
generation's files once and in order, a rotation at the cap cuts at a line end, and while
the keeper is down the app's pipe fills and the app waits in its write (nothing dropped)."""

from __future__ import annotations

import fcntl
import os
import random
import signal
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from runners.keepers.logkeeper import keeper_pid
from runners.keepers.logpipes import LogPipes
from tests.conftest import pid_dead, wait_for

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "numbered.py"
KILLS = 20
PIPE = 1 << 14  # the app's pipe: small, so it fills while the keeper is down
KEY = "00000000-0000-0000-0000-000000000001"


def waiting(fd: int) -> int:
    """Bytes in the pipe, not yet taken by any reader."""
    return int.from_bytes(fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"), sys.byteorder)


def files_oldest_first(log: Path) -> list[Path]:
    rotated = sorted(log.parent.glob(log.name + ".*"), key=lambda p: -int(p.suffix[1:]))
    return [*rotated, log] if log.exists() else rotated


def read_numbers(log: Path) -> list[int]:
    return [int(line.split()[0]) for p in files_oldest_first(log)
            for line in p.read_bytes().splitlines()]


def blocked_in_write(app: int, end: int) -> bool:
    """The app sleeps in a write to its pipe (the kernel's wait channel; where that is
    hidden, "0": the pipe holds something)."""
    try:
        wchan = Path(f"/proc/{app}/wchan").read_text()
    except OSError:
        return False
    if wchan == "0":
        return waiting(end) > 0
    return "pipe_write" in wchan and waiting(end) > 0


def kill_keeper(pipes: LogPipes, state: Path, app: int, end: int,
                rng: random.Random) -> None:
    pid = keeper_pid(state)
    assert pid, "a keeper runs"

    def written() -> int:  # a file rotated away between the listing and its stat counts 0
        sizes = []
        for p in state.glob("logs/h/g1.log*"):
            try:
                sizes.append(p.stat().st_size)
            except FileNotFoundError:
                pass
        return sum(sizes)

    # Measured from now, not from 0: the first look at 0 counted as progress at once, so
    # on a loaded box a new keeper could be killed before it had written a byte, again and
    # again, and no rotation happened between the kills ([rotating] failed by the box's speed).
    log_size = [written()]

    def progressed() -> bool:  # this keeper is taking bytes out of the pipe
        n = written()
        moved = n != log_size[0]
        log_size[0] = n
        return moved

    wait_for(progressed, 20, interval=0.001, what="the keeper writing")
    time.sleep(rng.uniform(0, 0.003))  # a random instant of its draining
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: pid_dead(pid), 10, what=f"keeper {pid} gone")
    # the app goes on writing until its pipe is full, then waits in its write
    wait_for(lambda: blocked_in_write(app, end), 20, interval=0.002,
             what="the app waiting in its write to a full pipe")
    pipes.peer.revive()  # what the agent does: a new keeper, handed every read end
    assert keeper_pid(state) not in (None, pid)


@pytest.mark.parametrize(("cap", "files"), [(1 << 30, 2), (4096, 1000)],
                         ids=["one-file", "rotating"])
def test_keeper_killed_20_times_loses_and_doubles_no_line(short_tmp: Path, cap: int,
                                                          files: int) -> None:
    rng = random.Random(24)
    (short_tmp / "logs" / "h").mkdir(parents=True)
    log = short_tmp / "logs" / "h" / "g1.log"
    pipes = LogPipes(short_tmp)
    w = pipes.open(KEY, str(log), cap, files)
    fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, PIPE)
    app = subprocess.Popen([sys.executable, str(FIXTURE)], stdout=w, stderr=subprocess.PIPE)
    os.close(w)
    end = pipes.ends[KEY][0]  # the agent's copy of the read end: it never reads from it
    try:
        kill_keeper(pipes, short_tmp, app.pid, end, rng)
        files_after_first_kill = len(files_oldest_first(log))
        for _ in range(KILLS - 1):
            kill_keeper(pipes, short_tmp, app.pid, end, rng)
        files_after_last_kill = len(files_oldest_first(log))
        app.send_signal(signal.SIGTERM)
        _, err = app.communicate(timeout=60)
        wrote = int(err)
        wait_for(lambda: waiting(end) == 0 and log.exists()
                 and log.read_bytes().endswith(b"%09d xxxxxx\n" % (wrote - 1)), 60,
                 what="the last line written")
        numbers = read_numbers(log)
        kept = files_oldest_first(log)
        first = numbers[0] if len(kept) >= files else 0  # the cap drops the oldest files
        assert numbers == list(range(first, wrote)), first_difference(numbers, first, wrote)
        for p in kept:  # a rotation cuts at a line end, at the cap
            data = p.read_bytes()
            assert len(data) <= cap and data.endswith(b"\n"), (p.name, len(data))
        if files > 2:  # how many depends on the box's speed; that some did, does not
            assert files_after_last_kill > files_after_first_kill, \
                "rotations happened between the kills"
    finally:
        if app.poll() is None:
            app.kill()
            app.wait()
        pipes.forget(KEY)
        pid = keeper_pid(short_tmp)
        if pid and pid > 0:
            os.kill(pid, signal.SIGKILL)
            wait_for(lambda: pid_dead(pid), 5, what="the keeper gone")


def first_difference(numbers: list[int], first: int, wrote: int) -> str:
    seen: dict[int, int] = {}
    for n in numbers:
        seen[n] = seen.get(n, 0) + 1
    lost = [n for n in range(first, wrote) if n not in seen]
    doubled = [n for n, c in seen.items() if c > 1]
    return (f"{wrote} lines written, {len(numbers)} from {first} in the files: {len(lost)} lost "
            f"(first {lost[:5]}), {len(doubled)} doubled (first {doubled[:5]})")
