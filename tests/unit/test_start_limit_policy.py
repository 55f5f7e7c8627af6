"""The restart policy's pure parts (issue 39 items 5 and 6): every delay jittered within
±20 % (drawn from an injected source at both ends), a start limit parsed or refused in one
line, and the notification words `exited` and `restarted`."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from models.errors import BadInput
from models.notices import word_of
from workflows.lifecycle.restarts import JITTER, parse_start_limit, restart_delay

HOST: Any = SimpleNamespace(restart_floor=1.0, restart_cap=30.0)


@pytest.mark.parametrize("n, base", [(0, 1.0), (1, 2.0), (3, 8.0), (9, 30.0)])
def test_every_delay_is_jittered_within_a_fifth(n: int, base: float) -> None:
    low, high = restart_delay(HOST, n, lambda: 0.0), restart_delay(HOST, n, lambda: 0.999999)
    assert low == pytest.approx(base * (1 - JITTER)) and high == pytest.approx(base * (1 + JITTER), rel=1e-5)
    assert restart_delay(HOST, n, lambda: 0.5) == pytest.approx(base)
    drawn = {restart_delay(HOST, n) for _ in range(200)}  # the real source
    assert all(base * 0.8 <= d <= base * 1.2 for d in drawn) and len(drawn) > 100


@pytest.mark.parametrize("given, stored", [("5/60", "5/60"), (" 3/0.5 ", "3/0.5"), ("1/86400", "1/86400")])
def test_a_start_limit_is_n_over_seconds(given: str, stored: str) -> None:
    assert parse_start_limit(given) == stored


@pytest.mark.parametrize("bad", ["5", "0/60", "5/0", "five/60", "5/-1", "5/90000", "/60", ""])
def test_a_bad_start_limit_is_refused_in_one_line(bad: str) -> None:
    with pytest.raises(BadInput) as e:
        parse_start_limit(bad)
    assert "is not N/SECONDS" in e.value.cause and "5/60" in e.value.fix


def test_exited_and_restarted_words() -> None:
    assert word_of("exited", {"status": "killed by SIGKILL"}) == "exited"
    assert word_of("exited", {"status": "oom"}) == "exited"
    assert word_of("exited", {"reason": "unhealthy: ..."}) is None  # retired by vigil itself
    assert word_of("exited", {"status": "exited 0", "one_shot": True}) is None
    assert word_of("restarted", {}) == "restarted"
    assert word_of("failed", {"start_limit": "3/60"}) == "failed"
