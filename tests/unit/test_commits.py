"""control.Commits: a progress poll's wait for the agent's next write commit."""

from __future__ import annotations

import threading

from runners.quick.control import Commits


def test_a_count_already_past_is_answered_at_once() -> None:
    c = Commits()
    c.committed(False)
    assert c.wait_past(-1, 30.0) == 1
    assert c.wait_past(0, 30.0) == 1


def test_reads_do_not_count_and_the_wait_is_bounded() -> None:
    c = Commits()
    c.committed(True)
    assert c.wait_past(0, 0.01) == 0


def test_a_commit_on_another_thread_ends_the_wait() -> None:
    c = Commits()
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(c.wait_past(0, 60.0)))
    waiter.start()
    c.committed(False)
    waiter.join(60)
    assert got == [1]
