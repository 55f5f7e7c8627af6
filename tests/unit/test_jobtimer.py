"""The jobs' timer (runners/agent/jobtimer.py): pokes from every thread, as many as drives
and rounds make, never run two turns at once and never lose one; a poke during a turn makes
one more turn after it. As an APScheduler job re-added at each poke, 5 s of such pokes
skipped 121 turns with a warning in the agent's log ("maximum number of running instances
reached"; the clean-clone .ci/run at 4ae1c0a failed the disk-full test on it)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import pytest

from runners.agent import jobtimer
from tests.conftest import wait_for


class Trust:
    """The store trusted (the timer's one question to it)."""

    def may_act(self) -> bool:
        return True

    @contextlib.contextmanager
    def guarded(self, log: logging.Logger, what: str) -> Iterator[None]:
        yield


class Ctx:
    shutting_down = threading.Event()


class Turns:
    """A stand-in for the tick (a turn's reads and writes of the store), recording when
    each turn ran and how many ran at once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.inside = 0
        self.most = 0
        self.starts: list[float] = []

    def __call__(self, ctx: Any, up_since: datetime, kick: Any) -> None:
        with self.lock:
            self.inside += 1
            self.most = max(self.most, self.inside)
            self.starts.append(time.monotonic())
        time.sleep(0.01)
        with self.lock:
            self.inside -= 1


def test_pokes_from_many_threads_make_one_turn_at_a_time_and_none_is_lost(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    turns = Turns()
    monkeypatch.setattr(jobtimer, "tick", turns)
    stop = threading.Event()
    timer = jobtimer.JobTimer(Ctx(), Trust(), stop)  # type: ignore[arg-type]
    timer.start()
    end = time.monotonic() + 2.0

    def hammer() -> None:
        while time.monotonic() < end:
            timer.poke()
            time.sleep(0.001)

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    last_poke = time.monotonic()
    timer.poke()
    wait_for(lambda: turns.starts and turns.starts[-1] > last_poke, 5,
             what="a turn after the last poke")
    stop.set()
    timer.poke()  # the loop wakes, sees the agent's stop and ends
    assert turns.most == 1, f"{turns.most} turns at once"
    assert len(turns.starts) > 50, len(turns.starts)  # pokes coalesce, but turns keep coming
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_with_nothing_due_it_waits_out_its_idle_backstop_and_ends_on_stop(
        monkeypatch: pytest.MonkeyPatch) -> None:
    turns = Turns()
    monkeypatch.setattr(jobtimer, "tick", turns)
    stop = threading.Event()
    timer = jobtimer.JobTimer(Ctx(), Trust(), stop)  # type: ignore[arg-type]
    timer.start()
    wait_for(lambda: len(turns.starts) == 1, 5, what="the first turn")
    stop.set()
    timer.poke()  # the loop wakes, sees the agent's stop and ends
    alive = [t for t in threading.enumerate() if t.name == "jobs"]
    for t in alive:
        t.join(5)
    assert not any(t.is_alive() for t in alive), "the timer's thread outlived the stop"
    assert len(turns.starts) == 1  # no job due: no turn before its 30 s backstop
