"""runners.base.deadline: a stall of this process re-arms the timeout once, never twice."""

from __future__ import annotations

import time

import pytest

from runners.base import deadline as mod
from runners.base.deadline import Deadline


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def test_steady_readings_count_down(clock: Clock) -> None:
    d = Deadline(2.0, 0.5, "x", clock)
    for _ in range(4):
        clock.now += 0.5
        d.left()
    assert d.left() == pytest.approx(0.0) and not d.rearmed


def test_a_jump_re_arms_once(clock: Clock) -> None:
    d = Deadline(2.0, 0.5, "x", clock)
    clock.now += 30  # SIGSTOP
    assert d.left() == pytest.approx(2.0) and d.rearmed
    clock.now += 30
    assert d.left() < 0


def test_a_gap_within_the_step_is_not_a_jump(clock: Clock) -> None:
    d = Deadline(1.0, 1.0, "x", clock)
    clock.now += 1.0 + mod.JUMP
    assert d.left() < 0 and not d.rearmed


def test_real_clock() -> None:
    d = Deadline(0.05, 0.01, "x")
    while d.left() > 0:
        time.sleep(0.01)
    assert not d.rearmed
