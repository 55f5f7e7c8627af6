"""The exit watcher (runners/agent/exit_watch.py): real processes, real pidfds. An exit is reported
by its generation id as it happens; a leader already gone, or a pid now naming another
process, is reported at once; a generation no longer wanted is no longer watched."""

from __future__ import annotations

import os
import subprocess
import threading
from collections.abc import Iterator

import psutil
import pytest

from runners.agent.exit_watch import ExitWatcher, pidfds_supported
from tests.conftest import wait_for

pytestmark = pytest.mark.skipif(not pidfds_supported(), reason="this kernel has no pidfds")


@pytest.fixture
def sleepers() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:  # every process this test started, by its pid
        if p.poll() is None:
            p.kill()
        p.wait(10)


def start(procs: list[subprocess.Popen[bytes]]) -> tuple[int, float]:
    p = subprocess.Popen(["sleep", "600"])
    procs.append(p)
    return p.pid, psutil.Process(p.pid).create_time()


def test_exits_are_reported_by_generation_and_unwanted_ones_are_dropped(sleepers) -> None:  # type: ignore[no-untyped-def]
    wanted: dict[int, tuple[int, float]] = {1: start(sleepers), 2: start(sleepers), 3: start(sleepers)}
    seen: list[set[int]] = []
    lock = threading.Lock()

    def on_exit(ids: set[int]) -> None:
        with lock:
            seen.append(ids)

    w = ExitWatcher(lambda: dict(wanted), on_exit, settle=0.01)
    w.start()
    try:
        wait_for(lambda: w.watched() == {1, 2, 3}, 10, what="three leaders watched")
        sleepers[1].kill()
        sleepers[1].wait(10)  # reaped: the pidfd still reports the exit
        wait_for(lambda: {2} in seen, 10, what="the exit of g2 reported")
        assert w.watched() == {1, 3}

        # No longer wanted: its fd is closed, and its later exit is nobody's business here.
        del wanted[3]
        w.refresh()
        wait_for(lambda: w.watched() == {1}, 10, what="g3 no longer watched")
        sleepers[2].kill()
        sleepers[2].wait(10)

        # A pid that names another process now (its start time differs), and one that is
        # gone: both reported as exited on the sync that meets them.
        pid, ctime = wanted[1]
        wanted[4] = (pid, ctime - 100.0)
        wanted[5] = (sleepers[1].pid, 0.0)
        w.refresh()
        wait_for(lambda: any(4 in ids for ids in seen) and any(5 in ids for ids in seen), 10,
                 what="the mismatched and the gone leader reported")
        with lock:
            everything = set().union(*seen)
        assert 1 not in everything and 3 not in everything, seen
    finally:
        w.close()


def test_close_after_the_loop_already_saw_stop() -> None:
    """The loop can see stop before close() rings its bell (woken by an exit in between):
    close() must still ring and close cleanly (it raised EBADF: the loop had closed the
    bell, and a reused fd number would have taken the write)."""
    w = ExitWatcher(dict, lambda ids: None, settle=0.01)
    w.start()
    w._bell.stopped.set()  # what close() does first; then the loop wakes for another reason (a
    os.write(w._bell.w, b"x")  # ring from before the stop: refresh() no longer rings after it)
    w._thread.join(5)
    assert not w._thread.is_alive()
    w.close()
